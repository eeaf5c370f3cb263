#include "server/session/lease_table.h"

#include "absl/random/random.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "server/common/mutex.h"

namespace kvtier {

LeaseTable::~LeaseTable() {
  MutexLock lock(&mu_);
  for (auto& [id, lease] : leases_) Unpin(lease);
}

void LeaseTable::Unpin(Lease& lease) {
  for (const SlotRef& s : lease.slots) s->Unpin();
}

void LeaseTable::Forget(const Lease& lease) {
  auto it = per_session_.find(lease.session_id);
  if (--it->second == 0) per_session_.erase(it);
  auto t = per_tenant_.find(lease.tenant);
  if (--t->second == 0) per_tenant_.erase(t);
}

LeaseTable::Granted LeaseTable::Create(const std::string& tenant, const std::string& session_id,
                                       std::vector<SlotRef> slots, uint32_t ttl_ms) {
  for (const SlotRef& s : slots) s->Pin();
  int64_t expires = clock_->NowMs() + ttl_ms;
  MutexLock lock(&mu_);
  // A counter keeps ids unique; the random part keeps them unguessable across tenants.
  static thread_local absl::BitGen gen;
  std::string id = absl::StrFormat("l-%d-%016x", next_++, absl::Uniform<uint64_t>(gen));
  leases_.emplace(id, Lease{tenant, session_id, expires, std::move(slots)});
  ++per_session_[session_id];
  ++per_tenant_[tenant];
  return {id, expires};
}

absl::Status LeaseTable::Release(const std::string& tenant, const std::string& lease_id) {
  Lease ended;
  {
    MutexLock lock(&mu_);
    auto it = leases_.find(lease_id);
    if (it == leases_.end()) {
      return absl::NotFoundError(
          absl::StrCat("lease_id: \"", lease_id, "\" is not a live lease (released or expired)"));
    }
    if (it->second.tenant != tenant) {
      return absl::PermissionDeniedError(
          absl::StrCat("lease_id: \"", lease_id, "\" belongs to another tenant"));
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
