// The aging pool: threads that run sessions' aging (regroup, quantize, index: aging.h) off
// the append path, so that an AppendKV is acknowledged once its rows are stored in fp16 and
// visible to Select. A session submits one task per layer while that layer has un-aged tokens
// and none queued or running (Session::Append, Session::AgeQueuedLayer), so that the threads
// age one session's layers side by side; the task holds the session only weakly, so a closed
// and dropped session's queued task does nothing.
//
// Thread-safe. mu_ is lock order 16, a leaf: a session submits under its own lock (3).
#ifndef KVTIER_SERVER_SESSION_AGING_POOL_H_
#define KVTIER_SERVER_SESSION_AGING_POOL_H_

#include <cstdint>
#include <deque>
#include <functional>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace kvtier {

class AgingPool {
 public:
  // The daemon's: aging is background work beside the calls it serves.
  static constexpr int kBackgroundNice = 10;
  // `nice` > 0: each thread runs at that nice value, so that on a busy machine the appends
  // and Selects it serves take the cores first (the backlog bound stops aging falling behind
  // without end).
  explicit AgingPool(int threads, int nice = 0);
  // Finishes the tasks in hand, drops the queued ones, joins the threads.
  ~AgingPool();
  AgingPool(const AgingPool&) = delete;
  AgingPool& operator=(const AgingPool&) = delete;

  int threads() const { return static_cast<int>(threads_.size()); }
  // Queues `task`; a no-op once the pool is stopping.
  void Submit(std::function<void()> task);
  // Blocks until no task is queued or running (tests, benchmarks).
  void WaitIdle();

  struct Counters {
    uint64_t tasks = 0;   // tasks run
    uint64_t queued = 0;  // tasks waiting now
  };
  Counters counters() const;

 private:
  void Run();
  bool Idle() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return stop_ || (queue_.empty() && busy_ == 0);
  }

  mutable absl::Mutex mu_;  // lock order 16 (server/common/lock_order.h)
  absl::CondVar work_;      // a task was queued, or stop
  absl::CondVar idle_;      // nothing queued or running
  std::deque<std::function<void()>> queue_ ABSL_GUARDED_BY(mu_);
  int busy_ ABSL_GUARDED_BY(mu_) = 0;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t tasks_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<std::thread> threads_;
};

}  // namespace kvtier

#endif  // KVTIER_SERVER_SESSION_AGING_POOL_H_
