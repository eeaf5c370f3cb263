#include "tests/support/kvtierd_process.h"

#include <signal.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

namespace kvtier::testing {
namespace {

int ExitCode(int status) {
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

}  // namespace

TempDir::TempDir() {
  char tmpl[] = "/tmp/kvtier-test-XXXXXX";
  path_ = mkdtemp(tmpl);
}

TempDir::~TempDir() {
  std::error_code ec;
  std::filesystem::remove_all(path_, ec);
}

std::string BinaryPath(const std::string& name) {
  std::string self = std::filesystem::read_symlink("/proc/self/exe").string();
  return (std::filesystem::path(self).parent_path() / name).string();
}

KvtierdProcess::KvtierdProcess(const std::string& instance_prefix,
                               const std::vector<std::string>& extra) {
  static std::atomic<int> counter{0};
  socket_ = dir_.path() + "/kvtier.sock";
  instance_ = instance_prefix + "-" + std::to_string(getpid()) + "-" + std::to_string(counter++);
  std::vector<std::string> args = {BinaryPath("kvtierd"), "--listen", "unix:" + socket_,
                                   "--instance", instance_, "--log_level", "warn"};
  args.insert(args.end(), extra.begin(), extra.end());
  const std::string log = dir_.path() + "/daemon.log";
  pid_ = fork();
  if (pid_ == 0) {
    if (freopen(log.c_str(), "w", stderr) != nullptr) dup2(fileno(stderr), fileno(stdout));
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
    if (waitpid(pid_, &status, WNOHANG) == pid_) {  // exited (bad flags, say)
      pid_ = -1;
      return;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
}

KvtierdProcess::~KvtierdProcess() { Terminate(); }

int KvtierdProcess::Terminate() {
  if (pid_ <= 0) return -1;
  kill(pid_, SIGTERM);
  int status = 0;
  waitpid(pid_, &status, 0);
  pid_ = -1;
  return ExitCode(status);
}

int KvtierdProcess::WaitForExit(int seconds) {
  for (int i = 0; i < seconds * 20 && pid_ > 0; ++i) {
    int status = 0;
    if (waitpid(pid_, &status, WNOHANG) == pid_) {
      pid_ = -1;
      return ExitCode(status);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return -1;
}

std::string KvtierdProcess::Log() const {
  std::ifstream in(dir_.path() + "/daemon.log");
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

}  // namespace kvtier::testing
