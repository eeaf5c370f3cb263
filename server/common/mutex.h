// kvtier::MutexLock: absl::MutexLock that ThreadSanitizer understands.
//
// Debian builds Abseil without TSAN, so absl::Mutex::Lock/Unlock (compiled in the library)
// carry no TSAN annotations and every field they guard looks racy. This scoped lock adds the
// happens-before edges itself in TSAN builds and is exactly absl::MutexLock otherwise, with
// the same thread-safety annotations for clang's analysis.
#ifndef KVTIER_SERVER_COMMON_MUTEX_H_
#define KVTIER_SERVER_COMMON_MUTEX_H_

#include <atomic>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"

#if defined(__SANITIZE_THREAD__)
#define KVTIER_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define KVTIER_TSAN 1
#endif
#endif

#ifdef KVTIER_TSAN
extern "C" void __tsan_acquire(void* addr);
extern "C" void __tsan_release(void* addr);
// Orders what one thread did before KVTIER_TSAN_RELEASE(p) before what another does after
// KVTIER_TSAN_ACQUIRE(p): for hand-offs through code TSAN cannot see (Abseil, gRPC).
#define KVTIER_TSAN_ACQUIRE(p) __tsan_acquire(const_cast<void*>(static_cast<const void*>(p)))
#define KVTIER_TSAN_RELEASE(p) __tsan_release(const_cast<void*>(static_cast<const void*>(p)))
#else
#define KVTIER_TSAN_ACQUIRE(p) ((void)0)
#define KVTIER_TSAN_RELEASE(p) ((void)0)
#endif

namespace kvtier {

class ABSL_SCOPED_LOCKABLE MutexLock {
 public:
  explicit MutexLock(absl::Mutex* mu) ABSL_EXCLUSIVE_LOCK_FUNCTION(mu) : mu_(mu) {
    mu_->Lock();
    KVTIER_TSAN_ACQUIRE(mu_);
  }
  ~MutexLock() ABSL_UNLOCK_FUNCTION() {
    KVTIER_TSAN_RELEASE(mu_);
    mu_->Unlock();
  }
  MutexLock(const MutexLock&) = delete;
  MutexLock& operator=(const MutexLock&) = delete;

 private:
  absl::Mutex* const mu_;
};

// Priority on one mutex for the calls a worker waits on over background work that takes it
// often (aging): a ForegroundLock counts itself in `waiting` while it waits for the lock, and
// background work calls YieldToForeground before it locks, so that it lets them in first and
// a worker waits for at most the one piece of background work that holds the lock already.
class ABSL_SCOPED_LOCKABLE ForegroundLock {
 public:
  ForegroundLock(absl::Mutex* mu, std::atomic<int>* waiting) ABSL_EXCLUSIVE_LOCK_FUNCTION(mu)
      : mu_(mu) {
    waiting->fetch_add(1, std::memory_order_relaxed);
    mu_->Lock();
    waiting->fetch_sub(1, std::memory_order_relaxed);
    KVTIER_TSAN_ACQUIRE(mu_);
  }
  ~ForegroundLock() ABSL_UNLOCK_FUNCTION() {
    KVTIER_TSAN_RELEASE(mu_);
    mu_->Unlock();
  }
  ForegroundLock(const ForegroundLock&) = delete;
  ForegroundLock& operator=(const ForegroundLock&) = delete;

 private:
  absl::Mutex* const mu_;
};

// Waits, 2 ms at most (background work is never starved), while a ForegroundLock waits.
inline void YieldToForeground(const std::atomic<int>& waiting) {
  for (int i = 0; i < 100 && waiting.load(std::memory_order_relaxed) > 0; ++i) {
    absl::SleepFor(absl::Microseconds(20));
  }
}

// cv->Wait(mu) with the TSAN edges of the unlock and relock it does inside Abseil. Callers
// test their condition in their own code, in a loop, after it returns (never through an
// absl::Condition, which Abseil evaluates where TSAN cannot see the lock).
inline void WaitOn(absl::CondVar* cv, absl::Mutex* mu) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
  KVTIER_TSAN_RELEASE(mu);
  cv->Wait(mu);
  KVTIER_TSAN_ACQUIRE(mu);
}

// WaitOn with a deadline; true when it passed (the caller still tests its condition).
inline bool WaitOnUntil(absl::CondVar* cv, absl::Mutex* mu, absl::Time deadline)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
  KVTIER_TSAN_RELEASE(mu);
  const bool timed_out = cv->WaitWithDeadline(mu, deadline);
  KVTIER_TSAN_ACQUIRE(mu);
  return timed_out;
}

}  // namespace kvtier

#endif  // KVTIER_SERVER_COMMON_MUTEX_H_
