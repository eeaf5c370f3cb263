// Prefetch after Select, off the Select path: each served Select names, from its own ranking,
// the chunks it would have chosen with a 25% larger budget (PrefetchGuess), and a worker thread
// promotes them onto the placement tier, so that the next decode step finds them cached
// (PromotionCache counts the hits). Best effort: a full queue drops the oldest task, a full
// tier or a closed session ends a task quietly. The tasks wait in a TaskPool of one thread at
// idle priority, whose queues have locks of their own: no lock every Select shares.
#ifndef KVTIER_SERVER_SESSION_PREFETCHER_H_
#define KVTIER_SERVER_SESSION_PREFETCHER_H_

#include <atomic>
#include <cstdint>
#include <memory>

#include "server/session/session.h"
#include "server/session/task_pool.h"

namespace kvtier {

class Prefetcher {
 public:
  // `max_queue`: the tasks that may wait, over the pool's queues (at least one a queue).
  explicit Prefetcher(uint32_t extra_percent = 25, size_t max_queue = 256);
  ~Prefetcher() = default;  // finishes the task in hand, drops the rest
  Prefetcher(const Prefetcher&) = delete;
  Prefetcher& operator=(const Prefetcher&) = delete;

  // How much larger a budget a Select's guess is made with (percent): Session::Select's
  // extra_percent.
  uint32_t extra_percent() const { return extra_percent_; }
  // Queues the promotion of what a Select that `session` just served guessed (nothing when
  // the guess is empty).
  void Enqueue(std::shared_ptr<Session> session, PrefetchGuess guess);
  // Blocks until every queued task has run (tests, benchmarks).
  void WaitIdle() { pool_.WaitIdle(); }

  struct Counters {
    uint64_t tasks = 0;    // prefetches run
    uint64_t copies = 0;   // copies they promoted
    uint64_t dropped = 0;  // tasks dropped from a full queue
    uint64_t failed = 0;   // tasks that ended in an error (a full tier, a closed session)
  };
  Counters counters() const;

 private:
  const uint32_t extra_percent_;
  std::atomic<uint64_t> copies_ = 0, failed_ = 0;
  // Last: its thread is joined before the counters it writes go.
  TaskPool pool_;
};

}  // namespace kvtier

#endif  // KVTIER_SERVER_SESSION_PREFETCHER_H_
