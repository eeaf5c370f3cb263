#include "server/session/aging_pool.h"

#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <utility>

#include "server/common/check.h"
#include "server/common/mutex.h"

namespace kvtier {

AgingPool::AgingPool(int threads, int nice) {
  CHECK_GT(threads, 0);
  for (int i = 0; i < threads; ++i) {
    threads_.emplace_back([this, nice] {
      // Linux: a thread's own nice value (a lower priority only; no privilege needed).
      if (nice > 0) setpriority(PRIO_PROCESS, static_cast<id_t>(syscall(SYS_gettid)), nice);
      Run();
    });
  }
}

AgingPool::~AgingPool() {
  std::deque<std::function<void()>> dropped;
  {
    MutexLock lock(&mu_);
    stop_ = true;
    dropped.swap(queue_);
    work_.SignalAll();
    idle_.SignalAll();
  }
  for (std::thread& t : threads_) t.join();
}

void AgingPool::Submit(std::function<void()> task) {
  MutexLock lock(&mu_);
  if (stop_) return;
  queue_.push_back(std::move(task));
  work_.Signal();
}

void AgingPool::WaitIdle() {
  MutexLock lock(&mu_);
  while (!Idle()) WaitOn(&idle_, &mu_);
}

AgingPool::Counters AgingPool::counters() const {
  MutexLock lock(&mu_);
  return Counters{.tasks = tasks_, .queued = queue_.size()};
}

void AgingPool::Run() {
  for (;;) {
    std::function<void()> task;
    {
      MutexLock lock(&mu_);
      while (!stop_ && queue_.empty()) WaitOn(&work_, &mu_);
      if (stop_) return;
      task = std::move(queue_.front());
      queue_.pop_front();
      ++busy_;
    }
    task();
    task = nullptr;  // what it held goes here, off the lock
    MutexLock lock(&mu_);
    --busy_;
    ++tasks_;
    if (Idle()) idle_.SignalAll();
  }
}

}  // namespace kvtier
