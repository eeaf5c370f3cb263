#include "server/metrics/registry.h"

#include <algorithm>
#include <sstream>

#include "absl/strings/ascii.h"
#include "prometheus/text_serializer.h"
#include "server/common/check.h"
#include "server/common/mutex.h"
#include "server/common/names.h"

namespace kvtier::metrics {
namespace {

// HELP text as the exposition format wants it (backslash and newline escaped), which
// prometheus-cpp 1.0 writes as it is given.
std::string EscapeHelp(const std::string& h) {
  std::string out;
  for (char c : h) {
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '\n') {
      out += "\\n";
    } else {
      out += c;
    }
  }
  return out;
}

}  // namespace

void Counter::Inc(double v) {
  CHECK_GE(v, 0.0) << "counters only go up";
  c_->Increment(v);
}

void Counter::IncreaseTo(double total) {
  MutexLock lock(&raise_mu_);
  const double cur = c_->Value();
  if (total > cur) c_->Increment(total - cur);
}

void Gauge::Add(double v) {
  if (v >= 0) {
    g_->Increment(v);
  } else {
    g_->Decrement(-v);
  }
}

Histogram::Histogram(prometheus::Histogram* h, std::vector<double> bounds)
    : h_(h),
      bounds_(std::move(bounds)),
      counts_(new std::atomic<uint64_t>[bounds_.size() + 1]()),
      flushed_(bounds_.size() + 1, 0) {}

void Histogram::Observe(double v) {
  // The first bound at or above v, as prometheus-cpp counts it (le is "less or equal").
  const size_t i = std::lower_bound(bounds_.begin(), bounds_.end(), v) - bounds_.begin();
  counts_[i].fetch_add(1, std::memory_order_relaxed);
  sum_.fetch_add(v, std::memory_order_relaxed);
}

void Histogram::Flush() const {
  MutexLock lock(&flush_mu_);
  std::vector<double> increments(flushed_.size());
  bool any = false;
  for (size_t i = 0; i < flushed_.size(); ++i) {
    const uint64_t now = counts_[i].load(std::memory_order_relaxed);
    increments[i] = static_cast<double>(now - flushed_[i]);
    any |= now != flushed_[i];
    flushed_[i] = now;
  }
  // An observation adds to its count before its sum: a flush between the two sees the count
  // alone, and the next one the sum alone, which it must hand over too.
  const double sum = sum_.load(std::memory_order_relaxed);
  if (any || sum != flushed_sum_) h_->ObserveMultiple(increments, sum - flushed_sum_);
  flushed_sum_ = sum;
}

std::vector<uint64_t> Histogram::CumulativeCounts() const {
  Flush();
  std::vector<uint64_t> out;
  for (const auto& b : h_->Collect().histogram.bucket) out.push_back(b.cumulative_count);
  return out;
}

double Histogram::sum() const {
  Flush();
  return h_->Collect().histogram.sample_sum;
}

uint64_t Histogram::count() const {
  Flush();
  return h_->Collect().histogram.sample_count;
}

std::vector<double> LatencyBuckets() {
  return {50e-6, 100e-6, 250e-6, 500e-6, 1e-3,   2.5e-3, 5e-3, 10e-3,
          25e-3, 50e-3,  100e-3, 250e-3, 500e-3, 1.0,    2.5,  10.0};
}

Registry::Registry() : registry_(std::make_shared<prometheus::Registry>()) {}

Registry::Family& Registry::GetFamily(const std::string& name, const std::string& help, Type type,
                                      const Labels& labels) {
  // [a-zA-Z_:][a-zA-Z0-9_:]* and [a-zA-Z_][a-zA-Z0-9_]*, as Prometheus defines them.
  CHECK(IsName(name, "_:", 200) && !absl::ascii_isdigit(name[0])) << "bad metric name " << name;
  for (const auto& [k, v] : labels) {
    CHECK(IsName(k, "_", 200) && !absl::ascii_isdigit(k[0]) && k.rfind("__", 0) != 0)
        << "bad label name " << k;
  }
  auto [it, inserted] = families_.try_emplace(name);
  Family& f = it->second;
  if (inserted) {
    f.type = type;
    switch (type) {
      case Type::kCounter:
        f.counters =
            &prometheus::BuildCounter().Name(name).Help(EscapeHelp(help)).Register(*registry_);
        break;
      case Type::kGauge:
        f.gauges = &prometheus::BuildGauge().Name(name).Help(EscapeHelp(help)).Register(*registry_);
        break;
      case Type::kHistogram:
        f.histograms =
            &prometheus::BuildHistogram().Name(name).Help(EscapeHelp(help)).Register(*registry_);
        break;
    }
  }
  CHECK(f.type == type) << "metric " << name << " registered with two types";
  return f;
}

Counter& Registry::GetCounter(const std::string& name, const std::string& help,
                              const Labels& labels) {
  MutexLock lock(&mu_);
  Family& f = GetFamily(name, help, Type::kCounter, labels);
  auto& slot = f.counter_handles[labels];
  if (!slot) slot = std::make_unique<Counter>(&f.counters->Add(labels));
  return *slot;
}

Gauge& Registry::GetGauge(const std::string& name, const std::string& help, const Labels& labels) {
  MutexLock lock(&mu_);
  Family& f = GetFamily(name, help, Type::kGauge, labels);
  auto& slot = f.gauge_handles[labels];
  if (!slot) slot = std::make_unique<Gauge>(&f.gauges->Add(labels));
  return *slot;
}

Histogram& Registry::GetHistogram(const std::string& name, const std::string& help,
                                  const std::vector<double>& bounds, const Labels& labels) {
  CHECK(!labels.contains("le")) << "le is reserved for histogram buckets";
  for (size_t i = 0; i + 1 < bounds.size(); ++i) CHECK_LT(bounds[i], bounds[i + 1]);
  MutexLock lock(&mu_);
  Family& f = GetFamily(name, help, Type::kHistogram, labels);
  auto& slot = f.histogram_handles[labels];
  if (!slot) {
    slot = std::make_unique<Histogram>(&f.histograms->Add(labels, bounds), bounds);
  }
  return *slot;
}

void Registry::OnScrape(std::function<void()> hook) {
  MutexLock lock(&mu_);
  hooks_.push_back(std::move(hook));
}

std::string Registry::Render() const {
  std::vector<std::function<void()>> hooks;
  std::vector<const Histogram*> histograms;
  {
    MutexLock lock(&mu_);
    hooks = hooks_;
    for (const auto& [name, f] : families_) {
      for (const auto& [labels, h] : f.histogram_handles) histograms.push_back(h.get());
    }
  }
  for (auto& h : hooks) h();  // outside the lock: hooks set gauges through this registry
  for (const Histogram* h : histograms) h->Flush();  // handles live as long as the registry
  std::vector<prometheus::MetricFamily> families = registry_->Collect();
  std::sort(families.begin(), families.end(),
            [](const auto& a, const auto& b) { return a.name < b.name; });
  return prometheus::TextSerializer().Serialize(families);
}

}  // namespace kvtier::metrics
