#include "kvtier/local_daemon.h"

#include <fcntl.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>

namespace kvtier {
namespace {

// In a forked child before exec: SIGTERM when the thread that forked it ends, so that a test or
// benchmark killed midway leaves no server behind, and an exit at once should it have ended
// already (before the request took effect). And none of the caller's descriptors past stderr
// stay open in the server: a pipe the caller's parent waits on to close (a death test's) would
// otherwise stay open as long as the server runs.
void EndWithParent(pid_t parent) {
  prctl(PR_SET_PDEATHSIG, SIGTERM);
  if (getppid() != parent) _exit(127);
  close_range(3, ~0u, 0);
}

int ExitCode(int status) {
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

// Whether a server listens on the Unix socket `path`: its socket file appears a moment before
// it listens, and a connection in between is refused.
bool Accepts(const std::string& path) {
  const int fd = socket(AF_UNIX, SOCK_STREAM, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::snprintf(addr.sun_path, sizeof(addr.sun_path), "%s", path.c_str());
  const bool ok = fd >= 0 && connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
  if (fd >= 0) close(fd);
  return ok;
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

LocalDaemon::LocalDaemon(const std::string& instance_prefix,
                         const std::vector<std::string>& extra) {
  static std::atomic<int> counter{0};
  socket_ = dir_.path() + "/kvtier.sock";
  instance_ = instance_prefix + "-" + std::to_string(getpid()) + "-" + std::to_string(counter++);
  std::vector<std::string> args = {
      BinaryPath("kvtierd"), "--listen", "unix:" + socket_, "--instance", instance_,
      "--log_level",         "warn"};
  args.insert(args.end(), extra.begin(), extra.end());
  const std::string log = dir_.path() + "/daemon.log";
  const pid_t parent = getpid();
  pid_ = fork();
  if (pid_ == 0) {
    EndWithParent(parent);
    if (freopen(log.c_str(), "w", stderr) != nullptr) dup2(fileno(stderr), fileno(stdout));
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    execv(argv[0], argv.data());
    _exit(127);
  }
  // A sanitizer build on a loaded machine (two cores, fuzzers beside it) can take many seconds
  // to listen: wait for the socket, or the process's exit, up to a minute.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (std::chrono::steady_clock::now() < deadline) {
    if (Accepts(socket_)) {
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

LocalDaemon::~LocalDaemon() { Terminate(); }

int LocalDaemon::SignalAndWait(int sig) {
  if (pid_ <= 0) return -1;
  kill(pid_, sig);
  int status = 0;
  waitpid(pid_, &status, 0);
  pid_ = -1;
  return ExitCode(status);
}

int LocalDaemon::Kill() { return SignalAndWait(SIGKILL); }

int LocalDaemon::Terminate() { return SignalAndWait(SIGTERM); }

int LocalDaemon::WaitForExit(int seconds) {
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

std::string LocalDaemon::Log() const {
  std::ifstream in(dir_.path() + "/daemon.log");
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

LocalRedis::LocalRedis() {
  socket_ = dir_.path() + "/redis.sock";
  const pid_t parent = getpid();
  pid_ = fork();
  if (pid_ == 0) {
    EndWithParent(parent);
    const int null = open("/dev/null", O_WRONLY);  // its log would mix with the caller's
    dup2(null, STDOUT_FILENO);
    dup2(null, STDERR_FILENO);
    execlp("redis-server", "redis-server", "--port", "0", "--unixsocket", socket_.c_str(), "--save",
           "", "--appendonly", "no", "--loglevel", "warning", (char*)nullptr);
    _exit(127);
  }
  for (int i = 0; i < 500 && !started_; ++i) {
    started_ = Accepts(socket_);
    if (!started_) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

LocalRedis::~LocalRedis() {
  if (pid_ <= 0) return;
  kill(pid_, SIGCONT);
  kill(pid_, SIGTERM);
  waitpid(pid_, nullptr, 0);
}

void LocalRedis::Pause() {
  if (pid_ > 0) kill(pid_, SIGSTOP);
}

void LocalRedis::Resume() {
  if (pid_ > 0) kill(pid_, SIGCONT);
}

}  // namespace kvtier
