#include "server/tier/remote_store.h"

#include <hiredis/hiredis.h>

#include <cerrno>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "server/common/mutex.h"

namespace kvtier {

absl::StatusOr<std::unique_ptr<RemoteStore>> RemoteStore::Connect(const std::string& address) {
  std::unique_ptr<RemoteStore> store;
  if (absl::StartsWith(address, "unix:")) {
    store.reset(new RemoteStore(address, "", 0, address.substr(5)));
  } else if (absl::StartsWith(address, "redis://")) {
    const std::string hostport = address.substr(8);
    const size_t colon = hostport.rfind(':');
    int port = 0;
    if (colon == std::string::npos || colon == 0 ||
        !absl::SimpleAtoi(hostport.substr(colon + 1), &port) || port <= 0 || port > 65535) {
      return absl::InvalidArgumentError(
          absl::StrCat("remote: \"", address, "\" is not redis://HOST:PORT"));
    }
    store.reset(new RemoteStore(address, hostport.substr(0, colon), port, ""));
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("remote: \"", address, "\" is neither redis://HOST:PORT nor unix:PATH"));
  }
  MutexLock lock(&store->mu_);
  if (absl::Status s = store->EnsureConnected(); !s.ok()) return s;
  return store;
}

RemoteStore::~RemoteStore() {
  MutexLock lock(&mu_);
  if (ctx_) redisFree(ctx_);
}

absl::Status RemoteStore::EnsureConnected() {
  if (ctx_ != nullptr && ctx_->err == 0) return absl::OkStatus();
  if (ctx_ != nullptr) redisFree(ctx_);
  const timeval timeout{5, 0};
  ctx_ = path_.empty() ? redisConnectWithTimeout(host_.c_str(), port_, timeout)
                       : redisConnectUnixWithTimeout(path_.c_str(), timeout);
  if (ctx_ == nullptr || ctx_->err != 0) {
    const std::string why = ctx_ ? ctx_->errstr : "cannot allocate a context";
    if (ctx_) redisFree(ctx_);
    ctx_ = nullptr;
    return absl::UnavailableError(absl::StrCat("remote ", address_, ": ", why));
  }
  redisSetTimeout(ctx_, timeval{30, 0});
  return absl::OkStatus();
}

absl::StatusOr<RemoteStore::Reply> RemoteStore::Command(
    std::initializer_list<std::string_view> argv) {
  std::vector<const char*> ptrs;
  std::vector<size_t> lens;
  for (std::string_view a : argv) {
    ptrs.push_back(a.data());
    lens.push_back(a.size());
  }
  redisReply* r = nullptr;
  // Every command here (SET, GET, DEL, EXISTS) may be sent twice. A connection the server
  // closed (a Redis restart, an idle timeout) is found only when a command fails on it: that
  // one is sent again on a new connection, so the first call after a restart succeeds. A
  // timeout is not retried: a hung Redis would only cost the caller twice as long.
  for (int attempt = 0; attempt < 2 && r == nullptr; ++attempt) {
    if (absl::Status s = EnsureConnected(); !s.ok()) return s;
    r = static_cast<redisReply*>(
        redisCommandArgv(ctx_, static_cast<int>(ptrs.size()), ptrs.data(), lens.data()));
    if (r != nullptr) break;
    const std::string why = ctx_->errstr;
    const bool closed = ctx_->err == REDIS_ERR_EOF ||
                        (ctx_->err == REDIS_ERR_IO && (errno == ECONNRESET || errno == EPIPE));
    redisFree(ctx_);  // the connection is unusable; a new one is made
    ctx_ = nullptr;
    if (!closed || attempt == 1) {
      return absl::UnavailableError(absl::StrCat("remote ", address_, ": ", why));
    }
  }
  Reply out;
  out.type = r->type;
  out.integer = r->integer;
  if (r->str != nullptr) out.str.assign(r->str, r->len);
  freeReplyObject(r);
  if (out.type == REDIS_REPLY_ERROR) {
    return absl::InternalError(absl::StrCat("remote ", address_, ": ", out.str));
  }
  return out;
}

absl::Status RemoteStore::Put(const std::string& key, const std::string& value) {
  MutexLock lock(&mu_);
  auto r = Command({"SET", key, value});
  return r.ok() ? absl::OkStatus() : r.status();
}

absl::StatusOr<std::optional<std::string>> RemoteStore::Get(const std::string& key) {
  MutexLock lock(&mu_);
  auto r = Command({"GET", key});
  if (!r.ok()) return r.status();
  if (r->type == REDIS_REPLY_NIL) return std::optional<std::string>();
  return std::optional<std::string>(std::move(r->str));
}

absl::StatusOr<bool> RemoteStore::Delete(const std::string& key) {
  MutexLock lock(&mu_);
  auto r = Command({"DEL", key});
  if (!r.ok()) return r.status();
  return r->integer > 0;
}

absl::StatusOr<bool> RemoteStore::Exists(const std::string& key) {
  MutexLock lock(&mu_);
  auto r = Command({"EXISTS", key});
  if (!r.ok()) return r.status();
  return r->integer > 0;
}

}  // namespace kvtier
