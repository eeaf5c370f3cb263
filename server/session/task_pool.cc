#include "server/session/task_pool.h"

#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <chrono>
#include <thread>
#include <utility>

#include "server/common/check.h"
#include "server/common/mutex.h"

namespace kvtier {
namespace {

// A pool thread at idle priority that a Boost may lift: its pool's nice value; else -1.
thread_local int tl_lift_to_nice = -1;
// Boosts alive on this thread: only the outermost lifts and lets go.
thread_local int tl_boosts = 0;

void SetPolicy(int policy) {
  sched_param none{};
  (void)pthread_setschedparam(pthread_self(), policy, &none);
}

}  // namespace

bool TaskPool::IdleCanBeLifted(int nice) {
  bool lifted = false;
  std::thread([nice, &lifted] {  // a thread of its own: it may stay at idle priority
    if (nice > 0) setpriority(PRIO_PROCESS, static_cast<id_t>(syscall(SYS_gettid)), nice);
    sched_param none{};
    if (pthread_setschedparam(pthread_self(), SCHED_IDLE, &none) != 0) return;
    lifted = pthread_setschedparam(pthread_self(), SCHED_OTHER, &none) == 0;
  })
      .join();
  return lifted;
}

TaskPool::Boost::Boost() {
  if (tl_lift_to_nice < 0) return;
  if (tl_boosts++ == 0) SetPolicy(SCHED_OTHER);  // the thread's nice value stays the pool's
  lifted_ = true;
}

TaskPool::Boost::~Boost() {
  if (lifted_ && --tl_boosts == 0) SetPolicy(SCHED_IDLE);
}

TaskPool::TaskPool(Options o)
    : max_queued_(o.max_queued),
      lift_(o.idle_priority && IdleCanBeLifted(o.nice)),
      idle_(o.idle_priority && (lift_ || !o.idle_only_if_boostable)),
      pressable_(o.pressable && idle_),  // threads at `nice` already take every task
      threads_asked_(o.threads) {
  CHECK_GT(o.threads, 0);
  for (int i = 0; i < (pressable_ ? 2 : 1) * o.threads; ++i) {
    const bool pressed = i >= o.threads;  // the second set: the pressable threads
    // Each thread looks first at a queue of its own, spread over the queues.
    const size_t first =
        static_cast<size_t>(i % o.threads) * kQueues / static_cast<size_t>(o.threads);
    threads_.emplace_back([this, o, first, pressed] {
      if (o.name[0] != '\0') pthread_setname_np(pthread_self(), o.name);
      // Linux: a thread's own nice value (a lower priority only; no privilege needed).
      if (o.nice > 0) setpriority(PRIO_PROCESS, static_cast<id_t>(syscall(SYS_gettid)), o.nice);
      if (pressed) {
        RunPressed(first);
        return;
      }
      if (idle_) {
        SetPolicy(SCHED_IDLE);
        if (lift_) tl_lift_to_nice = o.nice;
      }
      Run(first);
    });
  }
}

TaskPool::Press::Press(TaskPool* pool) : pool_(pool && pool->pressable_ ? pool : nullptr) {
  if (pool_ != nullptr && pool_->presses_.fetch_add(1, std::memory_order_acq_rel) == 0) {
    pool_->presses_.notify_all();
  }
}

TaskPool::Press::~Press() {
  if (pool_ != nullptr) pool_->presses_.fetch_sub(1, std::memory_order_acq_rel);
}

TaskPool::~TaskPool() {
  stop_.store(true, std::memory_order_release);
  presses_.fetch_add(1, std::memory_order_acq_rel);  // the pressable threads wake
  presses_.notify_all();
  ready_.release(static_cast<std::ptrdiff_t>(threads_.size()));  // each thread sees the stop
  for (std::thread& t : threads_) t.join();
  uint64_t dropped = 0;
  for (Queue& q : queues_) {
    std::deque<std::function<void()>> tasks;
    {
      MutexLock lock(&q.mu);
      q.closed = true;
      tasks.swap(q.tasks);
      q.size.store(0, std::memory_order_relaxed);
    }
    dropped += tasks.size();  // what they hold goes here, off the lock
  }
  queued_.fetch_sub(dropped, std::memory_order_relaxed);
  if (pending_.fetch_sub(dropped, std::memory_order_acq_rel) == dropped) pending_.notify_all();
}

void TaskPool::Submit(std::function<void()> task, uint64_t key) {
  if (stop_.load(std::memory_order_acquire)) return;
  Queue& q = queues_[key % kQueues];
  std::function<void()> dropped;  // what it holds goes after the lock
  {
    MutexLock lock(&q.mu);
    if (q.closed) return;
    if (max_queued_ != 0 && q.tasks.size() >= max_queued_) {
      // The oldest makes way: as many tasks wait as before, and the semaphore counts them.
      dropped = std::move(q.tasks.front());
      q.tasks.pop_front();
      q.tasks.push_back(std::move(task));
      dropped_.fetch_add(1, std::memory_order_relaxed);
      return;
    }
    pending_.fetch_add(1, std::memory_order_relaxed);
    queued_.fetch_add(1, std::memory_order_relaxed);
    q.tasks.push_back(std::move(task));
    q.size.store(q.tasks.size(), std::memory_order_release);
  }
  ready_.release();
}

void TaskPool::WaitIdle() {
  for (uint64_t p = pending_.load(std::memory_order_acquire); p != 0;
       p = pending_.load(std::memory_order_acquire)) {
    pending_.wait(p, std::memory_order_acquire);
  }
}

TaskPool::Counters TaskPool::counters() const {
  return Counters{.tasks = tasks_.load(std::memory_order_relaxed),
                  .queued = queued_.load(std::memory_order_relaxed),
                  .dropped = dropped_.load(std::memory_order_relaxed),
                  .pressed = pressed_tasks_.load(std::memory_order_relaxed)};
}

std::function<void()> TaskPool::Take(size_t first) {
  // Another thread may take the task this one saw first: then one waits in a queue passed
  // over, and the next round finds it.
  for (;;) {
    for (size_t k = 0; k < kQueues; ++k) {
      Queue& q = queues_[(first + k) % kQueues];
      if (q.size.load(std::memory_order_acquire) == 0) continue;
      MutexLock lock(&q.mu);
      if (q.tasks.empty()) continue;
      std::function<void()> task = std::move(q.tasks.front());
      q.tasks.pop_front();
      q.size.store(q.tasks.size(), std::memory_order_release);
      return task;
    }
  }
}

void TaskPool::Run(size_t first) {
  for (;;) {
    ready_.acquire();
    if (stop_.load(std::memory_order_acquire)) return;
    RunOne(first, /*pressed=*/false);
  }
}

void TaskPool::RunPressed(size_t first) {
  // A press ends unseen by a thread in a task, or waiting below: it looks again at least
  // this often (each look a wake-up of its own).
  constexpr auto kLookAgain = std::chrono::milliseconds(2);
  for (;;) {
    presses_.wait(0, std::memory_order_acquire);  // returns at once while one is held
    if (stop_.load(std::memory_order_acquire)) return;
    if (!ready_.try_acquire_for(kLookAgain)) continue;
    if (stop_.load(std::memory_order_acquire)) return;
    RunOne(first, /*pressed=*/true);
  }
}

void TaskPool::RunOne(size_t first, bool pressed) {
  std::function<void()> task = Take(first);
  queued_.fetch_sub(1, std::memory_order_relaxed);
  task();
  task = nullptr;  // what it held goes here
  tasks_.fetch_add(1, std::memory_order_relaxed);
  if (pressed) pressed_tasks_.fetch_add(1, std::memory_order_relaxed);
  if (pending_.fetch_sub(1, std::memory_order_acq_rel) == 1) pending_.notify_all();
}

}  // namespace kvtier
