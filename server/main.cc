// kvtierd: the KV-cache daemon. See docs/operator-guide.md.
#include <malloc.h>
#include <signal.h>
#include <sys/resource.h>

#include <cstdio>
#include <iostream>
#include <thread>

#include "absl/synchronization/mutex.h"
#include "google/protobuf/text_format.h"
#include "server/common/log.h"
#include "server/config/config.h"
#include "server/rpc/daemon.h"
#include "server/rpc/tls.h"

int main(int argc, char** argv) {
  // Signals go to one sigwait thread, so no gRPC thread is interrupted by them.
  sigset_t stop;  // and SIGHUP, which reloads the TLS files
  sigemptyset(&stop);
  sigaddset(&stop, SIGTERM);
  sigaddset(&stop, SIGINT);
  sigaddset(&stop, SIGHUP);
  pthread_sigmask(SIG_BLOCK, &stop, nullptr);
  signal(SIGPIPE, SIG_IGN);
  // Descriptors: every Unix-socket connection and every segment holds some; the soft limit
  // (often 1024) is raised to the hard one.
  if (rlimit nofile{};
      getrlimit(RLIMIT_NOFILE, &nofile) == 0 && nofile.rlim_cur < nofile.rlim_max) {
    nofile.rlim_cur = nofile.rlim_max;
    setrlimit(RLIMIT_NOFILE, &nofile);
  }
  // Debian's Abseil checks every Mutex acquisition for lock cycles (a debug aid that costs
  // on each lock); the lock order is documented and tested instead.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  // glibc's heap: blocks up to 32 MiB come from the heap rather than each from its own
  // mapping (a 256-token layer's K and V, 200 KB in a message, would otherwise fault in fresh
  // pages every time), and freed memory stays for reuse up to 64 MiB rather than going back
  // to the kernel at once.
  mallopt(M_MMAP_THRESHOLD, 32 << 20);
  mallopt(M_TRIM_THRESHOLD, 64 << 20);

  auto cl = kvtier::ParseCommandLine(std::vector<std::string>(argv + 1, argv + argc));
  if (!cl.ok()) {
    std::cerr << "kvtierd: " << cl.status().message() << "\n";
    return 2;
  }
  if (cl->help) {
    std::cout << kvtier::Usage();
    return 0;
  }
  if (cl->version) {
    std::cout << "kvtierd " << KVTIER_VERSION << "\n";
    return 0;
  }
  if (cl->print_default_config) {
    std::string text;
    google::protobuf::TextFormat::PrintToString(kvtier::DefaultConfig(), &text);
    std::cout << text;
    return 0;
  }
  auto options = kvtier::Validate(cl->config);
  if (!options.ok()) {
    std::cerr << "kvtierd: invalid configuration: " << options.status().message() << "\n";
    return 2;
  }
  if (auto s = kvtier::CheckTlsFiles(options->tls); !s.ok()) {  // exit 2, as Validate's
    std::cerr << "kvtierd: invalid configuration: " << s.message() << "\n";
    return 2;
  }
  kvtier::SetLogFormat(options->log_format == "json" ? kvtier::LogFormat::kJson
                                                     : kvtier::LogFormat::kLogfmt);
  if (auto s = kvtier::SetLogLevel(options->log_level); !s.ok()) {
    std::cerr << "kvtierd: " << s.message() << "\n";
    return 2;
  }
  auto daemon = kvtier::Daemon::Start(*options);
  if (!daemon.ok()) {
    std::cerr << "kvtierd: " << daemon.status().message() << "\n";
    return 1;
  }
  std::thread signals([d = daemon->get(), stop, refresh_s = options->tls.refresh_s] {
    int sig = 0;
    while (sigwait(&stop, &sig) == 0 && sig == SIGHUP) {
      const absl::Status s = d->ReloadTls();
      if (s.ok()) {
        KVLOG(info, "tls.reload", "served_within_s={}", refresh_s);
      } else {
        KVLOG(error, "tls.reload", "kept=previous error={}", kvtier::LogValue(s.message()));
      }
    }
    KVLOG(info, "daemon.signal", "signal={}", sig);
    d->RequestShutdown();
  });
  (*daemon)->WaitForShutdownRequest();
  (*daemon)->Shutdown();
  // The signal thread ends before the daemon goes (a Drain RPC may have ended it while the
  // thread waited): a SIGTERM to that thread alone ends its wait, however it got here.
  pthread_kill(signals.native_handle(), SIGTERM);
  signals.join();
  daemon->reset();
  return 0;
}
