// The daemon's sessions: creation with limits, lookup with tenant checks, close, fork, and
// the remote tier below the host tier (demotion of idle sessions, restore on lookup). When the
// host tier is full, this is the one place that makes room by demoting an idle session and
// tries again (Run, and restores).
#ifndef KVTIER_SERVER_SESSION_SESSION_MANAGER_H_
#define KVTIER_SERVER_SESSION_SESSION_MANAGER_H_

#include <array>
#include <atomic>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "server/config/config.h"
#include "server/session/remote_records.h"
#include "server/session/session.h"
#include "server/tier/remote_store.h"

namespace kvtier {

// A session's labels: at most this many, each key 1..kMaxLabelKey bytes and each value at most
// kMaxLabelValue bytes (Kubernetes' label sizes are 63; values here may hold a little more).
inline constexpr int kMaxLabels = 32;
inline constexpr size_t kMaxLabelKey = 63;
inline constexpr size_t kMaxLabelValue = 255;

// The sessions by id, in shards with locks of their own, so that a lookup (a Select, an append
// stream's first message) takes one shard's lock and no lock every session shares. The manager
// changes them under its own lock besides (SessionManager::mu_, then a shard's).
class SessionShards {
 public:
  static constexpr size_t kShards = 16;
  // The session of `id`, or null.
  std::shared_ptr<Session> Find(const std::string& id) const;
  void Put(const std::string& id, std::shared_ptr<Session> session);
  // Removes `id`'s session when it is `only` (any when null); returns what it removed.
  std::shared_ptr<Session> Remove(const std::string& id, const Session* only = nullptr);
  size_t size() const { return size_.load(std::memory_order_acquire); }
  // Every session, in no order.
  std::vector<std::shared_ptr<Session>> All() const;
  // Removes every session and returns them.
  std::vector<std::pair<std::string, std::shared_ptr<Session>>> TakeAll();

 private:
  struct Shard {
    mutable absl::Mutex mu;  // lock order 2, after SessionManager::mu_ (server/common/lock_order.h)
    absl::flat_hash_map<std::string, std::shared_ptr<Session>> sessions ABSL_GUARDED_BY(mu);
  };
  Shard& ShardOf(const std::string& id) const;
  mutable std::array<Shard, kShards> shards_;
  std::atomic<size_t> size_ = 0;
};

class SessionManager {
 public:
  // `options` and `remote` (the remote tier, or null) outlive the manager.
  SessionManager(const ServerOptions& options, const SessionEnv& env, RemoteStore* remote);
  ~SessionManager();

  // INVALID_ARGUMENT for the shape, the policy, a malformed session_id or labels past their
  // limits (kMaxLabels); ALREADY_EXISTS for a taken id; RESOURCE_EXHAUSTED past max_sessions.
  absl::StatusOr<v1::CreateSessionResponse> Create(const std::string& tenant,
                                                   const v1::CreateSessionRequest& req);

  // NOT_FOUND for an unknown id; PERMISSION_DENIED for another tenant's session. An empty
  // tenant is the admin view and sees every session. With a remote tier, a session that is
  // not here but stored there (demoted by this daemon or another) is restored first;
  // DATA_LOSS when its record fails its checksum (it is then not served).
  absl::StatusOr<std::shared_ptr<Session>> Get(const std::string& tenant,
                                               const std::string& session_id);

  // Runs `fn` on the session (looked up as Get does) and returns its status. Tries again, up
  // to 16 times, when the session moved to the remote tier while `fn` waited (ErrorReason
  // kSessionMoved: the next lookup restores it), and when the host tier was full
  // (kHostTierFull) and an idle session could be demoted to make room. `cached`, when given
  // and still the live session of that id, is tried first (a stream's appends look the
  // session up once), and holds the session used afterwards.
  absl::Status Run(const std::string& tenant, const std::string& session_id,
                   const std::function<absl::Status(const std::shared_ptr<Session>&)>& fn,
                   std::shared_ptr<Session>* cached = nullptr);

  // Remote tier. Moves one session there whole (Evict to TIER_HOST); returns the record's
  // bytes (0 when it lies there already). FAILED_PRECONDITION without a remote tier or while
  // leases hold its chunks. A restore of it in flight ends first.
  absl::StatusOr<uint64_t> Demote(const std::string& tenant, const std::string& session_id) {
    return Demote(tenant, session_id, /*after_restore=*/true);
  }
  // Demotes the least recently used session other than `keep` that no lease holds; false
  // when there is none (or no remote tier). Called when the host tier is full.
  bool DemoteIdle(const std::string& keep);

  struct RemoteCounters {
    uint64_t demotions = 0, demoted_bytes = 0;
    uint64_t restores = 0, restored_bytes = 0;
    double restore_seconds = 0;  // summed over restores
    uint64_t corrupt = 0;        // records refused for a bad checksum or format
    uint64_t lost = 0;           // demoted here, then gone from Redis (DATA_LOSS)
  };
  RemoteCounters remote_counters() const;
  bool has_remote() const { return remote_ != nullptr; }

  // Idempotent: false when there was no such session. PERMISSION_DENIED for another's. A
  // session lying in the remote tier is deleted there (Redis is reached without the map lock).
  absl::StatusOr<bool> Close(const std::string& tenant, const std::string& session_id);

  // As Create, from an existing session's first `num_tokens` tokens.
  absl::StatusOr<v1::CreateSessionResponse> Fork(const std::string& tenant,
                                                 const v1::ForkSessionRequest& req);

  // Moving a session between daemons (server/session/transfer.h). Export: the session as a
  // record, taken under its lock (looked up as Run does). Import: `record` becomes a session
  // of `tenant` here (whoever's it was there) under `session_id`, or the record's id when that
  // is empty, with Create's checks (the id's form and uniqueness, max_sessions, the tenant's
  // quota, the remote tier's claim) and a full host tier making room as Run's does. DATA_LOSS
  // for a record that does not describe a session.
  absl::StatusOr<v1::SessionRecord> Export(const std::string& tenant,
                                           const std::string& session_id);
  absl::StatusOr<v1::CreateSessionResponse> Import(const std::string& tenant,
                                                   v1::SessionRecord record,
                                                   const std::string& session_id);
  // Create's checks of a new id (its form, uniqueness, max_sessions, the tenant's quota), as
  // Import makes them: an import checks its id before its chunks arrive.
  absl::Status CheckNewSessionId(const std::string& tenant, const std::string& session_id) const;

  std::vector<std::shared_ptr<Session>> List() const;
  size_t size() const;

  // Closes every session (shutdown), letting their ids go in the remote tier (kept with
  // write-behind on: this instance's snapshots hold them).
  void CloseAll();

  // Shutdown with a remote tier: every session held here demoted to it, in turn, until
  // `deadline` (the rest are left to CloseAll). Leased sessions fail (end the leases first).
  struct DrainCounts {
    uint64_t demoted = 0, bytes = 0, failed = 0, left = 0;
  };
  DrainCounts DemoteAll(absl::Time deadline);

  // Write-behind (--persist_interval_ms with a remote tier): every session held here that
  // changed since its last snapshot is stored whole under SnapshotKey, a key of this daemon's
  // own (its instance and host), which no other daemon reads. After a SIGKILL the same
  // instance, started again on that Redis, restores each on its first use as of that point.
  // A close or a demotion removes the snapshot. `stop`, when given, is asked before each
  // session: true ends the pass (a shutdown, whose drain need not wait for the rest of it).
  struct PersistCounts {
    uint64_t sessions = 0, bytes = 0, failed = 0;
  };
  PersistCounts PersistChanged(const std::function<bool()>& stop = {});
  bool persisting() const { return remote_ != nullptr && options_.persist_interval_ms > 0; }
  std::string SnapshotKey(const std::string& session_id) const {
    return snapshot_prefix_ + session_id;
  }

 private:
  // Id syntax and uniqueness, then CheckRoom.
  absl::Status CheckNewId(const std::string& id, const std::string& tenant) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Room for one more session of `tenant` (named `id` in the message): the daemon's
  // max_sessions and the tenant's quota, a restore in progress counted.
  absl::Status CheckRoom(const std::string& id, const std::string& tenant) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::string NewId() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // Demote; with `after_restore`, a session not held here waits at its id's gate for a
  // restore in flight (without, it is looked for in the remote tier at once: DemoteIdle, which
  // runs inside a restore, must never wait at another id's gate).
  absl::StatusOr<uint64_t> Demote(const std::string& tenant, const std::string& session_id,
                                  bool after_restore);
  absl::StatusOr<std::shared_ptr<Session>> Restore(const std::string& tenant,
                                                   const std::string& session_id)
      ABSL_LOCKS_EXCLUDED(mu_);
  // The session held here under `session_id` (not moved to the remote tier), or null. Takes
  // one shard's lock only.
  std::shared_ptr<Session> Held(const std::string& session_id) const;
  // Removes `session_id` from the map and returns it; null when it is not here.
  // PERMISSION_DENIED for another tenant's.
  absl::StatusOr<std::shared_ptr<Session>> Take(const std::string& tenant,
                                                const std::string& session_id)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Runs `fn` until it succeeds or fails otherwise than for a full host tier; after each
  // such failure the least recently used idle session other than `keep` moves to the remote
  // tier, and when none can, the failure stands.
  absl::Status WithRoom(const std::string& keep, const std::function<absl::Status()>& fn);

  // A restore found neither a record nor a snapshot: NOT_FOUND, or DATA_LOSS for a session
  // this daemon demoted that nobody took or closed.
  absl::Status Vanished(const std::string& session_id);
  // Claims a new id in the remote tier (RemoteRecords::Claim): true when this claimed it now.
  // ALREADY_EXISTS when it lies there or another daemon holds it; false (unchecked) when Redis
  // is down or there is none.
  absl::StatusOr<bool> ClaimId(const std::string& id);
  // Lets this daemon's hold on the id go in the remote tier (a warning when Redis fails),
  // with the tombstone of a close when `tombstone` (RemoteRecords::Release).
  void ReleaseClaim(const std::string& session_id, bool tombstone = false);
  // Removes the session's snapshot, if write-behind is on (a warning when Redis fails).
  void DropSnapshot(const std::string& session_id);

  const ServerOptions& options_;
  const SessionEnv env_;
  RemoteStore* const remote_;
  const std::string self_;                // "<instance>@<hostname>", in owner keys and snapshots
  const std::string snapshot_prefix_;     // "kvtier:snapshot:<self>:"
  std::optional<RemoteRecords> records_;  // with a remote tier
  // Sessions this daemon demoted and has not seen since: one whose record then vanishes
  // (not taken by another daemon, not closed anywhere) is lost, and says so.
  absl::flat_hash_set<std::string> demoted_here_ ABSL_GUARDED_BY(mu_);
  // Changes of the map, and the counts and ids beside it. Never held across Redis I/O. Lock
  // order 2: held while sessions_ changes (each change takes a shard's lock too), so that a
  // check of a new id and its insertion are one step; a lookup takes only a shard's lock.
  mutable absl::Mutex mu_;
  SessionShards sessions_;
  RemoteCounters remote_counters_ ABSL_GUARDED_BY(mu_);
  // A restore from the remote tier, and a close of a session not held here, hold their id's
  // gate (IdGate) across Redis I/O and an Import: one at a time for each id, so that two calls
  // for one demoted session restore it once, and a close waits for a restore of its id. Other
  // ids' restores go side by side. The ids in hand; a call for one of them waits on gate_cv_.
  class IdGate;
  absl::flat_hash_set<std::string> gated_ ABSL_GUARDED_BY(mu_);
  absl::CondVar gate_cv_;
  // The tenants of the restores in progress, by id: each holds its place among the sessions
  // until it is in the map (or fails).
  absl::flat_hash_map<std::string, std::string> restoring_ ABSL_GUARDED_BY(mu_);
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
};

}  // namespace kvtier

#endif  // KVTIER_SERVER_SESSION_SESSION_MANAGER_H_
