#include "server/rpc/select_channel.h"

#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <optional>
#include <utility>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "kvtier/channel_layout.h"
#include "server/common/log.h"
#include "server/common/mutex.h"

namespace kvtier {
namespace {

absl::Status Errno(absl::string_view what) {
  return absl::InternalError(absl::StrCat("OpenChannel: ", what, ": ", std::strerror(errno)));
}

void CloseFd(int fd) {
  if (fd >= 0) close(fd);
}

// Spins up to kSpin until `ready()`; true when it became so. With `yield`, gives the CPU up
// between looks (sched_yield), so that a thread beside it on the CPU runs meanwhile.
template <typename Ready>
bool SpinFor(bool yield, Ready&& ready) {
  constexpr absl::Duration kSpin = absl::Microseconds(ChannelHub::kSpinUs);
  const absl::Time until = absl::Now() + kSpin;
  for (int i = 0;; ++i) {
    if (ready()) return true;
    if ((yield || (i & 63) == 63) && absl::Now() > until) return false;
    if (yield) {
      sched_yield();
    } else {
#if defined(__x86_64__)
      __builtin_ia32_pause();
#endif
    }
  }
}

// Holds the calling thread on `cpu` alone (-1: on `all`, the set it started with); false when
// the kernel refuses (a CPU outside this process's set).
bool HoldOn(int cpu, const cpu_set_t& all) {
  if (cpu < 0) return sched_setaffinity(0, sizeof all, &all) == 0;
  if (cpu >= CPU_SETSIZE || !CPU_ISSET(cpu, &all)) return false;
  cpu_set_t one;
  CPU_ZERO(&one);
  CPU_SET(cpu, &one);
  return sched_setaffinity(0, sizeof one, &one) == 0;
}

}  // namespace

struct ChannelHub::Channel {
  Channel(uint64_t id, std::string tenant, ShmSegment shm)
      : id(id), tenant(std::move(tenant)), shm(std::move(shm)) {}
  ~Channel() {
    for (int fd : {request_fd, response_fd, sock, worker_sock.load()}) CloseFd(fd);
  }
  const uint64_t id;
  const std::string tenant;
  std::string worker;  // set before the thread starts
  // The memory, until the channel ends (its thread lets it go then, under the hub's lock).
  std::optional<ShmSegment> shm;
  uint64_t request_capacity = 0, response_capacity = 0;
  int request_fd = -1, response_fd = -1;  // eventfds
  int sock = -1;                          // the daemon's end
  std::atomic<int> worker_sock{-1};       // the worker's end, until collected
  absl::Time collect_by;
  std::thread thread;
  std::atomic<bool> ended{false};
  bool abandoned = false;  // Abandon: ending, its descriptors never to be handed
};

ChannelHub::ChannelHub(std::string label, Hooks hooks, bool colocate)
    : label_(std::move(label)),
      hooks_(std::move(hooks)),
      colocate_(colocate),
      stop_fd_(eventfd(0, EFD_CLOEXEC)) {}

ChannelHub::~ChannelHub() {
  Stop();
  CloseFd(stop_fd_);
}

absl::StatusOr<ChannelHub::Opened> ChannelHub::Open(const std::string& tenant, uint64_t size_bytes,
                                                    uint64_t max_bytes) {
  const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  const uint64_t want = size_bytes == 0 ? kDefaultBytes : size_bytes;
  if (want < kMinBytes || want > max_bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("size_bytes: ", size_bytes, "; a channel holds ", kMinBytes, " to ", max_bytes,
                     " bytes (max_message_size), 0: ", kDefaultBytes));
  }
  const uint64_t size = (want + page - 1) / page * page;
  uint64_t id;
  {
    MutexLock lock(&mu_);
    if (stopping_ || stop_fd_ < 0) return absl::UnavailableError("kvtierd is draining");
    ReapLocked();
    // Channels being made count too, so that calls at once cannot pass the bounds together,
    // and abandoned ones until their threads end (at once: the reap above lets them go), so
    // that a burst of refused tickets never holds more threads than the bounds.
    int mine = reserved_[tenant];
    for (const auto& [other, c] : channels_) mine += c->tenant == tenant;
    const size_t all = channels_.size() + reserved_total_;
    if (all >= kMaxChannels || mine >= kMaxPerTenant) {
      return absl::ResourceExhaustedError(
          absl::StrCat("OpenChannel: tenant \"", tenant, "\" has ", mine,
                       " channels open (at most ", kMaxPerTenant, "; ", all, " of ", kMaxChannels,
                       " in all); close one (its worker's descriptors) first"));
    }
    ++reserved_[tenant];
    ++reserved_total_;
    id = next_id_++;
  }
  absl::Cleanup unreserve = [this, &tenant] {
    MutexLock lock(&mu_);
    if (--reserved_[tenant] == 0) reserved_.erase(tenant);
    --reserved_total_;
  };
  absl::StatusOr<ShmSegment> shm = ShmSegment::Create(absl::StrCat(label_, "-channel-", id), size,
                                                      ShmSegment::Naming::kMemfdShared);
  if (!shm.ok()) return shm.status();
  auto c = std::make_unique<Channel>(id, tenant, *std::move(shm));
  c->request_capacity = (size - channel::kHeaderBytes) / 4 / page * page;
  c->response_capacity = size - channel::kHeaderBytes - c->request_capacity;
  c->request_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  c->response_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (c->request_fd < 0 || c->response_fd < 0) return Errno("eventfd");
  int pair[2];
  if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, pair) != 0) return Errno("socketpair");
  c->sock = pair[0];
  c->worker_sock.store(pair[1]);
  channel::Header h{};
  h.magic = channel::kMagic;
  h.version = channel::kVersion;
  h.request_offset = channel::kHeaderBytes;
  h.request_capacity = c->request_capacity;
  h.response_offset = channel::kHeaderBytes + c->request_capacity;
  h.response_capacity = c->response_capacity;
  std::memcpy(c->shm->data(), &h, sizeof h);
  c->collect_by = absl::Now() + kCollectWithin;
  c->worker = hooks_.attach(tenant);  // before mu_: the lease table's lock comes first
  const Opened opened{id, size, c->worker};
  {
    MutexLock lock(&mu_);
    if (!stopping_) {
      Channel* raw = c.get();
      raw->thread = std::thread([this, raw] { Serve(raw); });
      channels_.emplace(id, std::move(c));
      return opened;  // (`unreserve` runs after the lock: the channel counts in channels_)
    }
  }
  hooks_.detach(opened.worker_id);  // after mu_, as every detach
  return absl::UnavailableError("kvtierd is draining");
}

absl::StatusOr<int> ChannelHub::OpenFd(uint64_t id, const std::string& tenant, size_t index) {
  MutexLock lock(&mu_);
  auto it = channels_.find(id);
  if (it == channels_.end() || it->second->tenant != tenant || it->second->ended.load() ||
      it->second->abandoned) {
    return absl::NotFoundError(absl::StrCat("channel ", id, " is not this tenant's"));
  }
  Channel& c = *it->second;
  switch (index) {
    case 0:
      return c.shm->OpenWritableFd();
    case 1:
    case 2: {
      const int fd = fcntl(index == 1 ? c.request_fd : c.response_fd, F_DUPFD_CLOEXEC, 0);
      if (fd < 0) return Errno("dup");
      return fd;
    }
    case 3: {
      const int fd = c.worker_sock.exchange(-1);  // the channel lets go: it hangs up with it
      if (fd < 0) return absl::NotFoundError(absl::StrCat("channel ", id, " was collected"));
      return fd;
    }
    default:
      return absl::NotFoundError(absl::StrCat("channel ", id, " has no descriptor ", index));
  }
}

void ChannelHub::Stop() {
  std::map<uint64_t, std::unique_ptr<Channel>> all;
  {
    MutexLock lock(&mu_);
    stop_requested_.store(true, std::memory_order_release);
    if (!stopping_ && stop_fd_ >= 0) eventfd_write(stop_fd_, 1);
    stopping_ = true;
    all.swap(channels_);
  }
  for (auto& [id, c] : all) {
    if (c->thread.joinable()) c->thread.join();
  }
}

int ChannelHub::open_channels() const {
  MutexLock lock(&mu_);
  int n = 0;
  for (const auto& [id, c] : channels_) n += !c->ended.load() && !c->abandoned;
  return n;
}

void ChannelHub::Abandon(uint64_t id) {
  MutexLock lock(&mu_);
  auto it = channels_.find(id);
  if (it == channels_.end()) return;
  it->second->abandoned = true;
  // Its thread sees the hang-up at once and ends the channel (OpenFd refuses it meanwhile).
  CloseFd(it->second->worker_sock.exchange(-1));
}

void ChannelHub::ReapLocked() {
  for (auto it = channels_.begin(); it != channels_.end();) {
    if (!it->second->ended.load()) {
      ++it;
      continue;
    }
    it->second->thread.join();  // it has ended: this returns at once
    it = channels_.erase(it);
  }
}

void ChannelHub::Serve(Channel* c) {
  pthread_setname_np(pthread_self(), "kvtier-channel");  // else the opening gRPC thread's name
  auto* shared = reinterpret_cast<channel::Header*>(c->shm->data());
  uint64_t answered = 0;  // the last seq answered
  cpu_set_t all;          // the CPUs this thread may run on when not held on its worker's
  const bool colocate = colocate_ && sched_getaffinity(0, sizeof all, &all) == 0;
  int held = -1;     // the CPU this thread is held on, -1: none
  int refused = -1;  // the last CPU the kernel refused, not asked for again
  for (;;) {
    // A worker whose next call is always there would keep this thread off the poll below,
    // where the stop rings.
    if (stop_requested_.load(std::memory_order_acquire)) break;
    // Where the worker last called from (a hint, checked like every field it writes).
    const uint32_t said = __atomic_load_n(&shared->worker_cpu, __ATOMIC_ACQUIRE);
    const int want = colocate && said > 0 && said <= CPU_SETSIZE ? static_cast<int>(said) - 1 : -1;
    if (colocate && want != held && !(want >= 0 && want == refused)) {
      if (HoldOn(want, all)) {
        held = want;
      } else {
        refused = want;
        if (held >= 0 && HoldOn(-1, all)) held = -1;
      }
    }
    const bool beside = held >= 0 && held == want;
    __atomic_store_n(&shared->serving_cpu, beside ? static_cast<uint32_t>(held) + 1 : 0u,
                     __ATOMIC_RELEASE);
    // A decode loop's next call often comes at once: a short spin on the worker's seq saves
    // the doorbell's wake-up (the doorbell is drained when the thread next polls). Beside its
    // worker the thread yields between looks instead (a spin would hold the worker off its
    // own CPU).
    // A call answered, counted by where the thread was when it came: held on the CPU that
    // call names, or elsewhere.
    auto answer = [&] {
      const uint32_t from = __atomic_load_n(&shared->worker_cpu, __ATOMIC_ACQUIRE);
      (held >= 0 && from == static_cast<uint32_t>(held) + 1 ? beside_worker_ : elsewhere_)
          .fetch_add(1, std::memory_order_relaxed);
      answered = Answer(c);
    };
    auto called = [&] { return __atomic_load_n(&shared->seq, __ATOMIC_ACQUIRE) != answered; };
    __atomic_store_n(&shared->daemon_watching, 1u, __ATOMIC_RELAXED);  // no need to ring
    if (SpinFor(beside, called)) {
      answer();
      continue;
    }
    // About to sleep on the doorbell: say so, then look once more (a call whose worker read
    // the flag before this store is seen here; one after it rings).
    __atomic_store_n(&shared->daemon_watching, 0u, __ATOMIC_RELAXED);
    std::atomic_thread_fence(std::memory_order_seq_cst);
    if (called()) {
      answer();
      continue;
    }
    const bool uncollected = c->worker_sock.load() >= 0;
    if (uncollected && absl::Now() > c->collect_by) break;  // nobody came for it
    pollfd p[3] = {{c->request_fd, POLLIN, 0}, {c->sock, POLLIN, 0}, {stop_fd_, POLLIN, 0}};
    if (poll(p, 3, uncollected ? 1000 : -1) < 0) {
      if (errno == EINTR) continue;
      KVLOG(error, "channel.poll", "channel={} error={}", c->id, LogValue(std::strerror(errno)));
      break;
    }
    if (p[2].revents != 0) break;  // the daemon stops
    // The worker's end closed (or it wrote to a socket that carries nothing): the channel ends.
    if (p[1].revents != 0) break;
    eventfd_t rung = 0;
    if ((p[0].revents & POLLIN) && eventfd_read(c->request_fd, &rung) == 0 && called()) {
      answer();
    }
  }
  hooks_.detach(c->worker);      // its Selects' leases end now
  shutdown(c->sock, SHUT_RDWR);  // the worker sees the hang-up
  {
    // The memory and the descriptors go now, not when the next Open reaps the channel (which
    // may be long after): OpenFd looks at `ended` under the same lock before it uses them.
    MutexLock lock(&mu_);
    c->ended.store(true);
    // Its pages too: a worker that keeps the memory's descriptor keeps the object, not them.
    if (absl::Status s = c->shm->Release(0, c->shm->size()); !s.ok()) {
      KVLOG(warn, "channel.release_failed", "channel={} error={}", c->id, LogValue(s.message()));
    }
    c->shm.reset();
    for (int* fd : {&c->request_fd, &c->response_fd, &c->sock}) CloseFd(std::exchange(*fd, -1));
    CloseFd(c->worker_sock.exchange(-1));
  }
  KVLOG(debug, "channel.end", "channel={} tenant={}", c->id, LogValue(c->tenant));
}

uint64_t ChannelHub::Answer(Channel* c) {
  uint8_t* base = c->shm->data();
  channel::Header h;
  std::memcpy(&h, base, sizeof h);  // a snapshot: the worker may write meanwhile
  absl::Status s;
  std::string out;
  if (h.request_bytes > c->request_capacity) {
    s = absl::InvalidArgumentError(absl::StrCat("request_bytes: ", h.request_bytes,
                                                " past the request area's ", c->request_capacity));
  } else {
    const std::string request(reinterpret_cast<const char*>(base + channel::kHeaderBytes),
                              h.request_bytes);
    s = hooks_.serve(Call{c->tenant, c->worker, h.op, request, c->response_capacity}, &out);
    if (s.ok() && out.size() > c->response_capacity) {  // the bound is checked first: a bug
      s = absl::InternalError("the reply outgrew the channel's response area");
    }
  }
  if (!s.ok()) out = std::string(s.message().substr(0, c->response_capacity));
  std::memcpy(base + channel::kHeaderBytes + c->request_capacity, out.data(), out.size());
  // The answer's fields, then its seq, then the doorbell.
  auto* shared = reinterpret_cast<channel::Header*>(base);
  shared->code = static_cast<int32_t>(s.code());
  shared->response_bytes = static_cast<uint32_t>(out.size());
  std::atomic_thread_fence(std::memory_order_release);
  __atomic_store_n(&shared->answered_seq, h.seq, __ATOMIC_RELEASE);
  // The doorbell only for a worker that may sleep on it (see channel_layout.h).
  std::atomic_thread_fence(std::memory_order_seq_cst);
  if (__atomic_load_n(&shared->worker_watching, __ATOMIC_RELAXED) != 1u) {
    eventfd_write(c->response_fd, 1);
  }
  return h.seq;
}

}  // namespace kvtier
