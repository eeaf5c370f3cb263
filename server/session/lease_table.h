// Leases: pins on the slots a Select returned, ended by Release or by TTL, so that a worker
// that dies cannot pin memory for ever. A leased slot is never rewritten in place (a session
// copies on write instead) and never freed, even after its session closes.
//
// Workers: a worker that holds an Attach stream open is attached under an id the daemon
// made; a Select naming that id (SelectRequest.worker_id) gets a lease that also ends when the
// worker detaches (its stream or connection ends), at once rather than at the TTL.
#ifndef KVTIER_SERVER_SESSION_LEASE_TABLE_H_
#define KVTIER_SERVER_SESSION_LEASE_TABLE_H_

#include <cstdint>
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

class LeaseTable {
 public:
  explicit LeaseTable(const Clock* clock) : clock_(clock) {}
  // Unpins whatever is still leased.
  ~LeaseTable();

  struct Granted {
    std::string lease_id;
    int64_t expires_unix_ms;
  };
  // Pins `slots` until Release, `ttl_ms` from now, or the end of `worker` (empty: none).
  // NOT_FOUND when `worker` is not attached (it detached meanwhile); nothing stays pinned.
  absl::StatusOr<Granted> Create(const std::string& tenant, const std::string& session_id,
                                 std::vector<SlotRef> slots, uint32_t ttl_ms,
                                 const std::string& worker = "");

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
  size_t CountForSession(const std::string& session_id) const;
  size_t CountForTenant(const std::string& tenant) const;

 private:
  struct Lease {
    std::string id;
    std::string tenant;
    std::string session_id;
    int64_t expires_ms;
    std::vector<SlotRef> slots;
    std::string worker;  // empty: none
  };
  struct Worker {
    std::string tenant;
    absl::flat_hash_set<std::string> leases;
  };
  absl::Status CheckWorkerLocked(const std::string& tenant, const std::string& worker) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // "<kind>-<counter>-<64 random bits>".
  std::string NewId(char kind) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  static void Unpin(Lease& lease);
  void Forget(const Lease& lease) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const Clock* const clock_;
  mutable absl::Mutex mu_;  // lock order 6 (server/common/lock_order.h)
  absl::flat_hash_map<std::string, Lease> leases_ ABSL_GUARDED_BY(mu_);
  // Live leases per session, so a session's count is a lookup, not a scan of every lease.
  absl::flat_hash_map<std::string, size_t> per_session_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, size_t> per_tenant_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, Worker> workers_ ABSL_GUARDED_BY(mu_);
  uint64_t next_ ABSL_GUARDED_BY(mu_) = 1;
};

}  // namespace kvtier

#endif  // KVTIER_SERVER_SESSION_LEASE_TABLE_H_
