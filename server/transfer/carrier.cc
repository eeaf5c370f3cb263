// The socket carrier (the NCCL carrier's CPU twin) and the choice between the two.
#include "server/transfer/carrier.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <deque>
#include <thread>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "server/common/mutex.h"
#include "server/common/status_macros.h"
#include "server/common/unique_fd.h"

namespace kvtier {
namespace {

constexpr size_t kTokenBytes = 16;
constexpr char kAck = 'K';

// Both ends of a socket carrier: a non-blocking TCP socket, on 127.0.0.1, each part's bytes
// sent at once.
int TcpSocket() { return socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0); }
sockaddr_in Loopback(uint16_t port) {
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = htons(port);
  return addr;
}
void NoDelay(int fd) {
  const int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

absl::Status Errno(absl::string_view what) {
  return absl::UnavailableError(absl::StrCat("carrier: ", what, ": ", strerror(errno)));
}

// Flags that end a carrier's waits: its owner's going, its call's cancellation.
struct Stop {
  const std::atomic<bool>* a = nullptr;
  const std::atomic<bool>* b = nullptr;
  bool now() const {
    return (a != nullptr && a->load(std::memory_order_relaxed)) ||
           (b != nullptr && b->load(std::memory_order_relaxed));
  }
};

// Waits for `events` on `fd` until `deadline`, or until `stop` (looked at every 100 ms).
absl::Status PollUntil(int fd, short events, absl::Time deadline, absl::string_view what,
                       Stop stop) {
  for (;;) {
    const int64_t left = absl::ToInt64Milliseconds(deadline - absl::Now());
    if (left <= 0) {
      return absl::DeadlineExceededError(
          absl::StrCat("carrier: ", what, ": the peer did not answer in time"));
    }
    if (stop.now()) {
      return absl::CancelledError(absl::StrCat("carrier: ", what, ": the transfer ended"));
    }
    pollfd p{fd, events, 0};
    const int r = poll(&p, 1, static_cast<int>(std::min<int64_t>(left, 100)));
    if (r > 0) return absl::OkStatus();  // an error or hang-up shows in the read or write
    if (r < 0 && errno != EINTR) return Errno(what);
  }
}

absl::Status WriteAll(int fd, const char* p, size_t n, absl::Time deadline, absl::string_view what,
                      Stop stop) {
  while (n > 0) {
    const ssize_t w = send(fd, p, n, MSG_NOSIGNAL);
    if (w > 0) {
      p += w;
      n -= static_cast<size_t>(w);
    } else if (w < 0 && (errno == EAGAIN || errno == EINTR)) {
      if (errno == EAGAIN) RETURN_IF_ERROR(PollUntil(fd, POLLOUT, deadline, what, stop));
    } else {
      return Errno(what);
    }
  }
  return absl::OkStatus();
}

absl::Status ReadAll(int fd, char* p, size_t n, absl::Time deadline, absl::string_view what,
                     Stop stop) {
  while (n > 0) {
    const ssize_t r = recv(fd, p, n, 0);
    if (r > 0) {
      p += r;
      n -= static_cast<size_t>(r);
    } else if (r == 0) {
      return absl::UnavailableError(absl::StrCat("carrier: ", what, ": the peer closed"));
    } else if (errno == EAGAIN || errno == EINTR) {
      if (errno == EAGAIN) RETURN_IF_ERROR(PollUntil(fd, POLLIN, deadline, what, stop));
    } else {
      return Errno(what);
    }
  }
  return absl::OkStatus();
}

// The exporter's side: a thread accepts the one peer that shows the token, then writes the
// queued bytes in order.
class SocketExporter final : public ByteCarrier {
 public:
  SocketExporter(int listener, std::string token, const CarrierOptions& options)
      : listener_(listener),
        token_(std::move(token)),
        timeout_(options.timeout),
        stop_flags_{&stopping_, options.cancelled} {
    thread_ = std::thread([this] { Run(); });
  }
  ~SocketExporter() override {
    {
      MutexLock lock(&mu_);  // Run tests it under mu_: its wake-up is not lost
      stopping_.store(true, std::memory_order_relaxed);  // a wait on the socket ends in 100 ms
    }
    cv_.SignalAll();
    thread_.join();
  }

  absl::Status Send(std::string bytes) override {
    MutexLock lock(&mu_);
    const absl::Time deadline = absl::Now() + timeout_;
    while (error_.ok() && queue_.size() >= kCarrierDepth) {
      RETURN_IF_ERROR(WaitSlice(deadline));
    }
    RETURN_IF_ERROR(error_);
    queue_.push_back(std::move(bytes));
    cv_.SignalAll();
    return absl::OkStatus();
  }

  absl::StatusOr<std::string> Recv(uint64_t) override {
    return absl::InternalError("carrier: the exporting side receives nothing");
  }

  absl::Status Finish() override {
    int conn;
    {
      MutexLock lock(&mu_);
      const absl::Time deadline = absl::Now() + timeout_;
      while (error_.ok() && (!queue_.empty() || conn_.get() < 0)) {
        RETURN_IF_ERROR(WaitSlice(deadline));
      }
      RETURN_IF_ERROR(error_);
      conn = conn_.get();  // the thread is idle now and leaves it alone
    }
    char ack = 0;
    RETURN_IF_ERROR(
        ReadAll(conn, &ack, 1, absl::Now() + timeout_, "the acknowledgement", stop_flags_));
    if (ack != kAck) return absl::DataLossError("carrier: a wrong acknowledgement");
    return absl::OkStatus();
  }

 private:
  // Waits on cv_ for at most 100 ms: DEADLINE_EXCEEDED past `deadline`, CANCELLED once stopped.
  absl::Status WaitSlice(absl::Time deadline) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (stop_flags_.now()) return absl::CancelledError("carrier: the transfer ended");
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError(
          "carrier: the importing daemon took no bytes in time; the transfer is aborted");
    }
    WaitOnUntil(&cv_, &mu_, std::min(deadline, absl::Now() + absl::Milliseconds(100)));
    return absl::OkStatus();
  }

  void Run() {
    absl::Status s = Accept();
    for (;;) {
      std::string* next = nullptr;
      {
        MutexLock lock(&mu_);
        if (!s.ok() && error_.ok()) error_ = s;
        cv_.SignalAll();
        while (!stopping_ && error_.ok() && queue_.empty()) WaitOn(&cv_, &mu_);
        if (stopping_ || !error_.ok()) return;
        next = &queue_.front();  // only this thread pops; a deque keeps it in place
      }
      // conn_ is set (by this thread, in Accept) before any bytes go.
      s = WriteAll(conn_.get(), next->data(), next->size(), absl::Now() + timeout_, "sending bytes",
                   stop_flags_);
      MutexLock lock(&mu_);
      if (s.ok()) queue_.pop_front();
    }
  }

  absl::Status Accept() {
    const absl::Time deadline = absl::Now() + timeout_;
    RETURN_IF_ERROR(
        PollUntil(listener_.get(), POLLIN, deadline, "waiting for the peer", stop_flags_));
    UniqueFd conn(accept4(listener_.get(), nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC));
    if (conn.get() < 0) return Errno("accept");
    listener_.Reset();  // one peer only
    std::string token(kTokenBytes, '\0');
    RETURN_IF_ERROR(
        ReadAll(conn.get(), token.data(), token.size(), deadline, "the token", stop_flags_));
    unsigned char diff = 0;  // in constant time
    for (size_t i = 0; i < kTokenBytes; ++i) diff |= token[i] ^ token_[i];
    if (diff != 0) return absl::PermissionDeniedError("carrier: a peer with the wrong token");
    NoDelay(conn.get());
    MutexLock lock(&mu_);
    conn_.Reset(conn.Release());
    return absl::OkStatus();
  }

  UniqueFd listener_;  // until the peer is accepted
  const std::string token_;
  const absl::Duration timeout_;
  // The accepted connection, closed with the carrier: set under mu_ by the thread, which alone
  // reads it without mu_.
  UniqueFd conn_;
  absl::Mutex mu_;  // lock order 20 (server/common/lock_order.h)
  absl::CondVar cv_;
  std::deque<std::string> queue_ ABSL_GUARDED_BY(mu_);
  absl::Status error_ ABSL_GUARDED_BY(mu_);
  std::atomic<bool> stopping_{false};  // the carrier is going: every wait ends
  const Stop stop_flags_;
  std::thread thread_;
};

class SocketImporter final : public ByteCarrier {
 public:
  SocketImporter(int fd, const CarrierOptions& options)
      : fd_(fd), timeout_(options.timeout), stop_{nullptr, options.cancelled} {}

  absl::Status Send(std::string) override {
    return absl::InternalError("carrier: the importing side sends nothing");
  }
  absl::StatusOr<std::string> Recv(uint64_t n) override {
    std::string out(n, '\0');
    RETURN_IF_ERROR(
        ReadAll(fd_.get(), out.data(), n, absl::Now() + timeout_, "receiving bytes", stop_));
    return out;
  }
  absl::Status Finish() override {
    return WriteAll(fd_.get(), &kAck, 1, absl::Now() + timeout_, "acknowledging", stop_);
  }

 private:
  UniqueFd fd_;
  const absl::Duration timeout_;
  const Stop stop_;
};

absl::StatusOr<OfferedCarrier> OfferSocket(const CarrierOptions& options) {
  UniqueFd fd(TcpSocket());
  if (fd.get() < 0) return Errno("socket");
  sockaddr_in addr = Loopback(0);  // any free port
  socklen_t len = sizeof(addr);
  if (bind(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) return Errno("bind");
  if (listen(fd.get(), 1) != 0) return Errno("listen");
  if (getsockname(fd.get(), reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    return Errno("getsockname");
  }
  std::string token(kTokenBytes, '\0');
  if (getrandom(token.data(), token.size(), 0) != static_cast<ssize_t>(token.size())) {
    return Errno("getrandom");
  }
  OfferedCarrier offered;
  offered.bootstrap =
      absl::StrCat("127.0.0.1:", ntohs(addr.sin_port), "/", absl::BytesToHexString(token));
  offered.carrier = std::make_unique<SocketExporter>(fd.Release(), std::move(token), options);
  return offered;
}

absl::StatusOr<std::unique_ptr<ByteCarrier>> JoinSocket(absl::string_view bootstrap,
                                                        const CarrierOptions& options) {
  auto bad = [&] {
    return absl::InvalidArgumentError(
        absl::StrCat("carrier: bootstrap \"", absl::CHexEscape(bootstrap.substr(0, 64)),
                     "\" is not a socket carrier's (127.0.0.1:PORT/TOKEN)"));
  };
  std::vector<absl::string_view> at = absl::StrSplit(bootstrap, '/');
  if (at.size() != 2 || !absl::ConsumePrefix(&at[0], "127.0.0.1:")) return bad();
  uint32_t port = 0;
  if (!absl::SimpleAtoi(at[0], &port) || port == 0 || port > 65535 ||
      at[1].size() != 2 * kTokenBytes ||
      !std::all_of(at[1].begin(), at[1].end(), [](char c) { return absl::ascii_isxdigit(c); })) {
    return bad();
  }
  const std::string token = absl::HexStringToBytes(at[1]);
  UniqueFd fd(TcpSocket());
  if (fd.get() < 0) return Errno("socket");
  const sockaddr_in addr = Loopback(static_cast<uint16_t>(port));
  const absl::Time deadline = absl::Now() + options.timeout;
  if (connect(fd.get(), reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)) != 0) {
    if (errno != EINPROGRESS) return Errno("connect");
    RETURN_IF_ERROR(
        PollUntil(fd.get(), POLLOUT, deadline, "connecting", Stop{nullptr, options.cancelled}));
    int err = 0;
    socklen_t len = sizeof(err);
    getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &err, &len);
    if (err != 0) {
      errno = err;
      return Errno("connect");
    }
  }
  NoDelay(fd.get());
  RETURN_IF_ERROR(WriteAll(fd.get(), token.data(), token.size(), deadline, "the token",
                           Stop{nullptr, options.cancelled}));
  return std::unique_ptr<ByteCarrier>(std::make_unique<SocketImporter>(fd.Release(), options));
}

}  // namespace

absl::StatusOr<OfferedCarrier> OfferCarrier(CarrierKind kind, const CarrierOptions& options) {
  return kind == CarrierKind::kNccl ? OfferNcclCarrier(options) : OfferSocket(options);
}

absl::StatusOr<std::unique_ptr<ByteCarrier>> JoinCarrier(CarrierKind kind,
                                                         absl::string_view bootstrap,
                                                         const CarrierOptions& options) {
  return kind == CarrierKind::kNccl ? JoinNcclCarrier(bootstrap, options)
                                    : JoinSocket(bootstrap, options);
}

}  // namespace kvtier
