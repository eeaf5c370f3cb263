// A pool of threads that run tasks off the calls that make them: the daemon's aging pool
// (regroup, quantize, index: aging.h, off the append path, so that an AppendKV is acknowledged
// once its rows are stored in fp16 and visible to Select) and the prefetcher's (prefetcher.h).
// For aging, a session submits one task per layer while that layer has un-aged tokens and none
// queued or running (Session::Append, Session::AgeQueuedLayer; an append that moves no chunk
// out of the recent window after a run that left nothing waiting submits none), so that the
// threads age one session's layers side by side; the task holds the session only weakly, so a
// closed and dropped session's queued task does nothing.
//
// Background work on a busy host: with `idle_priority` the threads run only on a core nothing
// else wants (SCHED_IDLE), so appends and Selects never share a core with them. A caller that
// waits for the pool's work (an append held back by its session's aging backlog) holds a Press
// meanwhile; a `pressable` pool then wakes as many threads again, at `nice`, which take tasks
// beside the idle ones only while some Press is held. (A thread cannot leave SCHED_IDLE
// without CAP_SYS_NICE, hence threads of their own.)
//
// Thread-safe, and no lock is shared by every session: tasks wait in 16 queues, each with a
// lock of its own, a task's queue chosen by the key its submitter names (a session's layer),
// and a semaphore (lock-free until a thread sleeps) counts them for the threads, each of which
// takes the oldest task of the first queue that holds one, from a queue of its own onward. A
// queue's lock is lock order 16, a leaf: a session submits under its own lock (3). A bounded
// pool's full queue drops its oldest task for the new one (destroyed after the lock).
#ifndef KVTIER_SERVER_SESSION_TASK_POOL_H_
#define KVTIER_SERVER_SESSION_TASK_POOL_H_

#include <array>
#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <semaphore>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "server/common/mutex.h"

namespace kvtier {

class TaskPool {
 public:
  // The daemon's aging: background work beside the calls it serves (the nice value of its
  // pressable threads).
  static constexpr int kBackgroundNice = 10;
  static constexpr size_t kQueues = 16;
  struct Options {
    int threads = 1;
    // > 0: each thread runs at that nice value, so that on a busy machine the appends and
    // Selects it serves take the cores first (aging's backlog bound stops it falling behind
    // without end).
    int nice = 0;
    // Each thread runs only on a core nothing else wants (SCHED_IDLE; no privilege needed).
    // Where the process may leave SCHED_IDLE again (CAP_SYS_NICE, or an RLIMIT_NICE that
    // reaches `nice`), a Boost lifts a thread to `nice` while it holds a lock that a
    // foreground call may wait for.
    bool idle_priority = false;
    // With idle_priority: where no Boost can lift a thread, it runs at `nice` instead (a lock
    // holder at idle priority, preempted on a host whose cores are all busy, would keep a
    // foreground call waiting for as long as the cores stay busy).
    bool idle_only_if_boostable = false;
    // With idle_priority (where the threads do run at it): `threads` more threads, at `nice`,
    // that take tasks only while a Press is held.
    bool pressable = false;
    // The threads' name (at most 15 characters); empty: the process's.
    const char* name = "";
    // The most tasks a queue holds (0: no bound); past it the oldest is dropped.
    size_t max_queued = 0;
  };
  explicit TaskPool(Options options);
  explicit TaskPool(int threads, int nice = 0)
      : TaskPool(Options{.threads = threads, .nice = nice}) {}
  // Finishes the tasks in hand, drops the queued ones, joins the threads.
  ~TaskPool();
  TaskPool(const TaskPool&) = delete;
  TaskPool& operator=(const TaskPool&) = delete;

  // The threads asked for (a pressable pool has as many again, which run only when pressed).
  int threads() const { return threads_asked_; }
  // Whether the pool's own threads run at SCHED_IDLE (Options::idle_priority, where allowed).
  bool idle() const { return idle_; }
  // Queues `task` in the queue `key` picks (tasks of one key run in the order submitted, as far
  // as one thread takes them); a no-op once the pool is stopping. In a full queue of a bounded
  // pool, the oldest task makes way (Counters::dropped).
  void Submit(std::function<void()> task, uint64_t key = 0);
  // Blocks until no task is queued or running (tests, benchmarks).
  void WaitIdle();
  // The pool is being destroyed: the tasks in hand finish, no other runs.
  bool stopping() const { return stop_.load(std::memory_order_acquire); }

  struct Counters {
    uint64_t tasks = 0;    // tasks run
    uint64_t queued = 0;   // tasks waiting now
    uint64_t dropped = 0;  // tasks dropped from a full queue
    uint64_t pressed = 0;  // of the tasks run, those the pressable threads ran
  };
  Counters counters() const;

  // Held by a pool's thread around a hold of a lock that a foreground call may wait for: a
  // thread at idle priority runs at its pool's nice value meanwhile. A no-op on any other
  // thread, and where the process may not leave SCHED_IDLE. Boosts nest: the thread goes back
  // to idle priority when the outermost ends (a task that takes a lock many times in a row
  // holds one around them all, rather than two system calls a hold).
  class Boost {
   public:
    Boost();
    ~Boost();
    Boost(const Boost&) = delete;
    Boost& operator=(const Boost&) = delete;

   private:
    bool lifted_ = false;
  };
  // Whether a thread of this process at `nice` may leave SCHED_IDLE (tried on a thread of its
  // own).
  static bool IdleCanBeLifted(int nice);

  // Held by a caller while it waits for the pool's work: a pressable pool's threads at `nice`
  // take tasks until the last Press ends. A no-op on a pool that is not pressable, or null.
  class Press {
   public:
    explicit Press(TaskPool* pool);
    ~Press();
    Press(const Press&) = delete;
    Press& operator=(const Press&) = delete;

   private:
    TaskPool* const pool_;
  };

 private:
  struct Queue {
    mutable absl::Mutex mu;  // lock order 16 (server/common/lock_order.h)
    std::deque<std::function<void()>> tasks ABSL_GUARDED_BY(mu);
    bool closed ABSL_GUARDED_BY(mu) = false;  // the pool is stopping: Submit drops the task
    std::atomic<size_t> size = 0;  // tasks.size(), read without the lock to skip empty queues
  };
  void Run(size_t first);
  // A pressable thread's loop: sleeps while no Press is held, else takes tasks as Run does.
  void RunPressed(size_t first);
  // Takes and runs one task (the semaphore let this thread through).
  void RunOne(size_t first, bool pressed);
  // The oldest task of the first queue from `first` on that holds one (one is there: the
  // semaphore said so, and only a thread it let through takes one).
  std::function<void()> Take(size_t first);

  const size_t max_queued_;
  std::array<Queue, kQueues> queues_;
  std::counting_semaphore<> ready_{0};  // a release per task queued (and per thread at stop)
  std::atomic<bool> stop_ = false;
  std::atomic<uint64_t> queued_ = 0, tasks_ = 0, dropped_ = 0, pressed_tasks_ = 0;
  // Presses held (each Press adds one while it lives); the destructor adds one for good so
  // that the pressable threads wake and see the stop.
  std::atomic<uint32_t> presses_ = 0;
  const bool lift_;       // a Boost lifts the idle threads (IdleCanBeLifted)
  const bool idle_;       // the pool's own threads run at SCHED_IDLE
  const bool pressable_;  // and a second set at `nice` runs while pressed
  const int threads_asked_;
  std::atomic<uint64_t> pending_ = 0;  // queued or running: WaitIdle waits on it
  std::vector<std::thread> threads_;
};

// A pool thread's hold of a lock that foreground calls take through a ForegroundLock: it lets
// them in first (YieldToForeground), and is lifted to its pool's nice value (TaskPool::Boost)
// from before it waits for the lock until after it lets the lock go, so that a preempted
// holder at idle priority never keeps them waiting.
class ABSL_SCOPED_LOCKABLE BackgroundLock {
 public:
  BackgroundLock(absl::Mutex* mu, const std::atomic<int>& waiting) ABSL_EXCLUSIVE_LOCK_FUNCTION(mu)
      : mu_(mu) {
    YieldToForeground(waiting);
    mu_->Lock();
    KVTIER_TSAN_ACQUIRE(mu_);
  }
  ~BackgroundLock() ABSL_UNLOCK_FUNCTION() {
    KVTIER_TSAN_RELEASE(mu_);
    mu_->Unlock();
  }  // boost_ goes after the unlock
  BackgroundLock(const BackgroundLock&) = delete;
  BackgroundLock& operator=(const BackgroundLock&) = delete;

 private:
  TaskPool::Boost boost_;  // first: lifted before the wait
  absl::Mutex* const mu_;
};

}  // namespace kvtier

#endif  // KVTIER_SERVER_SESSION_TASK_POOL_H_
