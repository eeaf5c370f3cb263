#include "server/session/prefetcher.h"

#include <functional>
#include <utility>

namespace kvtier {

// A guess for the next step runs only on a core nothing else wants (SCHED_IDLE): on a machine
// whose cores the workers and the Selects keep busy it would otherwise take their time (a
// decode step through the Select channel, 30 layers at 32K tokens on 2 cores: 71-74 ms beside
// the prefetcher, 43-47 ms without it).
Prefetcher::Prefetcher(uint32_t extra_percent, size_t max_queue)
    : extra_percent_(extra_percent),
      pool_(TaskPool::Options{.threads = 1,
                              .idle_priority = true,
                              .name = "kvtier-prefetch",
                              .max_queued = std::max<size_t>(1, max_queue / TaskPool::kQueues)}) {}

void Prefetcher::Enqueue(std::shared_ptr<Session> session, PrefetchGuess guess) {
  if (guess.empty()) return;
  // A session's layer keeps its queue: its guesses run in the order made.
  const uint64_t key = std::hash<const Session*>{}(session.get()) * 31 + guess.layer;
  pool_.Submit(
      [this, session = std::move(session), guess = std::move(guess)]() mutable {
        absl::StatusOr<uint64_t> made = session->Prefetch(std::move(guess));
        if (made.ok()) {
          copies_.fetch_add(*made, std::memory_order_relaxed);
        } else {
          failed_.fetch_add(1, std::memory_order_relaxed);
        }
      },
      key);
}

Prefetcher::Counters Prefetcher::counters() const {
  const TaskPool::Counters pool = pool_.counters();  // every task of the pool is a prefetch
  return Counters{.tasks = pool.tasks,
                  .copies = copies_.load(std::memory_order_relaxed),
                  .dropped = pool.dropped,
                  .failed = failed_.load(std::memory_order_relaxed)};
}

}  // namespace kvtier
