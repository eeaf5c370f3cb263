#include "server/session/lease_table.h"

#include <algorithm>

#include "absl/cleanup/cleanup.h"
#include "absl/hash/hash.h"
#include "absl/random/random.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "server/common/error.h"
#include "server/common/mutex.h"
#include "server/common/status_macros.h"

namespace kvtier {

LeaseTable::~LeaseTable() {
  for (LeaseShard& shard : lease_shards_) {
    MutexLock lock(&shard.mu);
    for (auto& [id, lease] : shard.leases) Unpin(lease);
  }
}

void LeaseTable::Unpin(const Lease& lease) {
  for (const SlotRef& s : lease.slots) s->Unpin();
}

LeaseTable::WorkerShard& LeaseTable::WorkersOf(const std::string& worker) const {
  return worker_shards_[absl::HashOf(worker) % kShards];
}

LeaseTable::LeaseShard& LeaseTable::LeasesOf(const std::string& lease_id) const {
  return lease_shards_[absl::HashOf(lease_id) % kShards];
}

std::shared_ptr<LeaseTable::TenantLeases> LeaseTable::Tenant(const std::string& tenant) {
  MutexLock lock(&tenants_mu_);
  auto it = tenants_.find(tenant);
  if (it != tenants_.end()) {
    if (std::shared_ptr<TenantLeases> held = it->second.lock()) return held;
  }
  // A tenant nothing holds any more is forgotten when the next one is made, so that the map
  // grows with the tenants in use, not with every tenant ever seen.
  absl::erase_if(tenants_, [](const auto& entry) { return entry.second.expired(); });
  auto made = std::make_shared<TenantLeases>(tenant);
  tenants_[tenant] = made;
  return made;
}

void LeaseTable::Forget(const Lease& lease) {
  if (lease.session != nullptr) lease.session->live_.fetch_sub(1, std::memory_order_relaxed);
  lease.tenant->live_.fetch_sub(1, std::memory_order_relaxed);
}

void LeaseTable::Unlist(const Lease& lease) {
  if (lease.worker.empty()) return;
  WorkerShard& shard = WorkersOf(lease.worker);
  MutexLock lock(&shard.mu);
  if (auto w = shard.workers.find(lease.worker); w != shard.workers.end()) {
    w->second.leases.erase(lease.id);
  }
}

void LeaseTable::End(std::vector<Lease>& ended) {
  for (Lease& l : ended) {
    Unlist(l);
    Unpin(l);  // dropping the last ref frees into the tier
  }
}

std::string LeaseTable::NewId(char kind) {
  // A counter keeps ids unique; the random part keeps them unguessable across tenants.
  static thread_local absl::BitGen gen;
  return absl::StrFormat("%c-%d-%016x", kind, next_.fetch_add(1, std::memory_order_relaxed),
                         absl::Uniform<uint64_t>(gen));
}

std::vector<LeaseTable::Info> LeaseTable::List(const std::string* tenant,
                                               const std::string& session_id, size_t limit,
                                               size_t* total) const {
  std::vector<Info> out;
  for (const LeaseShard& shard : lease_shards_) {
    MutexLock lock(&shard.mu);
    for (const auto& [id, l] : shard.leases) {
      if ((tenant != nullptr && l.tenant->tenant() != *tenant) ||
          (!session_id.empty() && l.session_id != session_id)) {
        continue;
      }
      Info i{.lease_id = id,
             .tenant = l.tenant->tenant(),
             .session_id = l.session_id,
             .worker = l.worker,
             .slots = static_cast<uint32_t>(l.slots.size()),
             .expires_unix_ms = l.expires_ms};
      for (const SlotRef& s : l.slots) i.pinned_bytes += s->bytes();
      out.push_back(std::move(i));
    }
  }
  *total = out.size();
  std::sort(out.begin(), out.end(),
            [](const Info& a, const Info& b) { return a.lease_id < b.lease_id; });
  if (out.size() > limit) out.resize(limit);
  return out;
}

absl::Status LeaseTable::TenantLeases::RoomFor(uint64_t max_live, int64_t live) const {
  if (max_live == 0 || live < static_cast<int64_t>(max_live)) return absl::OkStatus();
  return absl::ResourceExhaustedError(absl::StrFormat(
      "max_leases_per_tenant %d: tenant %s holds %d live leases; release some (or let them "
      "expire)",
      max_live, Quoted(tenant_), live));
}

absl::StatusOr<LeaseTable::Granted> LeaseTable::Create(const std::shared_ptr<TenantLeases>& tenant,
                                                       const std::string& session_id,
                                                       std::vector<SlotRef> slots, uint32_t ttl_ms,
                                                       const std::string& worker,
                                                       std::shared_ptr<SessionLeases> session,
                                                       uint64_t max_live) {
  // The tenant's count first, as one step against its limit: a check apart from the increment
  // let calls of one tenant at once each pass it.
  int64_t live = tenant->live_.load(std::memory_order_relaxed);
  do {
    RETURN_IF_ERROR(tenant->RoomFor(max_live, live));
  } while (!tenant->live_.compare_exchange_weak(live, live + 1, std::memory_order_relaxed));
  absl::Cleanup give_back = [&tenant] { tenant->live_.fetch_sub(1, std::memory_order_relaxed); };
  const int64_t expires = clock_->NowMs() + ttl_ms;
  std::string id = NewId('l');
  auto insert = [&] {
    LeaseShard& shard = LeasesOf(id);
    MutexLock lock(&shard.mu);
    for (const SlotRef& s : slots) s->Pin();
    if (session != nullptr) session->live_.fetch_add(1, std::memory_order_relaxed);
    shard.leases.emplace(
        id, Lease{id, tenant, session_id, expires, std::move(slots), worker, std::move(session)});
    std::move(give_back).Cancel();  // the lease holds its count now
  };
  if (worker.empty()) {
    insert();
    return Granted{std::move(id), expires};
  }
  // Under the worker's shard, so that a Detach sees the lease or the lease sees no worker.
  WorkerShard& shard = WorkersOf(worker);
  MutexLock lock(&shard.mu);
  RETURN_IF_ERROR(CheckWorkerIn(shard, tenant->tenant(), worker));
  insert();
  shard.workers[worker].leases.insert(id);
  return Granted{std::move(id), expires};
}

std::string LeaseTable::Attach(const std::string& tenant) {
  std::string id = NewId('w');
  WorkerShard& shard = WorkersOf(id);
  MutexLock lock(&shard.mu);
  shard.workers.emplace(id, Worker{tenant, {}});
  return id;
}

int LeaseTable::Detach(const std::string& worker) {
  absl::flat_hash_set<std::string> ids;
  {
    WorkerShard& shard = WorkersOf(worker);
    MutexLock lock(&shard.mu);
    auto w = shard.workers.find(worker);
    if (w == shard.workers.end()) return 0;
    ids = std::move(w->second.leases);
    shard.workers.erase(w);
  }
  std::vector<Lease> ended;
  for (const std::string& id : ids) {
    LeaseShard& shard = LeasesOf(id);
    MutexLock lock(&shard.mu);
    auto it = shard.leases.find(id);
    if (it == shard.leases.end()) continue;  // released or expired meanwhile
    ended.push_back(std::move(it->second));
    shard.leases.erase(it);
    Forget(ended.back());
  }
  for (Lease& l : ended) Unpin(l);  // outside the locks, as Release; the worker's set is gone
  return static_cast<int>(ended.size());
}

absl::Status LeaseTable::CheckWorkerIn(const WorkerShard& shard, const std::string& tenant,
                                       const std::string& worker) {
  if (worker.empty()) return absl::OkStatus();
  // Another tenant's worker is answered as one that does not exist, in the same words: ids
  // the daemon hands out are their holder's business.
  auto w = shard.workers.find(worker);
  if (w == shard.workers.end() || w->second.tenant != tenant) {
    return absl::NotFoundError(absl::StrCat("worker_id: ", Quoted(worker),
                                            " is not one of this tenant's attached workers (its "
                                            "Attach stream ended, or it never was)"));
  }
  return absl::OkStatus();
}

absl::Status LeaseTable::CheckWorker(const std::string& tenant, const std::string& worker) const {
  if (worker.empty()) return absl::OkStatus();
  const WorkerShard& shard = WorkersOf(worker);
  MutexLock lock(&shard.mu);
  return CheckWorkerIn(shard, tenant, worker);
}

size_t LeaseTable::workers() const {
  size_t n = 0;
  for (const WorkerShard& shard : worker_shards_) {
    MutexLock lock(&shard.mu);
    n += shard.workers.size();
  }
  return n;
}

namespace {

absl::Status NotLive(const std::string& lease_id) {
  return absl::NotFoundError(absl::StrCat("lease_id: ", Quoted(lease_id),
                                          " is not a live lease of this tenant (released, "
                                          "expired, or never granted to it)"));
}

}  // namespace

absl::Status LeaseTable::CheckLive(const std::string& tenant, const std::string& lease_id) const {
  LeaseShard& shard = LeasesOf(lease_id);
  MutexLock lock(&shard.mu);
  auto it = shard.leases.find(lease_id);
  if (it == shard.leases.end() || it->second.tenant->tenant() != tenant) return NotLive(lease_id);
  return absl::OkStatus();
}

absl::Status LeaseTable::Release(const std::string& tenant, const std::string& lease_id) {
  std::vector<Lease> ended;
  {
    LeaseShard& shard = LeasesOf(lease_id);
    MutexLock lock(&shard.mu);
    auto it = shard.leases.find(lease_id);
    if (it == shard.leases.end() || it->second.tenant->tenant() != tenant) {
      return NotLive(lease_id);  // another's: as if none (above)
    }
    ended.push_back(std::move(it->second));
    shard.leases.erase(it);
    Forget(ended.back());
  }
  End(ended);
  return absl::OkStatus();
}

int LeaseTable::ExpireDue() {
  std::vector<Lease> ended;
  const int64_t now = clock_->NowMs();
  for (LeaseShard& shard : lease_shards_) {
    MutexLock lock(&shard.mu);
    for (auto it = shard.leases.begin(); it != shard.leases.end();) {
      if (it->second.expires_ms <= now) {
        ended.push_back(std::move(it->second));
        Forget(ended.back());
        shard.leases.erase(it++);
      } else {
        ++it;
      }
    }
  }
  End(ended);
  return static_cast<int>(ended.size());
}

int LeaseTable::EndAll() {
  std::vector<Lease> ended;
  for (LeaseShard& shard : lease_shards_) {
    MutexLock lock(&shard.mu);
    for (auto& [id, lease] : shard.leases) {
      ended.push_back(std::move(lease));
      Forget(ended.back());
    }
    shard.leases.clear();
  }
  End(ended);
  return static_cast<int>(ended.size());
}

size_t LeaseTable::size() const {
  size_t n = 0;
  for (const LeaseShard& shard : lease_shards_) {
    MutexLock lock(&shard.mu);
    n += shard.leases.size();
  }
  return n;
}

}  // namespace kvtier
