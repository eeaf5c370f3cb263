// The daemon's descriptor socket (<socket>.fds): where a worker collects read-only
// descriptors of its tenant's segments, which it may not open by name (they are mode 0600).
// An OpenSegments call, authenticated like any other, issues a ticket for the process whose
// connection made it; that process connects here, writes the ticket and a newline, and gets
// one descriptor per segment by SCM_RIGHTS. A ticket is used once, by that pid and uid only
// (SO_PEERCRED), within kTicketLife; descriptors are opened when collected, kFdsPerMessage at
// a time, so a ticket holds none. Each connection is served on a thread of its own, within
// kReadTimeout for its ticket line; at most kConnectionsPerUid at once per uid and
// kConnections in all (more are closed at once), and at most kTicketsPerUid outstanding
// tickets per uid, so that no caller starves another.
//
// Descriptors sent and not yet read are in flight, and the kernel counts them against the
// daemon's uid (past its RLIMIT_NOFILE, every send fails: ETOOMANYREFS, for every tenant). So
// a connection sends its next message only once the client has read the last, and stays open
// until the client has read everything or closed its end: within kUnreadWait on its thread,
// then parked (its descriptor kept, no thread) until then. A parked connection still counts
// against its uid's connections, so one uid holds at most kConnectionsPerUid messages of
// kFdsPerMessage unread; connections served and parked together at most as many as half the
// daemon's RLIMIT_NOFILE allows in flight (past that, every connection is answered busy).
//
// Thread-safe. mu_ is lock order 15, a leaf; active_mu_ (a std::mutex, for its condition
// variable) is taken alone.
#ifndef KVTIER_SERVER_RPC_FD_CHANNEL_H_
#define KVTIER_SERVER_RPC_FD_CHANNEL_H_

#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "server/rpc/unix_listener.h"

namespace kvtier {

class FdChannel {
 public:
  static constexpr absl::Duration kTicketLife = absl::Seconds(10);
  static constexpr size_t kTicketsPerUid = 16;
  static constexpr size_t kFdsPerMessage = 250;
  static constexpr int kConnectionsPerUid = 4, kConnections = 32;
  static constexpr absl::Duration kReadTimeout = absl::Milliseconds(500);
  static constexpr absl::Duration kUnreadWait = absl::Seconds(1);

  // What a ticket hands over: segments, read-only (OpenSegments), a staging area, read-write
  // (OpenStaging), or a Select channel's descriptors (OpenChannel: its id once per descriptor).
  enum class Grant { kSegments, kStaging, kChannel };
  // Opens `id` of `tenant` as `grant` says, the ticket's `index`th: a descriptor the channel
  // closes after sending.
  using Opener = std::function<absl::StatusOr<int>(const std::string& tenant, uint64_t id,
                                                   Grant grant, size_t index)>;

  // Binds `path` (mode 0660) and starts serving. INTERNAL naming the path when it cannot.
  static absl::StatusOr<std::unique_ptr<FdChannel>> Start(const std::string& path, Opener open);
  ~FdChannel();  // stops, joins, and removes the socket file

  // A ticket for process `pid` of `uid` to collect `ids` of `tenant`. RESOURCE_EXHAUSTED
  // while `uid` has kTicketsPerUid unexpired tickets outstanding.
  absl::StatusOr<std::string> Issue(pid_t pid, uid_t uid, const std::string& tenant,
                                    std::vector<uint64_t> ids, Grant grant = Grant::kSegments);
  const std::string& path() const { return path_; }

 private:
  struct Ticket {
    pid_t pid;
    uid_t uid;
    std::string tenant;
    std::vector<uint64_t> ids;
    Grant grant;
    std::chrono::steady_clock::time_point expires;  // a wall clock stepped back would not end it
  };
  FdChannel(std::string path, std::unique_ptr<UnixListener> listener, Opener open)
      : path_(std::move(path)), listener_(std::move(listener)), open_(std::move(open)) {}
  // On the accept thread: a thread for the connection, or a close when past the caps.
  void Dispatch(int conn, const PeerCredentials& cred);
  // One connection: its ticket, then the descriptors or a refusal. True when it may close
  // now; false when the client has not read them (the caller parks it).
  bool Serve(int conn, const PeerCredentials& cred);
  // Closes the parked connections whose clients have read everything or closed their end.
  void PruneParkedLocked();
  absl::StatusOr<Ticket> Take(const std::string& ticket, const PeerCredentials& cred);

  const std::string path_;
  std::unique_ptr<UnixListener> listener_;
  const Opener open_;
  absl::Mutex mu_;  // lock order 15 (server/common/lock_order.h)
  std::map<std::string, Ticket> tickets_ ABSL_GUARDED_BY(mu_);
  std::mutex active_mu_;
  std::condition_variable idle_;      // signalled as the last connection ends
  std::map<uid_t, int> active_;       // connections being served or parked, by uid (active_mu_)
  int active_total_ = 0;              // connections being served (active_mu_)
  std::multimap<uid_t, int> parked_;  // connections whose descriptors are unread (active_mu_)
  // Connections served and parked together at most (each may hold a message of
  // kFdsPerMessage unread): within half the daemon's RLIMIT_NOFILE (set at Start).
  size_t max_unread_ = kConnections;
  std::atomic<bool> stopping_{false};  // the destructor runs: nothing is parked
};

}  // namespace kvtier

#endif  // KVTIER_SERVER_RPC_FD_CHANNEL_H_
