#include "server/session/lease_table.h"

#include "absl/random/random.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "server/common/error.h"
#include "server/common/mutex.h"
#include "server/common/status_macros.h"

namespace kvtier {

LeaseTable::~LeaseTable() {
  MutexLock lock(&mu_);
  for (auto& [id, lease] : leases_) Unpin(lease);
}

void LeaseTable::Unpin(Lease& lease) {
  for (const SlotRef& s : lease.slots) s->Unpin();
}

void LeaseTable::Forget(const Lease& lease) {
  if (!lease.worker.empty()) {
    if (auto w = workers_.find(lease.worker); w != workers_.end()) w->second.leases.erase(lease.id);
  }
  auto it = per_session_.find(lease.session_id);
  if (--it->second == 0) per_session_.erase(it);
  auto t = per_tenant_.find(lease.tenant);
  if (--t->second == 0) per_tenant_.erase(t);
}

std::string LeaseTable::NewId(char kind) {
  // A counter keeps ids unique; the random part keeps them unguessable across tenants.
  static thread_local absl::BitGen gen;
  return absl::StrFormat("%c-%d-%016x", kind, next_++, absl::Uniform<uint64_t>(gen));
}

std::vector<LeaseTable::Info> LeaseTable::List(const std::string* tenant,
                                               const std::string& session_id, size_t limit,
                                               size_t* total) const {
  std::vector<Info> out;
  MutexLock lock(&mu_);
  for (const auto& [id, l] : leases_) {
    if ((tenant != nullptr && l.tenant != *tenant) ||
        (!session_id.empty() && l.session_id != session_id)) {
      continue;
    }
    Info i{.lease_id = id,
           .tenant = l.tenant,
           .session_id = l.session_id,
           .worker = l.worker,
           .slots = static_cast<uint32_t>(l.slots.size()),
           .expires_unix_ms = l.expires_ms};
    for (const SlotRef& s : l.slots) i.pinned_bytes += s->bytes();
    out.push_back(std::move(i));
  }
  *total = out.size();
  std::sort(out.begin(), out.end(),
            [](const Info& a, const Info& b) { return a.lease_id < b.lease_id; });
  if (out.size() > limit) out.resize(limit);
  return out;
}

absl::StatusOr<LeaseTable::Granted> LeaseTable::Create(const std::string& tenant,
                                                       const std::string& session_id,
                                                       std::vector<SlotRef> slots, uint32_t ttl_ms,
                                                       const std::string& worker) {
  const int64_t expires = clock_->NowMs() + ttl_ms;
  MutexLock lock(&mu_);
  RETURN_IF_ERROR(CheckWorkerLocked(tenant, worker));
  for (const SlotRef& s : slots) s->Pin();
  std::string id = NewId('l');
  if (!worker.empty()) workers_[worker].leases.insert(id);
  leases_.emplace(id, Lease{id, tenant, session_id, expires, std::move(slots), worker});
  ++per_session_[session_id];
  ++per_tenant_[tenant];
  return Granted{id, expires};
}

std::string LeaseTable::Attach(const std::string& tenant) {
  MutexLock lock(&mu_);
  std::string id = NewId('w');
  workers_.emplace(id, Worker{tenant, {}});
  return id;
}

int LeaseTable::Detach(const std::string& worker) {
  std::vector<Lease> ended;
  {
    MutexLock lock(&mu_);
    auto w = workers_.find(worker);
    if (w == workers_.end()) return 0;
    const absl::flat_hash_set<std::string> ids = std::move(w->second.leases);
    workers_.erase(w);
    for (const std::string& id : ids) {
      auto it = leases_.find(id);
      ended.push_back(std::move(it->second));
      leases_.erase(it);
      Forget(ended.back());
    }
  }
  for (Lease& l : ended) Unpin(l);  // outside the lock, as Release
  return static_cast<int>(ended.size());
}

absl::Status LeaseTable::CheckWorkerLocked(const std::string& tenant,
                                           const std::string& worker) const {
  if (worker.empty()) return absl::OkStatus();
  // Another tenant's worker is answered as one that does not exist, in the same words: ids
  // the daemon hands out are their holder's business.
  auto w = workers_.find(worker);
  if (w == workers_.end() || w->second.tenant != tenant) {
    return absl::NotFoundError(absl::StrCat("worker_id: ", Quoted(worker),
                                            " is not one of this tenant's attached workers (its "
                                            "Attach stream ended, or it never was)"));
  }
  return absl::OkStatus();
}

absl::Status LeaseTable::CheckWorker(const std::string& tenant, const std::string& worker) const {
  if (worker.empty()) return absl::OkStatus();
  MutexLock lock(&mu_);
  return CheckWorkerLocked(tenant, worker);
}

size_t LeaseTable::workers() const {
  MutexLock lock(&mu_);
  return workers_.size();
}

absl::Status LeaseTable::Release(const std::string& tenant, const std::string& lease_id) {
  Lease ended;
  {
    MutexLock lock(&mu_);
    auto it = leases_.find(lease_id);
    if (it == leases_.end() || it->second.tenant != tenant) {  // another's: as if none (above)
      return absl::NotFoundError(absl::StrCat("lease_id: ", Quoted(lease_id),
                                              " is not a live lease of this tenant (released, "
                                              "expired, or never granted to it)"));
    }
    ended = std::move(it->second);
    leases_.erase(it);
    Forget(ended);
  }
  Unpin(ended);  // outside the lock: dropping the last ref frees into the tier
  return absl::OkStatus();
}

int LeaseTable::ExpireDue() {
  std::vector<Lease> ended;
  int64_t now = clock_->NowMs();
  {
    MutexLock lock(&mu_);
    for (auto it = leases_.begin(); it != leases_.end();) {
      if (it->second.expires_ms <= now) {
        ended.push_back(std::move(it->second));
        Forget(ended.back());
        leases_.erase(it++);
      } else {
        ++it;
      }
    }
  }
  for (Lease& l : ended) Unpin(l);
  return static_cast<int>(ended.size());
}

int LeaseTable::EndAll() {
  std::vector<Lease> ended;
  {
    MutexLock lock(&mu_);
    for (auto& [id, lease] : leases_) ended.push_back(std::move(lease));
    leases_.clear();
    per_session_.clear();
    per_tenant_.clear();
    for (auto& [id, w] : workers_) w.leases.clear();
  }
  for (Lease& l : ended) Unpin(l);
  return static_cast<int>(ended.size());
}

size_t LeaseTable::size() const {
  MutexLock lock(&mu_);
  return leases_.size();
}

size_t LeaseTable::CountForTenant(const std::string& tenant) const {
  MutexLock lock(&mu_);
  auto it = per_tenant_.find(tenant);
  return it == per_tenant_.end() ? 0 : it->second;
}

size_t LeaseTable::CountForSession(const std::string& session_id) const {
  MutexLock lock(&mu_);
  auto it = per_session_.find(session_id);
  return it == per_session_.end() ? 0 : it->second;
}

}  // namespace kvtier
