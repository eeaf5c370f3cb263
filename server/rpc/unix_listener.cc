#include "server/rpc/unix_listener.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "grpcpp/server_posix.h"
#include "server/common/log.h"
#include "server/common/mutex.h"

namespace kvtier {

absl::StatusOr<std::unique_ptr<UnixListener>> UnixListener::Bind(const std::string& path) {
  sockaddr_un addr{};
  if (path.empty() || path.size() >= sizeof(addr.sun_path)) {
    return absl::InvalidArgumentError(absl::StrCat("listen: socket path \"", path, "\" must be 1..",
                                                   sizeof(addr.sun_path) - 1, " bytes"));
  }
  // Bound under a name of its own, made 0660 and listening, then renamed into place (never
  // over an existing file): a client never finds the socket before its mode is set. Where
  // that name would not fit, bound in place and then made 0660.
  const std::string temp = path + ".new";
  const bool renamed = temp.size() < sizeof(addr.sun_path);
  const std::string& bound = renamed ? temp : path;
  struct stat st {};
  if (renamed && lstat(temp.c_str(), &st) == 0 && S_ISSOCK(st.st_mode)) {
    unlink(temp.c_str());  // left by a daemon killed between its bind and its rename
  }
  const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) return absl::InternalError(absl::StrCat("listen: socket: ", std::strerror(errno)));
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, bound.data(), bound.size());
  if (bind(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)) != 0) {
    const int err = errno;
    close(fd);
    return absl::UnavailableError(
        absl::StrCat("listen: cannot bind ", bound, ": ", std::strerror(err)));
  }
  if (chmod(bound.c_str(), 0660) != 0 || listen(fd, SOMAXCONN) != 0 ||
      (renamed &&
       renameat2(AT_FDCWD, temp.c_str(), AT_FDCWD, path.c_str(), RENAME_NOREPLACE) != 0)) {
    const int err = errno;
    close(fd);
    unlink(bound.c_str());
    return err == EEXIST
               ? absl::UnavailableError(
                     absl::StrCat("listen: cannot bind ", path, ": ", std::strerror(err)))
               : absl::InternalError(absl::StrCat("listen: ", path, ": ", std::strerror(err)));
  }
  int stop[2];
  if (pipe2(stop, O_CLOEXEC) != 0) {
    close(fd);
    unlink(path.c_str());
    return absl::InternalError(absl::StrCat("listen: pipe: ", std::strerror(errno)));
  }
  return std::unique_ptr<UnixListener>(new UnixListener(fd, stop[0], stop[1]));
}

UnixListener::~UnixListener() {
  Stop();
  close(stop_read_);
  close(stop_write_);
}

void UnixListener::Serve(grpc::Server* server, ConnectionLimit limit, Apart apart) {
  Serve([this, server, limit = std::move(limit), apart = std::move(apart)](
            int c, const PeerCredentials& cred) {
    if (!Admit(c, cred, limit)) {
      close(c);
      return;
    }
    {
      PeerShard& shard = ShardOf(c);
      MutexLock lock(&shard.mu);
      shard.peers[c] = cred;
    }
    const bool away = apart.server != nullptr && apart.uid(cred.uid);
    grpc::AddInsecureChannelFromFd(away ? apart.server : server, c);
  });
}

void UnixListener::Prune(std::vector<Open>& open) {
  std::erase_if(open, [](const Open& o) {
    struct stat st {};
    return fstat(o.fd, &st) != 0 || st.st_dev != o.dev || st.st_ino != o.ino;
  });
}

bool UnixListener::Admit(int c, const PeerCredentials& cred, const ConnectionLimit& limit) {
  if (limit.per_uid == 0 || cred.uid == limit.exempt) return true;
  struct stat st {};
  if (fstat(c, &st) != 0) return false;  // cannot be (an accepted socket): not counted, not let in
  // Uids whose connections all ended keep an entry until here: many uids, every one looked at,
  // and again only once there are twice as many as were left.
  if (open_.size() >= sweep_at_) {
    for (auto it = open_.begin(); it != open_.end();) {
      Prune(it->second.open);
      it = it->second.open.empty() ? open_.erase(it) : std::next(it);
    }
    sweep_at_ = std::max(kUidsBeforeSweep, 2 * open_.size());
  }
  Held& mine = open_[cred.uid];
  // At the bound its connections are looked at again, at most once in a while: a uid that
  // keeps connecting past it costs a look (per_uid fstat calls, well under a microsecond each)
  // every 40 us per connection it holds (10 ms at least), a few percent of this thread, not
  // one each try.
  const auto now = std::chrono::steady_clock::now();
  const auto again = std::max<std::chrono::steady_clock::duration>(
      kLookAgain, limit.per_uid * std::chrono::microseconds(40));
  if (mine.open.size() >= limit.per_uid && now - mine.looked >= again) {
    Prune(mine.open);
    mine.looked = now;
  }
  if (mine.open.size() >= limit.per_uid) {
    if (limit.refused) limit.refused(cred, mine.open.size());
    return false;
  }
  mine.open.push_back(Open{c, st.st_dev, st.st_ino});
  return true;
}

void UnixListener::Serve(Handler handler) {
  thread_ = std::thread([this, handler = std::move(handler)] { Accept(handler); });
}

void UnixListener::Stop() {
  if (thread_.joinable()) {
    const char byte = 0;
    while (write(stop_write_, &byte, 1) < 0 && errno == EINTR) {
    }
    thread_.join();
  }
  // Closed here, not at destruction: a client connecting from now on is refused at once,
  // not left in the backlog while the server shuts down.
  if (fd_ >= 0) {
    close(fd_);
    fd_ = -1;
  }
}

int UnixListener::Renumber(int c) {
  for (int pass = 0; pass < 2; ++pass) {
    const int d = fcntl(c, F_DUPFD_CLOEXEC, next_);
    if (d >= 0 && d < kFirst + kCycle) {
      close(c);
      next_ = d + 1 < kFirst + kCycle ? d + 1 : kFirst;
      return d;
    }
    if (d >= 0) close(d);  // past the cycle (every number in it taken): from its start
    next_ = kFirst;        // or past RLIMIT_NOFILE (EINVAL), or none free (EMFILE)
  }
  return c;
}

void UnixListener::Accept(const Handler& handler) {
  for (;;) {
    pollfd fds[2] = {{fd_, POLLIN, 0}, {stop_read_, POLLIN, 0}};
    if (poll(fds, 2, -1) < 0) {
      if (errno == EINTR) continue;
      KVLOG(error, "listen.poll", "error={}", LogValue(std::strerror(errno)));
      return;
    }
    if (fds[1].revents != 0) return;
    const int c = accept4(fd_, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (c < 0) {
      const int err = errno;  // before the log line can change it
      if (err != EAGAIN && err != EINTR && err != ECONNABORTED) {
        KVLOG(warn, "listen.accept", "error={}", LogValue(std::strerror(err)));
        if (err == EMFILE || err == ENFILE) poll(nullptr, 0, 100);  // let descriptors go
      }
      continue;
    }
    ucred cred{};
    socklen_t len = sizeof(cred);
    if (getsockopt(c, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) {
      const int err = errno;
      KVLOG(warn, "listen.peercred", "error={}", LogValue(std::strerror(err)));
      close(c);  // no credentials, no connection
      continue;
    }
    handler(Renumber(c), PeerCredentials{cred.uid, cred.gid, cred.pid});
  }
}

std::optional<PeerCredentials> UnixListener::Lookup(absl::string_view grpc_peer) const {
  int fd = -1;
  if (!absl::ConsumePrefix(&grpc_peer, "fd:") || !absl::SimpleAtoi(grpc_peer, &fd)) {
    return std::nullopt;
  }
  const PeerShard& shard = ShardOf(fd);
  MutexLock lock(&shard.mu);
  auto it = shard.peers.find(fd);
  if (it == shard.peers.end()) return std::nullopt;
  return it->second;
}

}  // namespace kvtier
