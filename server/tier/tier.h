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
// Nothing on the path of an allocation or a free takes a lock that every session takes. An
// allocation names a TierAccount: its tenant's count of bytes (an atomic, against the quota)
// and one of the tier's 16 shards, by the session that holds the account. The tier's bytes
// are an atomic against the capacity, taken with a compare-and-swap before any slot is, so
// that no race passes a limit. A shard holds the segments its accounts' slots come from, under
// a lock of its own: one session's appends, aging and promotions take its shard's lock only,
// and another session's take it only when it hashes to the same shard. A segment enters a
// shard's list when made (or taken from the retained ones), and leaves it when emptied; a
// tenant with sessions on many shards has a partly used segment per shard and slot size.
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

#include <array>
#include <atomic>
#include <cstdint>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <span>
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
class TierAccount;
struct TierSegment;  // tier.cc

// One slot of one segment. Not copyable; held through SlotRef, which Tier makes in one
// allocation with its count (std::make_shared; only Tier holds the Key). One per stored chunk,
// so its size counts against the stored format (quant_bench): 56 bytes, the slot's offset
// derived from its index (slot i of a segment lies at i * bytes) and its host or device
// memory in one pointer. It names its segment, whose shard takes it back.
class Slot {
 public:
  class Key {
    friend class Tier;
    Key() = default;
  };
  // `data`: the slot's bytes mapped here, or null for a slot in `device` memory.
  Slot(Key, Tier* tier, TierSegment* segment, uint32_t index, uint8_t* data, DeviceMemory* device,
       uint32_t bytes, uint64_t generation, uint64_t* shared_generation)
      : tier_(tier),
        segment_(segment),
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
  uint64_t segment_id() const;
  uint64_t offset() const { return uint64_t{index_} * bytes_; }
  v1::Tier tier() const;
  uint64_t generation() const { return generation_.load(std::memory_order_acquire); }

  // The memory is about to be rewritten in place: takes a new generation, published before
  // any store the caller makes after it (so call it before the rewrite, not after: a reader's
  // Recheck then fails for a copy that overlapped it).
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
  TierSegment* const segment_;
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

// A tenant's bytes on one tier (its slots' and its metadata's: what its quota counts), shared
// by the tier's table of tenants, each TierAccount of the tenant's and each of its segments.
struct TierTenant {
  TierTenant(std::string name, uint64_t limit) : name(std::move(name)), limit(limit) {}
  const std::string name;
  const uint64_t limit;  // its quota on the tier (TierOptions::tenant_limit); 0: none
  // Added to only once the tier's bytes are taken, so that no refusal elsewhere ever sees
  // bytes that are then given back; under quota_mu where there is a quota.
  std::atomic<uint64_t> used{0};
  // A quota's check and take as one: a lock of the tenant's sessions only (lock order 8, a
  // leaf), which a tenant with no quota never takes.
  absl::Mutex quota_mu;
};

class Tier {
 public:
  explicit Tier(TierOptions options);
  // REQUIRES: every Slot of this tier has been destroyed.
  ~Tier();
  Tier(const Tier&) = delete;
  Tier& operator=(const Tier&) = delete;

  // `tenant`'s account on this tier, allocating from the shard that `shard_key` (a hash of the
  // session that holds it) picks. Made once per holder: it takes a lock of the tier's (a leaf).
  TierAccount Account(const std::string& tenant, uint64_t shard_key = 0);

  // A slot of `slot_bytes` in one of the account's tenant's segments, of the account's shard.
  // The bytes are not cleared. RESOURCE_EXHAUSTED when the tier is full (ErrorReason
  // kHostTierFull or kDeviceTierFull) or the tenant's quota would be exceeded (kQuota; the
  // message names the quota); INVALID_ARGUMENT when a slot cannot fit in a segment;
  // RESOURCE_EXHAUSTED (the tier's full reason) when /dev/shm has no room for a new slot's
  // pages, which are committed before the slot is handed out; INTERNAL when shared memory
  // cannot be created.
  absl::StatusOr<SlotRef> Allocate(const TierAccount& account, uint64_t slot_bytes);
  // `count` such slots appended to `out`, all or none (the first refusal's status): their bytes
  // are counted at once, then the slots taken under one hold of the shard's lock.
  absl::Status AllocateMany(const TierAccount& account, uint64_t slot_bytes, uint64_t count,
                            std::vector<SlotRef>* out);
  // The same through an account made for the call, on shard 0 (tests, and paths that run once
  // per session).
  absl::StatusOr<SlotRef> Allocate(const std::string& tenant, uint64_t slot_bytes);
  absl::Status AllocateMany(const std::string& tenant, uint64_t slot_bytes, uint64_t count,
                            std::vector<SlotRef>* out);

  // Bytes the account's tenant may still take before its quota, or the tier's free bytes when
  // that is less (or the tenant has no quota).
  uint64_t RoomFor(const TierAccount& account) const;
  uint64_t RoomFor(const std::string& tenant);
  // The tier's free bytes: its capacity less what slots and session metadata take.
  uint64_t FreeBytes() const;
  // Whether the tenant's quota, not the tier's capacity, is what limits it now.
  bool QuotaBound(const TierAccount& account) const;
  bool QuotaBound(const std::string& tenant);
  // Slot and metadata bytes `tenant` holds.
  uint64_t TenantUsed(const std::string& tenant) const;

  // Charges `bytes` of the tenant's session metadata to this tier: when `checked`, refused as
  // Allocate refuses a slot of that size (kQuota, or the tier's full reason), with nothing
  // charged; else taken whatever the limits say (a count made true after the fact).
  absl::Status ChargeMetadata(const TierAccount& account, uint64_t bytes, bool checked = true);
  // Gives back metadata bytes charged before.
  void RefundMetadata(const TierAccount& account, uint64_t bytes);

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
  static constexpr size_t kShards = 16;
  // A segment's fresh slots are committed this many bytes at a time (at most the segment).
  static constexpr uint64_t kReserveAhead = 1 << 20;
  // Pages committed under a shard's lock, to be mapped in (ShmSegment::Populate) after it.
  struct PopulateRange {
    ShmSegment* shm;
    uint64_t offset, length;
  };
  // (tenant, slot bytes): the segments one class of slots comes from.
  using ClassKey = std::pair<const TierTenant*, uint64_t>;
  struct Shard {
    absl::Mutex mu;  // lock order 8 (server/common/lock_order.h)
    // Each class's segments with a slot in use, in the order they joined.
    std::map<ClassKey, std::vector<TierSegment*>> classes ABSL_GUARDED_BY(mu);
  };
  // How a segment of a class is laid out: its slots, and where its generation table starts.
  struct Layout {
    uint64_t num_slots;
    uint64_t table_offset;
  };
  absl::StatusOr<Layout> LayoutFor(uint64_t slot_bytes) const;
  // One slot of `shard`, under its lock; a range it committed goes to `populate`.
  absl::StatusOr<SlotRef> TakeSlotLocked(Shard& shard, uint32_t shard_index,
                                         const std::shared_ptr<TierTenant>& tenant,
                                         uint64_t slot_bytes, Layout layout,
                                         std::vector<PopulateRange>* populate)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(shard.mu);
  // A new segment of `tenant`'s, registered (not yet in any shard's classes).
  absl::StatusOr<TierSegment*> NewSegment(const std::shared_ptr<TierTenant>& tenant,
                                          uint64_t slot_bytes, Layout layout);
  // A retained segment of the class, taken out of the retained ones; null when none.
  TierSegment* Unretain(const ClassKey& key);
  // A segment whose last slot was just freed, out of every shard: retained or released.
  void RetainOrRelease(TierSegment* seg);
  // Releases the oldest retained segments while they pass retain_bytes or, with the bytes in
  // use, the capacity. Allocations look first without the lock (RetainedOver): in a steady
  // state with segments retained, none takes it.
  bool RetainedOver() const;
  void TrimRetained();
  void TrimRetainedLocked(std::vector<TierSegment*>* released)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(retained_mu_);
  // Unregisters segments with no slot in use (unmapped and unlinked as they go).
  void Release(std::span<TierSegment* const> segs);
  void Free(TierSegment* seg, uint32_t index, uint64_t bytes);

  // Takes `bytes` of the tenant's quota and the tier's capacity, both or neither: OK, or the
  // RESOURCE_EXHAUSTED that Allocate and ChargeMetadata answer (an allocation failure), `what`
  // naming the bytes.
  absl::Status TakeBytes(TierTenant& tenant, uint64_t bytes, absl::string_view what);
  // The capacity's part of it: a compare-and-swap, never past the capacity.
  absl::Status TakeTierBytes(uint64_t bytes, absl::string_view what);
  void GiveBytes(TierTenant& tenant, uint64_t bytes);
  // A RESOURCE_EXHAUSTED status (the capacity, or a full /dev/shm under a segment) with this
  // tier's full reason; other statuses pass unchanged.
  absl::Status WithTierReason(absl::Status s) const;
  // What is left of the capacity, and of the tenant's quota (the most a uint64 holds: none).
  struct Room {
    uint64_t tier = 0;
    uint64_t quota = std::numeric_limits<uint64_t>::max();
  };
  Room RoomOf(const TierTenant& tenant) const;
  // The capacity left with `used` bytes taken.
  uint64_t FreeOf(uint64_t used) const {
    return options_.capacity_bytes > used ? options_.capacity_bytes - used : 0;
  }
  static uint64_t FirstGeneration();
  void AddPinned(int64_t delta) { pinned_bytes_.fetch_add(delta, std::memory_order_relaxed); }

  const TierOptions options_;
  std::array<Shard, kShards> shards_;
  // Slot and metadata bytes: never past the capacity but by an unchecked metadata charge.
  std::atomic<uint64_t> used_bytes_{0};
  std::atomic<uint64_t> metadata_bytes_{0};  // part of used_bytes_ and of tenants' used
  std::atomic<uint64_t> num_slots_{0};
  std::atomic<uint64_t> allocation_failures_{0};
  std::atomic<int64_t> pinned_bytes_{0};
  // From a random start (below 2^52): a generation of this process is never one an earlier
  // daemon's segment of the same id held, so a worker's mapping of that one fails its check.
  std::atomic<uint64_t> next_generation_{FirstGeneration()};

  // The tenants with an account or a segment here.
  mutable absl::Mutex tenants_mu_;  // lock order 9 (server/common/lock_order.h)
  std::map<std::string, std::weak_ptr<TierTenant>> tenants_ ABSL_GUARDED_BY(tenants_mu_);

  // Emptied segments kept for reuse, in no shard: retained_seq -> segment, oldest first.
  absl::Mutex retained_mu_;  // lock order 8: a leaf, taken alone or under a shard's
  std::map<uint64_t, TierSegment*> retained_ ABSL_GUARDED_BY(retained_mu_);
  uint64_t next_retained_seq_ ABSL_GUARDED_BY(retained_mu_) = 1;
  std::atomic<uint64_t> retained_bytes_{0};  // written under retained_mu_

  // Every segment, by id: what owns them, and what ListSegments and OpenReadOnly read (the
  // fields a segment never changes). Taken when a segment is made or released.
  mutable absl::Mutex registry_mu_;  // lock order 8: a leaf, taken alone or under a shard's
  std::map<uint64_t, std::unique_ptr<TierSegment>> segments_ ABSL_GUARDED_BY(registry_mu_);
};

// Who allocates from a tier: a tenant, through one shard of the tier (Tier::Account). Cheap to
// copy; null when default-made.
class TierAccount {
 public:
  TierAccount() = default;
  Tier* tier() const { return tier_; }
  const std::string& tenant() const { return tenant_->name; }
  explicit operator bool() const { return tier_ != nullptr; }

 private:
  friend class Tier;
  TierAccount(Tier* tier, std::shared_ptr<TierTenant> tenant, uint32_t shard)
      : tier_(tier), tenant_(std::move(tenant)), shard_(shard) {}
  Tier* tier_ = nullptr;
  std::shared_ptr<TierTenant> tenant_;
  uint32_t shard_ = 0;
};

// One holder's metadata bytes on a tier, given back when it is destroyed or reset. Grow is
// checked against the capacity and the quota before the work it pays for; Set records what the
// work came to, which may pass what was grown (and the limits) by what no check foresaw.
class MetadataCharge {
 public:
  MetadataCharge() = default;
  explicit MetadataCharge(TierAccount account) : account_(std::move(account)) {}
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
  TierAccount account_;
  uint64_t bytes_ = 0;
};

// "host", "device", "remote".
const char* TierShortName(v1::Tier tier);

}  // namespace kvtier

#endif  // KVTIER_SERVER_TIER_TIER_H_
