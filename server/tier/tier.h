// A memory tier: a slab allocator over POSIX shared-memory segments with a byte capacity.
//
// A segment holds slots of one size for one tenant only, so that its permissions (or, on a
// GPU, who receives its IPC handle) can keep tenants apart. Slots leave the allocator as
// `SlotRef`s (shared, since a chunk, a fork of its session and a lease may all hold one);
// the last reference gives the space back. A segment whose last slot is freed is retained,
// committed and mapped, for its tenant's next slots of its size, while the emptied segments
// kept take at most `retain_bytes` (and never, with the slots in use, past the capacity);
// past that the oldest is unmapped and unlinked, so closed sessions return their memory to the
// OS. A retained segment's pages need no kernel work when they are taken again: a session
// that follows a closed one writes its bytes at memory speed.
//
// Capacity counts slot bytes: a slot is refused (RESOURCE_EXHAUSTED) when it would take
// used bytes past the capacity, so committed shared memory never exceeds the capacity by
// more than a page per segment.
//
// Every allocation takes a fresh tier-wide generation number, so a handle that names a
// slot's generation detects reuse of that memory. The generation is also written into the
// segment itself, in a table after the slots (0 while a slot is free), so that a worker
// reading through shared memory can check, after copying, that the slot still holds what
// its handle named:
//
//   0          slot_bytes   2*slot_bytes    n*slot_bytes  table (64-aligned)    size
//   +----------+------------+-----  ...  --+-------------+---------------------+----+
//   | slot 0   | slot 1     |              | (pad)       | u64 gen[n]          |    |
//   +----------+------------+-----  ...  --+-------------+---------------------+----+
//
// A tier with `device_memory` (a GPU's HBM) keeps its slots there, one DeviceMemory region per
// segment exported by a CUDA IPC handle, and the segment's generation table and stamp in a small
// shared-memory segment of their own (table at 0, stamp after it), so that a worker re-checks a
// generation on the host after its kernel read. Such a slot has no host address (data() is
// null): its bytes go in and out through Slot::Write and Slot::Read, which every path that
// may meet a device slot uses.
#ifndef KVTIER_SERVER_TIER_TIER_H_
#define KVTIER_SERVER_TIER_TIER_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "kvtier/v1/kvtier.pb.h"
#include "server/tier/shm_segment.h"
#include "server/transfer/gpu.h"

namespace kvtier {

struct TierOptions {
  v1::Tier tier = v1::TIER_HOST;
  // Segment names are "/kvtier-<instance>-<tier>-<segment id>".
  std::string instance = "default";
  uint64_t capacity_bytes = 1ull << 30;
  uint64_t segment_bytes = 64ull << 20;
  // A device tier held in host shared memory because no GPU is in use.
  bool emulated = false;
  // Segments named in /dev/shm (mode 0600), or unnamed memfds reached only by descriptor.
  ShmSegment::Naming naming = ShmSegment::Naming::kNamed;
  // Committed bytes of emptied segments kept for reuse (see above); 0: released at once.
  uint64_t retain_bytes = 0;
  // The bytes of slots one tenant may hold (its quota); 0 or unset: no limit.
  std::function<uint64_t(const std::string& tenant)> tenant_limit;
  // Set: each segment's slots are memory this makes (of segment_bytes; on a GPU,
  // AllocateGpuMemory), not host shared memory.
  std::function<absl::StatusOr<std::unique_ptr<DeviceMemory>>(uint64_t bytes)> device_memory;
  // The CUDA device of device_memory, as ListSegments reports it (-1: none).
  int gpu = -1;
};

class Tier;

// One slot of one segment. Not copyable; held through SlotRef, which Tier makes in one
// allocation with its count (std::make_shared; only Tier holds the Key). One per stored chunk,
// so its size counts against the stored format (quant_bench): 56 bytes, the slot's offset
// derived from its index (slot i of a segment lies at i * bytes) and its host or device
// memory in one pointer.
class Slot {
 public:
  class Key {
    friend class Tier;
    Key() = default;
  };
  // `data`: the slot's bytes mapped here, or null for a slot in `device` memory.
  Slot(Key, Tier* tier, uint64_t segment_id, uint32_t index, uint8_t* data, DeviceMemory* device,
       uint32_t bytes, uint64_t generation, uint64_t* shared_generation)
      : tier_(tier),
        segment_id_(segment_id),
        memory_(device != nullptr ? static_cast<void*>(device) : static_cast<void*>(data)),
        generation_(generation),
        shared_generation_(shared_generation),
        bytes_(bytes),
        index_(index),
        on_device_(device != nullptr) {
    Publish(generation);
  }
  Slot(const Slot&) = delete;
  Slot& operator=(const Slot&) = delete;
  ~Slot();  // gives the space back to its tier

  // The bytes, mapped here; null for a slot in device memory (see Write and Read).
  uint8_t* data() const { return on_device_ ? nullptr : static_cast<uint8_t*>(memory_); }
  bool on_device() const { return on_device_; }
  // The device memory of a device slot (its bytes at offset() there); null otherwise.
  DeviceMemory* device_memory() const {
    return on_device_ ? static_cast<DeviceMemory*>(memory_) : nullptr;
  }
  // `n` bytes of `src` into the slot at `at`, wherever it lives (a copy to the device for a
  // device slot); the device's error when that copy fails.
  absl::Status Write(uint64_t at, const void* src, uint64_t n);
  // `n` bytes of the slot at `at` into `dst`.
  absl::Status Read(uint64_t at, void* dst, uint64_t n) const;
  uint64_t bytes() const { return bytes_; }
  uint64_t segment_id() const { return segment_id_; }
  uint64_t offset() const { return uint64_t{index_} * bytes_; }
  v1::Tier tier() const;
  uint64_t generation() const { return generation_.load(std::memory_order_acquire); }

  // The memory is about to be rewritten in place: takes a new generation.
  void Renew();

  // Leases pin slots; a pinned slot's bytes count as the tier's pinned bytes.
  void Pin();
  void Unpin();
  bool pinned() const { return pins_.load(std::memory_order_acquire) > 0; }

 private:
  friend class Tier;
  // Writes the generation where readers of the segment see it.
  void Publish(uint64_t generation) {
    std::atomic_ref<uint64_t>(*shared_generation_).store(generation, std::memory_order_release);
  }

  Tier* const tier_;
  const uint64_t segment_id_;
  void* const memory_;  // the mapped bytes, or the segment's DeviceMemory (on_device_)
  std::atomic<uint64_t> generation_;
  uint64_t* const shared_generation_;  // this slot's cell of its segment's generation table
  const uint32_t bytes_;
  const uint32_t index_;
  std::atomic<int32_t> pins_{0};
  const bool on_device_;
};

using SlotRef = std::shared_ptr<Slot>;

struct TierSnapshot {
  v1::Tier tier;
  bool emulated;
  uint64_t capacity_bytes;
  uint64_t used_bytes;
  uint64_t pinned_bytes;
  uint64_t num_slots;
  uint64_t num_segments;
  uint64_t allocation_failures;
  // Heap bytes of session metadata (chunk records, statistics, index) charged to this tier
  // beside its slots (MetadataCharge); they count against its capacity and tenants' quotas.
  uint64_t metadata_bytes;
  // Committed bytes of emptied segments kept for reuse (TierOptions::retain_bytes).
  uint64_t retained_bytes;
};

struct SegmentInfo {
  uint64_t segment_id;
  v1::Tier tier;
  std::string shm_name;  // empty for an unnamed (memfd) segment
  uint64_t size_bytes;
  uint64_t slot_bytes;
  std::string tenant;
  uint64_t generation;
  uint64_t generation_table_offset;
  uint64_t stamp_offset;  // where `stamp` is written in the segment (after the table)
  uint64_t stamp;
  // A device-memory segment: its CUDA IPC handle and device; shm_name, generation_table_offset
  // and stamp_offset then name the host segment of its generation table.
  std::string cuda_ipc_handle;
  int device = -1;
};

class MetadataCharge;

class Tier {
 public:
  explicit Tier(TierOptions options);
  // REQUIRES: every Slot of this tier has been destroyed.
  ~Tier();
  Tier(const Tier&) = delete;
  Tier& operator=(const Tier&) = delete;

  // A slot of `slot_bytes` in one of `tenant`'s segments. The bytes are not cleared.
  // RESOURCE_EXHAUSTED when the tier is full (ErrorReason kHostTierFull or kDeviceTierFull)
  // or the tenant's quota would be exceeded (kQuota; the message names the quota);
  // INVALID_ARGUMENT when a slot cannot fit in a segment; RESOURCE_EXHAUSTED (the tier's full
  // reason) when /dev/shm has no room for a new slot's pages, which are committed before the
  // slot is handed out; INTERNAL when shared memory cannot be created.
  absl::StatusOr<SlotRef> Allocate(const std::string& tenant, uint64_t slot_bytes);
  // `count` such slots appended to `out`, all or none (the first refusal's status), under one
  // hold of the tier's lock: an append's slots at once.
  absl::Status AllocateMany(const std::string& tenant, uint64_t slot_bytes, uint64_t count,
                            std::vector<SlotRef>* out);

  // Bytes `tenant` may still take before its quota, or the tier's free bytes when that is
  // less (or the tenant has no quota).
  uint64_t RoomFor(const std::string& tenant) const;
  // The tier's free bytes: its capacity less what slots and session metadata take.
  uint64_t FreeBytes() const;
  // Whether `tenant`'s quota, not the tier's capacity, is what limits it now.
  bool QuotaBound(const std::string& tenant) const;
  // Slot and metadata bytes `tenant` holds.
  uint64_t TenantUsed(const std::string& tenant) const;

  // Charges `bytes` of `tenant`'s session metadata to this tier: when `checked`, refused as
  // Allocate refuses a slot of that size (kQuota, or the tier's full reason), with nothing
  // charged; else taken whatever the limits say (a count made true after the fact).
  absl::Status ChargeMetadata(const std::string& tenant, uint64_t bytes, bool checked = true);
  // Gives back metadata bytes charged before.
  void RefundMetadata(const std::string& tenant, uint64_t bytes);

  TierSnapshot Stats() const;
  std::vector<SegmentInfo> Segments() const;
  // A new read-only descriptor of segment `segment_id` of `tenant` (the caller closes it): a
  // mapping of it can never be made writable. NOT_FOUND, in the same words, for an id that is
  // no segment and for another tenant's.
  absl::StatusOr<int> OpenReadOnly(uint64_t segment_id, const std::string& tenant) const;
  const TierOptions& options() const { return options_; }
  std::string ShmPrefix() const;
  // The segment name prefix of `instance`'s tier `tier`: "/kvtier-<instance>-<tier>-".
  static std::string ShmPrefixOf(const std::string& instance, v1::Tier tier);

 private:
  friend class Slot;
  // A segment's fresh slots are committed this many bytes at a time (at most the segment).
  static constexpr uint64_t kReserveAhead = 1 << 20;
  // Pages committed under the lock, to be mapped in (ShmSegment::Populate) after it.
  struct PopulateRange {
    ShmSegment* shm;
    uint64_t offset, length;
  };
  // One slot, under the lock; a range it committed goes to `populate`.
  absl::StatusOr<SlotRef> AllocateLocked(const std::string& tenant, uint64_t slot_bytes,
                                         std::vector<PopulateRange>* populate)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  struct Segment {
    uint64_t id;
    std::string tenant;
    uint64_t slot_bytes;
    uint32_t num_slots;
    uint64_t table_offset;     // the generation table: uint64 [num_slots]
    uint32_t next_unused = 0;  // slots below this have been handed out at least once
    uint64_t reserved = 0;     // the slots' bytes [0, reserved) are committed (Reserve)
    uint32_t used = 0;
    std::vector<uint32_t> free;  // freed slots, reused last-in first-out (warm pages)
    ShmSegment shm;  // the slots and the table; the table alone when `device` holds the slots
    std::unique_ptr<DeviceMemory> device;
    uint64_t generation;
    uint64_t stamp;  // random, at stamp_offset() (SegmentInfo::stamp)
    // While emptied and retained: its place in retained_ (from 1) and the bytes it counts.
    uint64_t retained_seq = 0;
    uint64_t retained_bytes = 0;
    // Where the stamp lies: right after the generation table.
    uint64_t stamp_offset() const { return table_offset + uint64_t{num_slots} * sizeof(uint64_t); }
  };
  using ClassKey = std::pair<std::string, uint64_t>;  // (tenant, slot bytes)

  void Free(uint64_t segment_id, uint32_t index, uint64_t bytes);
  // A new segment of `tenant`'s for `num_slots` slots, its table at `table_offset`.
  absl::StatusOr<Segment*> NewSegmentLocked(const std::string& tenant, uint64_t slot_bytes,
                                            uint64_t num_slots, uint64_t table_offset)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Unmaps and unlinks a segment with no slot in use.
  void ReleaseLocked(Segment* seg) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A retained segment taken into use again.
  void UnretainLocked(Segment* seg) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Releases the oldest retained segments while they pass retain_bytes or, with the bytes in
  // use, the capacity.
  void TrimRetainedLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A RESOURCE_EXHAUSTED status (the capacity, or a full /dev/shm under a segment) with this
  // tier's full reason; other statuses pass unchanged.
  absl::Status WithTierReason(absl::Status s) const;
  // What is left of the capacity, and of `tenant`'s quota (the most a uint64 holds: none).
  struct Room {
    uint64_t tier = 0;
    uint64_t quota = std::numeric_limits<uint64_t>::max();
  };
  Room RoomLocked(const std::string& tenant) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  uint64_t FreeBytesLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return options_.capacity_bytes > used_bytes_ ? options_.capacity_bytes - used_bytes_ : 0;
  }
  uint64_t TenantUsedLocked(const std::string& tenant) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // OK when `bytes` more fit `tenant`'s quota and the capacity; else the RESOURCE_EXHAUSTED
  // that Allocate and ChargeMetadata answer (an allocation failure), `what` naming the bytes.
  absl::Status CheckRoomLocked(const std::string& tenant, uint64_t bytes, absl::string_view what)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  static uint64_t FirstGeneration();
  void AddPinned(int64_t delta) { pinned_bytes_.fetch_add(delta, std::memory_order_relaxed); }

  const TierOptions options_;
  mutable absl::Mutex mu_;  // lock order 8 (server/common/lock_order.h)
  std::map<uint64_t, std::unique_ptr<Segment>> segments_ ABSL_GUARDED_BY(mu_);
  std::map<ClassKey, std::vector<uint64_t>> classes_ ABSL_GUARDED_BY(mu_);
  uint64_t used_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<std::string, uint64_t> tenant_used_ ABSL_GUARDED_BY(mu_);
  uint64_t num_slots_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t allocation_failures_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t metadata_bytes_ ABSL_GUARDED_BY(mu_) = 0;  // part of used_bytes_ and tenant_used_
  std::map<uint64_t, uint64_t> retained_ ABSL_GUARDED_BY(mu_);  // retained_seq -> segment id
  uint64_t retained_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t next_retained_seq_ ABSL_GUARDED_BY(mu_) = 1;
  // From a random start (below 2^52): a generation of this process is never one an earlier
  // daemon's segment of the same id held, so a worker's mapping of that one fails its check.
  std::atomic<uint64_t> next_generation_{FirstGeneration()};
  std::atomic<int64_t> pinned_bytes_{0};
};

// One holder's metadata bytes on a tier, given back when it is destroyed or reset. Grow is
// checked against the capacity and the quota before the work it pays for; Set records what the
// work came to, which may pass what was grown (and the limits) by what no check foresaw.
class MetadataCharge {
 public:
  MetadataCharge() = default;
  MetadataCharge(Tier* tier, std::string tenant) : tier_(tier), tenant_(std::move(tenant)) {}
  MetadataCharge(const MetadataCharge&) = delete;
  MetadataCharge& operator=(const MetadataCharge&) = delete;
  MetadataCharge(MetadataCharge&& o) noexcept { *this = std::move(o); }
  MetadataCharge& operator=(MetadataCharge&& o) noexcept;
  ~MetadataCharge() { Set(0); }

  // Charges `extra` more bytes; the tier's error when they do not fit, with nothing charged.
  absl::Status Grow(uint64_t extra);
  // The charge becomes `bytes`: more is taken unchecked, less is given back.
  void Set(uint64_t bytes);
  uint64_t bytes() const { return bytes_; }

 private:
  Tier* tier_ = nullptr;
  std::string tenant_;
  uint64_t bytes_ = 0;
};

// "host", "device", "remote".
const char* TierShortName(v1::Tier tier);

}  // namespace kvtier

#endif  // KVTIER_SERVER_TIER_TIER_H_
