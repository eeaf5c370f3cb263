// A kvtierd child process on a temporary Unix socket, for tests and benchmarks.
#ifndef KVTIER_TESTS_SUPPORT_KVTIERD_PROCESS_H_
#define KVTIER_TESTS_SUPPORT_KVTIERD_PROCESS_H_

#include <string>
#include <vector>

namespace kvtier::testing {

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
// --log_level warn <extra...>` with its output in <tmp>/daemon.log, and waits up to 10 s for
// the socket. The destructor sends SIGTERM and waits if it still runs.
class KvtierdProcess {
 public:
  KvtierdProcess(const std::string& instance_prefix, const std::vector<std::string>& extra);
  ~KvtierdProcess();
  KvtierdProcess(const KvtierdProcess&) = delete;
  KvtierdProcess& operator=(const KvtierdProcess&) = delete;

  bool started() const { return started_; }
  bool running() const { return pid_ > 0; }
  std::string address() const { return "unix:" + socket_; }
  const std::string& socket() const { return socket_; }
  const std::string& instance() const { return instance_; }
  // SIGTERM, then the exit status (128 + signal if killed), or -1 if not running.
  int Terminate();
  // Waits up to `seconds` for the process to exit by itself; its exit status, or -1.
  int WaitForExit(int seconds);
  std::string Log() const;

 private:
  TempDir dir_;
  std::string socket_;
  std::string instance_;
  int pid_ = -1;
  bool started_ = false;
};

}  // namespace kvtier::testing

#endif  // KVTIER_TESTS_SUPPORT_KVTIERD_PROCESS_H_
