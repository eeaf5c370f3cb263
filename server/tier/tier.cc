#include "server/tier/tier.h"

#include <cstring>
#include <limits>
#include <utility>

#include "absl/random/random.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "server/common/check.h"
#include "server/common/error.h"
#include "server/common/mutex.h"
#include "server/common/size.h"
#include "server/common/status_macros.h"

namespace kvtier {
namespace {

// Segment ids are unique across all tiers of the process: clients key ListSegments by id.
std::atomic<uint64_t> next_segment_id{1};

// A segment's stamp: random, so that another daemon's same-named segment holds another one.
uint64_t RandomStamp() {
  static thread_local absl::BitGen gen;
  return absl::Uniform<uint64_t>(gen);
}

}  // namespace

const char* TierShortName(v1::Tier tier) {
  switch (tier) {
    case v1::TIER_DEVICE:
      return "device";
    case v1::TIER_HOST:
      return "host";
    case v1::TIER_REMOTE:
      return "remote";
    default:
      return "unspecified";
  }
}

Slot::~Slot() {
  Publish(0);  // free: a reader holding an old handle sees it at once
  if (pins_.load(std::memory_order_acquire) > 0) tier_->AddPinned(-static_cast<int64_t>(bytes_));
  tier_->Free(segment_id_, index_, bytes_);
}

v1::Tier Slot::tier() const { return tier_->options().tier; }

absl::Status Slot::Write(uint64_t at, const void* src, uint64_t n) {
  CHECK(at <= bytes_ && n <= bytes_ - at) << n << " bytes at " << at << " of a " << bytes_;
  if (on_device_) return device_memory()->Write(offset() + at, src, n);
  std::memcpy(data() + at, src, n);
  return absl::OkStatus();
}

absl::Status Slot::Read(uint64_t at, void* dst, uint64_t n) const {
  CHECK(at <= bytes_ && n <= bytes_ - at) << n << " bytes at " << at << " of a " << bytes_;
  if (on_device_) return device_memory()->Read(offset() + at, dst, n);
  std::memcpy(dst, data() + at, n);
  return absl::OkStatus();
}

void Slot::Renew() {
  const uint64_t g = tier_->next_generation_.fetch_add(1, std::memory_order_relaxed);
  generation_.store(g, std::memory_order_release);
  Publish(g);
}

void Slot::Pin() {
  if (pins_.fetch_add(1, std::memory_order_acq_rel) == 0) {
    tier_->AddPinned(static_cast<int64_t>(bytes_));
  }
}

void Slot::Unpin() {
  int32_t before = pins_.fetch_sub(1, std::memory_order_acq_rel);
  CHECK_GT(before, 0) << "Unpin without Pin";
  if (before == 1) tier_->AddPinned(-static_cast<int64_t>(bytes_));
}

uint64_t Tier::FirstGeneration() {
  return 1 + absl::Uniform<uint64_t>(absl::BitGen(), 0, 1ull << 52);
}

Tier::Tier(TierOptions options) : options_(std::move(options)) {}

Tier::~Tier() {
  MutexLock lock(&mu_);
  CHECK_EQ(num_slots_, 0u) << TierShortName(options_.tier) << " tier destroyed with live slots";
  CHECK_EQ(metadata_bytes_, 0u) << TierShortName(options_.tier)
                                << " tier destroyed with metadata charged";
}

absl::Status Tier::WithTierReason(absl::Status s) const {
  if (s.code() != absl::StatusCode::kResourceExhausted) return s;
  return WithReason(std::move(s), options_.tier == v1::TIER_DEVICE ? ErrorReason::kDeviceTierFull
                                                                   : ErrorReason::kHostTierFull);
}

std::string Tier::ShmPrefixOf(const std::string& instance, v1::Tier tier) {
  return absl::StrCat("/kvtier-", instance, "-", TierShortName(tier), "-");
}

std::string Tier::ShmPrefix() const { return ShmPrefixOf(options_.instance, options_.tier); }

absl::StatusOr<SlotRef> Tier::Allocate(const std::string& tenant, uint64_t slot_bytes) {
  std::vector<SlotRef> one;
  RETURN_IF_ERROR(AllocateMany(tenant, slot_bytes, 1, &one));
  return std::move(one[0]);
}

absl::Status Tier::AllocateMany(const std::string& tenant, uint64_t slot_bytes, uint64_t count,
                                std::vector<SlotRef>* out) {
  std::vector<PopulateRange> populate;
  std::vector<SlotRef> taken;
  absl::Status status;
  {
    MutexLock lock(&mu_);
    for (uint64_t i = 0; i < count && status.ok(); ++i) {
      absl::StatusOr<SlotRef> slot = AllocateLocked(tenant, slot_bytes, &populate);
      if (slot.ok()) {
        taken.push_back(*std::move(slot));
      } else {
        status = slot.status();
      }
    }
  }
  if (!status.ok()) return status;  // `taken` goes back, each slot taking the lock to free
  // The segments stay mapped: each range's segment has a slot just taken from it.
  for (const PopulateRange& r : populate) r.shm->Populate(r.offset, r.length);
  for (SlotRef& s : taken) out->push_back(std::move(s));
  return absl::OkStatus();
}

absl::StatusOr<SlotRef> Tier::AllocateLocked(const std::string& tenant, uint64_t slot_bytes,
                                             std::vector<PopulateRange>* populate) {
  // Host memory: slots, then the generation table at a 64-byte boundary, then the segment's
  // stamp. Device memory: the slots alone; the table at 0 of a host segment, then the stamp.
  const bool on_device = static_cast<bool>(options_.device_memory);
  uint64_t num_slots = slot_bytes == 0 ? 0 : options_.segment_bytes / slot_bytes;
  auto table_at = [slot_bytes, on_device](uint64_t n) {
    return on_device ? 0 : (n * slot_bytes + 63) / 64 * 64;
  };
  while (!on_device && num_slots > 0 &&
         table_at(num_slots) + 8 * (num_slots + 1) > options_.segment_bytes) {
    --num_slots;
  }
  if (num_slots == 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("slot of %d bytes does not fit a %d-byte segment with its generation",
                        slot_bytes, options_.segment_bytes));
  }
  if (slot_bytes > std::numeric_limits<uint32_t>::max()) {  // a Slot keeps its size in 32 bits
    return absl::InvalidArgumentError(
        absl::StrFormat("slot of %d bytes is larger than a slot may be (4 GiB - 1)", slot_bytes));
  }
  RETURN_IF_ERROR(CheckRoomLocked(tenant, slot_bytes, ""));
  Segment* seg = nullptr;
  auto& ids = classes_[{tenant, slot_bytes}];
  for (uint64_t id : ids) {
    Segment* s = segments_.at(id).get();
    if (!s->free.empty() || s->next_unused < s->num_slots) {
      seg = s;
      break;
    }
  }
  if (seg == nullptr) {
    ASSIGN_OR_RETURN(seg, NewSegmentLocked(tenant, slot_bytes, num_slots, table_at(num_slots)));
  }
  uint32_t index;
  if (!seg->free.empty()) {
    index = seg->free.back();  // its pages were committed when first handed out
    seg->free.pop_back();
  } else {
    // A slot never handed out: its pages are committed by now, so that a full /dev/shm is an
    // error here and never a SIGBUS where the bytes are first written. They are committed
    // (and mapped) kReserveAhead at a time, not a syscall and a page fault per slot; a
    // /dev/shm too full for that still gives the slot alone. (Device memory is whole.)
    const uint64_t end = uint64_t{seg->next_unused + 1} * slot_bytes;
    if (end > seg->reserved) {
      const uint64_t ahead = std::min<uint64_t>(uint64_t{seg->num_slots} * slot_bytes,
                                                std::max(end, seg->reserved + kReserveAhead));
      absl::Status s = seg->shm.Reserve(seg->reserved, ahead - seg->reserved);
      if (s.ok()) {
        populate->push_back({&seg->shm, seg->reserved, ahead - seg->reserved});
        seg->reserved = ahead;
      } else {
        s = seg->shm.Reserve(end - slot_bytes, slot_bytes);
        if (!s.ok()) {
          ++allocation_failures_;
          return WithTierReason(s);
        }
      }
    }
    index = seg->next_unused++;
  }
  if (seg->retained_seq != 0) UnretainLocked(seg);
  ++seg->used;
  used_bytes_ += slot_bytes;
  TrimRetainedLocked();
  tenant_used_[tenant] += slot_bytes;
  ++num_slots_;
  uint64_t offset = static_cast<uint64_t>(index) * slot_bytes;
  auto* table = reinterpret_cast<uint64_t*>(seg->shm.data() + seg->table_offset);
  return std::make_shared<Slot>(
      Slot::Key{}, this, seg->id, index, seg->device ? nullptr : seg->shm.data() + offset,
      seg->device.get(), static_cast<uint32_t>(slot_bytes),
      next_generation_.fetch_add(1, std::memory_order_relaxed), table + index);
}

absl::StatusOr<Tier::Segment*> Tier::NewSegmentLocked(const std::string& tenant,
                                                      uint64_t slot_bytes, uint64_t num_slots,
                                                      uint64_t table_offset) {
  const uint64_t id = next_segment_id.fetch_add(1, std::memory_order_relaxed);
  const uint64_t table_end = table_offset + (num_slots + 1) * sizeof(uint64_t);
  std::unique_ptr<DeviceMemory> device;
  if (options_.device_memory) {
    absl::StatusOr<std::unique_ptr<DeviceMemory>> m =
        options_.device_memory(num_slots * slot_bytes);
    if (!m.ok()) {
      ++allocation_failures_;
      return WithTierReason(m.status());
    }
    device = *std::move(m);
  }
  const uint64_t page = 4096;
  auto shm = ShmSegment::Create(
      absl::StrCat(ShmPrefix(), id),
      device ? (table_end + page - 1) / page * page : options_.segment_bytes, options_.naming);
  // The generation table and the stamp are written at once: their pages first.
  absl::Status reserved =
      shm.ok() ? shm->Reserve(table_offset, table_end - table_offset) : shm.status();
  if (!reserved.ok()) {
    ++allocation_failures_;
    return WithTierReason(reserved);
  }
  auto s = std::make_unique<Segment>(
      Segment{.id = id,
              .tenant = tenant,
              .slot_bytes = slot_bytes,
              .num_slots = static_cast<uint32_t>(num_slots),
              .table_offset = table_offset,
              .next_unused = 0,
              .reserved = device ? num_slots * slot_bytes : 0,
              .used = 0,
              .free = {},
              .shm = *std::move(shm),
              .device = std::move(device),
              .generation = next_generation_.fetch_add(1, std::memory_order_relaxed),
              .stamp = RandomStamp()});
  std::memcpy(s->shm.data() + s->stamp_offset(), &s->stamp, sizeof(s->stamp));
  Segment* seg = s.get();
  segments_.emplace(id, std::move(s));
  classes_[{tenant, slot_bytes}].push_back(id);
  return seg;
}

void Tier::Free(uint64_t segment_id, uint32_t index, uint64_t bytes) {
  MutexLock lock(&mu_);
  auto it = segments_.find(segment_id);
  CHECK(it != segments_.end()) << "slot freed into unknown segment " << segment_id;
  Segment* seg = it->second.get();
  used_bytes_ -= bytes;
  if ((tenant_used_[seg->tenant] -= bytes) == 0) tenant_used_.erase(seg->tenant);
  --num_slots_;
  seg->free.push_back(index);
  if (--seg->used > 0) return;
  const uint64_t committed = seg->reserved;
  if (committed == 0 || committed > options_.retain_bytes) {
    ReleaseLocked(seg);
    return;
  }
  seg->retained_seq = next_retained_seq_++;
  seg->retained_bytes = committed;
  retained_.emplace(seg->retained_seq, seg->id);
  retained_bytes_ += committed;
  TrimRetainedLocked();
}

void Tier::ReleaseLocked(Segment* seg) {
  if (seg->retained_seq != 0) UnretainLocked(seg);
  auto& ids = classes_[{seg->tenant, seg->slot_bytes}];
  std::erase(ids, seg->id);
  if (ids.empty()) classes_.erase({seg->tenant, seg->slot_bytes});
  segments_.erase(seg->id);  // unmaps and unlinks
}

void Tier::UnretainLocked(Segment* seg) {
  retained_.erase(seg->retained_seq);
  retained_bytes_ -= seg->retained_bytes;
  seg->retained_seq = 0;
  seg->retained_bytes = 0;
}

void Tier::TrimRetainedLocked() {
  while (!retained_.empty() && (retained_bytes_ > options_.retain_bytes ||
                                used_bytes_ + retained_bytes_ > options_.capacity_bytes)) {
    ReleaseLocked(segments_.at(retained_.begin()->second).get());
  }
}

absl::Status Tier::CheckRoomLocked(const std::string& tenant, uint64_t bytes,
                                   absl::string_view what) {
  const Room r = RoomLocked(tenant);
  if (bytes > r.quota) {
    ++allocation_failures_;
    return WithReason(
        absl::ResourceExhaustedError(absl::StrFormat(
            "quota: tenant \"%s\" %s_bytes %s would be exceeded: %s held, %d more bytes%s needed",
            tenant, TierShortName(options_.tier), FormatBytes(options_.tenant_limit(tenant)),
            FormatBytes(TenantUsedLocked(tenant)), bytes, what)),
        ErrorReason::kQuota);
  }
  if (bytes > r.tier) {
    ++allocation_failures_;
    return WithTierReason(absl::ResourceExhaustedError(absl::StrFormat(
        "%s tier full: %s of %s used, %d more bytes%s needed", TierShortName(options_.tier),
        FormatBytes(used_bytes_), FormatBytes(options_.capacity_bytes), bytes, what)));
  }
  return absl::OkStatus();
}

absl::Status Tier::ChargeMetadata(const std::string& tenant, uint64_t bytes, bool checked) {
  if (bytes == 0) return absl::OkStatus();
  MutexLock lock(&mu_);
  if (checked) RETURN_IF_ERROR(CheckRoomLocked(tenant, bytes, " of session metadata"));
  used_bytes_ += bytes;
  TrimRetainedLocked();
  metadata_bytes_ += bytes;
  tenant_used_[tenant] += bytes;
  return absl::OkStatus();
}

void Tier::RefundMetadata(const std::string& tenant, uint64_t bytes) {
  if (bytes == 0) return;
  MutexLock lock(&mu_);
  CHECK_GE(metadata_bytes_, bytes) << "metadata refund above the charge";
  used_bytes_ -= bytes;
  metadata_bytes_ -= bytes;
  auto it = tenant_used_.find(tenant);
  CHECK(it != tenant_used_.end() && it->second >= bytes) << "metadata refund above the charge";
  if ((it->second -= bytes) == 0) tenant_used_.erase(it);
}

MetadataCharge& MetadataCharge::operator=(MetadataCharge&& o) noexcept {
  if (this != &o) {
    Set(0);
    tier_ = o.tier_;
    tenant_ = std::move(o.tenant_);
    bytes_ = std::exchange(o.bytes_, 0);
  }
  return *this;
}

absl::Status MetadataCharge::Grow(uint64_t extra) {
  if (tier_ == nullptr) return absl::OkStatus();
  RETURN_IF_ERROR(tier_->ChargeMetadata(tenant_, extra));
  bytes_ += extra;
  return absl::OkStatus();
}

void MetadataCharge::Set(uint64_t bytes) {
  if (tier_ == nullptr || bytes == bytes_) return;
  if (bytes > bytes_) {
    // What was grown covers it in practice; taken even past the limits so the count stays true.
    (void)tier_->ChargeMetadata(tenant_, bytes - bytes_, /*checked=*/false);
  } else {
    tier_->RefundMetadata(tenant_, bytes_ - bytes);
  }
  bytes_ = bytes;
}

uint64_t Tier::TenantUsedLocked(const std::string& tenant) const {
  auto it = tenant_used_.find(tenant);
  return it == tenant_used_.end() ? 0 : it->second;
}

uint64_t Tier::TenantUsed(const std::string& tenant) const {
  MutexLock lock(&mu_);
  return TenantUsedLocked(tenant);
}

Tier::Room Tier::RoomLocked(const std::string& tenant) const {
  const uint64_t limit = options_.tenant_limit ? options_.tenant_limit(tenant) : 0;
  Room r;
  r.tier = FreeBytesLocked();
  if (limit != 0) {
    const uint64_t used = TenantUsedLocked(tenant);
    r.quota = limit > used ? limit - used : 0;
  }
  return r;
}

uint64_t Tier::RoomFor(const std::string& tenant) const {
  MutexLock lock(&mu_);
  const Room r = RoomLocked(tenant);
  return std::min(r.tier, r.quota);
}

uint64_t Tier::FreeBytes() const {
  MutexLock lock(&mu_);
  return FreeBytesLocked();
}

bool Tier::QuotaBound(const std::string& tenant) const {
  MutexLock lock(&mu_);
  const Room r = RoomLocked(tenant);
  return r.quota < r.tier;
}

TierSnapshot Tier::Stats() const {
  MutexLock lock(&mu_);
  return TierSnapshot{
      .tier = options_.tier,
      .emulated = options_.emulated,
      .capacity_bytes = options_.capacity_bytes,
      .used_bytes = used_bytes_ - metadata_bytes_,
      .pinned_bytes = static_cast<uint64_t>(pinned_bytes_.load(std::memory_order_relaxed)),
      .num_slots = num_slots_,
      .num_segments = segments_.size(),
      .allocation_failures = allocation_failures_,
      .metadata_bytes = metadata_bytes_,
      .retained_bytes = retained_bytes_,
  };
}

std::vector<SegmentInfo> Tier::Segments() const {
  MutexLock lock(&mu_);
  std::vector<SegmentInfo> out;
  out.reserve(segments_.size());
  for (const auto& [id, s] : segments_) {
    out.push_back(SegmentInfo{
        .segment_id = id,
        .tier = options_.tier,
        .shm_name = s->shm.named() ? s->shm.name() : std::string(),
        .size_bytes = s->device ? s->device->size() : s->shm.size(),
        .slot_bytes = s->slot_bytes,
        .tenant = s->tenant,
        .generation = s->generation,
        .generation_table_offset = s->table_offset,
        .stamp_offset = s->stamp_offset(),
        .stamp = s->stamp,
        .cuda_ipc_handle = s->device ? s->device->ipc_handle() : std::string(),
        .device = s->device ? s->device->device() : -1,
    });
  }
  return out;
}

absl::StatusOr<int> Tier::OpenReadOnly(uint64_t segment_id, const std::string& tenant) const {
  MutexLock lock(&mu_);
  auto it = segments_.find(segment_id);
  if (it == segments_.end() || it->second->tenant != tenant) {
    return absl::NotFoundError(
        absl::StrCat("segment_ids: ", segment_id, " is not a segment of this tenant's"));
  }
  return it->second->shm.OpenReadOnlyFd();
}

}  // namespace kvtier
