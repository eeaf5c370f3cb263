// The fp16 copies that Select promotes onto a tier (device copies of any chunk, dequantized
// host copies of cold chunks), held as a cache bounded by the tier's capacity. When a
// promotion does not fit, the cache evicts copies nobody is reading, in the order its
// EvictionPolicy gives; a copy under a lease (or held by a Select in progress) is never
// evicted. A chunk keeps a CachedCopy; the cache keeps only a weak reference to it, so a
// chunk that changes or goes away drops its copy without telling the cache.
//
// Thread-safe. Its copies lie in stripes, each with a lock of its own, so that Selects of
// different sessions read and insert their copies without a lock they all share: a copy's
// stripe comes from the group Insert names (Readable names a session's layer), and a Select
// reads one layer's copies under one stripe's lock. Making room takes every stripe. Its locks
// come after a session's and before its tier's (server/common/lock_order.h).
#ifndef KVTIER_SERVER_TIER_PROMOTION_CACHE_H_
#define KVTIER_SERVER_TIER_PROMOTION_CACHE_H_

#include <array>
#include <atomic>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "server/common/clock.h"
#include "server/tier/tier.h"

namespace kvtier {

// What a policy knows of one cached copy.
struct CopyStats {
  uint64_t bytes = 0;
  int64_t inserted_ms = 0;
  int64_t last_access_ms = 0;
  double frequency = 0;  // accesses, decayed (halved every half-life), as of frequency_ms
  int64_t frequency_ms = 0;
  double cost_us = 0;  // the estimated time to bring the copy back once evicted
};

// Orders copies for eviction: the lowest Keep value goes first.
class EvictionPolicy {
 public:
  virtual ~EvictionPolicy() = default;
  virtual const char* name() const = 0;
  virtual double Keep(const CopyStats& s, int64_t now_ms) const = 0;
};

// The frequency as of now_ms: halved every half_life_ms since it was last updated.
double DecayedFrequency(const CopyStats& s, int64_t now_ms, int64_t half_life_ms);

// Least recently used.
std::unique_ptr<EvictionPolicy> MakeLruPolicy();
// Selection frequency with exponential decay: the least often selected lately goes first.
std::unique_ptr<EvictionPolicy> MakeFrequencyPolicy(int64_t half_life_ms);
// Cost-aware (GreedyDual-Size-Frequency): decayed frequency times the cost to bring the copy
// back, per byte; a copy that is cheap to remake (a plain copy) goes before one that needs
// dequantizing or a remote fetch.
std::unique_ptr<EvictionPolicy> MakeCostAwarePolicy(int64_t half_life_ms);
// "lru", "frequency", "cost"; INVALID_ARGUMENT otherwise.
absl::StatusOr<std::unique_ptr<EvictionPolicy>> MakeEvictionPolicy(const std::string& name,
                                                                   int64_t half_life_ms);

class PromotionCache;

// The bytes of one holder's cached copies (a session's on one tier): what Insert added, less
// what was evicted, dropped or let go of since. Read without a lock.
struct CopyTally {
  std::atomic<uint64_t> bytes{0};
};

// One cached copy, owned by the chunk it copies.
class CachedCopy {
 public:
  CachedCopy(const CachedCopy&) = delete;
  CachedCopy& operator=(const CachedCopy&) = delete;
  // The last reference: nobody else can reach slot_ now.
  ~CachedCopy() ABSL_NO_THREAD_SAFETY_ANALYSIS { Untally(); }

 private:
  friend class PromotionCache;
  CachedCopy(SlotRef slot, std::string tenant, CopyStats stats, bool prefetched, size_t stripe,
             uint64_t seq, std::shared_ptr<CopyTally> tally)
      : slot_(std::move(slot)),
        tenant_(std::move(tenant)),
        stats_(stats),
        prefetched_(prefetched),
        stripe_(stripe),
        seq_(seq),
        tally_(std::move(tally)) {
    if (tally_) tally_->bytes.fetch_add(slot_->bytes(), std::memory_order_relaxed);
  }
  // Lets go of the slot (evicted or dropped) and marks the copy gone for Held. Under its
  // stripe's mutex.
  void Forget() {
    Untally();
    slot_.reset();
    gone_.store(true, std::memory_order_relaxed);
  }
  // slot_, stats_ and prefetched_ are guarded by the mutex of the cache's stripe `stripe_`.
  SlotRef slot_;  // null once evicted
  // Set with slot_'s end (Forget); read without the mutex as a hint (Held).
  std::atomic<bool> gone_ = false;
  const std::string tenant_;
  CopyStats stats_;
  bool prefetched_;  // promoted ahead by a prefetch and not read since
  const size_t stripe_;
  // The order of insertion, across stripes: ties of the policy go oldest first.
  const uint64_t seq_;
  const std::shared_ptr<CopyTally> tally_;  // null: counted nowhere
  // The slot's bytes leave the tally (the copy is let go of: evicted, dropped, destroyed).
  void Untally() ABSL_NO_THREAD_SAFETY_ANALYSIS {
    if (slot_ && tally_) tally_->bytes.fetch_sub(slot_->bytes(), std::memory_order_relaxed);
  }
};
using CopyRef = std::shared_ptr<CachedCopy>;

class PromotionCache {
 public:
  struct Options {
    int64_t half_life_ms = 10'000;
  };
  PromotionCache(Tier* tier, const Clock* clock, std::unique_ptr<EvictionPolicy> policy,
                 Options options);
  PromotionCache(Tier* tier, const Clock* clock, std::unique_ptr<EvictionPolicy> policy)
      : PromotionCache(tier, clock, std::move(policy), Options{}) {}

  Tier* tier() const { return tier_; }
  const EvictionPolicy& policy() const { return *policy_; }

  // The copy's slot while it is cached, recording a read (and a prefetch hit on the first
  // read of a prefetched copy); null when `copy` is null or was evicted.
  SlotRef Read(const CopyRef& copy);
  // As Read, without recording anything.
  SlotRef Peek(const CopyRef& copy) const;
  // Whether `copy` was cached when last looked at, without the lock: a hint that may lag an
  // eviction in flight (Peek says for sure).
  static bool Held(const CopyRef& copy) {
    return copy && !copy->gone_.load(std::memory_order_relaxed);
  }
  // Read (Peek without `record`) of each of `copies` under one hold of the lock, and one
  // clock reading: out[i] for *copies[i]. A Select reads tens of copies at once.
  void ReadAll(std::span<const CopyRef* const> copies, bool record, SlotRef* out);

  // `n` slots of `bytes` for the account (of this cache's tier), all or nothing. When the tier
  // is full, evicts unpinned copies that nobody else holds, by the policy, until they fit (only
  // the tenant's own copies when its quota is what binds); RESOURCE_EXHAUSTED when even that
  // leaves too little room.
  absl::StatusOr<std::vector<SlotRef>> Allocate(const TierAccount& account, uint64_t bytes,
                                                size_t n);

  // Registers a filled slot as a cached copy that would cost `cost_us` to remake. Copies of
  // one `group` (any number: copies read together, as a session's layer) share a stripe. Its
  // bytes count in `tally`, when given, while it is cached.
  CopyRef Insert(SlotRef slot, const std::string& tenant, double cost_us, bool prefetched,
                 uint64_t group = 0, std::shared_ptr<CopyTally> tally = nullptr);

  // Drops a copy now (a session's Evict); returns its bytes, 0 if it was not cached.
  uint64_t Drop(const CopyRef& copy);

  // What the cache did; TierStats reports promotions and evictions + drops as the tier's.
  struct Counters {
    uint64_t promotions = 0;  // copies made (Insert): misses + prefetched
    uint64_t hits = 0;        // reads that found their copy cached
    uint64_t misses = 0;      // copies made because a Select needed them
    uint64_t evictions = 0;   // copies evicted to make room
    uint64_t evicted_bytes = 0;
    uint64_t drops = 0;  // copies dropped on request (Drop: a session's Evict)
    uint64_t dropped_bytes = 0;
    uint64_t prefetched = 0;     // copies promoted ahead
    uint64_t prefetch_hits = 0;  // prefetched copies later read by a Select
  };
  Counters counters() const;
  size_t size() const;  // copies currently cached

 private:
  static constexpr size_t kStripes = 16;
  struct Stripe {
    mutable absl::Mutex mu;  // lock order 7 (server/common/lock_order.h)
    Counters counters ABSL_GUARDED_BY(mu);
    // The stripe's copies, for eviction (a chunk drops its copy without telling the cache).
    std::vector<std::weak_ptr<CachedCopy>> copies ABSL_GUARDED_BY(mu);
  };
  // Every stripe's lock, in order (making room, counting the copies).
  class AllStripes;
  // Evicts until `bytes` more would fit the account's room (or nothing evictable is left);
  // returns bytes freed. With `own` (its quota binds), only its tenant's copies go. Under every
  // stripe's lock (AllStripes).
  uint64_t MakeRoom(uint64_t bytes, const TierAccount& account, bool own);
  void Touch(CachedCopy& c, int64_t now) const;

  Tier* const tier_;
  const Clock* const clock_;
  const std::unique_ptr<EvictionPolicy> policy_;
  const Options options_;
  mutable std::array<Stripe, kStripes> stripes_;
  std::atomic<uint64_t> next_seq_{0};
};

}  // namespace kvtier

#endif  // KVTIER_SERVER_TIER_PROMOTION_CACHE_H_
