#include "server/session/prefetcher.h"

#include <pthread.h>
#include <sched.h>

#include <utility>

#include "server/common/mutex.h"

namespace kvtier {

Prefetcher::Prefetcher(uint32_t extra_percent, size_t max_queue)
    : extra_percent_(extra_percent), max_queue_(max_queue), worker_([this] { Run(); }) {}

Prefetcher::~Prefetcher() {
  {
    MutexLock lock(&mu_);
    stop_ = true;
    work_.SignalAll();
    idle_.SignalAll();
  }
  worker_.join();
}

void Prefetcher::Enqueue(std::shared_ptr<Session> session, PrefetchGuess guess) {
  if (guess.empty()) return;
  MutexLock lock(&mu_);
  if (stop_) return;
  if (queue_.size() >= max_queue_) {  // the oldest guess is the least useful now
    queue_.pop_front();
    ++counters_.dropped;
  }
  queue_.push_back(Task{std::move(session), std::move(guess)});
  work_.Signal();
}

void Prefetcher::WaitIdle() {
  MutexLock lock(&mu_);
  while (!Idle()) WaitOn(&idle_, &mu_);
}

Prefetcher::Counters Prefetcher::counters() const {
  MutexLock lock(&mu_);
  return counters_;
}

void Prefetcher::Run() {
  // A guess for the next step runs only on a core nothing else wants (SCHED_IDLE): on a
  // machine whose cores the workers and the Selects keep busy it would otherwise take their
  // time (a decode step through the Select channel, 30 layers at 32K tokens on 2 cores: 71-74 ms
  // beside the prefetcher, 43-47 ms without it). Lowering its own priority needs no privilege.
  pthread_setname_np(pthread_self(), "kvtier-prefetch");
  sched_param idle{};
  (void)pthread_setschedparam(pthread_self(), SCHED_IDLE, &idle);
  for (;;) {
    Task task;
    {
      MutexLock lock(&mu_);
      while (!stop_ && queue_.empty()) WaitOn(&work_, &mu_);
      if (stop_) return;
      task = std::move(queue_.front());
      queue_.pop_front();
      busy_ = true;
    }
    absl::StatusOr<uint64_t> made = task.session->Prefetch(std::move(task.guess));
    task.session.reset();  // a closed session's last reference goes here, off the lock
    MutexLock lock(&mu_);
    busy_ = false;
    ++counters_.tasks;
    if (made.ok()) {
      counters_.copies += *made;
    } else {
      ++counters_.failed;
    }
    if (Idle()) idle_.SignalAll();
  }
}

}  // namespace kvtier
