// Shared test helpers: status matchers, fp16 tensors, and a real kvtierd process.
#ifndef KVTIER_TESTS_TEST_UTIL_H_
#define KVTIER_TESTS_TEST_UTIL_H_

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
