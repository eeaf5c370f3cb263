#include "server/rpc/fd_channel.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/random/random.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "server/common/log.h"
#include "server/common/mutex.h"
#include "server/common/status_macros.h"

namespace kvtier {
namespace {

// Sends `bytes` with `fds` attached (none: a plain message).
bool SendWithFds(int conn, absl::string_view bytes, const int* fds, size_t n) {
  iovec iov{const_cast<char*>(bytes.data()), bytes.size()};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  std::vector<char> control(CMSG_SPACE(sizeof(int) * n));
  if (n > 0) {
    msg.msg_control = control.data();
    msg.msg_controllen = control.size();
    cmsghdr* c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int) * n);
    std::memcpy(CMSG_DATA(c), fds, sizeof(int) * n);
  }
  ssize_t sent;
  do {
    sent = sendmsg(conn, &msg, MSG_NOSIGNAL);
  } while (sent < 0 && errno == EINTR);
  return sent == static_cast<ssize_t>(bytes.size());
}

// The first line the client writes (the ticket), read within `timeout`; empty on a timeout, a
// close or a line past 128 bytes.
std::string ReadLine(int conn, absl::Duration timeout) {
  std::string line;
  const absl::Time deadline = absl::Now() + timeout;
  for (;;) {
    char buf[64];
    const ssize_t n = read(conn, buf, sizeof buf);
    if (n > 0) {
      line.append(buf, static_cast<size_t>(n));
      if (const size_t nl = line.find('\n'); nl != std::string::npos) return line.substr(0, nl);
      if (line.size() > 128) return "";
      continue;
    }
    if (n == 0 || (errno != EAGAIN && errno != EINTR)) return "";
    const int64_t left = absl::ToInt64Milliseconds(deadline - absl::Now());
    if (left <= 0) return "";
    pollfd p{conn, POLLIN, 0};
    poll(&p, 1, static_cast<int>(left));
  }
}

}  // namespace

absl::StatusOr<std::unique_ptr<FdChannel>> FdChannel::Start(const std::string& path, Opener open) {
  ASSIGN_OR_RETURN(std::unique_ptr<UnixListener> listener, UnixListener::Bind(path));
  auto channel = std::unique_ptr<FdChannel>(new FdChannel(path, std::move(listener), open));
  channel->listener_->Serve(
      [raw = channel.get()](int conn, const PeerCredentials& cred) { raw->Serve(conn, cred); });
  return channel;
}

FdChannel::~FdChannel() {
  listener_->Stop();
  unlink(path_.c_str());
}

absl::StatusOr<std::string> FdChannel::Issue(pid_t pid, uid_t uid, const std::string& tenant,
                                             std::vector<uint64_t> ids) {
  const absl::Time now = absl::Now();
  absl::BitGen gen;
  const std::string ticket =
      absl::StrFormat("%016x%016x", absl::Uniform<uint64_t>(gen), absl::Uniform<uint64_t>(gen));
  MutexLock lock(&mu_);
  for (auto it = tickets_.begin(); it != tickets_.end();) {
    it = it->second.expires < now ? tickets_.erase(it) : std::next(it);
  }
  if (tickets_.size() >= kMaxTickets) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "OpenSegments: ", kMaxTickets, " tickets are outstanding; collect them or wait ",
        absl::FormatDuration(kTicketLife)));
  }
  tickets_[ticket] = Ticket{pid, uid, tenant, std::move(ids), now + kTicketLife};
  return ticket;
}

absl::StatusOr<FdChannel::Ticket> FdChannel::Take(const std::string& ticket,
                                                  const PeerCredentials& cred) {
  MutexLock lock(&mu_);
  auto it = tickets_.find(ticket);
  // One answer for every refusal, so that a guess learns nothing.
  if (it == tickets_.end() || it->second.expires < absl::Now() || it->second.pid != cred.pid ||
      it->second.uid != cred.uid) {
    return absl::PermissionDeniedError(
        "no such ticket for this process (unknown, used, expired, or another process's)");
  }
  Ticket t = std::move(it->second);
  tickets_.erase(it);
  return t;
}

void FdChannel::Serve(int conn, const PeerCredentials& cred) {
  auto refuse = [conn](const absl::Status& s) {
    SendWithFds(conn, absl::StrCat("e", s.message()), nullptr, 0);
  };
  absl::StatusOr<Ticket> t = Take(ReadLine(conn, absl::Seconds(2)), cred);
  if (!t.ok()) {
    refuse(t.status());
    close(conn);
    return;
  }
  std::vector<int> fds;
  absl::Status s;
  for (uint64_t id : t->ids) {
    absl::StatusOr<int> fd = open_(t->tenant, id);
    if (!fd.ok()) {
      s = fd.status();  // retired since the call: the whole set is refused
      break;
    }
    fds.push_back(*fd);
  }
  if (!s.ok()) {
    refuse(s);
  } else {
    for (size_t at = 0; at < fds.size(); at += kFdsPerMessage) {
      if (!SendWithFds(conn, "k", fds.data() + at, std::min(kFdsPerMessage, fds.size() - at))) {
        KVLOG(debug, "fds.send", "pid={} error={}", cred.pid, LogValue(std::strerror(errno)));
        break;
      }
    }
  }
  for (int fd : fds) close(fd);
  close(conn);
}

}  // namespace kvtier
