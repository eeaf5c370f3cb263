// kvtierd as an object: tiers, sessions, leases, metrics and the gRPC server, started from
// validated options and stopped by a drain. main() and the in-process tests both use it.
//
// Shutdown (SIGTERM or the Drain RPC): new calls get UNAVAILABLE, health turns NOT_SERVING,
// calls in flight get drain_timeout_ms to finish, then sessions close, leases end, the
// shared-memory segments are unlinked and the Unix socket is removed.
#ifndef KVTIER_SERVER_RPC_DAEMON_H_
#define KVTIER_SERVER_RPC_DAEMON_H_

#include <atomic>
#include <memory>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "grpcpp/grpcpp.h"
#include "server/common/unique_fd.h"
#include "server/config/config.h"
#include "server/metrics/http_exporter.h"
#include "server/metrics/registry.h"
#include "server/rpc/service.h"
#include "server/rpc/tls.h"
#include "server/session/session_manager.h"
#include "server/tier/promotion_cache.h"
#include "server/tier/remote_store.h"
#include "server/tier/staging.h"
#include "server/tier/tier.h"
#include "server/transfer/gpu.h"

namespace kvtier {

class Daemon {
 public:
  // Binds the listeners and starts serving. INTERNAL or UNAVAILABLE naming the address when
  // a listener cannot bind. `options` is copied.
  static absl::StatusOr<std::unique_ptr<Daemon>> Start(const ServerOptions& options,
                                                       const Clock* clock = &SystemClock());
  ~Daemon();  // Shutdown() if not done

  // Asks for shutdown; returns at once. Thread-safe (not async-signal-safe: signals are
  // taken by a sigwait thread).
  void RequestShutdown();
  // SIGHUP: the TLS files again (TlsStage::Reload); OK and nothing done without TLS.
  absl::Status ReloadTls();
  // Blocks until RequestShutdown() or a Drain RPC.
  void WaitForShutdownRequest();
  // First phase of a drain: new calls get UNAVAILABLE and health turns NOT_SERVING; the
  // process keeps serving the calls already in flight. Idempotent.
  void StartDrain();
  // Drains (StartDrain, then up to drain_timeout_ms for in-flight calls) and stops.
  // Idempotent.
  void Shutdown();

  // The address clients dial: "unix:PATH" or "HOST:PORT".
  const std::string& address() const { return options_.listen; }
  metrics::Registry& metrics() { return metrics_; }

 private:
  // Where the device tier lives: a CUDA device, or emulated (gpu -1) and why.
  struct DeviceChoice {
    int gpu = -1;
    GpuInfo info;
    std::string why_emulated;
  };
  // --device against the GPUs this process can use; FAILED_PRECONDITION naming `device` when
  // it names a CUDA device there is not.
  static absl::StatusOr<DeviceChoice> ChooseDevice(const std::string& device);

  Daemon(const ServerOptions& options, DeviceChoice device, const Clock* clock);
  // "cuda:N" or "emulated", as the start-up line and kvtier_build_info say it.
  std::string DeviceName() const {
    return device_choice_.gpu >= 0 ? absl::StrCat("cuda:", device_choice_.gpu) : "emulated";
  }
  void RegisterGauges();
  // Starts the listener on server_, which has started; a uid's connections past its bound
  // are refused, and those of uids the config grants nothing go to a server of their own
  // (apart_, started here).
  absl::Status ServeUnixSocket();
  // Every 100 ms until shutdown: ends the leases past their TTL and the idle transfers.
  void Reap();
  void Persist();

  const ServerOptions options_;
  const DeviceChoice device_choice_;
  // Held for the daemon's life (flock; the kernel lets go when the process dies, SIGKILL too):
  // the instance's lock in /dev/shm and the Unix socket's beside it. Declared before the
  // tiers, so they are let go only after every segment is gone.
  UniqueFd instance_lock_;
  UniqueFd socket_lock_;
  bool owns_socket_ = false;  // this daemon bound the socket, so its shutdown removes it
  metrics::Registry metrics_;
  // Destroyed in reverse order: sessions and leases drop their slots before the tiers go.
  Tier host_;
  Tier device_;
  PromotionCache host_copies_;
  PromotionCache device_copies_;
  // The remote tier (--remote), or null; connected when the daemon is built.
  absl::StatusOr<std::unique_ptr<RemoteStore>> remote_;
  LeaseTable leases_;
  std::unique_ptr<Prefetcher> prefetcher_;  // null when prefetch is off
  // Sessions hold their staging areas: declared before them, it outlives every area.
  StagingRegistry staging_;
  // Ages sessions off the append path. Declared before the sessions and after the tiers: a
  // task in hand keeps its session alive until it ends, and the pool's threads are joined
  // before the tiers go.
  std::unique_ptr<TaskPool> aging_;
  SessionManager sessions_;
  // The Unix socket's listener (null for a TCP --listen): its connections' peers outlive
  // every call, so it is destroyed after the service and the server.
  std::unique_ptr<UnixListener> listener_;
  // listener_ as calls read it: set once, when the server runs.
  std::atomic<const UnixListener*> serving_listener_{nullptr};
  std::unique_ptr<TlsStage> tls_;   // null: no TLS
  std::unique_ptr<FdChannel> fds_;  // null: no Unix socket
  const Authenticator auth_;
  KvTierService service_;
  ApartService apart_service_{&service_};
  // The shared-memory Select channels (null: no Unix socket); their threads call the service,
  // so they are stopped before it goes.
  std::unique_ptr<ChannelHub> channels_;
  std::unique_ptr<grpc::Server> server_;
  // The Unix-socket connections of uids the config grants nothing, served apart from server_
  // (null: no Unix socket), so that their calls and messages never reach server_'s transport
  // bound: its own small bound, tiny messages, every kvtier call refused (ApartService).
  std::unique_ptr<grpc::Server> apart_;
  std::unique_ptr<metrics::HttpExporter> exporter_;

  absl::Notification shutdown_requested_;
  absl::Mutex mu_;  // lock order 11 (server/common/lock_order.h)
  bool stopped_ ABSL_GUARDED_BY(mu_) = false;
  std::thread reaper_;
  std::thread persister_;  // write-behind (--persist_interval_ms), or not started
};

}  // namespace kvtier

#endif  // KVTIER_SERVER_RPC_DAEMON_H_
