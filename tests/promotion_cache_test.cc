// The promotion cache: eviction order under each policy as time is driven through a
// ManualClock, and the copies it must never evict.
#include "server/tier/promotion_cache.h"

#include <unistd.h>

#include "tests/test_util.h"

namespace kvtier {
namespace {

using testing::StatusIs;
using Code = absl::StatusCode;
constexpr uint64_t kSlot = 4096;

TierOptions Room(int slots) {
  static int n = 0;
  TierOptions o;
  o.tier = v1::TIER_DEVICE;
  o.emulated = true;
  o.instance = "cachetest-" + std::to_string(getpid()) + "-" + std::to_string(n++);
  o.capacity_bytes = slots * kSlot;
  o.segment_bytes = 1 << 20;
  return o;
}

// A tier with room for `slots` slots and a cache over it.
struct Fixture {
  Fixture(int slots, std::unique_ptr<EvictionPolicy> policy)
      : tier(Room(slots)), cache(&tier, &clock, std::move(policy), {.half_life_ms = 1000}) {}
  // A new copy whose first byte is `tag`.
  CopyRef Add(uint8_t tag, double cost_us = 1, bool prefetched = false, uint64_t group = 0) {
    auto slots = cache.Allocate(tier.Account("t"), kSlot, 1);
    EXPECT_TRUE(slots.ok()) << slots.status();
    (*slots)[0]->data()[0] = tag;
    return cache.Insert((*slots)[0], "t", cost_us, prefetched, group);
  }
  ManualClock clock;
  Tier tier;
  PromotionCache cache;
};

bool Cached(const Fixture& f, const CopyRef& c) { return f.cache.Peek(c) != nullptr; }

TEST(PromotionCache, LruEvictsTheLeastRecentlyRead) {
  Fixture f(3, MakeLruPolicy());
  CopyRef a = f.Add(1);
  f.clock.AdvanceMs(10);
  CopyRef b = f.Add(2);
  f.clock.AdvanceMs(10);
  CopyRef c = f.Add(3);
  f.clock.AdvanceMs(10);
  ASSERT_NE(f.cache.Read(a), nullptr);  // a is now the most recent
  f.clock.AdvanceMs(10);
  CopyRef d = f.Add(4);  // the tier is full: b goes
  EXPECT_TRUE(Cached(f, a));
  EXPECT_FALSE(Cached(f, b));
  EXPECT_TRUE(Cached(f, c));
  EXPECT_EQ(f.cache.Read(d)->data()[0], 4);
  EXPECT_EQ(f.cache.Read(a)->data()[0], 1);
  EXPECT_EQ(f.tier.Stats().used_bytes, 3 * kSlot);
  EXPECT_EQ(f.cache.counters().evictions, 1u);
  EXPECT_EQ(f.cache.counters().promotions, 4u);  // every copy made, the evicted one too
  EXPECT_EQ(f.cache.counters().drops, 0u);
  EXPECT_EQ(f.cache.Drop(c), kSlot);  // dropped on request: counted apart from evictions
  EXPECT_EQ(f.cache.Drop(c), 0u);
  EXPECT_EQ(f.cache.counters().drops, 1u);
  EXPECT_EQ(f.cache.counters().dropped_bytes, kSlot);
  EXPECT_EQ(f.cache.counters().evictions, 1u);
  EXPECT_FALSE(Cached(f, c));
}

// Several copies read under one hold of the lock: each as Read gives it (null for a null or
// evicted copy), the hits and prefetch hits counted once each, and nothing counted or moved
// when only looking.
TEST(PromotionCache, ReadAllIsReadOfEachCopy) {
  Fixture f(2, MakeLruPolicy());
  CopyRef a = f.Add(1, 1, /*prefetched=*/true);
  f.clock.AdvanceMs(10);
  CopyRef b = f.Add(2);
  f.clock.AdvanceMs(10);
  CopyRef none;
  const CopyRef* copies[] = {&a, &none, &b};
  SlotRef out[3];
  f.cache.ReadAll(copies, /*record=*/false, out);
  EXPECT_EQ(out[0]->data()[0], 1);
  EXPECT_EQ(out[1], nullptr);
  EXPECT_EQ(out[2]->data()[0], 2);
  EXPECT_EQ(f.cache.counters().hits, 0u);
  EXPECT_EQ(f.cache.counters().prefetch_hits, 0u);
  f.cache.ReadAll(copies, /*record=*/true, out);
  EXPECT_EQ(f.cache.counters().hits, 2u);
  EXPECT_EQ(f.cache.counters().prefetch_hits, 1u);
  f.cache.ReadAll(copies, /*record=*/true, out);
  EXPECT_EQ(f.cache.counters().hits, 4u);
  EXPECT_EQ(f.cache.counters().prefetch_hits, 1u);  // the first read of a prefetched copy only
  // Both were read at the same time; reading b alone later makes a the least recent.
  for (SlotRef& s : out) s = nullptr;
  f.clock.AdvanceMs(10);
  ASSERT_NE(f.cache.Read(b), nullptr);
  f.clock.AdvanceMs(10);
  CopyRef c = f.Add(3);  // the tier is full: a goes
  f.cache.ReadAll(copies, /*record=*/true, out);
  EXPECT_EQ(out[0], nullptr);
  EXPECT_EQ(out[2]->data()[0], 2);
  EXPECT_TRUE(Cached(f, c));
}

// Copies of different groups lie in different stripes of the cache: the eviction order is still
// the policy's over every copy, and one ReadAll over copies of many groups (and none) reads each.
TEST(PromotionCache, EvictionAndReadsSpanEveryStripe) {
  Fixture f(8, MakeLruPolicy());
  std::vector<CopyRef> copies;
  for (int i = 0; i < 8; ++i) {
    copies.push_back(f.Add(static_cast<uint8_t>(10 + i), 1, false, /*group=*/i * 7919));
    f.clock.AdvanceMs(10);
  }
  // Read all but copy 5, in an order across groups, with an empty copy (-1) among them.
  const CopyRef none;
  const std::vector<int> order = {7, -1, 0, 0, 3, 1, 2, 4, 6};
  std::vector<const CopyRef*> read;
  for (int i : order) read.push_back(i < 0 ? &none : &copies[i]);
  std::vector<SlotRef> out(read.size());
  f.cache.ReadAll(read, /*record=*/true, out.data());
  for (size_t j = 0; j < order.size(); ++j) {
    if (order[j] < 0) {
      EXPECT_EQ(out[j], nullptr);
      continue;
    }
    ASSERT_NE(out[j], nullptr) << j;
    EXPECT_EQ(out[j]->data()[0], 10 + order[j]) << j;
  }
  out.clear();
  EXPECT_EQ(f.cache.counters().hits, 8u);  // the empty copy is no read
  f.clock.AdvanceMs(10);
  CopyRef extra = f.Add(99, 1, false, /*group=*/12345);  // full: the least recent goes
  for (int i = 0; i < 8; ++i) EXPECT_EQ(Cached(f, copies[i]), i != 5) << i;
  EXPECT_EQ(f.cache.counters().evictions, 1u);
  EXPECT_EQ(f.cache.size(), 8u);
}

TEST(PromotionCache, FrequencyDecaysWithTime) {
  // Read often long ago versus read twice just now: with 1 s half-lives the old counts fade.
  for (int64_t gap : {0, 10'000}) {
    Fixture f(2, MakeFrequencyPolicy(1000));
    CopyRef often = f.Add(1);
    for (int i = 0; i < 5; ++i) f.cache.Read(often);
    f.clock.AdvanceMs(gap);
    CopyRef recent = f.Add(2);
    f.cache.Read(recent);
    f.Add(3);
    if (gap == 0) {  // 6 reads against 2: the recent one goes
      EXPECT_TRUE(Cached(f, often));
      EXPECT_FALSE(Cached(f, recent));
    } else {  // 6 * 2^-10 against 2
      EXPECT_FALSE(Cached(f, often));
      EXPECT_TRUE(Cached(f, recent));
    }
  }
  CopyStats s;
  s.frequency = 8;
  s.frequency_ms = 0;
  EXPECT_DOUBLE_EQ(DecayedFrequency(s, 3000, 1000), 1.0);
}

TEST(PromotionCache, CostAwareKeepsWhatIsDearToRemake) {
  Fixture f(2, MakeCostAwarePolicy(1000));
  CopyRef dear = f.Add(1, /*cost_us=*/40);  // say, a dequantized int4 chunk
  CopyRef cheap = f.Add(2, /*cost_us=*/10);
  f.cache.Read(cheap);  // read twice as often, but a quarter of the cost
  f.Add(3);
  EXPECT_TRUE(Cached(f, dear));
  EXPECT_FALSE(Cached(f, cheap));
  // The same reads under LRU evict the other one.
  Fixture g(2, MakeLruPolicy());
  CopyRef first = g.Add(1, 40);
  g.clock.AdvanceMs(1);
  CopyRef second = g.Add(2, 10);
  g.cache.Read(second);
  g.Add(3);
  EXPECT_FALSE(Cached(g, first));
  EXPECT_TRUE(Cached(g, second));
}

TEST(PromotionCache, LeasedOrHeldCopiesAreNeverEvicted) {
  Fixture f(2, MakeLruPolicy());
  CopyRef leased = f.Add(1);
  CopyRef held = f.Add(2);
  SlotRef lease_view = f.cache.Read(leased);
  lease_view->Pin();                    // as a lease does
  SlotRef reader = f.cache.Read(held);  // as a Select in flight does
  lease_view.reset();
  EXPECT_THAT(f.cache.Allocate(f.tier.Account("t"), kSlot, 1), StatusIs(Code::kResourceExhausted));
  EXPECT_TRUE(Cached(f, leased));
  EXPECT_TRUE(Cached(f, held));
  reader.reset();
  ASSERT_OK(f.cache.Allocate(f.tier.Account("t"), kSlot, 1).status());  // `held` can go now
  EXPECT_FALSE(Cached(f, held));
  EXPECT_TRUE(Cached(f, leased));
  f.cache.Peek(leased)->Unpin();
}

TEST(PromotionCache, AllOrNothingAndDroppedCopiesFreeTheirSlots) {
  Fixture f(3, MakeLruPolicy());
  CopyRef a = f.Add(1);
  {
    CopyRef gone = f.Add(2);  // its chunk lets go of it: the memory returns at once
  }
  EXPECT_EQ(f.tier.Stats().used_bytes, kSlot);
  SlotRef pin = f.cache.Read(a);
  EXPECT_THAT(f.cache.Allocate(f.tier.Account("t"), kSlot, 3), StatusIs(Code::kResourceExhausted));
  EXPECT_EQ(f.tier.Stats().used_bytes, kSlot) << "nothing kept from a refused allocation";
  ASSERT_OK(f.cache.Allocate(f.tier.Account("t"), kSlot, 2).status());
  EXPECT_EQ(f.cache.Drop(a), kSlot);
  EXPECT_EQ(f.cache.Drop(a), 0u);
  EXPECT_EQ(pin->data()[0], 1) << "a reader keeps the bytes of a dropped copy";
}

TEST(PromotionCache, CountsHitsMissesAndPrefetchHits) {
  Fixture f(4, MakeLruPolicy());
  CopyRef wanted = f.Add(1);
  CopyRef ahead = f.Add(2, 1, /*prefetched=*/true);
  CopyRef unused = f.Add(3, 1, /*prefetched=*/true);
  f.cache.Read(wanted);
  f.cache.Read(ahead);
  f.cache.Read(ahead);
  const auto c = f.cache.counters();
  EXPECT_EQ(c.misses, 1u);
  EXPECT_EQ(c.prefetched, 2u);
  EXPECT_EQ(c.hits, 3u);
  EXPECT_EQ(c.prefetch_hits, 1u);  // the first read of `ahead` only
  EXPECT_EQ(f.cache.size(), 3u);
}

// A tenant at its quota makes room from its own copies only, even when another tenant's
// copy is older.
TEST(PromotionCache, QuotaBoundTenantEvictsItsOwnCopies) {
  TierOptions o = Room(8);
  o.tenant_limit = [](const std::string& t) -> uint64_t { return t == "a" ? 2 * kSlot : 0; };
  Tier tier(o);
  ManualClock clock;
  PromotionCache cache(&tier, &clock, MakeLruPolicy());
  auto add = [&](const std::string& tenant) {
    auto slots = cache.Allocate(tier.Account(tenant), kSlot, 1);
    EXPECT_TRUE(slots.ok()) << slots.status();
    clock.AdvanceMs(1);
    return cache.Insert((*slots)[0], tenant, 1, false);
  };
  CopyRef b_old = add("b");
  CopyRef a1 = add("a");
  CopyRef a2 = add("a");
  CopyRef a3 = add("a");  // a's quota binds: a1 goes, not b's older copy
  EXPECT_NE(cache.Peek(b_old), nullptr);
  EXPECT_EQ(cache.Peek(a1), nullptr);
  EXPECT_NE(cache.Peek(a2), nullptr);
  EXPECT_NE(cache.Peek(a3), nullptr);
  EXPECT_THAT(cache.Allocate(tier.Account("a"), kSlot, 3),
              StatusIs(Code::kResourceExhausted, "quota"));
}

TEST(EvictionPolicy, NamesAreChecked) {
  for (const char* name : {"lru", "frequency", "cost"}) {
    ASSERT_OK_AND_ASSIGN(auto p, MakeEvictionPolicy(name, 1000));
    EXPECT_STREQ(p->name(), name);
  }
  EXPECT_THAT(MakeEvictionPolicy("fifo", 1000),
              StatusIs(Code::kInvalidArgument, "eviction_policy"));
}

}  // namespace
}  // namespace kvtier
