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

// One segment: slots of one size for one tenant. Its id, tenant, size and layout never change;
// the rest is guarded by the lock of its shard while it is in one (`shard`), by the retained
// lock while retained, and by nothing while one thread alone holds it (made, emptied).
struct TierSegment {
  uint64_t id;
  std::shared_ptr<TierTenant> tenant;
  uint64_t slot_bytes;
  uint32_t num_slots;
  uint64_t table_offset;  // the generation table: uint64 [num_slots]
  ShmSegment shm;         // the slots and the table; the table alone when `device` holds the slots
  std::unique_ptr<DeviceMemory> device;
  uint64_t generation;
  uint64_t stamp;            // random, at stamp_offset() (SegmentInfo::stamp)
  uint32_t shard = 0;        // the shard whose lock its slots' frees take
  uint32_t next_unused = 0;  // slots below this have been handed out at least once
  uint64_t reserved = 0;     // the slots' bytes [0, reserved) are committed (Reserve)
  uint32_t used = 0;
  std::vector<uint32_t> free;  // freed slots, reused last-in first-out (warm pages)
  // While emptied and retained: its place in retained_ (from 1) and the bytes it counts.
  uint64_t retained_seq = 0;
  uint64_t retained_bytes = 0;
  // Where the stamp lies: right after the generation table.
  uint64_t stamp_offset() const { return table_offset + uint64_t{num_slots} * sizeof(uint64_t); }
};

Slot::~Slot() {
  Publish(0);  // free: a reader holding an old handle sees it at once
  if (pins_.load(std::memory_order_acquire) > 0) tier_->AddPinned(-static_cast<int64_t>(bytes_));
  tier_->Free(segment_, index_, bytes_);
}

uint64_t Slot::segment_id() const { return segment_->id; }

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
  // The rewrite that follows stores after the new generation, never before it (a release
  // store alone lets later stores move above it).
  std::atomic_thread_fence(std::memory_order_release);
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
  CHECK_EQ(num_slots_.load(), 0u) << TierShortName(options_.tier)
                                  << " tier destroyed with live slots";
  CHECK_EQ(metadata_bytes_.load(), 0u)
      << TierShortName(options_.tier) << " tier destroyed with metadata charged";
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

TierAccount Tier::Account(const std::string& tenant, uint64_t shard_key) {
  MutexLock lock(&tenants_mu_);
  std::weak_ptr<TierTenant>& known = tenants_[tenant];
  std::shared_ptr<TierTenant> t = known.lock();
  if (t == nullptr) {
    t = std::make_shared<TierTenant>(tenant,
                                     options_.tenant_limit ? options_.tenant_limit(tenant) : 0);
    known = t;
    // Tenants nobody holds any more go with the next one made: the table stays near the live set.
    std::erase_if(tenants_, [](const auto& e) { return e.second.expired(); });
  }
  return TierAccount(this, std::move(t), static_cast<uint32_t>(shard_key % kShards));
}

absl::StatusOr<SlotRef> Tier::Allocate(const TierAccount& account, uint64_t slot_bytes) {
  std::vector<SlotRef> one;
  RETURN_IF_ERROR(AllocateMany(account, slot_bytes, 1, &one));
  return std::move(one[0]);
}

absl::StatusOr<SlotRef> Tier::Allocate(const std::string& tenant, uint64_t slot_bytes) {
  return Allocate(Account(tenant), slot_bytes);
}

absl::Status Tier::AllocateMany(const std::string& tenant, uint64_t slot_bytes, uint64_t count,
                                std::vector<SlotRef>* out) {
  return AllocateMany(Account(tenant), slot_bytes, count, out);
}

absl::StatusOr<Tier::Layout> Tier::LayoutFor(uint64_t slot_bytes) const {
  // Host memory: slots, then the generation table at a 64-byte boundary, then the segment's
  // stamp. Device memory: the slots alone; the table at 0 of a host segment, then the stamp.
  const bool on_device = static_cast<bool>(options_.device_memory);
  const uint64_t size = options_.segment_bytes;
  uint64_t num_slots = slot_bytes == 0 ? 0 : size / slot_bytes;
  auto table_at = [slot_bytes, on_device](uint64_t n) {
    return on_device ? 0 : (n * slot_bytes + 63) / 64 * 64;
  };
  if (!on_device && num_slots > 0) {
    // The most slots whose table and stamp fit: n slot_bytes + 8 (n + 1) <= size gives at
    // least as many as fit (the table's 64-byte alignment aside), and a few steps down take
    // that away (each step frees slot_bytes + 8; the alignment costs at most 63). Counting down
    // from size / slot_bytes took millions of steps for slots of a few bytes, on every
    // allocation.
    num_slots = std::min(num_slots, size < 8 ? 0 : (size - 8) / (slot_bytes + 8));
    while (num_slots > 0 && table_at(num_slots) + 8 * (num_slots + 1) > size) --num_slots;
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
  return Layout{num_slots, table_at(num_slots)};
}

absl::Status Tier::AllocateMany(const TierAccount& account, uint64_t slot_bytes, uint64_t count,
                                std::vector<SlotRef>* out) {
  CHECK(account.tier_ == this) << "an account of another tier";
  ASSIGN_OR_RETURN(const Layout layout, LayoutFor(slot_bytes));
  if (count == 0) return absl::OkStatus();
  TierTenant& tenant = *account.tenant_;
  const uint64_t bytes = count > std::numeric_limits<uint64_t>::max() / slot_bytes
                             ? std::numeric_limits<uint64_t>::max()
                             : count * slot_bytes;
  RETURN_IF_ERROR(TakeBytes(tenant, bytes, ""));
  std::vector<PopulateRange> populate;
  std::vector<SlotRef> taken;
  taken.reserve(count);
  absl::Status status;
  {
    Shard& shard = shards_[account.shard_];
    MutexLock lock(&shard.mu);
    for (uint64_t i = 0; i < count && status.ok(); ++i) {
      absl::StatusOr<SlotRef> slot =
          TakeSlotLocked(shard, account.shard_, account.tenant_, slot_bytes, layout, &populate);
      if (slot.ok()) {
        taken.push_back(*std::move(slot));
      } else {
        status = slot.status();
      }
    }
  }
  num_slots_.fetch_add(taken.size(), std::memory_order_relaxed);
  if (!status.ok()) {
    // The slots not taken give their bytes back here; `taken` gives its own as it goes.
    GiveBytes(tenant, (count - taken.size()) * slot_bytes);
    return status;
  }
  if (RetainedOver()) TrimRetained();
  // The segments stay mapped: each range's segment has a slot just taken from it.
  for (const PopulateRange& r : populate) r.shm->Populate(r.offset, r.length);
  for (SlotRef& s : taken) out->push_back(std::move(s));
  return absl::OkStatus();
}

absl::StatusOr<SlotRef> Tier::TakeSlotLocked(Shard& shard, uint32_t shard_index,
                                             const std::shared_ptr<TierTenant>& tenant,
                                             uint64_t slot_bytes, Layout layout,
                                             std::vector<PopulateRange>* populate) {
  // Warm memory first: a freed slot, or a fresh one whose pages are committed already (kReserve
  // ahead); then a retained segment (a closed session's pages); only then pages committed now,
  // in one of the shard's segments or a new one. So the retained segments' lock is looked at
  // about once per kReserveAhead of fresh slots, not per slot.
  const ClassKey key{tenant.get(), slot_bytes};
  TierSegment* seg = nullptr;
  TierSegment* cold = nullptr;  // one with a fresh slot whose pages are not committed yet
  auto it = shard.classes.find(key);
  if (it != shard.classes.end()) {
    for (TierSegment* s : it->second) {
      const bool fresh = s->next_unused < s->num_slots;
      if (!s->free.empty() || (fresh && uint64_t{s->next_unused + 1} * slot_bytes <= s->reserved)) {
        seg = s;
        break;
      }
      if (cold == nullptr && fresh) cold = s;
    }
  }
  if (seg == nullptr) {
    seg = Unretain(key);
    if (seg == nullptr && cold == nullptr) {
      ASSIGN_OR_RETURN(seg, NewSegment(tenant, slot_bytes, layout));
    }
    if (seg != nullptr) {
      seg->shard = shard_index;
      shard.classes[key].push_back(seg);
    } else {
      seg = cold;
    }
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
          allocation_failures_.fetch_add(1, std::memory_order_relaxed);
          return WithTierReason(s);
        }
      }
    }
    index = seg->next_unused++;
  }
  ++seg->used;
  const uint64_t offset = static_cast<uint64_t>(index) * slot_bytes;
  auto* table = reinterpret_cast<uint64_t*>(seg->shm.data() + seg->table_offset);
  return std::make_shared<Slot>(
      Slot::Key{}, this, seg, index, seg->device ? nullptr : seg->shm.data() + offset,
      seg->device.get(), static_cast<uint32_t>(slot_bytes),
      next_generation_.fetch_add(1, std::memory_order_relaxed), table + index);
}

absl::StatusOr<TierSegment*> Tier::NewSegment(const std::shared_ptr<TierTenant>& tenant,
                                              uint64_t slot_bytes, Layout layout) {
  const uint64_t id = next_segment_id.fetch_add(1, std::memory_order_relaxed);
  const uint64_t table_end = layout.table_offset + (layout.num_slots + 1) * sizeof(uint64_t);
  std::unique_ptr<DeviceMemory> device;
  if (options_.device_memory) {
    absl::StatusOr<std::unique_ptr<DeviceMemory>> m =
        options_.device_memory(layout.num_slots * slot_bytes);
    if (!m.ok()) {
      allocation_failures_.fetch_add(1, std::memory_order_relaxed);
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
      shm.ok() ? shm->Reserve(layout.table_offset, table_end - layout.table_offset) : shm.status();
  if (!reserved.ok()) {
    allocation_failures_.fetch_add(1, std::memory_order_relaxed);
    return WithTierReason(reserved);
  }
  const uint64_t committed = device ? layout.num_slots * slot_bytes : 0;
  auto s = std::make_unique<TierSegment>(TierSegment{
      .id = id,
      .tenant = tenant,
      .slot_bytes = slot_bytes,
      .num_slots = static_cast<uint32_t>(layout.num_slots),
      .table_offset = layout.table_offset,
      .shm = *std::move(shm),
      .device = std::move(device),
      .generation = next_generation_.fetch_add(1, std::memory_order_relaxed),
      .stamp = RandomStamp(),
      .reserved = committed,
      .free = {},
  });
  std::memcpy(s->shm.data() + s->stamp_offset(), &s->stamp, sizeof(s->stamp));
  TierSegment* seg = s.get();
  MutexLock lock(&registry_mu_);
  segments_.emplace(id, std::move(s));
  return seg;
}

TierSegment* Tier::Unretain(const ClassKey& key) {
  if (retained_bytes_.load(std::memory_order_relaxed) == 0) return nullptr;
  MutexLock lock(&retained_mu_);
  for (auto it = retained_.begin(); it != retained_.end(); ++it) {
    TierSegment* seg = it->second;
    if (seg->tenant.get() != key.first || seg->slot_bytes != key.second) continue;
    retained_.erase(it);
    retained_bytes_.fetch_sub(seg->retained_bytes, std::memory_order_relaxed);
    seg->retained_seq = 0;
    seg->retained_bytes = 0;
    return seg;
  }
  return nullptr;
}

void Tier::Free(TierSegment* seg, uint32_t index, uint64_t bytes) {
  bool emptied = false;
  {
    Shard& shard = shards_[seg->shard];
    MutexLock lock(&shard.mu);
    seg->free.push_back(index);
    if (--seg->used == 0) {
      emptied = true;
      auto it = shard.classes.find({seg->tenant.get(), seg->slot_bytes});
      CHECK(it != shard.classes.end()) << "segment " << seg->id << " in no class of its shard";
      std::erase(it->second, seg);
      if (it->second.empty()) shard.classes.erase(it);
    }
  }
  GiveBytes(*seg->tenant, bytes);
  num_slots_.fetch_sub(1, std::memory_order_relaxed);
  if (emptied) RetainOrRelease(seg);  // no shard holds it now, and it has no slot in use
}

void Tier::RetainOrRelease(TierSegment* seg) {
  const uint64_t committed = seg->reserved;
  if (committed == 0 || committed > options_.retain_bytes) {
    Release({&seg, 1});
    return;
  }
  std::vector<TierSegment*> released;
  {
    MutexLock lock(&retained_mu_);
    seg->retained_seq = next_retained_seq_++;
    seg->retained_bytes = committed;
    retained_.emplace(seg->retained_seq, seg);
    retained_bytes_.fetch_add(committed, std::memory_order_relaxed);
    TrimRetainedLocked(&released);
  }
  Release(released);
}

bool Tier::RetainedOver() const {
  const uint64_t retained = retained_bytes_.load(std::memory_order_relaxed);
  return retained > 0 &&
         (retained > options_.retain_bytes ||
          used_bytes_.load(std::memory_order_relaxed) + retained > options_.capacity_bytes);
}

void Tier::TrimRetained() {
  std::vector<TierSegment*> released;
  {
    MutexLock lock(&retained_mu_);
    TrimRetainedLocked(&released);
  }
  Release(released);
}

void Tier::TrimRetainedLocked(std::vector<TierSegment*>* released) {
  while (!retained_.empty() && RetainedOver()) {
    TierSegment* seg = retained_.begin()->second;
    retained_.erase(retained_.begin());
    retained_bytes_.fetch_sub(seg->retained_bytes, std::memory_order_relaxed);
    released->push_back(seg);
  }
}

void Tier::Release(std::span<TierSegment* const> segs) {
  if (segs.empty()) return;
  std::vector<std::unique_ptr<TierSegment>> dead;
  {
    MutexLock lock(&registry_mu_);
    for (TierSegment* seg : segs) {
      auto node = segments_.extract(seg->id);
      CHECK(!node.empty()) << "segment " << seg->id << " released twice";
      dead.push_back(std::move(node.mapped()));
    }
  }
  // `dead` unmaps and unlinks them here, outside the lock.
}

absl::Status Tier::TakeBytes(TierTenant& tenant, uint64_t bytes, absl::string_view what) {
  if (tenant.limit == 0) {
    RETURN_IF_ERROR(TakeTierBytes(bytes, what));
    tenant.used.fetch_add(bytes, std::memory_order_relaxed);
    return absl::OkStatus();
  }
  MutexLock lock(&tenant.quota_mu);
  const uint64_t held = tenant.used.load(std::memory_order_relaxed);
  if (bytes > (tenant.limit > held ? tenant.limit - held : 0)) {
    allocation_failures_.fetch_add(1, std::memory_order_relaxed);
    return WithReason(
        absl::ResourceExhaustedError(absl::StrFormat(
            "quota: tenant \"%s\" %s_bytes %s would be exceeded: %s held, %d more bytes%s needed",
            tenant.name, TierShortName(options_.tier), FormatBytes(tenant.limit), FormatBytes(held),
            bytes, what)),
        ErrorReason::kQuota);
  }
  RETURN_IF_ERROR(TakeTierBytes(bytes, what));
  tenant.used.fetch_add(bytes, std::memory_order_relaxed);
  return absl::OkStatus();
}

absl::Status Tier::TakeTierBytes(uint64_t bytes, absl::string_view what) {
  if (uint64_t used; !ClaimBytes(&used_bytes_, bytes, options_.capacity_bytes, &used)) {
    allocation_failures_.fetch_add(1, std::memory_order_relaxed);
    return WithTierReason(absl::ResourceExhaustedError(absl::StrFormat(
        "%s tier full: %s of %s used, %d more bytes%s needed", TierShortName(options_.tier),
        FormatBytes(used), FormatBytes(options_.capacity_bytes), bytes, what)));
  }
  return absl::OkStatus();
}

void Tier::GiveBytes(TierTenant& tenant, uint64_t bytes) {
  const uint64_t held = tenant.used.fetch_sub(bytes, std::memory_order_relaxed);
  CHECK_GE(held, bytes) << "tenant \"" << tenant.name << "\" gave back more than it held";
  used_bytes_.fetch_sub(bytes, std::memory_order_relaxed);
}

absl::Status Tier::ChargeMetadata(const TierAccount& account, uint64_t bytes, bool checked) {
  if (bytes == 0) return absl::OkStatus();
  TierTenant& tenant = *account.tenant_;
  if (checked) {
    RETURN_IF_ERROR(TakeBytes(tenant, bytes, " of session metadata"));
  } else {
    tenant.used.fetch_add(bytes, std::memory_order_relaxed);
    used_bytes_.fetch_add(bytes, std::memory_order_relaxed);
  }
  metadata_bytes_.fetch_add(bytes, std::memory_order_relaxed);
  if (RetainedOver()) TrimRetained();
  return absl::OkStatus();
}

void Tier::RefundMetadata(const TierAccount& account, uint64_t bytes) {
  if (bytes == 0) return;
  const uint64_t charged = metadata_bytes_.fetch_sub(bytes, std::memory_order_relaxed);
  CHECK_GE(charged, bytes) << "metadata refund above the charge";
  GiveBytes(*account.tenant_, bytes);
}

MetadataCharge& MetadataCharge::operator=(MetadataCharge&& o) noexcept {
  if (this != &o) {
    Set(0);
    account_ = std::move(o.account_);
    bytes_ = std::exchange(o.bytes_, 0);
  }
  return *this;
}

absl::Status MetadataCharge::Grow(uint64_t extra) {
  if (!account_) return absl::OkStatus();
  RETURN_IF_ERROR(account_.tier()->ChargeMetadata(account_, extra));
  bytes_ += extra;
  return absl::OkStatus();
}

void MetadataCharge::Set(uint64_t bytes) {
  if (!account_ || bytes == bytes_) return;
  if (bytes > bytes_) {
    // What was grown covers it in practice; taken even past the limits so the count stays true.
    (void)account_.tier()->ChargeMetadata(account_, bytes - bytes_, /*checked=*/false);
  } else {
    account_.tier()->RefundMetadata(account_, bytes_ - bytes);
  }
  bytes_ = bytes;
}

uint64_t Tier::TenantUsed(const std::string& tenant) const {
  MutexLock lock(&tenants_mu_);
  auto it = tenants_.find(tenant);
  if (it == tenants_.end()) return 0;
  const std::shared_ptr<TierTenant> t = it->second.lock();
  return t ? t->used.load(std::memory_order_relaxed) : 0;
}

Tier::Room Tier::RoomOf(const TierTenant& tenant) const {
  Room r;
  r.tier = FreeBytes();
  if (tenant.limit != 0) {
    const uint64_t used = tenant.used.load(std::memory_order_relaxed);
    r.quota = tenant.limit > used ? tenant.limit - used : 0;
  }
  return r;
}

uint64_t Tier::RoomFor(const TierAccount& account) const {
  const Room r = RoomOf(*account.tenant_);
  return std::min(r.tier, r.quota);
}

uint64_t Tier::RoomFor(const std::string& tenant) { return RoomFor(Account(tenant)); }

uint64_t Tier::FreeBytes() const { return FreeOf(used_bytes_.load(std::memory_order_relaxed)); }

bool Tier::QuotaBound(const TierAccount& account) const {
  const Room r = RoomOf(*account.tenant_);
  return r.quota < r.tier;
}

bool Tier::QuotaBound(const std::string& tenant) { return QuotaBound(Account(tenant)); }

TierSnapshot Tier::Stats() const {
  // Metadata first: what it gains after this read, the used bytes read next include.
  const uint64_t metadata = metadata_bytes_.load(std::memory_order_relaxed);
  const uint64_t used = used_bytes_.load(std::memory_order_relaxed);
  uint64_t num_segments;
  {
    MutexLock lock(&registry_mu_);
    num_segments = segments_.size();
  }
  return TierSnapshot{
      .tier = options_.tier,
      .emulated = options_.emulated,
      .capacity_bytes = options_.capacity_bytes,
      .used_bytes = used > metadata ? used - metadata : 0,
      .pinned_bytes = static_cast<uint64_t>(pinned_bytes_.load(std::memory_order_relaxed)),
      .num_slots = num_slots_.load(std::memory_order_relaxed),
      .num_segments = num_segments,
      .allocation_failures = allocation_failures_.load(std::memory_order_relaxed),
      .metadata_bytes = metadata,
      .retained_bytes = retained_bytes_.load(std::memory_order_relaxed),
  };
}

std::vector<SegmentInfo> Tier::Segments() const {
  MutexLock lock(&registry_mu_);
  std::vector<SegmentInfo> out;
  out.reserve(segments_.size());
  for (const auto& [id, s] : segments_) {
    out.push_back(SegmentInfo{
        .segment_id = id,
        .tier = options_.tier,
        .shm_name = s->shm.named() ? s->shm.name() : std::string(),
        .size_bytes = s->device ? s->device->size() : s->shm.size(),
        .slot_bytes = s->slot_bytes,
        .tenant = s->tenant->name,
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
  MutexLock lock(&registry_mu_);
  auto it = segments_.find(segment_id);
  if (it == segments_.end() || it->second->tenant->name != tenant) {
    return absl::NotFoundError(
        absl::StrCat("segment_ids: ", segment_id, " is not a segment of this tenant's"));
  }
  return it->second->shm.OpenReadOnlyFd();
}

}  // namespace kvtier
