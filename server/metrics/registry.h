// Prometheus metrics, text exposition format 0.0.4, without prometheus-cpp (not packaged
// here). A Registry owns metric families; each family holds one metric per label set.
// Metric objects live as long as the registry; updates are lock-free atomics.
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

namespace kvtier::metrics {

using Labels = std::map<std::string, std::string>;

class Counter {
 public:
  void Inc(double v = 1.0);
  // For counters kept elsewhere (a tier's promotions): raises the value to `total`.
  void IncreaseTo(double total);
  double value() const { return value_.load(std::memory_order_relaxed); }

 private:
  std::atomic<double> value_{0.0};
};

class Gauge {
 public:
  void Set(double v) { value_.store(v, std::memory_order_relaxed); }
  void Add(double v);
  double value() const { return value_.load(std::memory_order_relaxed); }

 private:
  std::atomic<double> value_{0.0};
};

class Histogram {
 public:
  // `bounds`: strictly increasing upper bounds; +Inf is implicit.
  explicit Histogram(std::vector<double> bounds);
  void Observe(double v);
  // Cumulative counts per bound, then +Inf.
  std::vector<uint64_t> CumulativeCounts() const;
  double sum() const { return sum_.load(std::memory_order_relaxed); }
  uint64_t count() const { return count_.load(std::memory_order_relaxed); }
  const std::vector<double>& bounds() const { return bounds_; }

 private:
  const std::vector<double> bounds_;
  std::unique_ptr<std::atomic<uint64_t>[]> buckets_;  // [bounds.size() + 1], not cumulative
  std::atomic<double> sum_{0.0};
  std::atomic<uint64_t> count_{0};
};

// Latency buckets in seconds, 50 us .. 10 s.
std::vector<double> LatencyBuckets();

class Registry {
 public:
  // The same (name, labels) returns the same object. A name registered as another type,
  // or a malformed name or label name, is a programming error (CHECK).
  Counter& GetCounter(const std::string& name, const std::string& help, const Labels& labels = {});
  Gauge& GetGauge(const std::string& name, const std::string& help, const Labels& labels = {});
  Histogram& GetHistogram(const std::string& name, const std::string& help,
                          const std::vector<double>& bounds, const Labels& labels = {});

  // Called at the start of every Render(), to refresh gauges from their sources.
  void OnScrape(std::function<void()> hook);

  // The text exposition, families and label sets in sorted order.
  std::string Render() const;

 private:
  enum class Type { kCounter, kGauge, kHistogram };
  struct Family {
    Type type;
    std::string help;
    std::map<Labels, std::unique_ptr<Counter>> counters;
    std::map<Labels, std::unique_ptr<Gauge>> gauges;
    std::map<Labels, std::unique_ptr<Histogram>> histograms;
  };
  Family& GetFamily(const std::string& name, const std::string& help, Type type,
                    const Labels& labels) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  mutable absl::Mutex mu_;  // lock order 10 (server/common/lock_order.h)
  std::map<std::string, Family> families_ ABSL_GUARDED_BY(mu_);
  std::vector<std::function<void()>> hooks_ ABSL_GUARDED_BY(mu_);
};

// Escapes a label value: backslash, double quote and newline.
std::string EscapeLabelValue(const std::string& v);
// "1", "0.25", "+Inf", "NaN" as Prometheus writes them.
std::string FormatValue(double v);

}  // namespace kvtier::metrics

#endif  // KVTIER_SERVER_METRICS_REGISTRY_H_
