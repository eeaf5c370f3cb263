// ChannelHub, the daemon's side of the shared-memory Select channels, driven through the raw
// protocol of kvtier/channel_layout.h from threads of this process (one per channel), with
// an echoing serve hook: every answer is its own request's, the worker's socket end closing
// ends its channel and detaches its worker, and Stop hangs up channels in the middle of
// their calls. Also run under ThreadSanitizer (make tsan).
#include "server/rpc/select_channel.h"

#include <poll.h>
#include <sched.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <set>
#include <thread>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "kvtier/channel_layout.h"
#include "server/common/log.h"

namespace kvtier {
namespace {

// The logger made once, before any channel's thread logs (as the daemon does at start).
[[maybe_unused]] const bool kLogging = SetLogLevel("warn").ok();

// The hooks' record: workers attached and detached, calls served.
struct Record {
  std::mutex mu;
  std::set<std::string> attached, detached;
  std::atomic<int> calls{0};
};

ChannelHub::Hooks EchoHooks(Record* r) {
  return ChannelHub::Hooks{
      .serve = [r](const ChannelHub::Call& call, std::string* out) -> absl::Status {
        r->calls.fetch_add(1);
        if (call.op == channel::kRelease) return absl::NotFoundError("no such lease");
        *out = absl::StrCat(call.tenant, "/", call.worker, "/", call.op, ":", call.request);
        return absl::OkStatus();
      },
      .attach =
          [r](const std::string& tenant) {
            std::lock_guard lock(r->mu);
            const std::string w = absl::StrCat(tenant, "-w", r->attached.size());
            r->attached.insert(w);
            return w;
          },
      .detach =
          [r](const std::string& worker) {
            std::lock_guard lock(r->mu);
            r->detached.insert(worker);
          }};
}

// A worker's end of one channel: its four descriptors and the mapped memory.
struct Worker {
  int fds[channel::kDescriptors] = {-1, -1, -1, -1};
  uint8_t* mem = nullptr;
  size_t size = 0;
  uint64_t seq = 0;

  bool Open(ChannelHub& hub, uint64_t id, const std::string& tenant) {
    for (size_t i = 0; i < channel::kDescriptors; ++i) {
      absl::StatusOr<int> fd = hub.OpenFd(id, tenant, i);
      if (!fd.ok()) return false;
      fds[i] = *fd;
    }
    struct stat st {};
    if (fstat(fds[0], &st) != 0) return false;
    size = static_cast<size_t>(st.st_size);
    void* p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fds[0], 0);
    if (p == MAP_FAILED) return false;
    mem = static_cast<uint8_t*>(p);
    return true;
  }
  void Close() {
    if (mem != nullptr) munmap(mem, size);
    mem = nullptr;
    for (int& fd : fds) {
      if (fd >= 0) close(fd);
      fd = -1;
    }
  }
  channel::Header* header() { return reinterpret_cast<channel::Header*>(mem); }

  // One call: the code and the answer's bytes; code -1 when the daemon hung up first.
  // `worker_cpu` is the header's hint (1 + a CPU; 0: not said).
  std::pair<int, std::string> Call(uint32_t op, const std::string& request,
                                   uint32_t worker_cpu = 0) {
    channel::Header* h = header();
    std::memcpy(mem + h->request_offset, request.data(), request.size());
    h->op = op;
    h->request_bytes = static_cast<uint32_t>(request.size());
    __atomic_store_n(&h->worker_cpu, worker_cpu, __ATOMIC_RELAXED);
    __atomic_store_n(&h->seq, ++seq, __ATOMIC_RELEASE);
    eventfd_write(fds[1], 1);
    while (__atomic_load_n(&h->answered_seq, __ATOMIC_ACQUIRE) != seq) {
      pollfd p[2] = {{fds[2], POLLIN, 0}, {fds[3], POLLIN, 0}};
      if (poll(p, 2, 10000) <= 0) return {-2, "timed out"};
      eventfd_t n;
      if (p[0].revents & POLLIN) eventfd_read(fds[2], &n);
      if (__atomic_load_n(&h->answered_seq, __ATOMIC_ACQUIRE) == seq) break;
      if (p[1].revents != 0) return {-1, "hung up"};
    }
    return {h->code, std::string(reinterpret_cast<const char*>(mem + h->response_offset),
                                 h->response_bytes)};
  }

  // One call by the doorbell flags (channel_layout.h): the worker says it watches, rings only
  // when the daemon's thread may sleep, and watches the answer (spinning) for `watch`, then
  // says it sleeps, looks once more, and sleeps on the doorbell. `rang`: whether it rang.
  std::pair<int, std::string> CallSparing(const std::string& request, absl::Duration watch,
                                          bool* rang) {
    channel::Header* h = header();
    std::memcpy(mem + h->request_offset, request.data(), request.size());
    h->op = channel::kSelect;
    h->request_bytes = static_cast<uint32_t>(request.size());
    __atomic_store_n(&h->worker_watching, 1u, __ATOMIC_RELAXED);
    __atomic_store_n(&h->seq, ++seq, __ATOMIC_RELEASE);
    std::atomic_thread_fence(std::memory_order_seq_cst);
    *rang = __atomic_load_n(&h->daemon_watching, __ATOMIC_RELAXED) != 1u;
    if (*rang) eventfd_write(fds[1], 1);
    auto answered = [&] { return __atomic_load_n(&h->answered_seq, __ATOMIC_ACQUIRE) == seq; };
    for (const absl::Time until = absl::Now() + watch; !answered() && absl::Now() < until;) {
    }
    if (!answered()) {  // (answered, it stays watching: nothing rings until its next call)
      __atomic_store_n(&h->worker_watching, 0u, __ATOMIC_RELAXED);
      std::atomic_thread_fence(std::memory_order_seq_cst);
    }
    while (!answered()) {
      pollfd p{fds[2], POLLIN, 0};
      if (poll(&p, 1, 10000) <= 0) return {-2, "timed out"};
      eventfd_t n;
      eventfd_read(fds[2], &n);
    }
    return {h->code, std::string(reinterpret_cast<const char*>(mem + h->response_offset),
                                 h->response_bytes)};
  }
  // The response doorbell's count, drained (0: not rung since last drained).
  eventfd_t ResponseRings() {
    eventfd_t n = 0;
    pollfd p{fds[2], POLLIN, 0};
    if (poll(&p, 1, 0) == 1) eventfd_read(fds[2], &n);
    return n;
  }
};

// The doorbell flags: a worker that watches for its answer is not rung, one that sleeps is
// (however the two race), and a call made while the daemon's thread watches needs no ring;
// a worker that knows nothing of the flags is served as before (the tests above).
TEST(SelectChannel, ADoorbellRingsOnlyForASideThatMaySleep) {
  Record record;
  ChannelHub hub("kvtier-test", EchoHooks(&record), false);
  auto o = hub.Open("t", 0, 64 << 20);
  ASSERT_TRUE(o.ok());
  Worker w;
  ASSERT_TRUE(w.Open(hub, o->id, "t"));
  bool rang = false;
  for (int c = 0; c < 300; ++c) {  // back to back, the worker watching long: no answer rings
    const auto [code, got] = w.CallSparing(absl::StrCat("q", c), absl::Seconds(10), &rang);
    ASSERT_EQ(code, 0);
    ASSERT_EQ(got, absl::StrCat("t/", o->worker_id, "/1:q", c));
  }
  EXPECT_EQ(w.ResponseRings(), 0u) << "a watching worker was rung";
  // A call made while the daemon's thread says it watches is not rung, and is answered: each
  // try waits until the flag reads 1 (it does after every answer, for the thread's watch) and
  // calls at once; a try the watch ended first rings (and counts for nothing).
  bool spared = false;
  for (int c = 0; c < 2000 && !spared; ++c) {
    for (int i = 0;
         i < 100 && __atomic_load_n(&w.header()->daemon_watching, __ATOMIC_ACQUIRE) != 1u; ++i) {
      absl::SleepFor(absl::Microseconds(1));
    }
    const auto [code, got] = w.CallSparing(absl::StrCat("w", c), absl::Seconds(10), &rang);
    ASSERT_EQ(code, 0);
    ASSERT_EQ(got, absl::StrCat("t/", o->worker_id, "/1:w", c));
    spared = !rang;
  }
  EXPECT_TRUE(spared) << "no call found the daemon's thread watching";
  // The daemon's thread asleep (its watch over: the flag reads 0 until a call rings it): the
  // call rings, and is answered.
  for (int i = 0;
       i < 10000 && __atomic_load_n(&w.header()->daemon_watching, __ATOMIC_ACQUIRE) != 0u; ++i) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  EXPECT_EQ(__atomic_load_n(&w.header()->daemon_watching, __ATOMIC_ACQUIRE), 0u);
  auto [code, got] = w.CallSparing("late", absl::Seconds(10), &rang);
  EXPECT_EQ(code, 0);
  EXPECT_TRUE(rang);
  // A worker that goes to sleep at once: every answer rings it awake, whichever side was first.
  for (int c = 0; c < 300; ++c) {
    std::tie(code, got) = w.CallSparing(absl::StrCat("s", c), absl::ZeroDuration(), &rang);
    ASSERT_EQ(code, 0) << got;
    ASSERT_EQ(got, absl::StrCat("t/", o->worker_id, "/1:s", c));
  }
  w.Close();
}

TEST(SelectChannel, EachChannelAnswersItsOwnCallsAsItsTenantsWorker) {
  Record record;
  ChannelHub hub("kvtier-test", EchoHooks(&record), false);
  constexpr int kChannels = 4, kCalls = 300;
  std::vector<ChannelHub::Opened> opened;
  for (int i = 0; i < kChannels; ++i) {
    auto o = hub.Open(absl::StrCat("t", i % 2), 0, 64 << 20);
    ASSERT_TRUE(o.ok()) << o.status();
    EXPECT_EQ(o->size_bytes, ChannelHub::kDefaultBytes);
    opened.push_back(*o);
  }
  EXPECT_EQ(hub.open_channels(), kChannels);
  // Another tenant gets none of a channel's descriptors.
  EXPECT_EQ(hub.OpenFd(opened[0].id, "t1", 0).status().code(), absl::StatusCode::kNotFound);
  std::vector<std::thread> threads;
  std::atomic<int> wrong{0};
  for (int i = 0; i < kChannels; ++i) {
    threads.emplace_back([&, i] {
      Worker w;
      if (!w.Open(hub, opened[i].id, absl::StrCat("t", i % 2))) {
        wrong.fetch_add(1000);
        return;
      }
      // The socket end is handed once.
      if (hub.OpenFd(opened[i].id, absl::StrCat("t", i % 2), 3).ok()) wrong.fetch_add(1000);
      for (int c = 0; c < kCalls; ++c) {
        const std::string req = absl::StrCat("req-", i, "-", c, std::string(c % 50, 'x'));
        const auto [code, got] = w.Call(channel::kSelect, req);
        const std::string want = absl::StrCat("t", i % 2, "/", opened[i].worker_id, "/1:", req);
        if (code != 0 || got != want) wrong.fetch_add(1);
      }
      const auto [code, message] = w.Call(channel::kRelease, "x");
      if (code != static_cast<int>(absl::StatusCode::kNotFound) || message != "no such lease") {
        wrong.fetch_add(1);
      }
      // A request longer than the request area is refused by name, and served no further.
      channel::Header* h = w.header();
      h->request_bytes = static_cast<uint32_t>(h->request_capacity + 1);
      h->op = channel::kSelect;
      __atomic_store_n(&h->seq, ++w.seq, __ATOMIC_RELEASE);
      eventfd_write(w.fds[1], 1);
      while (__atomic_load_n(&h->answered_seq, __ATOMIC_ACQUIRE) != w.seq) {
        pollfd p{w.fds[2], POLLIN, 0};
        poll(&p, 1, 1000);
      }
      if (h->code != static_cast<int>(absl::StatusCode::kInvalidArgument)) wrong.fetch_add(1);
      w.Close();  // the worker goes: its channel ends
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(wrong.load(), 0);
  EXPECT_EQ(record.calls.load(), kChannels * (kCalls + 1));
  for (int i = 0; i < 200 && hub.open_channels() > 0; ++i) absl::SleepFor(absl::Milliseconds(10));
  EXPECT_EQ(hub.open_channels(), 0);
  std::lock_guard lock(record.mu);
  EXPECT_EQ(record.detached, record.attached);
  EXPECT_EQ(record.attached.size(), static_cast<size_t>(kChannels));
}

// What of this process refers to memory labelled `label`: its mappings (/proc/self/maps) and
// its descriptors (/proc/self/fd links, "/memfd:<label>...").
int ReferencesTo(const std::string& label) {
  int n = 0;
  std::ifstream maps("/proc/self/maps");
  for (std::string line; std::getline(maps, line);) n += line.find(label) != std::string::npos;
  for (const auto& fd : std::filesystem::directory_iterator("/proc/self/fd")) {
    std::error_code ec;
    const std::string target = std::filesystem::read_symlink(fd.path(), ec).string();
    n += !ec && target.find(label) != std::string::npos;
  }
  return n;
}

// A channel whose worker went gives its memory and descriptors back when it ends, not when the
// next channel is opened (which may be never).
TEST(SelectChannel, AnEndedChannelGivesItsMemoryBackAtOnce) {
  Record record;
  ChannelHub hub("kvtier-test-gone", EchoHooks(&record), false);
  auto o = hub.Open("t", 0, 64 << 20);
  ASSERT_TRUE(o.ok());
  EXPECT_GT(ReferencesTo("kvtier-test-gone-channel-"), 0);
  Worker w;
  ASSERT_TRUE(w.Open(hub, o->id, "t"));
  EXPECT_EQ(w.Call(channel::kSelect, "q").first, 0);
  w.Close();  // the worker goes: its channel ends
  for (int i = 0; i < 200 && hub.open_channels() > 0; ++i) absl::SleepFor(absl::Milliseconds(10));
  ASSERT_EQ(hub.open_channels(), 0);
  EXPECT_EQ(ReferencesTo("kvtier-test-gone-channel-"), 0)
      << "the ended channel still holds its memory or a descriptor";
  std::lock_guard lock(record.mu);
  EXPECT_EQ(record.detached, record.attached);
}

// A worker that keeps its channel's memory descriptor after the channel ended (a leak, or a
// worker opening channel after channel) keeps the object, not its pages: those the daemon
// wrote (the header, the answers) are freed as the channel ends.
TEST(SelectChannel, AnEndedChannelsPagesGoThoughTheWorkerKeepsItsDescriptor) {
  Record record;
  ChannelHub hub("kvtier-test-kept", EchoHooks(&record), false);
  auto o = hub.Open("t", 1 << 20, 64 << 20);
  ASSERT_TRUE(o.ok());
  Worker w;
  ASSERT_TRUE(w.Open(hub, o->id, "t"));
  EXPECT_EQ(w.Call(channel::kSelect, std::string(200000, 'q')).first, 0);
  const int kept = dup(w.fds[0]);
  ASSERT_GE(kept, 0);
  struct stat st {};
  ASSERT_EQ(fstat(kept, &st), 0);
  EXPECT_GT(st.st_blocks, 0);
  w.Close();
  for (int i = 0; i < 200 && hub.open_channels() > 0; ++i) absl::SleepFor(absl::Milliseconds(10));
  ASSERT_EQ(hub.open_channels(), 0);
  ASSERT_EQ(fstat(kept, &st), 0);
  EXPECT_EQ(st.st_blocks, 0) << "the worker's descriptor keeps the ended channel's pages";
  close(kept);
}

TEST(SelectChannel, StopHangsUpCallsInFlightAndRefusesNewChannels) {
  Record record;
  auto hub = std::make_unique<ChannelHub>("kvtier-test", EchoHooks(&record), false);
  auto o = hub->Open("t", 128 << 10, 64 << 20);
  ASSERT_TRUE(o.ok());
  EXPECT_EQ(hub->Open("t", 1024, 64 << 20).status().code(), absl::StatusCode::kInvalidArgument);
  Worker w;
  ASSERT_TRUE(w.Open(*hub, o->id, "t"));
  std::atomic<bool> go{true};
  std::atomic<int> answered{0}, hung_up{0};
  std::thread caller([&] {
    while (go.load()) {
      const auto [code, got] = w.Call(channel::kSelect, "q");
      if (code == -1) {
        hung_up.fetch_add(1);
        return;
      }
      answered.fetch_add(1);
    }
  });
  while (answered.load() < 50) absl::SleepFor(absl::Milliseconds(1));
  hub->Stop();
  EXPECT_EQ(hub->Open("t", 0, 64 << 20).status().code(), absl::StatusCode::kUnavailable);
  caller.join();
  EXPECT_EQ(hung_up.load(), 1) << "the caller never saw the hang-up";
  hub.reset();
  w.Close();
  std::lock_guard lock(record.mu);
  EXPECT_EQ(record.detached, record.attached);
}

// A worker whose next call is always there when an answer goes leaves its channel's thread no
// pause in which to sleep on the doorbells (and see the stop there): Stop ends the channel all
// the same, and returns. Here the serve hook itself makes the next call (it moves the
// header's seq on) while `feed` holds, so that the calls never pause, whatever the machine.
TEST(SelectChannel, StopEndsAChannelWhoseCallsNeverPause) {
  Record record;
  std::atomic<channel::Header*> header{nullptr};
  std::atomic<bool> feed{true};
  ChannelHub::Hooks hooks = EchoHooks(&record);
  hooks.serve = [&record, &header, &feed](const ChannelHub::Call&, std::string* out) {
    record.calls.fetch_add(1);
    channel::Header* h = header.load();
    if (h != nullptr && feed.load()) __atomic_fetch_add(&h->seq, 1, __ATOMIC_RELEASE);
    *out = "a";
    return absl::OkStatus();
  };
  auto hub = std::make_unique<ChannelHub>("kvtier-test", hooks, false);
  auto o = hub->Open("t", 128 << 10, 64 << 20);
  ASSERT_TRUE(o.ok());
  Worker w;
  ASSERT_TRUE(w.Open(*hub, o->id, "t"));
  header.store(w.header());
  std::thread first([&] { (void)w.Call(channel::kSelect, "q"); });  // then the hook calls on
  while (record.calls.load() < 1000) absl::SleepFor(absl::Milliseconds(1));
  std::atomic<bool> stopped{false};
  std::thread stopper([&] {
    hub->Stop();
    stopped.store(true);
  });
  for (int i = 0; i < 1000 && !stopped.load(); ++i) absl::SleepFor(absl::Milliseconds(10));
  EXPECT_TRUE(stopped.load()) << "Stop still waits for a channel whose calls never pause";
  feed.store(false);  // (a channel that missed the stop sleeps now, and sees it)
  stopper.join();
  first.join();
  hub.reset();
  w.Close();
  std::lock_guard lock(record.mu);
  EXPECT_EQ(record.detached, record.attached);
}

// The CPUs of this process's threads that are held on exactly one CPU (their
// Cpus_allowed_list in /proc is a single number).
std::vector<int> ThreadsHeldOnOneCpu() {
  std::vector<int> held;
  for (const auto& task : std::filesystem::directory_iterator("/proc/self/task")) {
    std::ifstream status(task.path() / "status");
    for (std::string line; std::getline(status, line);) {
      const std::string key = "Cpus_allowed_list:";
      if (line.rfind(key, 0) != 0) continue;
      const std::string list(absl::StripAsciiWhitespace(line.substr(key.size())));
      int cpu = -1;
      if (absl::SimpleAtoi(list, &cpu)) held.push_back(cpu);
    }
  }
  return held;
}

// Waits (up to 10 s) until the header's serving_cpu is `want`.
bool ServingCpuBecomes(Worker& w, uint32_t want) {
  for (int i = 0; i < 10000; ++i) {
    if (__atomic_load_n(&w.header()->serving_cpu, __ATOMIC_ACQUIRE) == want) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return false;
}

TEST(SelectChannel, ItsThreadWaitsOnTheCpuItsWorkerCallsFromWhenItCoLocates) {
  cpu_set_t mine;
  ASSERT_EQ(sched_getaffinity(0, sizeof mine, &mine), 0);
  std::vector<int> cpus;
  for (int c = 0; c < CPU_SETSIZE; ++c) {
    if (CPU_ISSET(c, &mine)) cpus.push_back(c);
  }
  ASSERT_FALSE(cpus.empty());
  if (cpus.size() == 1) GTEST_SKIP() << "one CPU: every thread is held on it already";
  Record record;
  ChannelHub hub("kvtier-test", EchoHooks(&record), /*colocate=*/true);
  auto o = hub.Open("t", 64 << 10, 64 << 20);
  ASSERT_TRUE(o.ok()) << o.status();
  Worker w;
  ASSERT_TRUE(w.Open(hub, o->id, "t"));
  // Not said: served as before, from any CPU.
  EXPECT_EQ(w.Call(channel::kSelect, "a").second, absl::StrCat("t/", o->worker_id, "/1:a"));
  EXPECT_TRUE(ServingCpuBecomes(w, 0));
  EXPECT_TRUE(ThreadsHeldOnOneCpu().empty());
  // Said: the thread is held on that CPU, and says so; it follows the worker to another. A
  // second call from the same CPU finds it there (the first, held elsewhere, does not).
  for (int cpu : {cpus[0], cpus[1], cpus[0]}) {
    const uint32_t said = static_cast<uint32_t>(cpu) + 1;
    for (int again = 0; again < 2; ++again) {
      EXPECT_EQ(w.Call(channel::kSelect, "b", said).second,
                absl::StrCat("t/", o->worker_id, "/1:b"));
      EXPECT_TRUE(ServingCpuBecomes(w, said)) << cpu;
      EXPECT_EQ(ThreadsHeldOnOneCpu(), std::vector<int>{cpu});
    }
  }
  // Every call counts once. Each second call from a CPU finds the thread there; the call
  // naming none does not; a move's first call may (the thread can read the new CPU before the
  // call's seq, and move first).
  const ChannelHub::Counters n = hub.counters();
  EXPECT_EQ(n.beside_worker + n.elsewhere, 7u);
  EXPECT_GE(n.beside_worker, 3u);
  EXPECT_GE(n.elsewhere, 1u);
  // A CPU the process may not use, and one past any CPU set: refused, and the thread runs
  // anywhere again; the answers are the same.
  int outside = -1;
  for (int c = 0; c < CPU_SETSIZE && outside < 0; ++c) {
    if (!CPU_ISSET(c, &mine)) outside = c;
  }
  for (uint32_t said : {static_cast<uint32_t>(outside) + 1, uint32_t{CPU_SETSIZE} + 7}) {
    EXPECT_EQ(w.Call(channel::kSelect, "c", said).second, absl::StrCat("t/", o->worker_id, "/1:c"));
    EXPECT_TRUE(ServingCpuBecomes(w, 0)) << said;
    EXPECT_TRUE(ThreadsHeldOnOneCpu().empty()) << said;
  }
  w.Close();
  hub.Stop();
}

TEST(SelectChannel, ItsThreadRunsAnywhereWhenItDoesNotCoLocate) {
  Record record;
  ChannelHub hub("kvtier-test", EchoHooks(&record), /*colocate=*/false);
  auto o = hub.Open("t", 64 << 10, 64 << 20);
  ASSERT_TRUE(o.ok()) << o.status();
  Worker w;
  ASSERT_TRUE(w.Open(hub, o->id, "t"));
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(w.Call(channel::kSelect, "a", /*worker_cpu=*/1).first, 0);
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
    EXPECT_EQ(__atomic_load_n(&w.header()->serving_cpu, __ATOMIC_ACQUIRE), 0u);
  }
  EXPECT_TRUE(ThreadsHeldOnOneCpu().empty());
  EXPECT_EQ(hub.counters().beside_worker, 0u);
  EXPECT_EQ(hub.counters().elsewhere, 3u);
  w.Close();
  hub.Stop();
}

TEST(SelectChannel, ChannelsAreBoundedPerTenant) {
  Record record;
  ChannelHub hub("kvtier-test", EchoHooks(&record), false);
  for (int i = 0; i < ChannelHub::kMaxPerTenant; ++i) {
    auto o = hub.Open("t", 64 << 10, 64 << 20);
    ASSERT_TRUE(o.ok()) << i << ": " << o.status();
  }
  const auto over = hub.Open("t", 64 << 10, 64 << 20);
  EXPECT_EQ(over.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(hub.Open("u", 64 << 10, 64 << 20).ok());  // another tenant still may
}

}  // namespace
}  // namespace kvtier
