// Prometheus metrics through prometheus-cpp (Debian's prometheus-cpp-dev): a Registry owns
// metric families, each family one metric per label set, and renders the text exposition
// format 0.0.4 with prometheus-cpp's serializer. The metric objects below are handles to
// prometheus-cpp's, live as long as the registry, and update lock-free (a histogram through
// atomics of its own, flushed to prometheus-cpp's at each scrape).
#ifndef KVTIER_SERVER_METRICS_REGISTRY_H_
#define KVTIER_SERVER_METRICS_REGISTRY_H_

#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"

namespace kvtier::metrics {

using Labels = std::map<std::string, std::string>;

class Counter {
 public:
  explicit Counter(prometheus::Counter* c) : c_(c) {}
  void Inc(double v = 1.0);
  // For counters kept elsewhere (a tier's promotions): raises the value to `total`.
  void IncreaseTo(double total);
  double value() const { return c_->Value(); }

 private:
  prometheus::Counter* const c_;
  absl::Mutex raise_mu_;  // IncreaseTo's read and add as one (two scrapes may run at once)
};

class Gauge {
 public:
  explicit Gauge(prometheus::Gauge* g) : g_(g) {}
  void Set(double v) { g_->Set(v); }
  void Add(double v);
  double value() const { return g_->Value(); }

 private:
  prometheus::Gauge* const g_;
};

// Observe takes no lock (each RPC observes its method's latency): the counts gather in atomics
// of its own, and reach prometheus-cpp's histogram, whose Observe locks a mutex, at each scrape
// and each read below (Flush).
class Histogram {
 public:
  Histogram(prometheus::Histogram* h, std::vector<double> bounds);
  void Observe(double v);
  // Cumulative counts per bound, then +Inf.
  std::vector<uint64_t> CumulativeCounts() const;
  double sum() const;
  uint64_t count() const;
  const std::vector<double>& bounds() const { return bounds_; }
  // Hands what was observed since the last flush to prometheus-cpp's histogram.
  void Flush() const;

 private:
  prometheus::Histogram* const h_;
  const std::vector<double> bounds_;
  // Per bucket (each bound, then +Inf): observations so far, and the sum of their values.
  const std::unique_ptr<std::atomic<uint64_t>[]> counts_;
  std::atomic<double> sum_ = 0;
  // What the last flush handed over. Lock order 10 too: a leaf, taken after Registry::mu_ is
  // let go (server/common/lock_order.h).
  mutable absl::Mutex flush_mu_;
  mutable std::vector<uint64_t> flushed_ ABSL_GUARDED_BY(flush_mu_);
  mutable double flushed_sum_ ABSL_GUARDED_BY(flush_mu_) = 0;
};

// Latency buckets in seconds, 50 us .. 10 s.
std::vector<double> LatencyBuckets();

class Registry {
 public:
  Registry();
  // The same (name, labels) returns the same object. A name registered as another type,
  // or a malformed name or label name, is a programming error (CHECK).
  Counter& GetCounter(const std::string& name, const std::string& help, const Labels& labels = {});
  Gauge& GetGauge(const std::string& name, const std::string& help, const Labels& labels = {});
  Histogram& GetHistogram(const std::string& name, const std::string& help,
                          const std::vector<double>& bounds, const Labels& labels = {});

  // Called at the start of every Render(), to refresh gauges from their sources.
  void OnScrape(std::function<void()> hook);

  // The text exposition (prometheus-cpp's TextSerializer), families in name order.
  std::string Render() const;

 private:
  enum class Type { kCounter, kGauge, kHistogram };
  struct Family {
    Type type;
    prometheus::Family<prometheus::Counter>* counters = nullptr;
    prometheus::Family<prometheus::Gauge>* gauges = nullptr;
    prometheus::Family<prometheus::Histogram>* histograms = nullptr;
    std::map<Labels, std::unique_ptr<Counter>> counter_handles;
    std::map<Labels, std::unique_ptr<Gauge>> gauge_handles;
    std::map<Labels, std::unique_ptr<Histogram>> histogram_handles;
  };
  Family& GetFamily(const std::string& name, const std::string& help, Type type,
                    const Labels& labels) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const std::shared_ptr<prometheus::Registry> registry_;
  mutable absl::Mutex mu_;  // lock order 10 (server/common/lock_order.h)
  std::map<std::string, Family> families_ ABSL_GUARDED_BY(mu_);
  std::vector<std::function<void()>> hooks_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvtier::metrics

#endif  // KVTIER_SERVER_METRICS_REGISTRY_H_
