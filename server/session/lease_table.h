// Leases: pins on the slots a Select returned, ended by Release or by TTL, so that a worker
// that dies cannot pin memory for ever. A leased slot is never rewritten in place (a session
// copies on write instead) and never freed, even after its session closes.
//
// Workers: a worker that holds an Attach stream open is attached under an id the daemon
// made; a Select naming that id (SelectRequest.worker_id) gets a lease that also ends when the
// worker detaches (its stream or connection ends), at once rather than at the TTL.
#ifndef KVTIER_SERVER_SESSION_LEASE_TABLE_H_
#define KVTIER_SERVER_SESSION_LEASE_TABLE_H_

#include <array>
#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "server/common/clock.h"
#include "server/tier/tier.h"

namespace kvtier {

// No lock is shared by every session: leases lie in shards by their id, workers in shards by
// theirs, and a tenant's count of live leases is an atomic its sessions hold (TenantLeases),
// so that Selects and Releases of different sessions and workers take different locks.
class LeaseTable {
 public:
  static constexpr size_t kShards = 16;

  explicit LeaseTable(const Clock* clock) : clock_(clock) {}
  // Unpins whatever is still leased.
  ~LeaseTable();

  // One tenant's count of live leases, read without a lock (Session::Select checks
  // max_leases_per_tenant against it). A session holds its tenant's from its start, and each
  // lease holds it until it ends.
  class TenantLeases {
   public:
    explicit TenantLeases(std::string tenant) : tenant_(std::move(tenant)) {}
    const std::string& tenant() const { return tenant_; }
    size_t live() const { return static_cast<size_t>(live_.load(std::memory_order_relaxed)); }
    // OK while it holds fewer than `max_live` leases (0: no limit), else RESOURCE_EXHAUSTED
    // naming the limit: a Select's early look, before its work (Create takes the count itself).
    absl::Status CheckRoom(uint64_t max_live) const {
      return RoomFor(max_live, live_.load(std::memory_order_relaxed));
    }

   private:
    friend class LeaseTable;
    absl::Status RoomFor(uint64_t max_live, int64_t live) const;
    const std::string tenant_;
    std::atomic<int64_t> live_ = 0;
  };
  // `tenant`'s count: the same object while anything holds it.
  std::shared_ptr<TenantLeases> Tenant(const std::string& tenant);

  // One session's count of live leases, read without a lock (DescribeSession, Evict, the idle
  // demotion). The session makes its own; each lease granted on it holds it until it ends. A
  // count of its own rather than one by session id: ids are the clients', and a session closed
  // with live leases leaves its id to the next session of that name, of any tenant.
  class SessionLeases {
   public:
    size_t live() const { return static_cast<size_t>(live_.load(std::memory_order_relaxed)); }

   private:
    friend class LeaseTable;
    std::atomic<int64_t> live_ = 0;
  };

  struct Granted {
    std::string lease_id;
    int64_t expires_unix_ms;
  };
  // Pins `slots` until Release, `ttl_ms` from now, or the end of `worker` (empty: none), for
  // `tenant` (made by Tenant), counted in `session` (null: in no session's count). NOT_FOUND
  // when `worker` is not attached (it detached meanwhile); RESOURCE_EXHAUSTED when the tenant
  // holds `max_live` leases already (0: no limit; the count is taken atomically, so calls at
  // once never pass it together). Either way nothing stays pinned.
  absl::StatusOr<Granted> Create(const std::shared_ptr<TenantLeases>& tenant,
                                 const std::string& session_id, std::vector<SlotRef> slots,
                                 uint32_t ttl_ms, const std::string& worker = "",
                                 std::shared_ptr<SessionLeases> session = nullptr,
                                 uint64_t max_live = 0);
  // The same, looking the tenant up (tests).
  absl::StatusOr<Granted> Create(const std::string& tenant, const std::string& session_id,
                                 std::vector<SlotRef> slots, uint32_t ttl_ms,
                                 const std::string& worker = "",
                                 std::shared_ptr<SessionLeases> session = nullptr) {
    return Create(Tenant(tenant), session_id, std::move(slots), ttl_ms, worker, std::move(session));
  }

  // A new worker of `tenant`; its id is unguessable.
  std::string Attach(const std::string& tenant);
  // Ends the worker and every lease it holds. Returns how many leases ended; idempotent.
  int Detach(const std::string& worker);
  // OK for an empty id or one of `tenant`'s attached workers; NOT_FOUND for an id that is
  // not attached (never, or no longer) and for another tenant's worker, in the same words.
  absl::Status CheckWorker(const std::string& tenant, const std::string& worker) const;
  size_t workers() const;

  // NOT_FOUND for an unknown or expired lease and for another tenant's, in the same words.
  absl::Status Release(const std::string& tenant, const std::string& lease_id);
  // Release's NOT_FOUND, without ending the lease: OK for a live lease of `tenant`.
  absl::Status CheckLive(const std::string& tenant, const std::string& lease_id) const;

  // Ends every lease whose time has come. Returns how many.
  int ExpireDue();
  // Ends every lease (shutdown). Returns how many.
  int EndAll();

  struct Info {
    std::string lease_id, tenant, session_id, worker;
    uint32_t slots = 0;
    uint64_t pinned_bytes = 0;
    int64_t expires_unix_ms = 0;
  };
  // The live leases of `tenant` (every tenant's when null), of `session_id` only unless it is
  // empty, ordered by id, at most `limit`; `total` receives how many matched.
  std::vector<Info> List(const std::string* tenant, const std::string& session_id, size_t limit,
                         size_t* total) const;

  size_t size() const;

 private:
  struct Lease {
    std::string id;
    std::shared_ptr<TenantLeases> tenant;
    std::string session_id;
    int64_t expires_ms;
    std::vector<SlotRef> slots;
    std::string worker;                      // empty: none
    std::shared_ptr<SessionLeases> session;  // null: counted in no session
  };
  struct Worker {
    std::string tenant;
    absl::flat_hash_set<std::string> leases;
  };
  // Lock order 6 (server/common/lock_order.h): a worker shard's, then a lease shard's.
  struct WorkerShard {
    mutable absl::Mutex mu;
    absl::flat_hash_map<std::string, Worker> workers ABSL_GUARDED_BY(mu);
  };
  struct LeaseShard {
    mutable absl::Mutex mu;
    absl::flat_hash_map<std::string, Lease> leases ABSL_GUARDED_BY(mu);
  };
  WorkerShard& WorkersOf(const std::string& worker) const;
  LeaseShard& LeasesOf(const std::string& lease_id) const;
  static absl::Status CheckWorkerIn(const WorkerShard& shard, const std::string& tenant,
                                    const std::string& worker)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(shard.mu);
  // "<kind>-<counter>-<64 random bits>".
  std::string NewId(char kind);
  // Ends `lease` in its tenant's and session's counts (the caller removes it from its shard).
  static void Forget(const Lease& lease);
  // Takes `lease` out of its worker's set (a Release or an expiry; a Detach took the set).
  void Unlist(const Lease& lease);
  static void Unpin(const Lease& lease);
  // Unpins each lease's slots and takes it out of its worker's set, outside every shard lock.
  void End(std::vector<Lease>& ended);

  const Clock* const clock_;
  std::atomic<uint64_t> next_ = 1;
  mutable std::array<WorkerShard, kShards> worker_shards_;
  mutable std::array<LeaseShard, kShards> lease_shards_;
  // Tenant's objects, by name: taken when a session starts (Tenant), not per Select.
  absl::Mutex tenants_mu_;  // lock order 6 too: a leaf, taken under no shard's
  absl::flat_hash_map<std::string, std::weak_ptr<TenantLeases>> tenants_
      ABSL_GUARDED_BY(tenants_mu_);
};

}  // namespace kvtier

#endif  // KVTIER_SERVER_SESSION_LEASE_TABLE_H_
