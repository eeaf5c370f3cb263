// Prefetch after Select, off the Select path: each served Select names, from its own ranking,
// the chunks it would have chosen with a 25% larger budget (PrefetchGuess), and a worker thread
// promotes them onto the placement tier, so that the next decode step finds them cached
// (PromotionCache counts the hits). Best effort: a full queue drops the oldest task, a full
// tier or a closed session ends a task quietly.
#ifndef KVTIER_SERVER_SESSION_PREFETCHER_H_
#define KVTIER_SERVER_SESSION_PREFETCHER_H_

#include <cstdint>
#include <deque>
#include <memory>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "server/session/session.h"

namespace kvtier {

class Prefetcher {
 public:
  explicit Prefetcher(uint32_t extra_percent = 25, size_t max_queue = 256);
  ~Prefetcher();  // finishes the task in hand, drops the rest
  Prefetcher(const Prefetcher&) = delete;
  Prefetcher& operator=(const Prefetcher&) = delete;

  // How much larger a budget a Select's guess is made with (percent): Session::Select's
  // extra_percent.
  uint32_t extra_percent() const { return extra_percent_; }
  // Queues the promotion of what a Select that `session` just served guessed (nothing when
  // the guess is empty).
  void Enqueue(std::shared_ptr<Session> session, PrefetchGuess guess);
  // Blocks until every queued task has run (tests, benchmarks).
  void WaitIdle();

  struct Counters {
    uint64_t tasks = 0;    // prefetches run
    uint64_t copies = 0;   // copies they promoted
    uint64_t dropped = 0;  // tasks dropped from a full queue
    uint64_t failed = 0;   // tasks that ended in an error (a full tier, a closed session)
  };
  Counters counters() const;

 private:
  struct Task {
    std::shared_ptr<Session> session;
    PrefetchGuess guess;
  };
  void Run();
  // Whether no task is queued or running (or the worker is stopping).
  bool Idle() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return stop_ || (queue_.empty() && !busy_);
  }

  const uint32_t extra_percent_;
  const size_t max_queue_;
  mutable absl::Mutex mu_;  // lock order 5 (server/common/lock_order.h)
  absl::CondVar work_;      // a task was queued, or stop
  absl::CondVar idle_;      // the queue emptied with no task in hand
  std::deque<Task> queue_ ABSL_GUARDED_BY(mu_);
  bool busy_ ABSL_GUARDED_BY(mu_) = false;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  Counters counters_ ABSL_GUARDED_BY(mu_);
  std::thread worker_;
};

}  // namespace kvtier

#endif  // KVTIER_SERVER_SESSION_PREFETCHER_H_
