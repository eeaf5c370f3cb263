// Helpers for the benchmarks: a kvtierd child process, timing, statistics, JSON lines.
#ifndef KVTIER_BENCH_BENCH_UTIL_H_
#define KVTIER_BENCH_BENCH_UTIL_H_

#include <chrono>
#include <map>
#include <string>
#include <vector>

#include "kvtier/local_daemon.h"
#include "kvtier/v1/kvtier.pb.h"

namespace kvtier::bench {

// kvtierd (next to this binary) on a temporary Unix socket; throws if it does not start.
class Daemon : public LocalDaemon {
 public:
  explicit Daemon(const std::vector<std::string>& flags = {});
};

// CreateSession for SmolLM2-135M's shape: 30 layers, 9 query heads, 3 KV heads, head_dim 64.
v1::CreateSessionRequest SmolLm2Session();

inline double NowSeconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// q in [0, 1]; the nearest-rank quantile of a copy of `v`.
double Quantile(std::vector<double> v, double q);
double Median(std::vector<double> v);

// One figure as a JSON line on stdout.
struct Figure {
  std::string name;
  double value;
  std::string unit;
  double baseline;
  std::string baseline_name;
  std::map<std::string, std::string> parameters;
};
void Print(const Figure& f);

}  // namespace kvtier::bench

#endif  // KVTIER_BENCH_BENCH_UTIL_H_
