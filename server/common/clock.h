// Time as an interface, so that leases and (later) eviction can be tested by driving time.
#ifndef KVTIER_SERVER_COMMON_CLOCK_H_
#define KVTIER_SERVER_COMMON_CLOCK_H_

#include <atomic>
#include <cstdint>

namespace kvtier {

class Clock {
 public:
  virtual ~Clock() = default;
  // Milliseconds since the Unix epoch.
  virtual int64_t NowMs() const = 0;
};

// The wall clock. Shared, stateless.
Clock& SystemClock();

// A clock that moves only when told. Thread-safe.
class ManualClock final : public Clock {
 public:
  explicit ManualClock(int64_t start_ms = 1'000'000) : now_ms_(start_ms) {}
  int64_t NowMs() const override { return now_ms_.load(std::memory_order_acquire); }
  void AdvanceMs(int64_t ms) { now_ms_.fetch_add(ms, std::memory_order_acq_rel); }

 private:
  std::atomic<int64_t> now_ms_;
};

}  // namespace kvtier

#endif  // KVTIER_SERVER_COMMON_CLOCK_H_
