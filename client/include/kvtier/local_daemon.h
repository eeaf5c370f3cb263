// LocalDaemon: kvtierd as a child process on a Unix socket in a temporary directory, for
// tests, benchmarks and tools that run a cache of their own (the C++ twin of the Python
// client's kvtier.daemon.LocalDaemon); LocalRedis, a redis-server for its remote tier. Part
// of the kvtier_local_daemon library.
#ifndef KVTIER_LOCAL_DAEMON_H_
#define KVTIER_LOCAL_DAEMON_H_

#include <string>
#include <vector>

namespace kvtier {

// A directory under /tmp removed (recursively) on destruction.
class TempDir {
 public:
  TempDir();
  ~TempDir();
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// Path of a binary next to the running one (build/bin).
std::string BinaryPath(const std::string& name);

// Starts `kvtierd --listen unix:<tmp>/kvtier.sock --instance <prefix>-<pid>-<n>
// --log_level warn <extra...>` (kvtierd next to the running binary) with its output in
// <tmp>/daemon.log, and waits up to 10 s for the socket. The destructor sends SIGTERM and
// waits if it still runs. The daemon also gets SIGTERM when the thread that made it ends
// (PR_SET_PDEATHSIG), as when its test or benchmark is killed: make it on a thread that
// outlives it. LocalRedis likewise.
class LocalDaemon {
 public:
  LocalDaemon(const std::string& instance_prefix, const std::vector<std::string>& extra);
  ~LocalDaemon();
  LocalDaemon(const LocalDaemon&) = delete;
  LocalDaemon& operator=(const LocalDaemon&) = delete;

  bool started() const { return started_; }
  bool running() const { return pid_ > 0; }
  int pid() const { return pid_; }
  std::string address() const { return "unix:" + socket_; }
  const std::string& socket() const { return socket_; }
  const std::string& instance() const { return instance_; }
  // SIGTERM, then the exit status (128 + signal if killed), or -1 if not running.
  int Terminate();
  // SIGKILL: no shutdown of any kind. The exit status (137), or -1 if not running.
  int Kill();
  // Waits up to `seconds` for the process to exit by itself; its exit status, or -1.
  int WaitForExit(int seconds);
  std::string Log() const;

 private:
  int SignalAndWait(int sig);

  TempDir dir_;
  std::string socket_;
  std::string instance_;
  int pid_ = -1;
  bool started_ = false;
};

// redis-server on a Unix socket in a temporary directory, without persistence, for the life of
// the object: a remote tier for tests and benchmarks. started() is false when redis-server is
// missing or its socket did not appear within 5 s.
class LocalRedis {
 public:
  LocalRedis();
  ~LocalRedis();  // SIGTERM (after SIGCONT, should it be stopped), then waits
  LocalRedis(const LocalRedis&) = delete;
  LocalRedis& operator=(const LocalRedis&) = delete;

  bool started() const { return started_; }
  // What kvtierd's --remote takes: "unix:PATH".
  std::string address() const { return "unix:" + socket_; }
  // Freezes (SIGSTOP) or thaws (SIGCONT) the server: a hung Redis, for tests.
  void Pause();
  void Resume();

 private:
  TempDir dir_;
  std::string socket_;
  int pid_ = -1;
  bool started_ = false;
};

}  // namespace kvtier

#endif  // KVTIER_LOCAL_DAEMON_H_
