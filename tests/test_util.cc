#include "tests/test_util.h"

#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include "server/common/fp16.h"

namespace kvtier::testing {

std::vector<uint16_t> RandomHalfs(size_t n, std::mt19937& rng) {
  std::normal_distribution<float> dist(0.f, 1.f);
  std::vector<uint16_t> out(n);
  for (auto& h : out) h = FloatToHalf(std::clamp(dist(rng), -4.f, 4.f));
  return out;
}

std::string AsBytes(const std::vector<uint16_t>& v) {
  return std::string(reinterpret_cast<const char*>(v.data()), v.size() * 2);
}

std::vector<uint16_t> Slice(const std::vector<uint16_t>& all, int kv_heads, int total, int d,
                            int start, int n) {
  std::vector<uint16_t> out;
  out.reserve(static_cast<size_t>(kv_heads) * n * d);
  for (int h = 0; h < kv_heads; ++h) {
    auto begin = all.begin() + (static_cast<size_t>(h) * total + start) * d;
    out.insert(out.end(), begin, begin + static_cast<size_t>(n) * d);
  }
  return out;
}

TempDir::TempDir() {
  char tmpl[] = "/tmp/kvtier-test-XXXXXX";
  path_ = mkdtemp(tmpl);
}

TempDir::~TempDir() {
  std::error_code ec;
  std::filesystem::remove_all(path_, ec);
}

std::string BinaryPath(const std::string& name) {
  // Tests run from build/tests or build/bin; binaries land in build/bin.
  std::string self = std::filesystem::read_symlink("/proc/self/exe").string();
  return (std::filesystem::path(self).parent_path() / name).string();
}

DaemonProcess::DaemonProcess(std::vector<std::string> extra) {
  static std::atomic<int> counter{0};
  socket_ = dir_.path() + "/kvtier.sock";
  instance_ = "test-" + std::to_string(getpid()) + "-" + std::to_string(counter++);
  std::vector<std::string> args = {BinaryPath("kvtierd"), "--listen", "unix:" + socket_,
                                   "--instance", instance_, "--log_level", "warn"};
  args.insert(args.end(), extra.begin(), extra.end());
  std::string log = dir_.path() + "/daemon.log";
  pid_ = fork();
  if (pid_ == 0) {
    FILE* f = freopen(log.c_str(), "w", stderr);
    (void)f;
    dup2(fileno(stderr), fileno(stdout));
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    execv(argv[0], argv.data());
    _exit(127);
  }
  for (int i = 0; i < 200; ++i) {
    struct stat st {};
    if (stat(socket_.c_str(), &st) == 0 && S_ISSOCK(st.st_mode)) {
      started_ = true;
      return;
    }
    int status = 0;
    if (waitpid(pid_, &status, WNOHANG) == pid_) {
      pid_ = -1;
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  ADD_FAILURE() << "kvtierd did not start: " << Log();
}

int DaemonProcess::Terminate() {
  if (pid_ <= 0) return -1;
  kill(pid_, SIGTERM);
  int status = 0;
  waitpid(pid_, &status, 0);
  pid_ = -1;
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

int DaemonProcess::WaitForExit(int seconds) {
  for (int i = 0; i < seconds * 20 && pid_ > 0; ++i) {
    int status = 0;
    if (waitpid(pid_, &status, WNOHANG) == pid_) {
      pid_ = -1;
      return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return -1;
}

DaemonProcess::~DaemonProcess() {
  if (pid_ > 0) {
    int code = Terminate();
    if (code != 0) ADD_FAILURE() << "kvtierd exited " << code << ": " << Log();
  }
}

std::string DaemonProcess::Log() const {
  std::ifstream in(dir_.path() + "/daemon.log");
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::pair<int, std::string> RunCommand(const std::string& cmd) {
  std::string out;
  FILE* p = popen((cmd + " 2>&1").c_str(), "r");
  if (p == nullptr) return {-1, ""};
  std::array<char, 4096> buf;
  size_t n;
  while ((n = fread(buf.data(), 1, buf.size(), p)) > 0) out.append(buf.data(), n);
  int status = pclose(p);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, out};
}

}  // namespace kvtier::testing
