#include "server/metrics/registry.h"

#include <cmath>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "server/common/check.h"
#include "server/common/mutex.h"
#include "server/common/names.h"

namespace kvtier::metrics {
namespace {

void AtomicAdd(std::atomic<double>& a, double v) {
  double cur = a.load(std::memory_order_relaxed);
  while (!a.compare_exchange_weak(cur, cur + v, std::memory_order_relaxed)) {
  }
}

std::string RenderLabels(const Labels& labels, const std::string& extra_key = "",
                         const std::string& extra_value = "") {
  if (labels.empty() && extra_key.empty()) return "";
  std::string out = "{";
  bool first = true;
  for (const auto& [k, v] : labels) {
    absl::StrAppend(&out, first ? "" : ",", k, "=\"", EscapeLabelValue(v), "\"");
    first = false;
  }
  if (!extra_key.empty()) {
    absl::StrAppend(&out, first ? "" : ",", extra_key, "=\"", extra_value, "\"");
  }
  return out + "}";
}

std::string EscapeHelp(const std::string& h) {
  std::string out;
  for (char c : h) {
    if (c == '\\')
      out += "\\\\";
    else if (c == '\n')
      out += "\\n";
    else
      out += c;
  }
  return out;
}

}  // namespace

void Counter::Inc(double v) {
  CHECK_GE(v, 0.0) << "counters only go up";
  AtomicAdd(value_, v);
}

void Counter::IncreaseTo(double total) {
  double cur = value_.load(std::memory_order_relaxed);
  while (cur < total && !value_.compare_exchange_weak(cur, total, std::memory_order_relaxed)) {
  }
}

void Gauge::Add(double v) { AtomicAdd(value_, v); }

Histogram::Histogram(std::vector<double> bounds)
    : bounds_(std::move(bounds)), buckets_(new std::atomic<uint64_t>[bounds_.size() + 1]) {
  for (size_t i = 0; i + 1 < bounds_.size(); ++i) CHECK_LT(bounds_[i], bounds_[i + 1]);
  for (size_t i = 0; i <= bounds_.size(); ++i) buckets_[i].store(0);
}

void Histogram::Observe(double v) {
  size_t i = std::lower_bound(bounds_.begin(), bounds_.end(), v) - bounds_.begin();
  buckets_[i].fetch_add(1, std::memory_order_relaxed);
  AtomicAdd(sum_, v);
  count_.fetch_add(1, std::memory_order_relaxed);
}

std::vector<uint64_t> Histogram::CumulativeCounts() const {
  std::vector<uint64_t> out(bounds_.size() + 1);
  uint64_t run = 0;
  for (size_t i = 0; i <= bounds_.size(); ++i) {
    run += buckets_[i].load(std::memory_order_relaxed);
    out[i] = run;
  }
  return out;
}

std::vector<double> LatencyBuckets() {
  return {50e-6, 100e-6, 250e-6, 500e-6, 1e-3,   2.5e-3, 5e-3, 10e-3,
          25e-3, 50e-3,  100e-3, 250e-3, 500e-3, 1.0,    2.5,  10.0};
}

std::string EscapeLabelValue(const std::string& v) {
  std::string out;
  out.reserve(v.size());
  for (char c : v) {
    if (c == '\\')
      out += "\\\\";
    else if (c == '"')
      out += "\\\"";
    else if (c == '\n')
      out += "\\n";
    else
      out += c;
  }
  return out;
}

std::string FormatValue(double v) {
  if (std::isnan(v)) return "NaN";
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  if (v == std::floor(v) && std::fabs(v) < 1e15) return absl::StrFormat("%.0f", v);
  return absl::StrFormat("%.17g", v);
}

Registry::Family& Registry::GetFamily(const std::string& name, const std::string& help, Type type,
                                      const Labels& labels) {
  // [a-zA-Z_:][a-zA-Z0-9_:]* and [a-zA-Z_][a-zA-Z0-9_]*, as Prometheus defines them.
  CHECK(IsName(name, "_:", 200) && !absl::ascii_isdigit(name[0])) << "bad metric name " << name;
  for (const auto& [k, v] : labels) {
    CHECK(IsName(k, "_", 200) && !absl::ascii_isdigit(k[0]) && k.rfind("__", 0) != 0)
        << "bad label name " << k;
  }
  auto [it, inserted] = families_.try_emplace(name);
  if (inserted) {
    it->second.type = type;
    it->second.help = help;
  }
  CHECK(it->second.type == type) << "metric " << name << " registered with two types";
  return it->second;
}

Counter& Registry::GetCounter(const std::string& name, const std::string& help,
                              const Labels& labels) {
  MutexLock lock(&mu_);
  auto& slot = GetFamily(name, help, Type::kCounter, labels).counters[labels];
  if (!slot) slot = std::make_unique<Counter>();
  return *slot;
}

Gauge& Registry::GetGauge(const std::string& name, const std::string& help, const Labels& labels) {
  MutexLock lock(&mu_);
  auto& slot = GetFamily(name, help, Type::kGauge, labels).gauges[labels];
  if (!slot) slot = std::make_unique<Gauge>();
  return *slot;
}

Histogram& Registry::GetHistogram(const std::string& name, const std::string& help,
                                  const std::vector<double>& bounds, const Labels& labels) {
  CHECK(!labels.contains("le")) << "le is reserved for histogram buckets";
  MutexLock lock(&mu_);
  auto& slot = GetFamily(name, help, Type::kHistogram, labels).histograms[labels];
  if (!slot) slot = std::make_unique<Histogram>(bounds);
  return *slot;
}

void Registry::OnScrape(std::function<void()> hook) {
  MutexLock lock(&mu_);
  hooks_.push_back(std::move(hook));
}

std::string Registry::Render() const {
  std::vector<std::function<void()>> hooks;
  {
    MutexLock lock(&mu_);
    hooks = hooks_;
  }
  for (auto& h : hooks) h();  // outside the lock: hooks set gauges through this registry
  MutexLock lock(&mu_);
  std::string out;
  for (const auto& [name, f] : families_) {
    const char* type = f.type == Type::kCounter ? "counter"
                       : f.type == Type::kGauge ? "gauge"
                                                : "histogram";
    absl::StrAppend(&out, "# HELP ", name, " ", EscapeHelp(f.help), "\n# TYPE ", name, " ", type,
                    "\n");
    for (const auto& [labels, c] : f.counters) {
      absl::StrAppend(&out, name, RenderLabels(labels), " ", FormatValue(c->value()), "\n");
    }
    for (const auto& [labels, g] : f.gauges) {
      absl::StrAppend(&out, name, RenderLabels(labels), " ", FormatValue(g->value()), "\n");
    }
    for (const auto& [labels, h] : f.histograms) {
      std::vector<uint64_t> cum = h->CumulativeCounts();
      for (size_t i = 0; i < cum.size(); ++i) {
        std::string le = i < h->bounds().size() ? FormatValue(h->bounds()[i]) : "+Inf";
        absl::StrAppend(&out, name, "_bucket", RenderLabels(labels, "le", le), " ", cum[i], "\n");
      }
      absl::StrAppend(&out, name, "_sum", RenderLabels(labels), " ", FormatValue(h->sum()), "\n");
      absl::StrAppend(&out, name, "_count", RenderLabels(labels), " ", cum.back(), "\n");
    }
  }
  return out;
}

}  // namespace kvtier::metrics
