// Shared test helpers: status matchers, fp16 tensors, and a real kvtierd process.
#ifndef KVTIER_TESTS_TEST_UTIL_H_
#define KVTIER_TESTS_TEST_UTIL_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kvtier/local_daemon.h"

namespace kvtier::testing {

using ::kvtier::BinaryPath;
using ::kvtier::TempDir;

// EXPECT_THAT(status_or_statusor, StatusIs(absl::StatusCode::kNotFound))
MATCHER_P(StatusIs, code, "") {
  absl::Status s = [&] {
    if constexpr (std::is_same_v<std::decay_t<decltype(arg)>, absl::Status>) {
      return arg;
    } else {
      return arg.status();
    }
  }();
  *result_listener << "status is " << s;
  return s.code() == code;
}

MATCHER_P2(StatusIs, code, substring, "") {
  absl::Status s = [&] {
    if constexpr (std::is_same_v<std::decay_t<decltype(arg)>, absl::Status>) {
      return arg;
    } else {
      return arg.status();
    }
  }();
  *result_listener << "status is " << s;
  return s.code() == code && std::string(s.message()).find(substring) != std::string::npos;
}

#define ASSERT_OK(expr) ASSERT_TRUE((expr).ok()) << (expr)
#define EXPECT_OK(expr) EXPECT_TRUE((expr).ok()) << (expr)
#define ASSERT_OK_AND_ASSIGN(lhs, expr)                \
  auto KVTIER_TEST_CONCAT_(_r_, __LINE__) = (expr);    \
  ASSERT_TRUE(KVTIER_TEST_CONCAT_(_r_, __LINE__).ok()) \
      << KVTIER_TEST_CONCAT_(_r_, __LINE__).status();  \
  lhs = std::move(KVTIER_TEST_CONCAT_(_r_, __LINE__)).value()
#define KVTIER_TEST_CONCAT_INNER_(a, b) a##b
#define KVTIER_TEST_CONCAT_(a, b) KVTIER_TEST_CONCAT_INNER_(a, b)

// Random fp16 bit patterns of finite values in about [-4, 4].
std::vector<uint16_t> RandomHalfs(size_t n, std::mt19937& rng);
std::string AsBytes(const std::vector<uint16_t>& v);

// Tokens [start, start+n) of a [kv_heads][total][d] tensor as [kv_heads][n][d].
std::vector<uint16_t> Slice(const std::vector<uint16_t>& all, int kv_heads, int total, int d,
                            int start, int n);

// The query the ranking of compact statistics takes (RoundQueryToInt8), found here another way:
// each head's d values on the grid of the smallest power of two p with every |x| <= 127 p
// (found by halving and doubling), rounded to the nearest multiple of p (ties to even).
inline void OnQueryGrid(std::vector<float>* q, int d) {
  for (size_t h = 0; h * d < q->size(); ++h) {
    float* x = q->data() + h * d;
    double top = 0;
    for (int j = 0; j < d; ++j) top = std::max(top, std::fabs(double(x[j])));
    double p = 1;
    while (top > 127 * p) p *= 2;
    while (p > 0x1p-100 && top <= 127 * (p / 2)) p /= 2;
    for (int j = 0; j < d; ++j) x[j] = float(std::nearbyint(x[j] / p) * p);
  }
}

// A kvtierd process for a test: a failed start and an unclean exit are test failures.
class DaemonProcess : public LocalDaemon {
 public:
  explicit DaemonProcess(const std::vector<std::string>& extra = {});
  // SIGTERM, then ADD_FAILURE unless it exits 0.
  ~DaemonProcess();
};

// Runs a command, returns (exit status, stdout+stderr).
std::pair<int, std::string> RunCommand(const std::string& cmd);

// A loopback TCP port that was free a moment ago.
int FreePort();
// The whole HTTP/1.1 response (status line, headers, body) to GET `path` on 127.0.0.1:port;
// empty if nothing listens there.
std::string HttpGet(int port, const std::string& path);

}  // namespace kvtier::testing

#endif  // KVTIER_TESTS_TEST_UTIL_H_
