// The worker's side of a shared-memory Select channel (kvtier/channel_layout.h).
#include <poll.h>
#include <sched.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <climits>
#include <cstring>
#include <tuple>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "kvtier/channel_layout.h"
#include "kvtier/client.h"

namespace kvtier {
namespace {
constexpr int kSpinUs = 100;  // how long a call watches for its answer before it sleeps
// How long a call whose answer is served on its own CPU gives that CPU up (sched_yield) before
// it sleeps: a dense layer's Select at long contexts takes milliseconds.
constexpr int kHandOverUs = 50'000;
}  // namespace

absl::StatusOr<std::unique_ptr<SelectChannel>> Client::OpenChannel(uint64_t size_bytes) {
  if (!absl::StartsWith(address_, "unix:")) {
    return absl::FailedPreconditionError(
        "OpenChannel: channels are handed over the Unix socket only");
  }
  v1::OpenChannelRequest req;
  req.set_size_bytes(size_bytes);
  v1::OpenChannelResponse resp;
  grpc::ClientContext ctx;
  Prepare(&ctx);
  if (grpc::Status s = stub_->OpenChannel(&ctx, req, &resp); !s.ok()) return FromGrpcStatus(s);
  absl::StatusOr<std::vector<int>> fds = CollectFds(resp.ticket(), channel::kDescriptors);
  if (!fds.ok()) return fds.status();
  auto c = std::unique_ptr<SelectChannel>(new SelectChannel());
  for (size_t i = 0; i < channel::kDescriptors; ++i) c->fds_[i] = (*fds)[i];
  c->id_ = resp.channel_id();
  c->worker_ = resp.worker_id();
  c->timeout_ = options_.timeout;
  // The memory's real size bounds everything; the header's areas must lie inside it.
  struct stat st {};
  if (fstat(c->fds_[0], &st) != 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("OpenChannel: the channel's memory: fstat: ", std::strerror(errno)));
  }
  if (st.st_size < static_cast<off_t>(channel::kHeaderBytes)) {
    return absl::FailedPreconditionError(absl::StrCat("OpenChannel: the channel's memory is ",
                                                      st.st_size, " bytes, below its header's ",
                                                      channel::kHeaderBytes));
  }
  c->size_ = static_cast<uint64_t>(st.st_size);
  void* p = mmap(nullptr, c->size_, PROT_READ | PROT_WRITE, MAP_SHARED, c->fds_[0], 0);
  if (p == MAP_FAILED) {
    return absl::FailedPreconditionError(
        absl::StrCat("OpenChannel: the channel's memory cannot be mapped: ", std::strerror(errno)));
  }
  c->data_ = static_cast<uint8_t*>(p);
  channel::Header h;
  std::memcpy(&h, c->data_, sizeof h);
  auto inside = [&](uint64_t offset, uint64_t length) {
    return offset >= channel::kHeaderBytes && offset <= c->size_ && length <= c->size_ - offset;
  };
  if (h.magic != channel::kMagic || h.version != channel::kVersion) {
    return absl::FailedPreconditionError(absl::StrCat(
        "OpenChannel: the channel's header (magic 0x", absl::Hex(h.magic), ", version ", h.version,
        ") is not a version-", channel::kVersion, " kvtier channel's"));
  }
  // Areas an int counts (the parse takes an int size), within the memory.
  for (const auto& [what, offset, capacity] :
       {std::tuple{"request", uint64_t{h.request_offset}, uint64_t{h.request_capacity}},
        {"response", uint64_t{h.response_offset}, uint64_t{h.response_capacity}}}) {
    if (!inside(offset, capacity) || capacity > INT_MAX) {
      return absl::FailedPreconditionError(
          absl::StrCat("OpenChannel: the channel's ", what, " area (", capacity, " bytes at ",
                       offset, ") lies outside its ", c->size_, " bytes of memory"));
    }
  }
  c->request_offset_ = h.request_offset;
  c->request_capacity_ = h.request_capacity;
  c->response_offset_ = h.response_offset;
  c->response_capacity_ = h.response_capacity;
  return c;
}

SelectChannel::~SelectChannel() {
  if (data_ != nullptr) munmap(data_, size_);
  for (int fd : fds_) {
    if (fd >= 0) close(fd);
  }
}

absl::StatusOr<v1::SelectResponse> SelectChannel::Select(const v1::SelectRequest& req) {
  v1::SelectResponse resp;
  if (absl::Status s = Call(channel::kSelect, req, &resp); !s.ok()) return s;
  return resp;
}

absl::Status SelectChannel::Select(const v1::SelectRequest& req, v1::SelectResponse* out) {
  out->Clear();
  return Call(channel::kSelect, req, out);
}

absl::StatusOr<v1::BatchSelectResponse> SelectChannel::BatchSelect(
    const v1::BatchSelectRequest& req) {
  v1::BatchSelectResponse resp;
  if (absl::Status s = Call(channel::kBatchSelect, req, &resp); !s.ok()) return s;
  return resp;
}

absl::Status SelectChannel::Release(const std::string& lease_id) {
  v1::ReleaseRequest req;
  req.set_lease_id(lease_id);
  v1::ReleaseResponse resp;
  return Call(channel::kRelease, req, &resp);
}

absl::StatusOr<uint64_t> SelectChannel::AppendKV(const v1::AppendKVRequest& req) {
  v1::AppendKVResponse resp;
  if (absl::Status s = Call(channel::kAppendKV, req, &resp); !s.ok()) return s;
  return resp.num_tokens();
}

absl::Status SelectChannel::Call(uint32_t op, const google::protobuf::Message& req,
                                 google::protobuf::Message* resp) {
  std::lock_guard lock(mu_);
  if (broken_) {
    return absl::FailedPreconditionError(
        absl::StrCat("channel ", id_, " is closed (a call timed out or the daemon hung up)"));
  }
  const size_t bytes = req.ByteSizeLong();
  if (bytes > request_capacity_) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "request: ", bytes, " bytes past channel ", id_, "'s request area of ", request_capacity_));
  }
  req.SerializeWithCachedSizesToArray(data_ + request_offset_);
  auto* h = reinterpret_cast<channel::Header*>(data_);
  h->op = op;
  h->request_bytes = static_cast<uint32_t>(bytes);
  // Where this call comes from, so that a daemon that co-locates serves it here; not said by a
  // thread of a real-time policy, which a yield would not take off its CPU.
  const int policy = sched_getscheduler(0);
  const int cpu =
      policy == SCHED_OTHER || policy == SCHED_BATCH || policy == SCHED_IDLE ? sched_getcpu() : -1;
  const uint32_t here = cpu >= 0 ? static_cast<uint32_t>(cpu) + 1 : 0;
  __atomic_store_n(&h->worker_cpu, here, __ATOMIC_RELAXED);
  __atomic_store_n(&h->worker_watching, 1u, __ATOMIC_RELAXED);  // the answer needs no doorbell
  __atomic_store_n(&h->seq, ++seq_, __ATOMIC_RELEASE);  // last: the daemon may be watching it
  // The doorbell only when the daemon's thread may be asleep (channel_layout.h).
  std::atomic_thread_fence(std::memory_order_seq_cst);
  if (__atomic_load_n(&h->daemon_watching, __ATOMIC_RELAXED) != 1u &&
      eventfd_write(fds_[1], 1) != 0) {
    broken_ = true;
    return absl::UnavailableError(absl::StrCat("channel ", id_, ": ", std::strerror(errno)));
  }
  const absl::Time deadline = absl::Now() + timeout_;
  auto answered = [&] { return __atomic_load_n(&h->answered_seq, __ATOMIC_ACQUIRE) == seq_; };
  if (here != 0 && __atomic_load_n(&h->serving_cpu, __ATOMIC_ACQUIRE) == here) {
    // The daemon's thread waits on this CPU: the doorbell woke it here, and it serves the call
    // once this thread gives the CPU up (a spin would only hold it off).
    const absl::Time until = std::min(deadline, absl::Now() + absl::Microseconds(kHandOverUs));
    for (int i = 0; !answered(); ++i) {
      if ((i & 15) == 15 && absl::Now() > until) break;
      sched_yield();
    }
  } else {
    // The answer often comes within microseconds: watch for it a while before sleeping on the
    // doorbell (whose count the next poll drains).
    const absl::Time spin_until = absl::Now() + absl::Microseconds(kSpinUs);
    for (int i = 0; !answered(); ++i) {
      if ((i & 63) == 63 && absl::Now() > spin_until) break;
#if defined(__x86_64__)
      __builtin_ia32_pause();
#endif
    }
  }
  // About to sleep on the doorbell: say so, then look once more before each sleep (an answer
  // stored before the daemon read the flag is seen here; one after it rings). An answer
  // already here leaves the flag as it is: nothing rings until the next call.
  if (!answered()) {
    __atomic_store_n(&h->worker_watching, 0u, __ATOMIC_RELAXED);
    std::atomic_thread_fence(std::memory_order_seq_cst);
  }
  while (!answered()) {
    pollfd p[2] = {{fds_[2], POLLIN, 0}, {fds_[3], POLLIN, 0}};
    // In whole milliseconds rounded up, and at most what poll takes (a longer timeout, up to
    // an infinite one, is slept in parts, never cut short).
    const int64_t left_us = absl::ToInt64Microseconds(deadline - absl::Now());
    const int64_t left_ms = left_us <= 0 ? 0 : left_us / 1000 + (left_us % 1000 != 0);
    const int n = poll(p, 2, static_cast<int>(std::min<int64_t>(left_ms, INT_MAX)));
    if (n < 0 && errno == EINTR) continue;
    if (n == 0 && absl::Now() < deadline) continue;
    if (n < 0) {
      broken_ = true;  // the answer may still come: the memory is no longer this call's
      return absl::UnavailableError(
          absl::StrCat("channel ", id_, ": waiting for the answer: ", std::strerror(errno)));
    }
    if (n == 0) {
      broken_ = true;
      return absl::DeadlineExceededError(
          absl::StrCat("channel ", id_, ": no answer within ", absl::FormatDuration(timeout_)));
    }
    eventfd_t rung = 0;
    if (p[0].revents & POLLIN) eventfd_read(fds_[2], &rung);  // nonblocking: a lost race is fine
    if (answered()) break;
    if (p[1].revents != 0) {  // the daemon hung up (drained, exited) before answering
      broken_ = true;
      return absl::UnavailableError(absl::StrCat("channel ", id_, ": the daemon closed it"));
    }
  }
  const int32_t code = h->code;
  const uint32_t got = h->response_bytes;
  if (got > response_capacity_) {
    broken_ = true;
    return absl::FailedPreconditionError(absl::StrCat("channel ", id_, ": an answer of ", got,
                                                      " bytes past its response area's ",
                                                      response_capacity_));
  }
  const uint8_t* out = data_ + response_offset_;
  if (code != 0) {
    const std::string message(reinterpret_cast<const char*>(out), got);
    if (code >= 1 && code <= 16) return absl::Status(static_cast<absl::StatusCode>(code), message);
    return absl::UnknownError(absl::StrCat("channel ", id_, ": status code ", code, ": ", message));
  }
  if (!resp->ParseFromArray(out, static_cast<int>(got))) {
    resp->Clear();  // cleared whatever the outcome, as the header says
    return absl::DataLossError(
        absl::StrCat("channel ", id_, ": an answer of ", got, " bytes that does not parse"));
  }
  return absl::OkStatus();
}

}  // namespace kvtier
