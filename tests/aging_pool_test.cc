// Aging off the append path: a session whose aging runs on a TaskPool acknowledges appends
// with nothing aged, stays exact for Select meanwhile (against brute force), ends in the same
// chunks as a session that aged inline, bounds its backlog, and forks, closes and drops
// correctly with aging queued. `make tsan` runs it under ThreadSanitizer too.
#include <sched.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <iostream>
#include <numeric>
#include <thread>

#include "absl/cleanup/cleanup.h"
#include "absl/synchronization/notification.h"
#include "server/session/task_pool.h"
#include "tests/session_fixture.h"

namespace kvtier {
namespace {

using namespace ::kvtier::testing;
using Code = absl::StatusCode;

// A TaskPool of one thread, held busy until Release(): what aging is queued waits.
class BlockedPool {
 public:
  BlockedPool() {
    pool.Submit([this] { gate_.WaitForNotification(); });
  }
  ~BlockedPool() { Release(); }
  void Release() {
    if (!gate_.HasBeenNotified()) gate_.Notify();
  }
  TaskPool pool{1};

 private:
  absl::Notification gate_;
};

// Selects on `f`'s layers in turn (budget 256, no data), from a thread of its own, until
// destroyed. With `short_ok` a layer not yet holding the sinks and window may be refused by
// field (INVALID_ARGUMENT); nothing else fails.
class SelectLoop {
 public:
  SelectLoop(Fixture& f, int layers, bool short_ok)
      : thread_([this, &f, layers, short_ok] {
          for (int i = 0; !done_.load(); ++i) {
            v1::SelectResponse r;
            auto req = SelectReq(f, i % layers, 256, i);
            req.set_include_data(false);
            const absl::Status s = f.session->Select(req, &r);
            if (!s.ok() && !(short_ok && s.code() == Code::kInvalidArgument)) ADD_FAILURE() << s;
          }
        }) {}
  ~SelectLoop() {
    done_ = true;
    thread_.join();
  }

 private:
  std::atomic<bool> done_{false};  // before thread_, which reads it
  std::thread thread_;
};

// Every chunk's bytes of every head of every layer, through ReadChunks.
std::vector<std::string> AllBytes(Fixture& f) {
  std::vector<std::string> out;
  for (int l = 0; l < f.layers; ++l) {
    for (int h = 0; h < f.kvh; ++h) {
      for (const v1::BlockHandle& b : StreamHandles(f, l, h)) {
        out.push_back(absl::StrCat(b.precision(), ":", b.keys(), b.values()));
      }
    }
  }
  return out;
}

// The pool's own queues: tasks from many threads under many keys each run once; one key's run in
// the order submitted on one thread; a task queued behind a busy thread is taken by an idle one
// from that queue; and the queued tasks a stopping pool drops never run.
TEST(TaskPool, EveryTaskRunsOnceAndAnIdleThreadTakesWhatWaitsBehindABusyOne) {
  {
    TaskPool pool(2);
    std::atomic<int> ran = 0;
    std::vector<std::thread> submitters;
    for (int t = 0; t < 4; ++t) {
      submitters.emplace_back([&, t] {
        for (int i = 0; i < 500; ++i) pool.Submit([&] { ran.fetch_add(1); }, t * 1000 + i);
      });
    }
    for (std::thread& t : submitters) t.join();
    pool.WaitIdle();
    EXPECT_EQ(ran.load(), 2000);
    EXPECT_EQ(pool.counters().tasks, 2000u);
    EXPECT_EQ(pool.counters().queued, 0u);
  }
  {
    TaskPool pool(1);
    std::vector<int> order;  // one thread: written by it alone, read after WaitIdle
    for (int i = 0; i < 100; ++i) pool.Submit([&order, i] { order.push_back(i); }, /*key=*/7);
    pool.WaitIdle();
    std::vector<int> want(100);
    std::iota(want.begin(), want.end(), 0);
    EXPECT_EQ(order, want);
  }
  {
    // Both tasks under one key, so in one queue: the first holds its thread until the second
    // runs, which only the other thread can do.
    TaskPool pool(2);
    absl::Notification second_ran;
    std::atomic<bool> first_saw = false;
    pool.Submit([&] { first_saw = second_ran.WaitForNotificationWithTimeout(absl::Seconds(30)); },
                /*key=*/3);
    pool.Submit([&] { second_ran.Notify(); }, /*key=*/3);
    pool.WaitIdle();
    EXPECT_TRUE(first_saw.load()) << "the second task waited behind the busy thread";
  }
  {
    std::atomic<int> ran = 0;
    absl::Notification started;
    auto pool = std::make_unique<TaskPool>(1);
    const TaskPool* raw = pool.get();
    pool->Submit([&] {
      started.Notify();
      while (!raw->stopping()) absl::SleepFor(absl::Milliseconds(1));  // ends once it stops
    });
    started.WaitForNotification();
    for (int i = 0; i < 10; ++i) pool->Submit([&] { ran.fetch_add(1); }, i);
    EXPECT_EQ(pool->counters().queued, 10u);
    pool.reset();  // finishes the task in hand, drops the rest
    EXPECT_EQ(ran.load(), 0);
  }
}

// A bounded pool (the prefetcher's): a full queue drops its oldest task for the new one, and
// what the dropped task held goes at once; the tasks kept run in the order submitted, and
// WaitIdle counts exactly them. Another key's queue is not full for it.
TEST(TaskPool, ABoundedQueueDropsItsOldestTask) {
  TaskPool pool(TaskPool::Options{.threads = 1, .name = "kvtier-test", .max_queued = 2});
  absl::Notification gate, started;
  pool.Submit([&] {
    started.Notify();
    gate.WaitForNotification();
  });
  started.WaitForNotification();  // the thread is busy: what follows waits in the queues
  std::vector<int> ran;           // written by the pool's one thread, read after WaitIdle
  auto held = std::make_shared<int>(0);
  for (int i = 0; i < 5; ++i) pool.Submit([&ran, i, held] { ran.push_back(i); }, /*key=*/1);
  pool.Submit([&ran] { ran.push_back(100); }, /*key=*/2);
  EXPECT_EQ(pool.counters().dropped, 3u);
  EXPECT_EQ(pool.counters().queued, 3u);
  EXPECT_EQ(held.use_count(), 3);  // the test's and the two kept tasks'
  gate.Notify();
  pool.WaitIdle();
  ASSERT_EQ(ran.size(), 3u);
  EXPECT_EQ(std::count(ran.begin(), ran.end(), 100), 1);
  std::erase(ran, 100);
  EXPECT_EQ(ran, (std::vector<int>{3, 4}));
  EXPECT_EQ(pool.counters().tasks, 4u);
  EXPECT_EQ(pool.counters().queued, 0u);
}

// How the thread that runs a task is scheduled: its policy and its nice value.
struct Scheduling {
  int policy = -1;
  int nice = -100;
};
Scheduling Current() {
  errno = 0;
  const int nice = getpriority(PRIO_PROCESS, static_cast<id_t>(syscall(SYS_gettid)));
  return {sched_getscheduler(0), errno == 0 ? nice : -100};
}

// A pressable pool: its own threads run at idle priority; a task queued behind them all waits
// until a Press is held, when a thread of normal policy at the pool's nice value runs it; once
// the press has ended, tasks run on the idle threads again.
TEST(TaskPool, APressWakesThreadsOfNormalPriority) {
  absl::Notification gate, started;
  Scheduling idle, pressed, after;
  absl::Notification ran;
  TaskPool pool(
      TaskPool::Options{.threads = 1, .nice = 10, .idle_priority = true, .pressable = true});
  absl::Cleanup open_gate = [&] {  // a failed assertion still lets the pool stop
    if (!gate.HasBeenNotified()) gate.Notify();
  };
  pool.Submit([&] {
    idle = Current();
    started.Notify();
    gate.WaitForNotification();
  });
  started.WaitForNotification();  // the idle thread is held: a task now waits in its queue
  EXPECT_EQ(idle.policy, SCHED_IDLE);

  pool.Submit([&] {
    pressed = Current();
    ran.Notify();
  });
  EXPECT_FALSE(ran.WaitForNotificationWithTimeout(absl::Milliseconds(50)))
      << "a task ran with the idle thread held and no press";
  {
    TaskPool::Press press(&pool);
    ASSERT_TRUE(ran.WaitForNotificationWithTimeout(absl::Seconds(30)));
  }
  EXPECT_EQ(pressed.policy, SCHED_OTHER);
  EXPECT_EQ(pressed.nice, 10);

  gate.Notify();
  pool.WaitIdle();
  EXPECT_EQ(pool.counters().pressed, 1u);  // counted once the task has returned
  // With the press over, the pressed thread looks again (within 2 ms of being run) and sleeps;
  // until a loaded machine has run it, it may still take a task. So tasks go in one at a time
  // until one runs at idle priority: every one before it was the pressed thread's.
  uint64_t more = 0;
  for (; more < 500 && after.policy != SCHED_IDLE; ++more) {
    absl::SleepFor(absl::Milliseconds(10));
    pool.Submit([&] { after = Current(); });
    pool.WaitIdle();
  }
  EXPECT_EQ(after.policy, SCHED_IDLE);
  EXPECT_EQ(pool.counters().pressed, more);  // the first press's, then all but the last
  EXPECT_EQ(pool.counters().tasks, 2 + more);

  // A pool that is not pressable ignores a press (and so does a null pool).
  TaskPool plain(1);
  TaskPool::Press ignored(&plain), none(nullptr);
  plain.Submit([] {});
  plain.WaitIdle();
  EXPECT_EQ(plain.counters().pressed, 0u);
}

// A Boost lifts an idle-priority pool thread to the pool's nice value while it is held (where
// the process may leave SCHED_IDLE: CAP_SYS_NICE, as root; elsewhere a pool that asks for it
// runs at its nice value throughout), until the outermost of nested ones ends, and changes
// nothing on a thread of no pool.
TEST(TaskPool, ABoostLiftsAnIdleThreadWhileItHoldsALock) {
  const bool can = TaskPool::IdleCanBeLifted(10);
  Scheduling before, during, nested, after_inner, after;
  {
    TaskPool pool(TaskPool::Options{
        .threads = 1, .nice = 10, .idle_priority = true, .idle_only_if_boostable = true});
    pool.Submit([&] {
      before = Current();
      {
        TaskPool::Boost boost;
        during = Current();
        {
          TaskPool::Boost inner;  // nested: the outer one's lift stays
          nested = Current();
        }
        after_inner = Current();
      }
      after = Current();
    });
    pool.WaitIdle();
  }
  EXPECT_EQ(before.policy, can ? SCHED_IDLE : SCHED_OTHER);
  EXPECT_EQ(during.policy, SCHED_OTHER);
  EXPECT_EQ(during.nice, 10);
  EXPECT_EQ(nested.policy, SCHED_OTHER);
  EXPECT_EQ(after_inner.policy, SCHED_OTHER);
  EXPECT_EQ(after_inner.nice, 10);
  EXPECT_EQ(after.policy, before.policy);
  const Scheduling here = Current();
  {
    TaskPool::Boost boost;
    EXPECT_EQ(Current().policy, here.policy);
    EXPECT_EQ(Current().nice, here.nice);
  }
  if (!can) std::cout << "this process may not leave SCHED_IDLE: the pool ran at nice 10\n";
}

TEST(AgingPool, AppendsReturnUnagedAndSelectStaysExactUntilThePoolCatchesUp) {
  Env e(128 << 20);
  BlockedPool blocked;
  e.env.aging = &blocked.pool;
  const int tokens = 3000;
  Fixture f = Make(e, 3, 4, 2, 64, tokens, Lossless(), 7);
  ASSERT_OK(AppendAll(f, tokens, 500));
  EXPECT_EQ(f.session->aging_backlog_tokens(), 3u * tokens);
  EXPECT_EQ(f.session->Info().aging_backlog_tokens(), 3u * tokens);
  EXPECT_EQ(f.session->Layers()->at(2).indexed_chunks(), 0u) << "the index waits for the pool";
  std::vector<std::vector<int64_t>> chunks;
  for (int lo = 0; lo < tokens; lo += 16) {
    chunks.emplace_back();
    for (int t = lo; t < std::min(lo + 16, tokens); ++t) chunks.back().push_back(t);
  }
  // Every chunk scored beside the index, by its float statistics.
  ExpectLongContextSelections(f, tokens, chunks, 3, /*compact=*/false);
  blocked.Release();
  blocked.pool.WaitIdle();
  EXPECT_EQ(f.session->aging_backlog_tokens(), 0u);
  EXPECT_EQ(f.session->Layers()->at(2).indexed_chunks(), 2u * ((tokens - 64) / 16 - 1));  // no sink
  ExpectLongContextSelections(f, tokens, chunks, 3);
  ExpectStreamExact(f, 1, 1, tokens);
}

// Quantization and semantic regrouping on the pool give the same chunks, byte for byte, as
// on the append path, with the same chunks indexed, and hold about the same
// metadata (arrays' capacities follow each path's history: within a tenth) once the pool
// caught up; a context too short for a whole span of regrouping too.
TEST(AgingPool, ThePoolAgesIntoTheSameChunksAsTheAppendPath) {
  for (const int tokens : {2500, 200}) {
    for (const v1::SessionPolicy& policy : {Cold(), SemanticPolicy(false)}) {
      SCOPED_TRACE(tokens);
      Env inline_env(128 << 20), pooled_env(128 << 20);
      TaskPool pool(2);
      pooled_env.env.aging = &pool;
      Fixture a = Make(inline_env, 3, 4, 2, 64, tokens, policy, 11);
      Fixture b = Make(pooled_env, 3, 4, 2, 64, tokens, policy, 11);
      ASSERT_OK(AppendAll(a, tokens, 300));
      ASSERT_OK(AppendAll(b, tokens, 300));
      pool.WaitIdle();
      for (int l = 0; l < 3; ++l) {
        EXPECT_EQ(a.session->Layers()->at(l).indexed_chunks(),
                  b.session->Layers()->at(l).indexed_chunks());
      }
      EXPECT_EQ(b.session->aging_backlog_tokens(), 0u);
      const v1::SessionInfo ia = a.session->Info(), ib = b.session->Info();
      using Counts = std::map<std::string, uint64_t>;
      const Counts ca(ia.chunks_by_precision().begin(), ia.chunks_by_precision().end());
      if (tokens > 1000) {
        EXPECT_GT(ca.count("PRECISION_INT4") ? ca.at("PRECISION_INT4") : 0, 0u);
      }
      EXPECT_EQ(ca, Counts(ib.chunks_by_precision().begin(), ib.chunks_by_precision().end()));
      EXPECT_EQ(AllBytes(a), AllBytes(b));
      EXPECT_LE(b.session->metadata_bytes(), a.session->metadata_bytes() * 11 / 10);
      EXPECT_GE(b.session->metadata_bytes(), a.session->metadata_bytes() * 9 / 10);
      for (uint32_t budget : {128u, 512u}) {
        v1::SelectResponse ra, rb;
        ASSERT_OK(a.session->Select(SelectReq(a, 2, budget, 4), &ra));
        ASSERT_OK(b.session->Select(SelectReq(b, 2, budget, 4), &rb));
        for (int h = 0; h < 2; ++h) EXPECT_EQ(ChunkIndices(ra.heads(h)), ChunkIndices(rb.heads(h)));
      }
    }
  }
}

// A decode loop's appends, one token a layer: the pool is asked to run only when a chunk leaves
// the recent window (once every chunk_tokens appends), not at every append, and the session
// still ends in the same chunks, byte for byte, with the same index as one that aged every
// append inline. A policy change, which moves the window, asks for a run again.
TEST(AgingPool, OneTokenAppendsQueueAgingOnlyWhenAChunkLeavesTheWindow) {
  Env inline_env(64 << 20), pooled_env(64 << 20);
  TaskPool pool(1);
  pooled_env.env.aging = &pool;
  const int prefill = 1000, steps = 64;  // window 64, chunks of 16
  Fixture a = Make(inline_env, 2, 4, 2, 64, prefill + steps + 1, Cold(), 13);
  Fixture b = Make(pooled_env, 2, 4, 2, 64, prefill + steps + 1, Cold(), 13);
  for (Fixture* f : {&a, &b}) {
    for (int l = 0; l < 2; ++l) ASSERT_OK(f->session->Append(Req(*f, l, 0, prefill)).status());
  }
  pool.WaitIdle();
  const uint64_t before = pool.counters().tasks;
  int crossings = 0;  // appends after which one more chunk ends by tokens - window
  for (int t = prefill; t < prefill + steps; ++t) {
    if ((t + 1 - 64) % 16 == 0) ++crossings;
    for (Fixture* f : {&a, &b}) {
      for (int l = 0; l < 2; ++l) ASSERT_OK(f->session->Append(Req(*f, l, t, 1)).status());
    }
    pool.WaitIdle();  // each run done before the next append, as a decode step's Selects wait
  }
  ASSERT_EQ(crossings, 4);
  EXPECT_EQ(pool.counters().tasks - before, 2u * crossings) << "one run a layer a crossing";
  EXPECT_EQ(b.session->aging_backlog_tokens(), 0u);
  EXPECT_EQ(AllBytes(a), AllBytes(b));
  for (int l = 0; l < 2; ++l) {
    EXPECT_EQ(a.session->Layers()->at(l).indexed_chunks(),
              b.session->Layers()->at(l).indexed_chunks());
  }
  EXPECT_EQ(b.session->Layers()->at(1).indexed_chunks(), 2u * ((prefill + steps - 64) / 16 - 1))
      << "every chunk out of the window but the sink";

  // A smaller window ages chunks out at once: the next append asks for a run even though it
  // moves no chunk out itself.
  v1::SessionPolicy smaller;
  smaller.set_recent_window(32);
  for (Fixture* f : {&a, &b}) ASSERT_OK(f->session->SetPolicy(smaller).status());
  const uint64_t at_change = pool.counters().tasks;
  const int t = prefill + steps;  // 1064 tokens then 1065: 1065 - 32 ends no new chunk
  for (Fixture* f : {&a, &b}) ASSERT_OK(f->session->Append(Req(*f, 0, t, 1)).status());
  pool.WaitIdle();
  EXPECT_EQ(pool.counters().tasks - at_change, 1u);
  EXPECT_EQ(b.session->aging_backlog_tokens(), 0u);
  EXPECT_EQ(AllBytes(a), AllBytes(b)) << "the chunks the smaller window let go are quantized";
}

// wait_aged ages the layer before the reply, pool or not, and never waits on the backlog.
TEST(AgingPool, WaitAgedAgesTheLayerBeforeTheReply) {
  Env e(64 << 20);
  BlockedPool blocked;
  e.env.aging = &blocked.pool;
  Fixture f = Make(e, 2, 2, 1, 64, 1000, Cold(), 5);
  ASSERT_OK(f.session->Append(Req(f, 0, 0, 1000)).status());
  v1::AppendKVRequest r = Req(f, 1, 0, 1000);
  r.set_wait_aged(true);
  ASSERT_OK(f.session->Append(r).status());
  EXPECT_EQ(f.session->aging_backlog_tokens(), 1000u) << "layer 0's, still queued";
  const std::vector<v1::LayerStats> layers = *f.session->Layers();
  EXPECT_EQ(layers[0].indexed_chunks(), 0u);
  EXPECT_EQ(layers[1].indexed_chunks(), (1000 - 64) / 16 - 1);
}

// Past max_aging_backlog_tokens an append waits for the pool and, when it does not catch up,
// is RESOURCE_EXHAUSTED naming the backlog with nothing stored; once it catches up, appends
// go on.
TEST(AgingPool, TheBacklogIsBounded) {
  Env e(64 << 20);
  BlockedPool blocked;
  e.env.aging = &blocked.pool;
  e.env.max_aging_backlog_tokens = 1500;
  e.env.aging_wait_ms = 100;
  Fixture f = Make(e, 2, 2, 1, 64, 3000, Cold(), 6);
  ASSERT_OK(f.session->Append(Req(f, 0, 0, 1000)).status());
  ASSERT_OK(f.session->Append(Req(f, 1, 0, 1000)).status());  // 1000 < 1500 when it began
  EXPECT_THAT(f.session->Append(Req(f, 0, 1000, 500)),
              StatusIs(Code::kResourceExhausted, "aging backlog: session \"s\" holds 2000 tokens"));
  EXPECT_EQ(f.session->Info().num_tokens(), 1000u);
  // A waiting append goes on as soon as the pool has aged enough (a session made now reads
  // the longer wait: the env is copied at creation).
  e.env.aging_wait_ms = 30'000;
  Fixture g = Make(e, 2, 2, 1, 64, 3000, Cold(), 7);
  ASSERT_OK(g.session->Append(Req(g, 0, 0, 1000)).status());
  ASSERT_OK(g.session->Append(Req(g, 1, 0, 1000)).status());
  std::thread release([&] {
    absl::SleepFor(absl::Milliseconds(20));
    blocked.Release();
  });
  ASSERT_OK(g.session->Append(Req(g, 0, 1000, 500)).status());
  release.join();
  blocked.pool.WaitIdle();
  ASSERT_OK(f.session->Append(Req(f, 0, 1000, 500)).status());
}

// An append held back by the backlog presses the pool: with the pool's idle thread held
// (a busy machine's cores), its pressed thread ages what the append waits for.
TEST(AgingPool, AnAppendThatWaitsOnTheBacklogPressesThePool) {
  Env e(64 << 20);
  absl::Notification gate, started;
  TaskPool pool(
      TaskPool::Options{.threads = 1, .nice = 10, .idle_priority = true, .pressable = true});
  absl::Cleanup open_gate = [&] {  // a failed assertion still lets the pool stop
    if (!gate.HasBeenNotified()) gate.Notify();
  };
  pool.Submit([&] {
    started.Notify();
    gate.WaitForNotification();
  });
  started.WaitForNotification();
  e.env.aging = &pool;
  e.env.max_aging_backlog_tokens = 1500;
  e.env.aging_wait_ms = 30'000;
  Fixture f = Make(e, 2, 2, 1, 64, 3000, Cold(), 11);
  ASSERT_OK(f.session->Append(Req(f, 0, 0, 1000)).status());
  ASSERT_OK(f.session->Append(Req(f, 1, 0, 1000)).status());
  EXPECT_EQ(pool.counters().pressed, 0u);
  ASSERT_OK(f.session->Append(Req(f, 0, 1000, 500)).status());  // 2000 >= 1500: it waits
  EXPECT_EQ(f.session->Info().num_tokens(), 1000u);             // the least layer's
  gate.Notify();
  pool.WaitIdle();
  EXPECT_GE(pool.counters().pressed, 1u);  // counted once a task has returned
  EXPECT_EQ(f.session->aging_backlog_tokens(), 0u);
}

// Fork ages what is pending first, so the child starts from final chunks; a closed or dropped
// session's queued aging does nothing.
TEST(AgingPool, ForkCloseAndDropWithAgingQueued) {
  Env e(128 << 20);
  BlockedPool blocked;
  e.env.aging = &blocked.pool;
  Fixture f = Make(e, 3, 4, 2, 64, 2000, Cold(), 8);
  ASSERT_OK(AppendAll(f, 2000, 400));
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Session> child, f.session->Fork("c", 1500));
  EXPECT_EQ(f.session->aging_backlog_tokens(), 0u);
  EXPECT_EQ(child->aging_backlog_tokens(), 0u);
  EXPECT_EQ(child->Layers()->at(2).indexed_chunks(), 2u * ((1500 - 64) / 16 - 1));

  Fixture g = Make(e, 3, 4, 2, 64, 2000, Cold(), 9);
  Fixture h = Make(e, 3, 4, 2, 64, 2000, Cold(), 10);
  ASSERT_OK(AppendAll(g, 2000, 1000));
  ASSERT_OK(AppendAll(h, 2000, 1000));
  g.session->Close();
  h.session.reset();  // its queued task holds it only weakly
  const uint64_t used = e.host.Stats().used_bytes;
  blocked.Release();
  blocked.pool.WaitIdle();
  EXPECT_EQ(e.host.Stats().used_bytes, used) << "nothing aged for a closed or dropped session";
  EXPECT_EQ(f.session->aging_backlog_tokens(), 0u);
}

// Appends on every layer from several threads, Selects beside them, and the pool aging all the
// while (ThreadSanitizer's case); at the end the session equals one aged inline.
TEST(AgingPool, AppendsSelectsAndAgingAtOnce) {
  Env e(128 << 20), twin_env(128 << 20);
  TaskPool pool(2);
  e.env.aging = &pool;
  const int layers = 4, tokens = 2048;
  Fixture f = Make(e, layers, 4, 2, 64, tokens, Cold(), 12);
  Fixture twin = Make(twin_env, layers, 4, 2, 64, tokens, Cold(), 12);
  {
    SelectLoop selects(f, layers, /*short_ok=*/true);
    std::vector<std::thread> appenders;
    for (int l = 0; l < layers; ++l) {
      appenders.emplace_back([&, l] {
        for (int s = 0; s < tokens; s += 128)
          EXPECT_OK(f.session->Append(Req(f, l, s, 128)).status());
      });
    }
    for (std::thread& t : appenders) t.join();
  }
  ASSERT_OK(AppendAll(twin, tokens, 128));
  pool.WaitIdle();
  EXPECT_EQ(f.session->aging_backlog_tokens(), 0u);
  EXPECT_EQ(AllBytes(f), AllBytes(twin));
}

// A decode loop on every layer at once: one-token appends (most of which leave aging out,
// some moving a chunk out of the window) from a thread per layer, Selects beside them and the
// pool ageing meanwhile, end in the same chunks as a session that aged every append inline.
TEST(AgingPool, OneTokenAppendsSelectsAndAgingAtOnce) {
  Env e(128 << 20), twin_env(128 << 20);
  TaskPool pool(2);
  e.env.aging = &pool;
  const int layers = 3, prefill = 512, steps = 100;
  Fixture f = Make(e, layers, 4, 2, 64, prefill + steps, Cold(), 14);
  Fixture twin = Make(twin_env, layers, 4, 2, 64, prefill + steps, Cold(), 14);
  ASSERT_OK(AppendAll(f, prefill, 128));
  ASSERT_OK(AppendAll(twin, prefill, 128));
  {
    SelectLoop selects(f, layers, /*short_ok=*/false);
    std::vector<std::thread> appenders;
    for (int l = 0; l < layers; ++l) {
      appenders.emplace_back([&, l] {
        for (int t = prefill; t < prefill + steps; ++t) {
          EXPECT_OK(f.session->Append(Req(f, l, t, 1)).status());
        }
      });
    }
    for (std::thread& t : appenders) t.join();
  }
  for (int t = prefill; t < prefill + steps; ++t) {
    for (int l = 0; l < layers; ++l) ASSERT_OK(twin.session->Append(Req(twin, l, t, 1)).status());
  }
  pool.WaitIdle();
  EXPECT_EQ(f.session->aging_backlog_tokens(), 0u);
  EXPECT_EQ(AllBytes(f), AllBytes(twin));
  for (int l = 0; l < layers; ++l) {
    EXPECT_EQ(f.session->Layers()->at(l).indexed_chunks(),
              twin.session->Layers()->at(l).indexed_chunks());
  }
}

}  // namespace
}  // namespace kvtier
