// The remote tier's store: a real Redis server reached through hiredis, holding whole idle
// sessions as single values. A pool of connections, each made when first needed and again
// when it breaks (a command that finds its connection closed by the server is sent again on a
// new one); a call takes a free connection for itself, so calls go on side by side, and waits
// at most the timeout for one. Every connect and command is bounded by the timeout too, so a
// hung Redis costs each call that needs it at most about twice the timeout, and no other call
// anything. Every error names the address and Redis's words.
#ifndef KVTIER_SERVER_TIER_REMOTE_STORE_H_
#define KVTIER_SERVER_TIER_REMOTE_STORE_H_

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

struct redisContext;

namespace kvtier {

// Lua for a script that replaces or deletes a key's value: defines drop_parts(key, new),
// which deletes the parts of the manifest the key holds (RemoteStore::StoreParts), if it holds
// one (read in its first 128 bytes: RemoteStore::kManifestBytes), unless that manifest is
// `new` (the script's own value: sent again after its reply was lost, it must not drop the
// parts it stored the first time). A manifest naming more than a million parts is damaged:
// its parts are left, never looped over with Redis blocked.
#define KVTIER_DROP_PARTS_LUA                                             \
  "local function drop_parts(k, new)\n"                                   \
  "  local head = redis.call('GETRANGE', k, 0, 127)\n"                    \
  "  if head == new then return end\n"                                    \
  "  local nonce, n = string.match(head, '^KVPARTS1 (%x+) (%d+) %d+$')\n" \
  "  if not nonce or tonumber(n) > 1000000 then return end\n"             \
  "  for i = 0, tonumber(n) - 1 do\n"                                     \
  "    redis.call('DEL', 'kvtier:part:' .. nonce .. ':' .. i)\n"          \
  "  end\n"                                                               \
  "end\n"

// Lua for a script that stores a value: defines keep_parts(new), which, when `new` is a
// manifest, makes its parts permanent (StoreParts writes each with an expiry, so that the
// parts of a value whose manifest never comes, its writer killed or its store refused, go by
// themselves); false, and nothing changed, when one of them is gone (it expired, or Redis
// evicted it): the script is to store nothing then.
#define KVTIER_KEEP_PARTS_LUA                                                \
  "local function keep_parts(new)\n"                                         \
  "  local nonce, n = string.match(new, '^KVPARTS1 (%x+) (%d+) %d+$')\n"     \
  "  if not nonce or #new > 128 then return true end\n"                      \
  "  if tonumber(n) > 1000000 then return false end\n"                       \
  "  local prefix = 'kvtier:part:' .. nonce .. ':'\n"                        \
  "  for i = 0, tonumber(n) - 1 do\n"                                        \
  "    if redis.call('EXISTS', prefix .. i) == 0 then return false end\n"    \
  "  end\n"                                                                  \
  "  for i = 0, tonumber(n) - 1 do redis.call('PERSIST', prefix .. i) end\n" \
  "  return true\n"                                                          \
  "end\n"

class RemoteStore {
 public:
  // "redis://HOST:PORT" or "unix:PATH". Connects at once: UNAVAILABLE when Redis cannot be
  // reached, INVALID_ARGUMENT for a malformed address. The process must ignore SIGPIPE (as
  // kvtierd's main does), or a write to a Redis that died kills it.
  struct Options {
    int connections = 4;         // the pool's size
    uint32_t timeout_ms = 5000;  // a connect, a command, and the wait for a free connection
    // A value larger than this is stored in parts of at most this many bytes (StoreParts):
    // Redis refuses a value past 512 MB (its proto-max-bulk-len), and one part is one command.
    uint64_t part_bytes = uint64_t{64} << 20;
    // Each part expires this long after it is written unless the script that stores its
    // manifest (KVTIER_KEEP_PARTS_LUA) has made it permanent: the parts of a value whose
    // manifest never came (a daemon killed while it wrote them) go by themselves. A value
    // whose writing takes longer is refused (UNAVAILABLE) and its parts dropped. At least 1.
    uint64_t part_ttl_ms = 3'600'000;
  };
  static absl::StatusOr<std::unique_ptr<RemoteStore>> Connect(const std::string& address,
                                                              Options options);
  static absl::StatusOr<std::unique_ptr<RemoteStore>> Connect(const std::string& address) {
    return Connect(address, Options{});
  }
  ~RemoteStore();

  // Values of any size (parts, below): Put replaces the key's value (and drops the parts of
  // the one it replaces), Get reads it whole (nullopt when the key does not exist), Delete
  // deletes it and its parts (whether the key existed).
  absl::Status Put(const std::string& key, const std::string& value);
  absl::StatusOr<std::optional<std::string>> Get(const std::string& key);
  absl::StatusOr<bool> Delete(const std::string& key);

  // Large values. One larger than Options::part_bytes is written as parts under keys of their
  // own ("kvtier:part:<nonce>:<i>", a fresh random nonce each time), and what its key holds is
  // a small manifest naming them ("KVPARTS1 <nonce> <parts> <bytes>"), which StoreParts
  // returns once the parts are written; for a value that fits, nothing is written and nullopt
  // returned (the key holds the value itself). The parts expire (Options::part_ttl_ms) until
  // the script that stores the manifest keeps them (KVTIER_KEEP_PARTS_LUA). A script that
  // replaces or deletes a key's value drops its parts (KVTIER_DROP_PARTS_LUA).
  absl::StatusOr<std::optional<std::string>> StoreParts(const std::string& value);
  // A fresh random name, 32 hex digits: a value's parts' nonce, a put's token.
  static std::string Nonce();
  // What a store answers when its script found a part of `stored` gone before it could keep
  // them (keep_parts false): the rest of its parts are dropped, and the error says why.
  absl::Status PartsGone(std::string_view stored);
  // What a key held, whole: a manifest's parts read back and joined (DATA_LOSS naming the
  // part when one is missing, or when they do not add up), anything else as it is.
  absl::StatusOr<std::string> LoadParts(std::string stored);
  // Deletes the parts a manifest names (nothing for anything else): those of a value whose
  // manifest was never stored.
  absl::Status DropParts(std::string_view stored);
  // Whether what a key holds is a manifest (at most kManifestBytes, which scripts read of a
  // key to find one).
  static constexpr size_t kManifestBytes = 128;
  // The most parts a manifest names (the scripts' bound, above): StoreParts refuses more.
  static constexpr uint64_t kMaxParts = 1'000'000;
  static bool IsManifest(std::string_view stored);
  // After a script that was to store `stored` at `key` failed, its outcome unknown (a reply
  // lost, a timeout): OK when the key holds it (the script ran); otherwise its parts are
  // dropped and `failed` is returned. When even that cannot be asked, the parts stay until
  // they expire (never a manifest whose parts are gone) and `failed` is returned.
  absl::Status Settle(const std::string& key, std::string_view stored, absl::Status failed);
  absl::StatusOr<bool> Exists(const std::string& key);
  // A Lua script run atomically by Redis (EVAL) over `keys` and `args`, answering an array:
  // its elements as strings (integers in decimal, nil as nullopt).
  absl::StatusOr<std::vector<std::optional<std::string>>> Eval(
      std::string_view script, const std::vector<std::string_view>& keys,
      const std::vector<std::string_view>& args);
  const std::string& address() const { return address_; }

 private:
  RemoteStore(std::string address, std::string host, int port, std::string path, Options options)
      : address_(std::move(address)),
        host_(std::move(host)),
        port_(port),
        path_(std::move(path)),
        options_(options) {}
  // One pooled connection: owned by the call that took it from the free list, until it gives
  // it back, so it needs no lock of its own.
  struct Conn {
    redisContext* ctx = nullptr;
  };
  // A free connection, waiting up to the timeout; UNAVAILABLE when none came free.
  absl::StatusOr<Conn*> Take();
  void Give(Conn* c);
  absl::Status EnsureConnected(Conn* c);
  // Runs one command (argv form, binary safe); the reply's status, and its string if any.
  struct Reply {
    int type = 0;
    long long integer = 0;
    std::string str;
    std::vector<std::optional<std::string>> elements;  // an array's, as Eval returns them
  };
  absl::StatusOr<Reply> Command(const std::vector<std::string_view>& argv);

  const std::string address_, host_;
  const int port_;
  const std::string path_;
  const Options options_;
  std::vector<std::unique_ptr<Conn>> pool_;  // fixed at Connect
  absl::Mutex mu_;  // lock order 4 (server/common/lock_order.h): the free list only
  absl::CondVar freed_;
  std::vector<Conn*> free_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvtier

#endif  // KVTIER_SERVER_TIER_REMOTE_STORE_H_
