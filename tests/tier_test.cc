#include "server/tier/tier.h"

#include <dirent.h>
#include <fcntl.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <future>
#include <set>
#include <thread>

#include "absl/strings/match.h"
#include "server/common/error.h"
#include "server/common/status_macros.h"
#include "server/tier/staging.h"
#include "tests/fake_device.h"
#include "tests/test_util.h"

namespace kvtier {
namespace {

using testing::FakeDeviceAllocator;
using testing::FakeDeviceMemory;
using testing::FakeDeviceState;
using testing::StatusIs;
using Code = absl::StatusCode;

TierOptions Options(uint64_t capacity, uint64_t segment = 1 << 20) {
  static int n = 0;
  TierOptions o;
  o.tier = v1::TIER_HOST;
  o.instance = "tiertest-" + std::to_string(getpid()) + "-" + std::to_string(n++);
  o.capacity_bytes = capacity;
  o.segment_bytes = segment;
  return o;
}

bool ShmExists(const std::string& name) {
  struct stat st {};
  return stat(("/dev/shm" + name).c_str(), &st) == 0;
}

TEST(Tier, SlotsAreDistinctAndInsideTheirSegment) {
  Tier tier(Options(1 << 20, 64 << 10));
  std::vector<SlotRef> slots;
  std::set<std::pair<uint64_t, uint64_t>> seen;
  for (int i = 0; i < 40; ++i) {  // 16 slots of 4K per 64K segment: three segments
    ASSERT_OK_AND_ASSIGN(SlotRef s, tier.Allocate("a", 4096));
    EXPECT_EQ(s->offset() % 4096, 0u);
    EXPECT_LE(s->offset() + s->bytes(), 64u << 10);
    EXPECT_TRUE(seen.insert({s->segment_id(), s->offset()}).second);
    std::memset(s->data(), i, s->bytes());
    slots.push_back(std::move(s));
  }
  for (int i = 0; i < 40; ++i) {  // nobody wrote over anybody
    EXPECT_EQ(slots[i]->data()[0], i);
    EXPECT_EQ(slots[i]->data()[4095], i);
  }
  TierSnapshot st = tier.Stats();
  EXPECT_EQ(st.num_segments, 3u);
  EXPECT_EQ(st.used_bytes, 40u * 4096);
  EXPECT_EQ(st.num_slots, 40u);
}

// A segment holds the most slots whose generation table (at a 64-byte boundary after them) and
// stamp still fit: counted here one slot at a time, down from the segment's size over the
// slot's, and read back from the segment's layout (SegmentInfo), for slots of a few bytes to
// larger than a page.
TEST(Tier, ASegmentHoldsTheMostSlotsWhoseTableFits) {
  for (const uint64_t segment : {uint64_t{4096}, uint64_t{4096 + 72}, uint64_t{65536} + 8}) {
    for (const uint64_t slot : {4u, 8u, 12u, 24u, 56u, 64u, 100u, 1000u, 2040u, 4000u}) {
      uint64_t want = segment / slot;
      auto table_at = [&](uint64_t n) { return (n * slot + 63) / 64 * 64; };
      while (want > 0 && table_at(want) + 8 * (want + 1) > segment) --want;
      Tier tier(Options(1 << 20, segment));
      auto s = tier.Allocate("a", slot);
      if (want == 0) {
        EXPECT_THAT(s.status(), StatusIs(Code::kInvalidArgument)) << segment << " " << slot;
        continue;
      }
      ASSERT_OK(s.status());
      const SegmentInfo seg = tier.Segments().at(0);
      EXPECT_EQ(seg.generation_table_offset, table_at(want)) << segment << " " << slot;
      EXPECT_EQ((seg.stamp_offset - seg.generation_table_offset) / 8, want)
          << segment << " " << slot;
      EXPECT_LE(seg.stamp_offset + 8, segment);
    }
  }
}

TEST(Tier, FullTierRefusesAndNeverOverruns) {
  Tier tier(Options(3 * 4096));
  std::vector<SlotRef> slots;
  for (int i = 0; i < 3; ++i) {
    ASSERT_OK_AND_ASSIGN(SlotRef s, tier.Allocate("a", 4096));
    slots.push_back(std::move(s));
  }
  EXPECT_THAT(tier.Allocate("a", 4096), StatusIs(Code::kResourceExhausted, "host tier full"));
  EXPECT_THAT(tier.Allocate("b", 16), StatusIs(Code::kResourceExhausted));
  EXPECT_EQ(tier.Stats().used_bytes, 3u * 4096);
  EXPECT_EQ(tier.Stats().allocation_failures, 2u);
  slots.pop_back();
  EXPECT_OK(tier.Allocate("a", 4096).status());
}

// An append's slots come at once, all or none: a refusal part way leaves the tier as it was.
TEST(Tier, AllocateManyIsAllOrNone) {
  Tier tier(Options(3 * 4096));
  std::vector<SlotRef> slots;
  EXPECT_THAT(tier.AllocateMany("a", 4096, 5, &slots),
              StatusIs(Code::kResourceExhausted, "host tier full"));
  EXPECT_TRUE(slots.empty());
  EXPECT_EQ(tier.Stats().used_bytes, 0u);
  EXPECT_EQ(tier.Stats().num_slots, 0u);
  ASSERT_OK(tier.AllocateMany("a", 4096, 3, &slots));
  ASSERT_EQ(slots.size(), 3u);
  std::set<uint64_t> offsets;
  for (const SlotRef& s : slots) {
    std::memset(s->data(), 7, s->bytes());  // committed and mapped: no signal
    offsets.insert(s->offset());
  }
  EXPECT_EQ(offsets.size(), 3u);
  EXPECT_EQ(tier.Stats().used_bytes, 3u * 4096);
}

TEST(Tier, SlotLargerThanASegmentIsInvalid) {
  Tier tier(Options(8 << 20, 1 << 20));
  EXPECT_THAT(tier.Allocate("a", (1 << 20) + 1), StatusIs(Code::kInvalidArgument));
  EXPECT_THAT(tier.Allocate("a", 0), StatusIs(Code::kInvalidArgument));
  // A slot keeps its size in 32 bits: one of 4 GiB or more is refused even where a segment
  // would hold it (nothing is mapped before the refusal).
  Tier big(Options(uint64_t{16} << 30, uint64_t{8} << 30));
  EXPECT_THAT(big.Allocate("a", uint64_t{4} << 30),
              StatusIs(Code::kInvalidArgument, "larger than a slot may be"));
  EXPECT_EQ(big.Stats().used_bytes, 0u);
  EXPECT_TRUE(big.Segments().empty());
}

TEST(Tier, ReuseTakesANewGeneration) {
  Tier tier(Options(1 << 20));
  ASSERT_OK_AND_ASSIGN(SlotRef keep, tier.Allocate("a", 4096));  // keeps the segment alive
  ASSERT_OK_AND_ASSIGN(SlotRef s, tier.Allocate("a", 4096));
  const uint64_t offset = s->offset(), generation = s->generation();
  s.reset();
  ASSERT_OK_AND_ASSIGN(SlotRef again, tier.Allocate("a", 4096));
  EXPECT_EQ(again->offset(), offset);  // the freed slot, reused
  EXPECT_GT(again->generation(), generation);
  const uint64_t before = again->generation();
  again->Renew();
  EXPECT_GT(again->generation(), before);
}

TEST(Tier, TenantsAndSlotSizesGetTheirOwnSegments) {
  Tier tier(Options(4 << 20));
  ASSERT_OK_AND_ASSIGN(SlotRef a, tier.Allocate("alice", 4096));
  ASSERT_OK_AND_ASSIGN(SlotRef b, tier.Allocate("bob", 4096));
  ASSERT_OK_AND_ASSIGN(SlotRef c, tier.Allocate("alice", 8192));
  EXPECT_NE(a->segment_id(), b->segment_id());
  EXPECT_NE(a->segment_id(), c->segment_id());
  std::map<uint64_t, std::string> owner;
  for (const SegmentInfo& s : tier.Segments()) owner[s.segment_id] = s.tenant;
  EXPECT_EQ(owner[a->segment_id()], "alice");
  EXPECT_EQ(owner[b->segment_id()], "bob");
}

TEST(Tier, EmptySegmentIsUnlinkedAtOnce) {
  Tier tier(Options(1 << 20));
  ASSERT_OK_AND_ASSIGN(SlotRef s, tier.Allocate("a", 4096));
  const std::string name = tier.Segments().at(0).shm_name;
  EXPECT_TRUE(ShmExists(name));
  s.reset();
  EXPECT_FALSE(ShmExists(name));
  EXPECT_EQ(tier.Stats().num_segments, 0u);
  EXPECT_EQ(tier.Stats().used_bytes, 0u);
}

// With retain_bytes, an emptied segment stays, committed and mapped, for its tenant's next
// slot of its size; another tenant or another size never gets it.
TEST(Tier, AnEmptiedSegmentIsKeptForItsTenantsNextSlots) {
  TierOptions o = Options(4 << 20);
  o.retain_bytes = 1 << 20;
  Tier tier(o);
  ASSERT_OK_AND_ASSIGN(SlotRef s, tier.Allocate("a", 4096));
  const uint64_t id = s->segment_id();
  const std::string name = tier.Segments().at(0).shm_name;
  std::memset(s->data(), 0x5a, s->bytes());
  s.reset();
  EXPECT_TRUE(ShmExists(name));
  TierSnapshot st = tier.Stats();
  EXPECT_EQ(st.num_segments, 1u);
  EXPECT_EQ(st.used_bytes, 0u);
  EXPECT_EQ(st.num_slots, 0u);
  EXPECT_GT(st.retained_bytes, 0u);
  EXPECT_LE(st.retained_bytes, 1u << 20);
  ASSERT_OK_AND_ASSIGN(SlotRef other_tenant, tier.Allocate("b", 4096));
  ASSERT_OK_AND_ASSIGN(SlotRef other_size, tier.Allocate("a", 8192));
  EXPECT_NE(other_tenant->segment_id(), id);
  EXPECT_NE(other_size->segment_id(), id);
  ASSERT_OK_AND_ASSIGN(SlotRef again, tier.Allocate("a", 4096));
  EXPECT_EQ(again->segment_id(), id);
  EXPECT_EQ(tier.Stats().retained_bytes, 0u);  // in use again
  again.reset();
  other_tenant.reset();
  other_size.reset();  // three emptied segments of about 1 MiB: the last alone is kept
  EXPECT_EQ(tier.Stats().num_segments, 1u);
  EXPECT_EQ(tier.Segments().at(0).tenant, "a");
  EXPECT_EQ(tier.Segments().at(0).slot_bytes, 8192u);
}

// What is retained is bounded by retain_bytes, oldest released first, and never keeps a slot
// from being allocated: with the slots in use it stays within the capacity.
TEST(Tier, RetainedSegmentsAreBoundedAndGiveWayToSlots) {
  TierOptions o = Options(3 << 20);  // three 1 MiB segments
  o.retain_bytes = 2 << 20;
  Tier tier(o);
  std::vector<std::string> names;
  for (const char* tenant : {"a", "b", "c"}) {
    std::vector<SlotRef> slots;
    ASSERT_OK(tier.AllocateMany(tenant, 64 << 10, 15, &slots));  // a segment holds 15
    names.push_back(tier.Segments().back().shm_name);
  }
  // Each emptied in turn: the third passes retain_bytes, so the first goes.
  EXPECT_FALSE(ShmExists(names[0]));
  EXPECT_TRUE(ShmExists(names[1]));
  EXPECT_TRUE(ShmExists(names[2]));
  EXPECT_EQ(tier.Stats().num_segments, 2u);
  EXPECT_LE(tier.Stats().retained_bytes, 2u << 20);
  // Slots of a fourth tenant up to the whole capacity: the retained segments make way.
  std::vector<SlotRef> d;
  ASSERT_OK(tier.AllocateMany("d", 64 << 10, 45, &d));
  EXPECT_FALSE(ShmExists(names[1]));
  EXPECT_FALSE(ShmExists(names[2]));
  const TierSnapshot st = tier.Stats();
  EXPECT_EQ(st.retained_bytes, 0u);
  EXPECT_EQ(st.used_bytes, 45u * (64 << 10));
  EXPECT_LE(st.used_bytes + st.retained_bytes, st.capacity_bytes);
}

// A tier over device memory (a GPU's, here its CPU twin): slots have no host address and
// their bytes go through Write and Read at the slot's offset of its segment's region; the
// generation table and the stamp are a host segment of their own, where another process reads
// a slot's generation; ListSegments names the region's IPC handle and device.
TEST(Tier, DeviceMemorySlotsHaveNoHostAddressAndTheirTableIsInSharedMemory) {
  auto state = std::make_shared<FakeDeviceState>();
  TierOptions o = Options(4 << 20);
  o.tier = v1::TIER_DEVICE;
  o.device_memory = FakeDeviceAllocator(state);
  Tier tier(o);
  std::vector<SlotRef> slots;
  ASSERT_OK(tier.AllocateMany("a", 4096, 3, &slots));
  EXPECT_EQ(state->regions, 1);
  for (size_t i = 0; i < slots.size(); ++i) {
    EXPECT_EQ(slots[i]->data(), nullptr);
    EXPECT_TRUE(slots[i]->on_device());
    std::vector<uint8_t> bytes(4096);
    for (size_t j = 0; j < bytes.size(); ++j) bytes[j] = static_cast<uint8_t>(j * 7 + i);
    ASSERT_OK(slots[i]->Write(0, bytes.data(), bytes.size()));
    std::vector<uint8_t> back(4096);
    ASSERT_OK(slots[i]->Read(0, back.data(), back.size()));
    EXPECT_EQ(back, bytes);
  }
  ASSERT_EQ(tier.Segments().size(), 1u);
  const SegmentInfo seg = tier.Segments()[0];
  EXPECT_EQ(seg.device, FakeDeviceMemory::kDevice);
  EXPECT_EQ(seg.cuda_ipc_handle.size(), kCudaIpcHandleBytes);
  EXPECT_EQ(seg.size_bytes, 256u * 4096);  // a 1 MiB segment's slots, no table among them
  EXPECT_EQ(seg.generation_table_offset, 0u);
  EXPECT_EQ(seg.stamp_offset, 256u * 8);
  // The table, read by another process through the host segment's name.
  const SlotRef& s = slots[2];
  const uint64_t index = s->offset() / 4096, generation = s->generation();
  pid_t pid = fork();
  if (pid == 0) {
    auto shm = ShmSegment::OpenReadOnly(seg.shm_name);
    if (!shm.ok()) _exit(2);
    uint64_t g = 0, stamp = 0;
    std::memcpy(&g, shm->data() + seg.generation_table_offset + 8 * index, 8);
    std::memcpy(&stamp, shm->data() + seg.stamp_offset, 8);
    _exit(g == generation && stamp == seg.stamp ? 0 : 3);
  }
  int status = 0;
  waitpid(pid, &status, 0);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0) << "2: cannot open, 3: generation or stamp differ";
  // A failed copy is the caller's error; the region goes with the segment's last slot.
  state->fail_copies = true;
  uint8_t byte = 1;
  EXPECT_THAT(slots[0]->Write(0, &byte, 1), StatusIs(Code::kInternal, "injected"));
  state->fail_copies = false;
  slots.clear();
  EXPECT_EQ(state->regions, 0);
  EXPECT_FALSE(ShmExists(seg.shm_name));
}

// Device memory that cannot be had (cudaMalloc out of memory) is the device tier's full reason.
TEST(Tier, DeviceMemoryThatCannotBeMadeIsTheTierFull) {
  auto state = std::make_shared<FakeDeviceState>();
  state->fail_allocations = true;
  TierOptions o = Options(4 << 20);
  o.tier = v1::TIER_DEVICE;
  o.device_memory = FakeDeviceAllocator(state);
  Tier tier(o);
  absl::StatusOr<SlotRef> s = tier.Allocate("a", 4096);
  EXPECT_THAT(s, StatusIs(Code::kResourceExhausted, "cudaMalloc"));
  EXPECT_EQ(ReasonOf(s.status()), ErrorReason::kDeviceTierFull);
  EXPECT_EQ(tier.Stats().allocation_failures, 1u);
  EXPECT_EQ(tier.Stats().num_segments, 0u);
  state->fail_allocations = false;
  EXPECT_OK(tier.Allocate("a", 4096).status());
}

TEST(Tier, PinnedBytesFollowPins) {
  Tier tier(Options(1 << 20));
  ASSERT_OK_AND_ASSIGN(SlotRef s, tier.Allocate("a", 4096));
  s->Pin();
  s->Pin();
  EXPECT_EQ(tier.Stats().pinned_bytes, 4096u);
  s->Unpin();
  EXPECT_EQ(tier.Stats().pinned_bytes, 4096u);
  s->Unpin();
  EXPECT_EQ(tier.Stats().pinned_bytes, 0u);
}

// Another process opens the segment by its name and reads exactly what was written.
TEST(Tier, AnotherProcessReadsTheBytesByName) {
  Tier tier(Options(1 << 20));
  std::vector<SlotRef> slots;
  for (int i = 0; i < 5; ++i) {
    ASSERT_OK_AND_ASSIGN(SlotRef s, tier.Allocate("a", 4096));
    slots.push_back(std::move(s));
  }
  const SlotRef& s = slots[3];
  for (uint64_t i = 0; i < s->bytes(); ++i) s->data()[i] = static_cast<uint8_t>(i * 31 + 7);
  const std::string name = tier.Segments().at(0).shm_name;
  pid_t pid = fork();
  if (pid == 0) {
    auto seg = ShmSegment::OpenReadOnly(name);
    if (!seg.ok()) _exit(2);
    for (uint64_t i = 0; i < 4096; ++i) {
      if (seg->data()[s->offset() + i] != static_cast<uint8_t>(i * 31 + 7)) _exit(3);
    }
    _exit(0);
  }
  int status = 0;
  waitpid(pid, &status, 0);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0) << "2: cannot open, 3: bytes differ";
}

// An unnamed (memfd) segment has no file anywhere: its name is empty and /dev/shm holds
// nothing of the instance. A descriptor of it reads the written bytes but cannot write them,
// and its seals forbid any new writable mapping and any change of size (even through a
// writable descriptor), while the tier's own mapping still writes.
TEST(Tier, AMemfdSegmentIsReachedByDescriptorOnlyAndSealed) {
  TierOptions o = Options(1 << 20);
  o.naming = ShmSegment::Naming::kMemfd;
  Tier tier(o);
  ASSERT_OK_AND_ASSIGN(SlotRef s, tier.Allocate("a", 4096));
  for (uint64_t i = 0; i < s->bytes(); ++i) s->data()[i] = static_cast<uint8_t>(i * 13 + 1);
  const SegmentInfo info = tier.Segments().at(0);
  EXPECT_EQ(info.shm_name, "");
  DIR* dir = opendir("/dev/shm");
  ASSERT_NE(dir, nullptr);
  while (dirent* e = readdir(dir)) {
    EXPECT_FALSE(absl::StartsWith(e->d_name, "kvtier-" + o.instance)) << e->d_name;
  }
  closedir(dir);

  ASSERT_OK_AND_ASSIGN(int fd, tier.OpenReadOnly(info.segment_id, "a"));
  EXPECT_EQ(fcntl(fd, F_GETFL) & O_ACCMODE, O_RDONLY);
  const int seals = fcntl(fd, F_GET_SEALS);
  for (int seal : {F_SEAL_SHRINK, F_SEAL_GROW, F_SEAL_FUTURE_WRITE, F_SEAL_SEAL}) {
    EXPECT_NE(seals & seal, 0) << "seal " << seal << " missing from " << seals;
  }
  void* p = mmap(nullptr, info.size_bytes, PROT_READ, MAP_SHARED, fd, 0);
  ASSERT_NE(p, MAP_FAILED);
  const uint8_t* bytes = static_cast<const uint8_t*>(p) + s->offset();
  for (uint64_t i = 0; i < s->bytes(); ++i) {
    ASSERT_EQ(bytes[i], static_cast<uint8_t>(i * 13 + 1)) << i;
  }
  EXPECT_NE(mprotect(p, info.size_bytes, PROT_READ | PROT_WRITE), 0);
  EXPECT_EQ(mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0), MAP_FAILED);
  // A writable descriptor reopened through /proc (what a leak would give) is held by the seals.
  const int rw = open(("/proc/self/fd/" + std::to_string(fd)).c_str(), O_RDWR);
  ASSERT_GE(rw, 0);
  EXPECT_EQ(mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, rw, 0), MAP_FAILED);
  EXPECT_EQ(errno, EPERM);
  EXPECT_NE(ftruncate(rw, 0), 0);
  EXPECT_NE(pwrite(rw, "x", 1, 0), 1);
  close(rw);
  s->data()[0] = 0xAB;  // the tier's own mapping still writes, and readers see it
  EXPECT_EQ(bytes[0], 0xAB);
  munmap(p, info.size_bytes);
  close(fd);
  // A second slot commits pages (fallocate within the sealed size).
  ASSERT_OK(tier.Allocate("a", 4096).status());
}

TEST(Tier, TenantQuotaLimitsOneTenantOnly) {
  TierOptions o = Options(16 * 4096);
  o.tenant_limit = [](const std::string& t) -> uint64_t { return t == "small" ? 3 * 4096 : 0; };
  Tier tier(o);
  std::vector<SlotRef> held;
  for (int i = 0; i < 3; ++i) {
    ASSERT_OK_AND_ASSIGN(SlotRef s, tier.Allocate("small", 4096));
    held.push_back(s);
  }
  EXPECT_EQ(tier.RoomFor("small"), 0u);
  EXPECT_TRUE(tier.QuotaBound("small"));
  EXPECT_THAT(tier.Allocate("small", 4096),
              StatusIs(Code::kResourceExhausted, "quota: tenant \"small\" host_bytes 12.0 KiB"));
  for (int i = 0; i < 10; ++i) {  // another tenant is not limited by it
    ASSERT_OK_AND_ASSIGN(SlotRef s, tier.Allocate("big", 4096));
    held.push_back(s);
  }
  EXPECT_FALSE(tier.QuotaBound("big"));
  EXPECT_EQ(tier.RoomFor("big"), 3u * 4096);
  EXPECT_EQ(tier.TenantUsed("small"), 3u * 4096);
  held.erase(held.begin());  // one of small's slots goes back
  EXPECT_EQ(tier.TenantUsed("small"), 2u * 4096);
  ASSERT_OK(tier.Allocate("small", 4096).status());
  held.clear();
  EXPECT_EQ(tier.TenantUsed("small"), 0u);
}

// A session's account picks one of the tier's shards: accounts of one tenant on other shards
// take their slots from other segments, and the same shard's from the same; the tenant's bytes,
// and its quota, are one count over all of its accounts.
TEST(Tier, AccountsOnOtherShardsTakeOtherSegmentsAndShareTheirTenantsQuota) {
  TierOptions o = Options(16 * 4096);
  o.tenant_limit = [](const std::string& t) -> uint64_t { return t == "q" ? 3 * 4096 : 0; };
  Tier tier(o);
  const TierAccount a = tier.Account("q", 0), b = tier.Account("q", 1), c = tier.Account("q", 2);
  const TierAccount same_as_a = tier.Account("q", 16);  // 16 shards: 16 picks a's
  ASSERT_OK_AND_ASSIGN(SlotRef sa, tier.Allocate(a, 4096));
  ASSERT_OK_AND_ASSIGN(SlotRef sb, tier.Allocate(b, 4096));
  ASSERT_OK_AND_ASSIGN(SlotRef sa2, tier.Allocate(same_as_a, 4096));
  EXPECT_NE(sa->segment_id(), sb->segment_id());
  EXPECT_EQ(sa->segment_id(), sa2->segment_id());
  EXPECT_EQ(tier.Segments().size(), 2u);
  EXPECT_EQ(tier.TenantUsed("q"), 3u * 4096);
  EXPECT_EQ(tier.RoomFor(c), 0u);
  EXPECT_THAT(tier.Allocate(c, 4096), StatusIs(Code::kResourceExhausted, "quota"));
  EXPECT_THAT(tier.ChargeMetadata(b, 1), StatusIs(Code::kResourceExhausted, "quota"));
  sb.reset();  // its segment empties and goes (no retain_bytes)
  EXPECT_EQ(tier.Segments().size(), 1u);
  ASSERT_OK_AND_ASSIGN(SlotRef sc, tier.Allocate(c, 4096));
  EXPECT_EQ(tier.Stats().used_bytes, 3u * 4096);
  EXPECT_EQ(tier.Stats().num_segments, 2u);
  // A retained segment serves its class on any shard.
  TierOptions r = Options(4 << 20);
  r.retain_bytes = 1 << 20;
  Tier kept(r);
  ASSERT_OK_AND_ASSIGN(SlotRef first, kept.Allocate(kept.Account("t", 3), 4096));
  const uint64_t id = first->segment_id();
  first.reset();
  EXPECT_GT(kept.Stats().retained_bytes, 0u);
  ASSERT_OK_AND_ASSIGN(SlotRef again, kept.Allocate(kept.Account("t", 5), 4096));
  EXPECT_EQ(again->segment_id(), id);
  EXPECT_EQ(kept.Stats().retained_bytes, 0u);
}

// Warm pages first: a shard whose segment has only slots with uncommitted pages left takes a
// retained segment (a closed session's, from another shard) before committing new pages.
TEST(Tier, ARetainedSegmentIsTakenBeforePagesAreCommittedAnew) {
  TierOptions o = Options(64 << 20, 4 << 20);  // segments of 4 MiB, committed 1 MiB at a time
  o.retain_bytes = 8 << 20;
  Tier tier(o);
  const TierAccount x = tier.Account("t", 0), y = tier.Account("t", 1);
  std::vector<SlotRef> xs;
  ASSERT_OK(tier.AllocateMany(x, 4096, 256, &xs));  // the first MiB of x's segment, all of it
  ASSERT_OK_AND_ASSIGN(SlotRef ys, tier.Allocate(y, 4096));
  const uint64_t closed = ys->segment_id();
  ASSERT_NE(closed, xs[0]->segment_id());
  ys.reset();  // y's segment empties: retained
  ASSERT_GT(tier.Stats().retained_bytes, 0u);
  ASSERT_OK_AND_ASSIGN(SlotRef next, tier.Allocate(x, 4096));
  EXPECT_EQ(next->segment_id(), closed);
  EXPECT_EQ(tier.Stats().retained_bytes, 0u);
  // The retained segment's committed slots next, before x's uncommitted ones; past them (and
  // none retained), x's segment commits its next pages.
  ASSERT_OK_AND_ASSIGN(SlotRef more, tier.Allocate(x, 4096));
  EXPECT_EQ(more->segment_id(), closed);
  std::vector<SlotRef> rest;
  ASSERT_OK(tier.AllocateMany(x, 4096, 300, &rest));
  std::set<uint64_t> ids;
  for (const SlotRef& r : rest) ids.insert(r->segment_id());
  EXPECT_TRUE(ids.count(xs[0]->segment_id()));  // past the committed ones: x's own, anew
}

// No lock of the tier is held by every allocation: while one shard makes a segment (here its
// device memory, held back by the test), another shard's account allocates and frees, and
// the tier's counts and segments can be read. With a lock all shards shared, the second
// account would wait for the first's segment; the test fails after 20 s instead of hanging.
TEST(Tier, AnAllocationDoesNotWaitForAnotherShardsNewSegment) {
  auto state = std::make_shared<FakeDeviceState>();
  auto make = FakeDeviceAllocator(state);
  std::promise<void> entered, go;
  std::shared_future<void> released = go.get_future().share();
  std::atomic<int> calls = 0;
  TierOptions o = Options(4 << 20);
  o.tier = v1::TIER_DEVICE;
  o.device_memory = [&](uint64_t bytes) {
    if (calls.fetch_add(1) == 1) {  // the second segment made: the first account's
      entered.set_value();
      released.wait();
    }
    return make(bytes);
  };
  Tier tier(o);
  const TierAccount slow = tier.Account("t", 0), other = tier.Account("t", 1);
  ASSERT_OK_AND_ASSIGN(SlotRef held, tier.Allocate(other, 4096));  // other's segment, first
  absl::StatusOr<SlotRef> slow_slot;
  std::thread maker([&] { slow_slot = tier.Allocate(slow, 4096); });
  entered.get_future().wait();
  auto meanwhile = std::async(std::launch::async, [&]() -> absl::Status {
    std::vector<SlotRef> more;
    RETURN_IF_ERROR(tier.AllocateMany(other, 4096, 3, &more));
    more.clear();
    if (tier.Stats().num_slots != 1 || tier.Segments().size() != 1) {
      return absl::InternalError("counts changed by the segment in the making");
    }
    return absl::OkStatus();
  });
  const bool done = meanwhile.wait_for(std::chrono::seconds(20)) == std::future_status::ready;
  go.set_value();
  maker.join();
  ASSERT_TRUE(done) << "the other shard's allocation waited for this shard's new segment";
  EXPECT_OK(meanwhile.get());
  ASSERT_OK(slow_slot.status());
  EXPECT_NE((*slow_slot)->segment_id(), held->segment_id());
  EXPECT_EQ(tier.Stats().num_slots, 2u);
}

// Callers tell a full tier from a quota by the reason the status carries, never its words.
TEST(Tier, RefusalsCarryTheirReason) {
  TierOptions o = Options(2 * 4096);
  o.tenant_limit = [](const std::string& t) -> uint64_t { return t == "small" ? 4096 : 0; };
  Tier host(o);
  ASSERT_OK_AND_ASSIGN(SlotRef a, host.Allocate("small", 4096));
  const absl::Status quota = host.Allocate("small", 4096).status();
  EXPECT_EQ(ReasonOf(quota), ErrorReason::kQuota);
  ASSERT_OK_AND_ASSIGN(SlotRef b, host.Allocate("big", 4096));
  const absl::Status full = host.Allocate("big", 4096).status();
  EXPECT_THAT(full, StatusIs(Code::kResourceExhausted, "host tier full"));
  EXPECT_EQ(ReasonOf(full), ErrorReason::kHostTierFull);
  TierOptions d = Options(4096);
  d.tier = v1::TIER_DEVICE;
  d.instance += "-device";
  Tier device(d);
  ASSERT_OK_AND_ASSIGN(SlotRef c, device.Allocate("big", 4096));
  EXPECT_EQ(ReasonOf(device.Allocate("big", 4096).status()), ErrorReason::kDeviceTierFull);
  EXPECT_EQ(ReasonOf(host.Allocate("big", 1 << 21).status()), ErrorReason::kNone);  // too big
}

// A /dev/shm with no room left: a new slot is RESOURCE_EXHAUSTED with the tier's full reason,
// never a SIGBUS where its bytes are first written (Docker's /dev/shm is 64 MiB). In a child
// with a private mount namespace and a 1 MiB tmpfs on /dev/shm; skipped where the process may
// not make one (it needs CAP_SYS_ADMIN).
TEST(Tier, AFullDevShmIsAnErrorAndNeverASignal) {
  const pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    if (unshare(CLONE_NEWNS) != 0) _exit(77);
    if (mount("none", "/", nullptr, MS_REC | MS_PRIVATE, nullptr) != 0) _exit(77);
    if (mount("tmpfs", "/dev/shm", "tmpfs", 0, "size=1m") != 0) _exit(77);
    TierOptions o;
    o.instance = "devshm-full";
    o.capacity_bytes = 64 << 20;  // the tier would allow far more than /dev/shm holds
    o.segment_bytes = 8 << 20;
    int code = 2;  // never refused
    {
      Tier t(o);
      std::vector<SlotRef> held;
      for (int i = 0; i < 128; ++i) {
        absl::StatusOr<SlotRef> s = t.Allocate("t", 64 << 10);
        if (!s.ok()) {
          const bool right = s.status().code() == absl::StatusCode::kResourceExhausted &&
                             ReasonOf(s.status()) == ErrorReason::kHostTierFull &&
                             absl::StrContains(s.status().message(), "/dev/shm is full");
          code = right && i > 0 ? 0 : 1;
          break;
        }
        std::memset((*s)->data(), 1, 64 << 10);  // its pages are there: no SIGBUS
        held.push_back(*std::move(s));
      }
    }
    _exit(code);
  }
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  if (WIFEXITED(status) && WEXITSTATUS(status) == 77) {
    GTEST_SKIP() << "no private mount namespace here (needs CAP_SYS_ADMIN)";
  }
  ASSERT_TRUE(WIFEXITED(status)) << "the child died of signal " << WTERMSIG(status);
  EXPECT_EQ(WEXITSTATUS(status), 0) << "1: the wrong error; 2: never refused";
}

TEST(ShmSegment, RemoveStaleTakesOnlyThePrefixAndASegmentId) {
  const std::string prefix = "/kvtier-staletest-" + std::to_string(getpid()) + "-";
  {
    ASSERT_OK_AND_ASSIGN(ShmSegment a, ShmSegment::Create(prefix + "1", 4096));
    ASSERT_OK_AND_ASSIGN(
        ShmSegment other,
        ShmSegment::Create("/kvtier-otherinstance-" + std::to_string(getpid()), 4096));
    // An instance whose name extends this one's ("staletest-<pid>-host"): not this one's.
    ASSERT_OK_AND_ASSIGN(ShmSegment longer, ShmSegment::Create(prefix + "host-1", 4096));
    EXPECT_EQ(ShmSegment::RemoveStale(prefix), 1);
    EXPECT_FALSE(ShmExists(prefix + "1"));
    EXPECT_TRUE(ShmExists(other.name()));
    EXPECT_TRUE(ShmExists(longer.name()));
  }
  EXPECT_THAT(ShmSegment::OpenReadOnly(prefix + "1"), StatusIs(Code::kNotFound));
}

// An area's pages are committed (and mapped) when it is made, not at the appends that read it:
// its memory holds every page before anyone writes, and the limit counts it.
TEST(StagingRegistry, AnAreaIsCommittedWhenMadeAndCounted) {
  StagingRegistry reg("staging-test", 8 << 20);
  ASSERT_OK_AND_ASSIGN(std::shared_ptr<StagingArea> area, reg.Create("alice", 3 << 20));
  EXPECT_EQ(area->size(), uint64_t{3} << 20);
  EXPECT_EQ(reg.bytes_in_use(), uint64_t{3} << 20);
  ASSERT_OK_AND_ASSIGN(int fd, area->OpenWritableFd());
  struct stat st {};
  ASSERT_EQ(fstat(fd, &st), 0);
  close(fd);
  EXPECT_GE(uint64_t(st.st_blocks) * 512, area->size()) << "pages not committed";
  const size_t page = size_t(sysconf(_SC_PAGESIZE));
  std::vector<unsigned char> resident(area->size() / page);
  ASSERT_EQ(mincore(const_cast<uint8_t*>(area->data()), area->size(), resident.data()), 0);
  EXPECT_EQ(std::count(resident.begin(), resident.end(), 0), 0) << "pages not mapped";
  EXPECT_THAT(reg.Create("alice", 6 << 20).status(), StatusIs(Code::kResourceExhausted));
  // A worker's descriptor outlives the area (it was replaced, its session closed): it keeps the
  // object, not the memory, which the count no longer holds.
  ASSERT_OK_AND_ASSIGN(const int worker, area->OpenWritableFd());
  area.reset();
  EXPECT_EQ(reg.bytes_in_use(), 0u);
  ASSERT_EQ(fstat(worker, &st), 0);
  EXPECT_EQ(st.st_blocks, 0) << "a worker's descriptor keeps the area's pages";
  EXPECT_EQ(uint64_t(st.st_size), uint64_t{3} << 20);
  close(worker);
}

}  // namespace
}  // namespace kvtier
