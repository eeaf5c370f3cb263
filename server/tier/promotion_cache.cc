#include "server/tier/promotion_cache.h"

#include <algorithm>
#include <cmath>
#include <optional>

#include "absl/hash/hash.h"
#include "absl/strings/str_cat.h"
#include "server/common/mutex.h"

namespace kvtier {

double DecayedFrequency(const CopyStats& s, int64_t now_ms, int64_t half_life_ms) {
  const double age = static_cast<double>(std::max<int64_t>(0, now_ms - s.frequency_ms));
  return s.frequency * std::exp2(-age / static_cast<double>(std::max<int64_t>(1, half_life_ms)));
}

namespace {

class LruPolicy final : public EvictionPolicy {
 public:
  const char* name() const override { return "lru"; }
  double Keep(const CopyStats& s, int64_t) const override {
    return static_cast<double>(s.last_access_ms);
  }
};

class FrequencyPolicy final : public EvictionPolicy {
 public:
  explicit FrequencyPolicy(int64_t half_life_ms) : half_life_ms_(half_life_ms) {}
  const char* name() const override { return "frequency"; }
  double Keep(const CopyStats& s, int64_t now_ms) const override {
    return DecayedFrequency(s, now_ms, half_life_ms_);
  }

 private:
  const int64_t half_life_ms_;
};

class CostAwarePolicy final : public EvictionPolicy {
 public:
  explicit CostAwarePolicy(int64_t half_life_ms) : half_life_ms_(half_life_ms) {}
  const char* name() const override { return "cost"; }
  double Keep(const CopyStats& s, int64_t now_ms) const override {
    return DecayedFrequency(s, now_ms, half_life_ms_) * s.cost_us /
           static_cast<double>(std::max<uint64_t>(1, s.bytes));
  }

 private:
  const int64_t half_life_ms_;
};

}  // namespace

std::unique_ptr<EvictionPolicy> MakeLruPolicy() { return std::make_unique<LruPolicy>(); }
std::unique_ptr<EvictionPolicy> MakeFrequencyPolicy(int64_t half_life_ms) {
  return std::make_unique<FrequencyPolicy>(half_life_ms);
}
std::unique_ptr<EvictionPolicy> MakeCostAwarePolicy(int64_t half_life_ms) {
  return std::make_unique<CostAwarePolicy>(half_life_ms);
}

absl::StatusOr<std::unique_ptr<EvictionPolicy>> MakeEvictionPolicy(const std::string& name,
                                                                   int64_t half_life_ms) {
  if (name == "lru") return MakeLruPolicy();
  if (name == "frequency") return MakeFrequencyPolicy(half_life_ms);
  if (name == "cost") return MakeCostAwarePolicy(half_life_ms);
  return absl::InvalidArgumentError(
      absl::StrCat("eviction_policy: \"", name, "\" is not one of lru, frequency, cost"));
}

PromotionCache::PromotionCache(Tier* tier, const Clock* clock,
                               std::unique_ptr<EvictionPolicy> policy, Options options)
    : tier_(tier), clock_(clock), policy_(std::move(policy)), options_(options) {}

// Every stripe's lock, taken in order (each a MutexLock, with its annotations for TSAN) and let
// go in reverse (an array's elements are destroyed last first).
class PromotionCache::AllStripes {
 public:
  explicit AllStripes(const PromotionCache* cache) ABSL_NO_THREAD_SAFETY_ANALYSIS {
    for (size_t i = 0; i < kStripes; ++i) locks_[i].emplace(&cache->stripes_[i].mu);
  }
  AllStripes(const AllStripes&) = delete;
  AllStripes& operator=(const AllStripes&) = delete;

 private:
  std::array<std::optional<MutexLock>, kStripes> locks_;
};

void PromotionCache::Touch(CachedCopy& c, int64_t now) const {
  c.stats_.frequency = DecayedFrequency(c.stats_, now, options_.half_life_ms) + 1;
  c.stats_.frequency_ms = now;
  c.stats_.last_access_ms = now;
}

SlotRef PromotionCache::Read(const CopyRef& copy) {
  const CopyRef* one[] = {&copy};
  SlotRef out;
  ReadAll(one, /*record=*/true, &out);
  return out;
}

void PromotionCache::ReadAll(std::span<const CopyRef* const> copies, bool record, SlotRef* out) {
  const int64_t now = record ? clock_->NowMs() : 0;
  // A run of copies of one stripe (a Select's layer: all of them) under one hold of its lock.
  for (size_t i = 0; i < copies.size();) {
    if (!*copies[i]) {
      out[i++] = nullptr;
      continue;
    }
    const size_t at = (*copies[i])->stripe_;
    Stripe& stripe = stripes_[at];
    MutexLock lock(&stripe.mu);
    for (; i < copies.size(); ++i) {
      const CopyRef& copy = *copies[i];
      if (copy && copy->stripe_ != at) break;
      out[i] = copy ? copy->slot_ : nullptr;
      if (!record || !out[i]) continue;
      Touch(*copy, now);
      ++stripe.counters.hits;
      if (copy->prefetched_) {
        copy->prefetched_ = false;
        ++stripe.counters.prefetch_hits;
      }
    }
  }
}

SlotRef PromotionCache::Peek(const CopyRef& copy) const {
  if (!copy) return nullptr;
  MutexLock lock(&stripes_[copy->stripe_].mu);
  return copy->slot_;
}

CopyRef PromotionCache::Insert(SlotRef slot, const std::string& tenant, double cost_us,
                               bool prefetched, uint64_t group, std::shared_ptr<CopyTally> tally) {
  const int64_t now = clock_->NowMs();
  CopyStats stats;
  stats.bytes = slot->bytes();
  stats.inserted_ms = now;
  stats.cost_us = cost_us;
  const size_t at = absl::HashOf(group) % kStripes;
  auto copy =
      CopyRef(new CachedCopy(std::move(slot), tenant, stats, prefetched, at,
                             next_seq_.fetch_add(1, std::memory_order_relaxed), std::move(tally)));
  Stripe& stripe = stripes_[at];
  MutexLock lock(&stripe.mu);
  Touch(*copy, now);
  ++(prefetched ? stripe.counters.prefetched : stripe.counters.misses);
  ++stripe.counters.promotions;
  // Forget copies whose chunks dropped them, now and then, so the list stays near the live set.
  std::vector<std::weak_ptr<CachedCopy>>& copies = stripe.copies;
  if (copies.size() >= 64 && copies.size() == copies.capacity()) {
    std::erase_if(copies, [](const std::weak_ptr<CachedCopy>& w) { return w.expired(); });
  }
  copies.push_back(copy);
  return copy;
}

uint64_t PromotionCache::Drop(const CopyRef& copy) {
  if (!copy) return 0;
  Stripe& stripe = stripes_[copy->stripe_];
  MutexLock lock(&stripe.mu);
  if (!copy->slot_) return 0;
  const uint64_t bytes = copy->slot_->bytes();
  copy->Forget();  // a lease still holding the slot keeps its memory until released
  ++stripe.counters.drops;
  stripe.counters.dropped_bytes += bytes;
  return bytes;
}

uint64_t PromotionCache::MakeRoom(uint64_t bytes, const TierAccount& account, bool own)
    ABSL_NO_THREAD_SAFETY_ANALYSIS {  // under every stripe's lock (AllStripes), as the caller holds
  const uint64_t free = own ? tier_->RoomFor(account) : tier_->FreeBytes();
  if (free >= bytes) return 0;
  const int64_t now = clock_->NowMs();
  struct Candidate {
    double keep;
    uint64_t seq;
    size_t at;
  };
  std::vector<CopyRef> live;
  std::vector<Candidate> order;
  for (Stripe& stripe : stripes_) {
    std::vector<std::weak_ptr<CachedCopy>>& copies = stripe.copies;
    size_t kept = 0;
    for (size_t i = 0; i < copies.size(); ++i) {
      CopyRef c = copies[i].lock();
      if (!c || !c->slot_) continue;  // dropped by its chunk, or evicted: forget it
      copies[kept++] = copies[i];
      // Evictable only when the cache's reference is the last: no lease, no Select in flight.
      if (c->slot_.use_count() == 1 && !c->slot_->pinned() &&
          (!own || c->tenant_ == account.tenant())) {
        order.push_back({policy_->Keep(c->stats_, now), c->seq_, live.size()});
        live.push_back(std::move(c));
      }
    }
    copies.resize(kept);
  }
  // The policy's order; among equals, the oldest copy first.
  std::sort(order.begin(), order.end(), [](const Candidate& a, const Candidate& b) {
    return a.keep < b.keep || (a.keep == b.keep && a.seq < b.seq);
  });
  uint64_t freed = 0;
  for (const Candidate& o : order) {
    if (free + freed >= bytes) break;
    CachedCopy& c = *live[o.at];
    const uint64_t slot_bytes = c.slot_->bytes();
    freed += slot_bytes;
    c.Forget();  // the last reference: the slot goes back to the tier now
    Counters& n = stripes_[c.stripe_].counters;
    ++n.evictions;
    n.evicted_bytes += slot_bytes;
  }
  return freed;
}

absl::StatusOr<std::vector<SlotRef>> PromotionCache::Allocate(const TierAccount& account,
                                                              uint64_t bytes, size_t n) {
  std::vector<SlotRef> out;
  out.reserve(n);
  while (out.size() < n) {
    auto slot = tier_->Allocate(account, bytes);
    if (!slot.ok() && absl::IsResourceExhausted(slot.status())) {
      uint64_t freed;
      const bool own = tier_->QuotaBound(account);
      {
        AllStripes all(this);
        freed = MakeRoom((n - out.size()) * bytes, account, own);
      }
      if (freed > 0) slot = tier_->Allocate(account, bytes);
    }
    if (!slot.ok()) return slot.status();  // what was taken goes back with `out`
    out.push_back(*std::move(slot));
  }
  return out;
}

PromotionCache::Counters PromotionCache::counters() const {
  Counters sum;
  for (const Stripe& stripe : stripes_) {
    MutexLock lock(&stripe.mu);
    const Counters& n = stripe.counters;
    sum.promotions += n.promotions;
    sum.hits += n.hits;
    sum.misses += n.misses;
    sum.evictions += n.evictions;
    sum.evicted_bytes += n.evicted_bytes;
    sum.drops += n.drops;
    sum.dropped_bytes += n.dropped_bytes;
    sum.prefetched += n.prefetched;
    sum.prefetch_hits += n.prefetch_hits;
  }
  return sum;
}

size_t PromotionCache::size() const ABSL_NO_THREAD_SAFETY_ANALYSIS {  // AllStripes holds them
  AllStripes all(this);
  size_t n = 0;
  for (const Stripe& stripe : stripes_) {
    for (const auto& w : stripe.copies) {
      CopyRef c = w.lock();
      n += c && c->slot_;
    }
  }
  return n;
}

}  // namespace kvtier
