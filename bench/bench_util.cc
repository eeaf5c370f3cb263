#include "bench/bench_util.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <stdexcept>

namespace kvtier::bench {

Daemon::Daemon(const std::vector<std::string>& flags) : LocalDaemon("bench", flags) {
  if (!started()) throw std::runtime_error("kvtierd did not start: " + Log());
}

v1::CreateSessionRequest SmolLm2Session() {
  v1::CreateSessionRequest r;
  r.mutable_shape()->set_num_layers(30);
  r.mutable_shape()->set_num_q_heads(9);
  r.mutable_shape()->set_num_kv_heads(3);
  r.mutable_shape()->set_head_dim(64);
  return r;
}

double Quantile(std::vector<double> v, double q) {
  if (v.empty()) return NAN;
  std::sort(v.begin(), v.end());
  size_t rank = static_cast<size_t>(std::ceil(q * v.size()));
  return v[std::clamp<size_t>(rank, 1, v.size()) - 1];
}

double Median(std::vector<double> v) { return Quantile(std::move(v), 0.5); }

void Print(const Figure& f) {
  std::string params;
  for (const auto& [k, v] : f.parameters) {
    params += (params.empty() ? "" : ", ") + ("\"" + k + "\": ") +
              (std::all_of(v.begin(), v.end(),
                           [](char c) { return std::isdigit(c) || c == '.' || c == '-'; }) &&
                       !v.empty()
                   ? v
                   : "\"" + v + "\"");
  }
  std::printf(
      "{\"name\": \"%s\", \"value\": %.6g, \"unit\": \"%s\", \"baseline\": %.6g, "
      "\"baseline_name\": \"%s\", \"ratio\": %.4f, \"parameters\": {%s}}\n",
      f.name.c_str(), f.value, f.unit.c_str(), f.baseline, f.baseline_name.c_str(),
      f.baseline != 0 ? f.value / f.baseline : NAN, params.c_str());
  std::fflush(stdout);
}

}  // namespace kvtier::bench
