// The tables every Select and append goes through, under threads. They lie in shards with
// locks of their own (no lock every session shares), so these check what the sharding must keep
// exact, against counts each test keeps itself:
// - LeaseTable: every lease ends once, a worker's Detach ends every lease it granted (none
//   slips in beside it), and the tenant, session and pin counts come back to zero;
// - PromotionCache: reads of copies in many stripes beside evictions that span them all count
//   every hit once, and the copies left are the ones promoted and not evicted;
// - SessionManager: lookups beside creates and closes of other sessions find each session
//   while it lives, and the limits (max_sessions, ids) hold.
// Also built by the ThreadSanitizer build (make tsan).
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <random>
#include <thread>

#include "gtest/gtest.h"
#include "server/common/clock.h"
#include "server/config/policy.h"
#include "server/session/lease_table.h"
#include "server/session/session_manager.h"
#include "server/tier/promotion_cache.h"
#include "server/tier/tier.h"
#include "tests/session_fixture.h"
#include "tests/test_util.h"

namespace kvtier {
namespace {

using testing::StatusIs;
using Code = absl::StatusCode;

constexpr uint64_t kSlotBytes = 4096;

TierOptions HostTier() {
  static std::atomic<int> n = 0;
  TierOptions o;
  o.tier = v1::TIER_HOST;
  o.instance = "leasetest-" + std::to_string(getpid()) + "-" + std::to_string(n++);
  o.capacity_bytes = 64 << 20;
  o.segment_bytes = 1 << 20;
  return o;
}

std::vector<SlotRef> Slots(Tier& tier, int n) {
  std::vector<SlotRef> out;
  for (int i = 0; i < n; ++i) out.push_back(*tier.Allocate("t", kSlotBytes));
  return out;
}

// A worker's leases made while it detaches: each Create either fails (the worker is gone) or
// its lease is one the Detach ends. With the worker's shard not held across the insertion, a
// lease could slip in after the Detach and live on to its TTL.
TEST(LeaseTable, DetachEndsEveryLeaseItsWorkerWasGranted) {
  for (int round = 0; round < 20; ++round) {
    ManualClock clock;
    Tier tier(HostTier());
    LeaseTable leases(&clock);
    const std::string worker = leases.Attach("a");
    std::vector<SlotRef> slots = Slots(tier, 8);
    std::atomic<int> granted = 0;
    std::atomic<bool> refused = false;
    std::vector<std::thread> creators;
    for (int t = 0; t < 3; ++t) {
      creators.emplace_back([&, t] {
        for (int i = 0; !refused.load(); ++i) {
          absl::StatusOr<LeaseTable::Granted> g = leases.Create(
              "a", "s" + std::to_string(t), {slots[(t + i) % slots.size()]}, 60'000, worker);
          if (g.ok()) {
            granted.fetch_add(1);
          } else {
            EXPECT_THAT(g.status(), StatusIs(Code::kNotFound, "worker_id"));
            refused = true;
          }
        }
      });
    }
    while (granted.load() < 50 * (round + 1) / 10 + 1) std::this_thread::yield();
    const int ended = leases.Detach(worker);
    for (std::thread& t : creators) t.join();
    EXPECT_EQ(ended, granted.load()) << "round " << round;
    EXPECT_EQ(leases.size(), 0u);
    EXPECT_EQ(leases.Tenant("a")->live(), 0u);
    for (const SlotRef& s : slots) EXPECT_FALSE(s->pinned());
    EXPECT_EQ(tier.Stats().pinned_bytes, 0u);
  }
}

// Threads of two tenants lease, release half, and leave the rest to a TTL that a thread of its
// own expires; the counts the table answers meanwhile never go below what each thread knows
// it holds, and every count ends at zero.
TEST(LeaseTable, CountsStayExactUnderThreads) {
  ManualClock clock;
  Tier tier(HostTier());
  LeaseTable leases(&clock);
  constexpr int kThreads = 4, kLeases = 400;
  std::vector<std::vector<SlotRef>> slots;
  for (int t = 0; t < kThreads; ++t) slots.push_back(Slots(tier, 4));
  std::atomic<int> started = 0;
  std::vector<std::thread> threads;
  std::vector<int> kept(kThreads, 0);
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      const std::string tenant = t % 2 ? "b" : "a";
      const std::string session = "s" + std::to_string(t);
      const std::string worker = leases.Attach(tenant);
      std::shared_ptr<LeaseTable::TenantLeases> mine = leases.Tenant(tenant);
      auto counted = std::make_shared<LeaseTable::SessionLeases>();  // the session's own count
      started.fetch_add(1);
      std::vector<std::string> held;
      for (int i = 0; i < kLeases; ++i) {
        // Every third lease has a long TTL and no worker: the one kind the expirer may not end.
        const bool keep = i % 3 == 0;
        absl::StatusOr<LeaseTable::Granted> g = leases.Create(
            mine, session, {slots[t][i % 4]}, keep ? 3'600'000 : 10, keep ? "" : worker, counted);
        ASSERT_TRUE(g.ok()) << g.status();
        if (keep) {
          ++kept[t];
        } else if (i % 2 == 0) {
          held.push_back(g->lease_id);
        }
        EXPECT_GE(counted->live(), static_cast<size_t>(kept[t]));
        EXPECT_GE(mine->live(), static_cast<size_t>(kept[t]));
      }
      // Released now, or expired already: NOT_FOUND is the expirer's doing, never an error.
      for (const std::string& id : held) {
        absl::Status s = leases.Release(tenant, id);
        if (!s.ok()) {
          EXPECT_THAT(s, StatusIs(Code::kNotFound, "lease_id"));
        }
        EXPECT_THAT(leases.Release(tenant == "a" ? "b" : "a", id),
                    StatusIs(Code::kNotFound, "lease_id"));  // never another tenant's
      }
      // The worker ends what is left of its short leases.
      leases.Detach(worker);
      EXPECT_EQ(counted->live(), static_cast<size_t>(kept[t]));
    });
  }
  std::atomic<bool> done = false;
  std::thread expirer([&] {
    while (started.load() < kThreads) std::this_thread::yield();
    while (!done.load()) {
      clock.AdvanceMs(5);
      leases.ExpireDue();
    }
  });
  for (std::thread& t : threads) t.join();
  done = true;
  expirer.join();
  const size_t a = kept[0] + kept[2], b = kept[1] + kept[3];
  EXPECT_EQ(leases.Tenant("a")->live(), a);
  EXPECT_EQ(leases.Tenant("b")->live(), b);
  EXPECT_EQ(leases.size(), a + b);
  EXPECT_EQ(leases.workers(), 0u);
  size_t total = 0;
  EXPECT_EQ(leases.List(nullptr, "", 10, &total).size(), 10u);
  EXPECT_EQ(total, a + b);
  const std::string b_name = "b";
  leases.List(&b_name, "s1", 1'000'000, &total);
  EXPECT_EQ(total, static_cast<size_t>(kept[1]));
  EXPECT_EQ(tier.Stats().pinned_bytes, 16 * kSlotBytes);  // each thread's 4 slots, held
  EXPECT_EQ(leases.EndAll(), static_cast<int>(a + b));
  EXPECT_EQ(leases.size(), 0u);
  EXPECT_EQ(leases.Tenant("a")->live(), 0u);
  EXPECT_EQ(leases.Tenant("b")->live(), 0u);
  EXPECT_EQ(tier.Stats().pinned_bytes, 0u);
}

// A tenant's count is one object while anything holds it, and forgotten after.
TEST(LeaseTable, ATenantsCountIsOneObjectWhileHeld) {
  ManualClock clock;
  Tier tier(HostTier());
  LeaseTable leases(&clock);
  std::shared_ptr<LeaseTable::TenantLeases> a = leases.Tenant("a");
  EXPECT_EQ(leases.Tenant("a"), a);
  EXPECT_NE(leases.Tenant("b"), a);
  absl::StatusOr<LeaseTable::Granted> g = leases.Create("a", "s", Slots(tier, 2), 1000);
  ASSERT_TRUE(g.ok());
  EXPECT_EQ(a->live(), 1u);  // the lease made through the name counts on the same object
  a.reset();                 // the lease still holds it
  EXPECT_EQ(leases.Tenant("a")->live(), 1u);
  ASSERT_TRUE(leases.Release("a", g->lease_id).ok());
  EXPECT_EQ(leases.Tenant("a")->live(), 0u);
}

// A session's lease count is its own: a session of the same id made after it (by its tenant
// or another), while its leases still live, counts none of them.
TEST(LeaseTable, ASessionsLeaseCountIsItsOwn) {
  ManualClock clock;
  Tier tier(HostTier());
  LeaseTable leases(&clock);
  auto first = std::make_shared<LeaseTable::SessionLeases>();
  absl::StatusOr<LeaseTable::Granted> g = leases.Create("a", "x", Slots(tier, 2), 1000, "", first);
  ASSERT_TRUE(g.ok());
  EXPECT_EQ(first->live(), 1u);
  for (const std::string tenant : {"a", "b"}) {  // "x" closed, and made again
    auto again = std::make_shared<LeaseTable::SessionLeases>();
    absl::StatusOr<LeaseTable::Granted> h =
        leases.Create(tenant, "x", Slots(tier, 1), 1000, "", again);
    ASSERT_TRUE(h.ok());
    EXPECT_EQ(again->live(), 1u);
    EXPECT_EQ(first->live(), 1u);
    ASSERT_TRUE(leases.Release(tenant, h->lease_id).ok());
    EXPECT_EQ(again->live(), 0u);
  }
  ASSERT_TRUE(leases.Release("a", g->lease_id).ok());
  EXPECT_EQ(first->live(), 0u);
  auto expiring = std::make_shared<LeaseTable::SessionLeases>();  // an expiry ends it too
  ASSERT_TRUE(leases.Create("a", "x", Slots(tier, 1), 1000, "", expiring).ok());
  clock.AdvanceMs(2000);
  EXPECT_EQ(leases.ExpireDue(), 1);
  EXPECT_EQ(expiring->live(), 0u);
}

// Reader threads promote copies in groups of their own (their own stripes) and read them all
// again and again, while the tier (room for 64 copies) fills, so that each promotion past it
// evicts, over every stripe, what nobody reads.
TEST(PromotionCache, ReadsBesideEvictionsCountEachHitOnce) {
  ManualClock clock;
  TierOptions o = HostTier();
  o.capacity_bytes = 64 * kSlotBytes;
  Tier tier(o);
  PromotionCache cache(&tier, &clock, MakeLruPolicy());
  constexpr int kThreads = 4, kRounds = 200;
  std::vector<std::vector<CopyRef>> made(kThreads);
  std::vector<uint64_t> hits(kThreads, 0), promoted(kThreads, 0);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      const TierAccount account = tier.Account("t", /*shard_key=*/t);  // a session's, each
      for (int r = 0; r < kRounds; ++r) {
        // Another thread may take the room an eviction made before this one's next try (or
        // hold, reading, every copy there is): the tier full is an answer, never an overrun.
        absl::StatusOr<std::vector<SlotRef>> slots = cache.Allocate(account, kSlotBytes, 1);
        if (slots.ok()) {
          (*slots)[0]->data()[0] = static_cast<uint8_t>(t);
          made[t].push_back(cache.Insert((*slots)[0], "t", 1, false, /*group=*/t * 31 + r % 3));
          ++promoted[t];
        } else {
          EXPECT_THAT(slots.status(), StatusIs(Code::kResourceExhausted, "host tier full"));
        }
        slots = std::vector<SlotRef>();  // the cache's reference is the last: evictable
        // The last eight promoted, read together (held while counted).
        std::vector<const CopyRef*> mine;
        for (size_t i = made[t].size() > 8 ? made[t].size() - 8 : 0; i < made[t].size(); ++i) {
          mine.push_back(&made[t][i]);
        }
        std::vector<SlotRef> out(mine.size());
        cache.ReadAll(mine, /*record=*/true, out.data());
        for (const SlotRef& s : out) {
          if (s == nullptr) continue;
          EXPECT_EQ(s->data()[0], t);  // a copy's bytes are its own, never another's slot
          ++hits[t];
        }
        clock.AdvanceMs(1);
      }
    });
  }
  for (std::thread& t : threads) t.join();
  const PromotionCache::Counters n = cache.counters();
  EXPECT_EQ(n.promotions, promoted[0] + promoted[1] + promoted[2] + promoted[3]);
  EXPECT_GT(n.promotions, uint64_t{kThreads} * kRounds / 2);
  EXPECT_EQ(n.hits, hits[0] + hits[1] + hits[2] + hits[3]);
  EXPECT_GT(n.evictions, 0u);
  EXPECT_EQ(cache.size(), n.promotions - n.evictions);
  EXPECT_LE(cache.size(), 64u);
  EXPECT_LE(tier.Stats().used_bytes, 64 * kSlotBytes);
  size_t cached = 0;
  for (const auto& copies : made) {
    for (const CopyRef& c : copies) cached += cache.Peek(c) != nullptr;
  }
  EXPECT_EQ(cached, cache.size());
}

// Threads with accounts on shards of their own (two tenants, whose quotas share the capacity)
// take slots in batches until refused, then free another thread's slots in an order of their
// own, over and over, with segments small enough to empty, be retained and be taken again by
// another shard. The tier's bytes never pass its capacity, nor a tenant's its quota; a refusal
// comes only when the limit is reached (a round ends with each tenant at its quota); the counts
// return to zero.
TEST(Tier, LimitsHoldAndCountsStayExactUnderThreadsOnManyShards) {
  constexpr int kThreads = 8, kRounds = 100;
  constexpr uint64_t kCapacity = 120 * kSlotBytes, kQuota = 40 * kSlotBytes;
  TierOptions o = HostTier();
  o.capacity_bytes = kCapacity;
  o.segment_bytes = 64 << 10;  // 15 slots and the generation table
  o.retain_bytes = 256 << 10;
  o.tenant_limit = [](const std::string& t) -> uint64_t {
    return t == "q" ? kQuota : kCapacity - kQuota;
  };
  Tier tier(o);
  std::vector<std::vector<SlotRef>> held(kThreads);
  std::atomic<uint64_t> over_capacity = 0, over_quota = 0, early_refusals = 0;
  for (int round = 0; round < kRounds; ++round) {
    std::vector<std::thread> threads;
    for (int t = 0; t < kThreads; ++t) {
      threads.emplace_back([&, t] {
        // This round's account: a new shard for the thread each round.
        const TierAccount account = tier.Account(t % 2 ? "q" : "free", t + round * 3);
        std::mt19937 rng(round * kThreads + t);
        for (;;) {
          const uint64_t n = 1 + rng() % 4;
          const absl::Status s = tier.AllocateMany(account, kSlotBytes, n, &held[t]);
          if (tier.Stats().used_bytes > kCapacity) ++over_capacity;
          if (tier.TenantUsed("q") > kQuota) ++over_quota;
          if (s.ok()) continue;
          // Refused: n more would pass the quota (nothing is freed meanwhile, so the room only
          // shrinks after the refusal).
          if (!absl::IsResourceExhausted(s) || tier.RoomFor(account) >= n * kSlotBytes) {
            ++early_refusals;
          }
          if (n == 1) break;
        }
      });
    }
    for (std::thread& th : threads) th.join();
    ASSERT_EQ(over_capacity.load(), 0u);
    ASSERT_EQ(over_quota.load(), 0u);
    ASSERT_EQ(early_refusals.load(), 0u);
    uint64_t slots = 0, of_q = 0;
    for (int t = 0; t < kThreads; ++t) {
      slots += held[t].size();
      if (t % 2) of_q += held[t].size();
    }
    // Every thread stopped on a refusal of one slot: each tenant at its quota, the tier full.
    ASSERT_EQ(slots * kSlotBytes, kCapacity) << "round " << round;
    ASSERT_EQ(of_q * kSlotBytes, kQuota) << "round " << round;
    ASSERT_EQ(tier.Stats().num_slots, slots);
    ASSERT_EQ(tier.TenantUsed("q"), kQuota);
    // Each thread frees another's slots, in an order of its own.
    threads.clear();
    for (int t = 0; t < kThreads; ++t) {
      threads.emplace_back([&, t] {
        std::vector<SlotRef>& mine = held[(t + 1 + round) % kThreads];
        std::shuffle(mine.begin(), mine.end(), std::mt19937(t));
        while (!mine.empty()) mine.pop_back();
      });
    }
    for (std::thread& th : threads) th.join();
    const TierSnapshot st = tier.Stats();
    ASSERT_EQ(st.used_bytes, 0u);
    ASSERT_EQ(st.num_slots, 0u);
    ASSERT_LE(st.retained_bytes, o.retain_bytes);
    ASSERT_EQ(tier.TenantUsed("q"), 0u);
  }
}

// Threads create, look up and close sessions of their own, while every thread also looks up the
// sessions of the others: a session is found from its Create until its Close (by every thread,
// the tenant checked), never after, and the count and the limit stay exact.
TEST(SessionManager, LookupsBesideCreatesAndClosesFindEachSessionWhileItLives) {
  testing::Env e;
  ServerOptions o;
  o.default_policy = BuiltinPolicy();
  constexpr int kThreads = 4, kRounds = 60;
  o.max_sessions = 2 * kThreads;  // each thread holds at most two at once
  SessionManager m(o, e.env, /*remote=*/nullptr);
  v1::CreateSessionRequest req = testing::SmallestSession();
  // Each thread's session that stays, looked up by the others throughout.
  std::vector<std::string> stays;
  for (int t = 0; t < kThreads; ++t) {
    req.set_session_id("stays-" + std::to_string(t));
    ASSERT_TRUE(m.Create("t" + std::to_string(t), req).ok());
    stays.push_back(req.session_id());
  }
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      const std::string tenant = "t" + std::to_string(t);
      v1::CreateSessionRequest mine = req;
      for (int r = 0; r < kRounds; ++r) {
        mine.set_session_id(absl::StrCat("churn-", t, "-", r));
        ASSERT_TRUE(m.Create(tenant, mine).ok());
        absl::StatusOr<std::shared_ptr<Session>> got = m.Get(tenant, mine.session_id());
        ASSERT_TRUE(got.ok()) << got.status();
        EXPECT_EQ((*got)->id(), mine.session_id());
        for (int other = 0; other < kThreads; ++other) {
          absl::StatusOr<std::shared_ptr<Session>> s = m.Get("", stays[other]);
          ASSERT_TRUE(s.ok()) << s.status();
          EXPECT_EQ((*s)->tenant(), "t" + std::to_string(other));
          if (other != t) {
            EXPECT_THAT(m.Get(tenant, stays[other]), StatusIs(Code::kPermissionDenied));
          }
        }
        ASSERT_TRUE(*m.Close(tenant, mine.session_id()));
        EXPECT_THAT(m.Get(tenant, mine.session_id()), StatusIs(Code::kNotFound));
      }
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(m.size(), static_cast<size_t>(kThreads));
  EXPECT_EQ(m.List().size(), static_cast<size_t>(kThreads));
  for (int i = kThreads; i < 2 * kThreads; ++i) {
    req.set_session_id("fill-" + std::to_string(i));
    ASSERT_TRUE(m.Create("t0", req).ok());
  }
  req.set_session_id("one-too-many");
  EXPECT_THAT(m.Create("t0", req), StatusIs(Code::kResourceExhausted, "max_sessions"));
  req.set_session_id(stays[1]);
  EXPECT_THAT(m.Create("t1", req), StatusIs(Code::kAlreadyExists));
  m.CloseAll();
  EXPECT_EQ(m.size(), 0u);
  EXPECT_THAT(m.Get("", stays[0]), StatusIs(Code::kNotFound));
}

}  // namespace
}  // namespace kvtier
