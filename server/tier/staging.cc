#include "server/tier/staging.h"

#include <unistd.h>

#include "absl/strings/str_cat.h"
#include "server/common/log.h"
#include "server/common/mutex.h"
#include "server/common/size.h"

namespace kvtier {

StagingArea::~StagingArea() {
  // Its pages go now, with its count: a worker may hold a descriptor of it for as long as it
  // likes (that keeps the object, never the daemon's memory).
  if (absl::Status s = shm_.Release(0, size()); !s.ok()) {
    KVLOG(warn, "staging.release_failed", "id={} error={}", id_, LogValue(s.message()));
  }
  in_use_->fetch_sub(size(), std::memory_order_relaxed);
}

absl::StatusOr<std::shared_ptr<StagingArea>> StagingRegistry::Create(const std::string& tenant,
                                                                     uint64_t size) {
  const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  if (size == 0 || size > max_bytes_) {
    return absl::InvalidArgumentError(absl::StrCat(
        "size_bytes: ", size, "; a staging area holds 1 to --max_staging_size ", max_bytes_));
  }
  const uint64_t bytes = (size + page - 1) / page * page;
  // Claimed before the memory is made, so that two calls at once cannot both pass the limit.
  if (uint64_t used; !ClaimBytes(in_use_.get(), bytes, max_bytes_, &used)) {
    return absl::ResourceExhaustedError(
        absl::StrCat("size_bytes: ", bytes, " more bytes of staging would pass --max_staging_size ",
                     max_bytes_, " (", used, " in use by the sessions' areas)"));
  }
  uint64_t id;
  {
    MutexLock lock(&mu_);
    id = next_id_++;
  }
  absl::StatusOr<ShmSegment> shm = ShmSegment::Create(absl::StrCat(label_, "-staging-", id), bytes,
                                                      ShmSegment::Naming::kMemfdShared);
  // Its pages committed and mapped here now, not at the appends that read them: an area is
  // made once and filled again and again, and a full shared memory is this call's
  // RESOURCE_EXHAUSTED, not a fault in an append.
  if (shm.ok()) {
    if (absl::Status s = shm->Reserve(0, bytes); !s.ok()) shm = s;
  }
  if (!shm.ok()) {
    in_use_->fetch_sub(bytes, std::memory_order_relaxed);
    return shm.status();
  }
  shm->Populate(0, bytes);
  auto area = std::shared_ptr<StagingArea>(new StagingArea(id, tenant, *std::move(shm), in_use_));
  MutexLock lock(&mu_);
  for (auto it = areas_.begin(); it != areas_.end();) {  // the ended ones go
    it = it->second.expired() ? areas_.erase(it) : std::next(it);
  }
  areas_.emplace(id, area);
  return area;
}

absl::StatusOr<int> StagingRegistry::OpenWritable(uint64_t id, const std::string& tenant) const {
  std::shared_ptr<StagingArea> area;
  {
    MutexLock lock(&mu_);
    auto it = areas_.find(id);
    if (it != areas_.end()) area = it->second.lock();
  }
  if (area == nullptr || area->tenant() != tenant) {
    return absl::NotFoundError(absl::StrCat("staging area ", id, " is not this tenant's"));
  }
  return area->OpenWritableFd();  // the last holder may let go meanwhile: this one holds it
}

}  // namespace kvtier
