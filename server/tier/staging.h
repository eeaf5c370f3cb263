// Staging areas: shared memory that a worker on this host writes K and V into, and then names
// in an append (AppendKVRequest.staged), so that the bytes never pass through gRPC. Each area
// is an unnamed memfd of a sealed size that its worker maps read-write through a descriptor
// handed over the descriptor socket to its tenant's process only (OpenStaging). The daemon
// copies an append's bytes out of the area before it validates them, so that a worker writing
// meanwhile changes only what it sent, never what was checked.
//
// The registry counts the bytes of the areas alive (a session holds its own; an area ends
// with its last holder) against --max_staging_size, and finds an area by id for the
// descriptor socket. Thread-safe; mu_ is lock order 17, a leaf.
#ifndef KVTIER_SERVER_TIER_STAGING_H_
#define KVTIER_SERVER_TIER_STAGING_H_

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "server/tier/shm_segment.h"

namespace kvtier {

class StagingArea {
 public:
  ~StagingArea();  // its bytes leave the registry's count
  StagingArea(const StagingArea&) = delete;
  StagingArea& operator=(const StagingArea&) = delete;

  uint64_t id() const { return id_; }
  const std::string& tenant() const { return tenant_; }
  uint64_t size() const { return shm_.size(); }
  // The worker may write any byte at any time: copy out before checking.
  const uint8_t* data() const { return shm_.data(); }
  // A new read-write descriptor of the area (the caller closes it).
  absl::StatusOr<int> OpenWritableFd() const { return shm_.OpenWritableFd(); }

 private:
  friend class StagingRegistry;
  StagingArea(uint64_t id, std::string tenant, ShmSegment shm,
              std::shared_ptr<std::atomic<uint64_t>> in_use)
      : id_(id), tenant_(std::move(tenant)), shm_(std::move(shm)), in_use_(std::move(in_use)) {}

  const uint64_t id_;
  const std::string tenant_;
  ShmSegment shm_;
  const std::shared_ptr<std::atomic<uint64_t>> in_use_;
};

class StagingRegistry {
 public:
  // `label` names the areas in /proc/<pid>/fd ("memfd:<label>-staging-<id>").
  StagingRegistry(std::string label, uint64_t max_bytes)
      : label_(std::move(label)),
        max_bytes_(max_bytes),
        in_use_(std::make_shared<std::atomic<uint64_t>>(0)) {}

  // An area of at least `size` bytes (whole pages) for `tenant`. INVALID_ARGUMENT naming
  // size_bytes when it is 0 or past max_bytes; RESOURCE_EXHAUSTED when the areas alive leave
  // too little room; INTERNAL when the kernel refuses the memory.
  absl::StatusOr<std::shared_ptr<StagingArea>> Create(const std::string& tenant, uint64_t size);
  // A read-write descriptor of area `id` of `tenant`: NOT_FOUND when there is no such area
  // alive, or it is another tenant's.
  absl::StatusOr<int> OpenWritable(uint64_t id, const std::string& tenant) const;

  uint64_t bytes_in_use() const { return in_use_->load(std::memory_order_relaxed); }
  uint64_t max_bytes() const { return max_bytes_; }

 private:
  const std::string label_;
  const uint64_t max_bytes_;
  const std::shared_ptr<std::atomic<uint64_t>> in_use_;  // shared with every area
  mutable absl::Mutex mu_;  // lock order 17 (server/common/lock_order.h)
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
  std::map<uint64_t, std::weak_ptr<StagingArea>> areas_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvtier

#endif  // KVTIER_SERVER_TIER_STAGING_H_
