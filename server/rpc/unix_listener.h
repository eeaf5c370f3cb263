// The daemon's Unix socket, accepted here rather than by gRPC, so that each connection's
// peer is known: the kernel's credentials of the process that connected (SO_PEERCRED: uid,
// gid, pid, taken at connect time). Each accepted connection is handed to the gRPC server as
// a descriptor (grpc::AddInsecureChannelFromFd), whose calls then report the peer "fd:N";
// Lookup("fd:N") gives that connection's credentials. A descriptor number is reused only
// after gRPC closed its connection, and the accept that reuses it records the new peer
// before the connection can carry a call; a call takes its identity once, as it starts (its
// connection is open then), so that reuse cannot change who a running call is. A call whose
// client closed the connection in the instant between its arrival and its start could read a
// newer connection's entry (gRPC gives no per-connection identity of its own), were the number
// given again at once, as the kernel gives the lowest free one: each connection is moved to the
// next number of a cycle of kCycle instead (Renumber), so a number comes back only after that
// many connections.
//
// Each uid but the daemon's own may hold a bounded number of connections open at once
// (ConnectionLimit, --max_connections_per_uid): one past it is closed as it is accepted, before
// gRPC holds any memory for it.
//
// Thread-safe. Lookup takes mu_ (lock order 14, a leaf).
#ifndef KVTIER_SERVER_RPC_UNIX_LISTENER_H_
#define KVTIER_SERVER_RPC_UNIX_LISTENER_H_

#include <sys/types.h>

#include <array>
#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "grpcpp/grpcpp.h"

namespace kvtier {

struct PeerCredentials {
  uid_t uid = 0;
  gid_t gid = 0;
  pid_t pid = 0;
};

class UnixListener {
 public:
  // Binds `path` (created with mode 0660: the socket appears there with that mode, through
  // `path`.new renamed into place) and listens. INTERNAL naming the path and the reason when it
  // cannot; UNAVAILABLE when the path is in use.
  static absl::StatusOr<std::unique_ptr<UnixListener>> Bind(const std::string& path);
  ~UnixListener();  // Stop()

  // A bound on the connections each uid holds open at once.
  struct ConnectionLimit {
    size_t per_uid = 0;  // 0: none
    // This uid's connections are not bounded (the daemon's own: it could end the daemon anyway).
    std::optional<uid_t> exempt;
    // Told of each connection refused, with how many its uid holds; on the accept thread.
    std::function<void(const PeerCredentials& cred, size_t open)> refused;
  };
  // Connections of the uids `uid` picks go to `server` instead (both set, or neither).
  struct Apart {
    grpc::Server* server = nullptr;
    std::function<bool(uid_t)> uid;
  };
  // Starts accepting, each connection handed to `server` (or `apart.server`; started, and not
  // shut down before Stop returns), its credentials kept for Lookup. A connection whose uid
  // already holds `limit.per_uid` open is closed as it is accepted, before gRPC reads a byte of
  // it; a connection counts until gRPC has closed it (its descriptor no longer names its
  // socket).
  void Serve(grpc::Server* server, ConnectionLimit limit, Apart apart);
  // Starts accepting, each connection (non-blocking) and its credentials handed to `handler`
  // on the accept thread; the handler owns the descriptor.
  using Handler = std::function<void(int fd, const PeerCredentials& cred)>;
  void Serve(Handler handler);
  // Stops accepting, joins the accept thread and closes the listening socket, so that new
  // clients are refused; idempotent. Connections already handed over stay gRPC's. The socket
  // file stays (its owner removes it).
  void Stop();

  // The credentials of the connection a call names as its peer ("fd:N"), or nullopt when the
  // peer is not one of this listener's connections.
  std::optional<PeerCredentials> Lookup(absl::string_view grpc_peer) const;

 private:
  UnixListener(int fd, int stop_read, int stop_write)
      : fd_(fd), stop_read_(stop_read), stop_write_(stop_write) {}
  void Accept(const Handler& handler);
  // `c` moved to the next free number of the cycle [kFirst, kFirst + kCycle) (closed here),
  // or `c` as it is when none is to be had. The accept thread only.
  int Renumber(int c);
  static constexpr int kFirst = 64, kCycle = 32768;
  int next_ = kFirst;  // the accept thread's

  // A connection handed to gRPC, as accepted: its number and its socket's identity.
  struct Open {
    int fd;
    dev_t dev;
    ino_t ino;
  };
  // Whether `limit` lets `c` (from `cred`) in; if so it is counted. The accept thread only.
  bool Admit(int c, const PeerCredentials& cred, const ConnectionLimit& limit);
  // Forgets the connections of `open` that gRPC has closed.
  static void Prune(std::vector<Open>& open);
  // Each bounded uid's connections handed over, some maybe closed since (looked at when its
  // uid is at the bound, at most once in a while, kLookAgain or longer, and every uid's when
  // there are many uids), and when they were last looked at. The accept thread's.
  struct Held {
    std::vector<Open> open;
    std::chrono::steady_clock::time_point looked;
  };
  static constexpr auto kLookAgain = std::chrono::milliseconds(10);
  static constexpr size_t kUidsBeforeSweep = 1024;
  std::map<uid_t, Held> open_;
  size_t sweep_at_ = kUidsBeforeSweep;

  int fd_;                            // -1 once stopped
  const int stop_read_, stop_write_;  // a pipe whose write end wakes the accept loop to stop
  std::thread thread_;
  // The connections' credentials, in shards by descriptor: every call looks its caller up, and
  // calls on different connections take different locks.
  struct PeerShard {
    mutable absl::Mutex mu;  // lock order 14 (server/common/lock_order.h)
    std::map<int, PeerCredentials> peers ABSL_GUARDED_BY(mu);
  };
  static constexpr int kPeerShards = 16;
  PeerShard& ShardOf(int fd) const { return peer_shards_[static_cast<unsigned>(fd) % kPeerShards]; }
  mutable std::array<PeerShard, kPeerShards> peer_shards_;
};

}  // namespace kvtier

#endif  // KVTIER_SERVER_RPC_UNIX_LISTENER_H_
