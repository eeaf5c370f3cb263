#include "server/rpc/fd_channel.h"

#include <fcntl.h>
#include <linux/sockios.h>
#include <openssl/rand.h>
#include <poll.h>
#include <sys/ioctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <system_error>

#include "absl/strings/escaping.h"
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

// Whether nothing sent on `conn` is left in the client's queue: it has read everything, or
// closed its socket (which empties the queue). A client that only shuts its end down keeps
// what it was not read in flight, and counts as not drained.
bool Drained(int conn) {
  int unread = 0;
  return ioctl(conn, SIOCOUTQ, &unread) == 0 && unread == 0;
}

// Waits up to `timeout` for Drained(conn), or until `stopping`; whether it was drained.
bool WaitDrained(int conn, absl::Duration timeout, const std::atomic<bool>& stopping) {
  const absl::Time deadline = absl::Now() + timeout;
  for (int i = 0;; ++i) {
    if (Drained(conn)) return true;
    if (absl::Now() >= deadline || stopping.load(std::memory_order_relaxed)) return false;
    // The client reads within microseconds when it is well: look often at first.
    absl::SleepFor(i < 20 ? absl::Microseconds(50) : absl::Milliseconds(10));
  }
}

}  // namespace

absl::StatusOr<std::unique_ptr<FdChannel>> FdChannel::Start(const std::string& path, Opener open) {
  ASSIGN_OR_RETURN(std::unique_ptr<UnixListener> listener, UnixListener::Bind(path));
  auto channel = std::unique_ptr<FdChannel>(new FdChannel(path, std::move(listener), open));
  rlimit nofile{};
  if (getrlimit(RLIMIT_NOFILE, &nofile) == 0 && nofile.rlim_cur != RLIM_INFINITY) {
    channel->max_unread_ = std::max<size_t>(1, nofile.rlim_cur / 2 / kFdsPerMessage);
  }
  if (channel->max_unread_ < size_t{kConnections}) {
    KVLOG(warn, "fds.limit",
          "RLIMIT_NOFILE {} lets the descriptor socket serve or hold unread {} connections at "
          "once (of {}); raise the limit",
          nofile.rlim_cur, channel->max_unread_, kConnections);
  }
  channel->listener_->Serve(
      [raw = channel.get()](int conn, const PeerCredentials& cred) { raw->Dispatch(conn, cred); });
  return channel;
}

FdChannel::~FdChannel() {
  listener_->Stop();  // no new connections; then the ones being served end (each is bounded)
  std::unique_lock lock(active_mu_);
  stopping_.store(true);  // a connection served now is closed, not parked
  for (const auto& [uid, conn] : parked_) close(conn);
  parked_.clear();
  idle_.wait(lock, [this] { return active_total_ == 0; });
  unlink(path_.c_str());
}

void FdChannel::PruneParkedLocked() {
  for (auto it = parked_.begin(); it != parked_.end();) {
    if (!Drained(it->second)) {
      ++it;
      continue;
    }
    close(it->second);
    if (--active_[it->first] == 0) active_.erase(it->first);
    it = parked_.erase(it);
  }
}

void FdChannel::Dispatch(int conn, const PeerCredentials& cred) {
  {
    std::lock_guard lock(active_mu_);
    if (!parked_.empty()) PruneParkedLocked();
    int& mine = active_[cred.uid];
    // Parked connections count against their uid, not the serving slots. Each one served may
    // end parked, with a message unread: served and parked together stay within what the
    // daemon's descriptor limit allows in flight.
    if (mine >= kConnectionsPerUid || active_total_ >= kConnections ||
        parked_.size() + active_total_ >= max_unread_) {
      const int held = mine;  // `mine` goes with its entry
      if (held == 0) active_.erase(cred.uid);
      // Said, not only closed ("b": busy, try again), so that a client can tell a limit from a
      // daemon going away.
      SendWithFds(conn,
                  absl::StrCat("buid ", cred.uid, " has ", held,
                               " descriptor connections open, unread ones included (at most ",
                               kConnectionsPerUid, "; ", active_total_, " of ", kConnections,
                               " served, and ", parked_.size() + active_total_, " of ", max_unread_,
                               " served or unread, in all); try again"),
                  nullptr, 0);
      close(conn);
      return;
    }
    ++mine;
    ++active_total_;
  }
  auto done = [this, uid = cred.uid] {
    std::lock_guard lock(active_mu_);
    if (--active_[uid] == 0) active_.erase(uid);
    if (--active_total_ == 0) idle_.notify_all();
  };
  try {
    std::thread([this, conn, cred, done] {
      if (!Serve(conn, cred)) {
        // Unread: parked until its client reads or closes it (a later connection's Dispatch
        // looks), or the channel stops; it keeps its uid's place, and gives the serving slot
        // back.
        std::lock_guard lock(active_mu_);
        if (!stopping_.load()) {
          KVLOG(debug, "fds.unread", "pid={} uid={}", cred.pid, cred.uid);
          parked_.emplace(cred.uid, conn);
          if (--active_total_ == 0) idle_.notify_all();
          return;
        }
      }
      close(conn);
      done();
    }).detach();
  } catch (const std::system_error& e) {  // no thread to be had (RLIMIT_NPROC): this one waits
    KVLOG(warn, "fds.no_thread", "uid={} error={}", cred.uid, LogValue(e.what()));
    close(conn);
    done();
  }
}

absl::StatusOr<std::string> FdChannel::Issue(pid_t pid, uid_t uid, const std::string& tenant,
                                             std::vector<uint64_t> ids, Grant grant) {
  const auto now = std::chrono::steady_clock::now();
  const char* rpc = grant == Grant::kStaging   ? "OpenStaging"
                    : grant == Grant::kChannel ? "OpenChannel"
                                               : "OpenSegments";
  unsigned char raw[16];
  if (RAND_bytes(raw, sizeof raw) != 1) {
    return absl::UnavailableError(absl::StrCat(rpc, ": no random bytes for a ticket; try again"));
  }
  const std::string ticket =
      absl::BytesToHexString(absl::string_view(reinterpret_cast<const char*>(raw), sizeof raw));
  MutexLock lock(&mu_);
  size_t theirs = 0;
  for (auto it = tickets_.begin(); it != tickets_.end();) {
    if (it->second.expires < now) {
      it = tickets_.erase(it);
      continue;
    }
    theirs += it->second.uid == uid;
    ++it;
  }
  if (theirs >= kTicketsPerUid) {
    return absl::ResourceExhaustedError(absl::StrCat(rpc, ": uid ", uid, " has ", kTicketsPerUid,
                                                     " tickets outstanding; collect them or wait ",
                                                     absl::FormatDuration(kTicketLife)));
  }
  tickets_[ticket] =
      Ticket{pid, uid, tenant, std::move(ids), grant, now + absl::ToChronoNanoseconds(kTicketLife)};
  return ticket;
}

absl::StatusOr<FdChannel::Ticket> FdChannel::Take(const std::string& ticket,
                                                  const PeerCredentials& cred) {
  MutexLock lock(&mu_);
  auto it = tickets_.find(ticket);
  // One answer for every refusal, so that a guess learns nothing.
  if (it == tickets_.end() || it->second.expires < std::chrono::steady_clock::now() ||
      it->second.pid != cred.pid || it->second.uid != cred.uid) {
    return absl::PermissionDeniedError(
        "no such ticket for this process (unknown, used, expired, or another process's)");
  }
  Ticket t = std::move(it->second);
  tickets_.erase(it);
  return t;
}

bool FdChannel::Serve(int conn, const PeerCredentials& cred) {
  auto refuse = [conn](const absl::Status& s) {
    SendWithFds(conn, absl::StrCat("e", s.message()), nullptr, 0);
  };
  absl::StatusOr<Ticket> t = Take(ReadLine(conn, kReadTimeout), cred);
  if (!t.ok()) {
    refuse(t.status());
    return true;
  }
  // kFdsPerMessage at a time: opened, sent, closed, so that a large set never holds more of
  // the daemon's descriptors than that. A segment retired meanwhile ends the set with a
  // refusal (what was sent is the client's to close).
  std::vector<int> fds;
  for (size_t at = 0; at < t->ids.size(); at += kFdsPerMessage) {
    // One message unread at most: the next waits for the client to read the last, and a
    // client too slow for that (or a daemon stopping) ends the set there, busy ("b": the
    // clients' UNAVAILABLE, to be asked again).
    if (at > 0 && !WaitDrained(conn, kUnreadWait, stopping_)) {
      SendWithFds(conn,
                  absl::StrCat("bdescriptors ", at, " of ", t->ids.size(),
                               stopping_.load() ? " sent; the daemon is stopping"
                                                : absl::StrCat(" sent and not read within ",
                                                               absl::FormatDuration(kUnreadWait)),
                               "; ask for them again"),
                  nullptr, 0);
      return false;
    }
    absl::Status s;
    for (size_t i = at; i < std::min(t->ids.size(), at + kFdsPerMessage) && s.ok(); ++i) {
      absl::StatusOr<int> fd = open_(t->tenant, t->ids[i], t->grant, i);
      if (fd.ok()) {
        fds.push_back(*fd);
      } else {
        s = fd.status();
      }
    }
    const bool sent = s.ok() && SendWithFds(conn, "k", fds.data(), fds.size());
    for (int fd : fds) close(fd);
    fds.clear();
    if (!s.ok()) refuse(s);
    if (!sent) {
      if (s.ok())
        KVLOG(debug, "fds.send", "pid={} error={}", cred.pid, LogValue(std::strerror(errno)));
      break;
    }
  }
  return WaitDrained(conn, kUnreadWait, stopping_);
}

}  // namespace kvtier
