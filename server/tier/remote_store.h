// The remote tier's store: a real Redis server reached through hiredis, holding whole idle
// sessions as single values. One connection, reconnected when it breaks (a command that finds
// it closed by the server is sent again on a new one); calls are serialized. Every error names
// the address and Redis's words.
#ifndef KVTIER_SERVER_TIER_REMOTE_STORE_H_
#define KVTIER_SERVER_TIER_REMOTE_STORE_H_

#include <memory>
#include <optional>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

struct redisContext;

namespace kvtier {

class RemoteStore {
 public:
  // "redis://HOST:PORT" or "unix:PATH". Connects at once: UNAVAILABLE when Redis cannot be
  // reached, INVALID_ARGUMENT for a malformed address. The process must ignore SIGPIPE (as
  // kvtierd's main does), or a write to a Redis that died kills it.
  static absl::StatusOr<std::unique_ptr<RemoteStore>> Connect(const std::string& address);
  ~RemoteStore();

  absl::Status Put(const std::string& key, const std::string& value);
  // nullopt when the key does not exist.
  absl::StatusOr<std::optional<std::string>> Get(const std::string& key);
  // Whether the key existed.
  absl::StatusOr<bool> Delete(const std::string& key);
  absl::StatusOr<bool> Exists(const std::string& key);
  const std::string& address() const { return address_; }

 private:
  RemoteStore(std::string address, std::string host, int port, std::string path)
      : address_(std::move(address)), host_(std::move(host)), port_(port), path_(std::move(path)) {}
  absl::Status EnsureConnected() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Runs one command (argv form, binary safe); the reply's status, and its string if any.
  struct Reply {
    int type = 0;
    long long integer = 0;
    std::string str;
  };
  absl::StatusOr<Reply> Command(std::initializer_list<std::string_view> argv)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const std::string address_, host_;
  const int port_;
  const std::string path_;
  absl::Mutex mu_;  // lock order 4 (server/common/lock_order.h)
  redisContext* ctx_ ABSL_GUARDED_BY(mu_) = nullptr;
};

}  // namespace kvtier

#endif  // KVTIER_SERVER_TIER_REMOTE_STORE_H_
