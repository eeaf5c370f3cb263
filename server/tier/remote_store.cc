#include "server/tier/remote_store.h"

#include <hiredis/hiredis.h>

#include <algorithm>
#include <cerrno>
#include <optional>
#include <string_view>
#include <vector>

#include "absl/random/random.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "server/common/mutex.h"
#include "server/common/status_macros.h"

namespace kvtier {

absl::StatusOr<std::unique_ptr<RemoteStore>> RemoteStore::Connect(const std::string& address,
                                                                  Options options) {
  if (options.connections < 1) options.connections = 1;
  if (options.timeout_ms < 1) options.timeout_ms = 1;
  std::unique_ptr<RemoteStore> store;
  if (absl::StartsWith(address, "unix:")) {
    store.reset(new RemoteStore(address, "", 0, address.substr(5), options));
  } else if (absl::StartsWith(address, "redis://")) {
    const std::string hostport = address.substr(8);
    const size_t colon = hostport.rfind(':');
    int port = 0;
    if (colon == std::string::npos || colon == 0 ||
        !absl::SimpleAtoi(hostport.substr(colon + 1), &port) || port <= 0 || port > 65535) {
      return absl::InvalidArgumentError(
          absl::StrCat("remote: \"", address, "\" is not redis://HOST:PORT"));
    }
    store.reset(new RemoteStore(address, hostport.substr(0, colon), port, "", options));
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("remote: \"", address, "\" is neither redis://HOST:PORT nor unix:PATH"));
  }
  for (int i = 0; i < options.connections; ++i) store->pool_.push_back(std::make_unique<Conn>());
  {
    MutexLock lock(&store->mu_);
    for (auto& c : store->pool_) store->free_.push_back(c.get());
  }
  // One connection at once, so that a Redis that cannot be reached fails the start.
  if (absl::Status s = store->EnsureConnected(store->pool_.front().get()); !s.ok()) return s;
  return store;
}

RemoteStore::~RemoteStore() {
  for (auto& c : pool_) {
    if (c->ctx) redisFree(c->ctx);
  }
}

absl::StatusOr<RemoteStore::Conn*> RemoteStore::Take() {
  const absl::Time deadline = absl::Now() + absl::Milliseconds(options_.timeout_ms);
  MutexLock lock(&mu_);
  while (free_.empty()) {
    KVTIER_TSAN_RELEASE(&mu_);
    const bool timed_out = freed_.WaitWithDeadline(&mu_, deadline);
    KVTIER_TSAN_ACQUIRE(&mu_);
    if (timed_out && free_.empty()) {
      return absl::UnavailableError(absl::StrCat("remote ", address_, ": all ", pool_.size(),
                                                 " connections busy for ", options_.timeout_ms,
                                                 " ms (a slow or hung Redis)"));
    }
  }
  Conn* c = free_.back();
  free_.pop_back();
  return c;
}

void RemoteStore::Give(Conn* c) {
  {
    MutexLock lock(&mu_);
    free_.push_back(c);
  }
  freed_.Signal();
}

absl::Status RemoteStore::EnsureConnected(Conn* c) {
  if (c->ctx != nullptr && c->ctx->err == 0) return absl::OkStatus();
  if (c->ctx != nullptr) redisFree(c->ctx);
  const timeval timeout{static_cast<time_t>(options_.timeout_ms / 1000),
                        static_cast<suseconds_t>(options_.timeout_ms % 1000 * 1000)};
  c->ctx = path_.empty() ? redisConnectWithTimeout(host_.c_str(), port_, timeout)
                         : redisConnectUnixWithTimeout(path_.c_str(), timeout);
  if (c->ctx == nullptr || c->ctx->err != 0) {
    const std::string why = c->ctx ? c->ctx->errstr : "cannot allocate a context";
    if (c->ctx) redisFree(c->ctx);
    c->ctx = nullptr;
    return absl::UnavailableError(absl::StrCat("remote ", address_, ": ", why));
  }
  redisSetTimeout(c->ctx, timeout);
  return absl::OkStatus();
}

namespace {

std::optional<std::string> AsString(const redisReply* r) {
  switch (r->type) {
    case REDIS_REPLY_STRING:
    case REDIS_REPLY_STATUS:
      return std::string(r->str, r->len);
    case REDIS_REPLY_INTEGER:
      return absl::StrCat(r->integer);
    default:
      return std::nullopt;
  }
}

}  // namespace

absl::StatusOr<RemoteStore::Reply> RemoteStore::Command(const std::vector<std::string_view>& argv) {
  std::vector<const char*> ptrs;
  std::vector<size_t> lens;
  for (std::string_view a : argv) {
    ptrs.push_back(a.data());
    lens.push_back(a.size());
  }
  ASSIGN_OR_RETURN(Conn* const c, Take());
  struct GiveBack {
    RemoteStore* store;
    Conn* c;
    ~GiveBack() { store->Give(c); }
  } give_back{this, c};
  redisReply* r = nullptr;
  // Every command here (SET, GET, DEL, EXISTS, and the scripts, each safe to run twice: see
  // KVTIER_DROP_PARTS_LUA and remote_records.cc) may be sent twice. A connection the server
  // closed (a Redis restart, an idle timeout) is found only when a command fails on it: that
  // one is sent again on a new connection, so the first call after a restart succeeds. A
  // timeout is not retried: a hung Redis would only cost the caller twice as long.
  for (int attempt = 0; attempt < 2 && r == nullptr; ++attempt) {
    if (absl::Status s = EnsureConnected(c); !s.ok()) return s;
    r = static_cast<redisReply*>(
        redisCommandArgv(c->ctx, static_cast<int>(ptrs.size()), ptrs.data(), lens.data()));
    if (r != nullptr) break;
    const std::string why = c->ctx->errstr;
    const bool closed = c->ctx->err == REDIS_ERR_EOF ||
                        (c->ctx->err == REDIS_ERR_IO && (errno == ECONNRESET || errno == EPIPE));
    redisFree(c->ctx);  // the connection is unusable; a new one is made
    c->ctx = nullptr;
    if (!closed || attempt == 1) {
      return absl::UnavailableError(absl::StrCat("remote ", address_, ": ", why));
    }
  }
  Reply out;
  out.type = r->type;
  out.integer = r->integer;
  if (r->str != nullptr) out.str.assign(r->str, r->len);
  if (r->type == REDIS_REPLY_ARRAY) {
    for (size_t i = 0; i < r->elements; ++i) out.elements.push_back(AsString(r->element[i]));
  }
  freeReplyObject(r);
  if (out.type == REDIS_REPLY_ERROR) {
    return absl::InternalError(absl::StrCat("remote ", address_, ": ", out.str));
  }
  return out;
}

namespace {

constexpr char kPartsMagic[] = "KVPARTS1 ";

// A manifest's fields; nullopt for a value that is none.
struct Manifest {
  std::string nonce;
  uint64_t parts = 0, bytes = 0;
};
std::optional<Manifest> ParseManifest(std::string_view bytes) {
  const absl::string_view stored(bytes.data(), bytes.size());  // Abseil's own, here
  if (!absl::StartsWith(stored, kPartsMagic) || stored.size() > RemoteStore::kManifestBytes) {
    return std::nullopt;
  }
  const std::vector<absl::string_view> f = absl::StrSplit(stored, ' ');
  Manifest m;
  if (f.size() != 4 || f[1].empty() || !absl::SimpleAtoi(f[2], &m.parts) || m.parts == 0 ||
      !absl::SimpleAtoi(f[3], &m.bytes)) {
    return std::nullopt;
  }
  m.nonce = std::string(f[1]);
  return m;
}

std::string PartKey(const std::string& nonce, uint64_t i) {
  return absl::StrCat("kvtier:part:", nonce, ":", i);
}

// KEYS[1] the key, ARGV[1] its new value: its parts kept, the old value's parts dropped, then
// the value set.
constexpr char kReplace[] = KVTIER_KEEP_PARTS_LUA KVTIER_DROP_PARTS_LUA R"lua(
if not keep_parts(ARGV[1]) then return {'parts gone'} end
drop_parts(KEYS[1], ARGV[1])
redis.call('SET', KEYS[1], ARGV[1])
return {'ok'}
)lua";

// KEYS[1] the key: its parts dropped, then the key; whether it existed.
constexpr char kDelete[] = KVTIER_DROP_PARTS_LUA R"lua(
drop_parts(KEYS[1], nil)
return {redis.call('DEL', KEYS[1])}
)lua";

}  // namespace

std::string RemoteStore::Nonce() {
  absl::BitGen gen;
  return absl::StrFormat("%016x%016x", absl::Uniform<uint64_t>(gen), absl::Uniform<uint64_t>(gen));
}

absl::StatusOr<std::optional<std::string>> RemoteStore::StoreParts(const std::string& value) {
  const uint64_t part = std::max<uint64_t>(1, options_.part_bytes);
  if (value.size() <= part) return std::nullopt;
  const std::string nonce = Nonce();
  const uint64_t parts = (value.size() + part - 1) / part;
  if (parts > kMaxParts) {  // the scripts would take its manifest for a damaged one
    return absl::InvalidArgumentError(absl::StrCat(
        "remote ", address_, ": a value of ", value.size(), " bytes would take ", parts,
        " parts of ", part, " bytes, past the ", kMaxParts, " a manifest may name"));
  }
  const std::string manifest = absl::StrCat(kPartsMagic, nonce, " ", parts, " ", value.size());
  const std::string ttl = absl::StrCat(std::max<uint64_t>(1, options_.part_ttl_ms));
  for (uint64_t i = 0; i < parts; ++i) {
    const std::string key = PartKey(nonce, i);
    if (auto r = Command({"SET", key, std::string_view(value).substr(i * part, part), "PX", ttl});
        !r.ok()) {
      DropParts(manifest).IgnoreError();  // those written so far, as far as Redis lets
      return r.status();
    }
  }
  return manifest;
}

absl::StatusOr<std::string> RemoteStore::LoadParts(std::string stored) {
  const std::optional<Manifest> m = ParseManifest(stored);
  if (!m) return stored;
  std::string value;
  for (uint64_t i = 0; i < m->parts; ++i) {
    const std::string key = PartKey(m->nonce, i);
    ASSIGN_OR_RETURN(Reply r, Command({"GET", key}));
    if (r.type == REDIS_REPLY_NIL) {
      return absl::DataLossError(absl::StrCat("remote ", address_, ": part ", i, " of ", m->parts,
                                              " (", key, ") is missing"));
    }
    // The first part's size and the manifest's agree (every part but the last is as large),
    // or the manifest is damaged: it must not make this daemon reserve what it never reads.
    if (i == 0 && (r.str.empty() || m->parts != (m->bytes + r.str.size() - 1) / r.str.size())) {
      return absl::DataLossError(absl::StrCat("remote ", address_, ": a manifest of ", m->parts,
                                              " parts and ", m->bytes, " bytes, whose first ",
                                              "part holds ", r.str.size()));
    }
    if (i == 0) value.reserve(m->bytes);
    value += r.str;
  }
  if (value.size() != m->bytes) {
    return absl::DataLossError(absl::StrCat("remote ", address_, ": the ", m->parts, " parts of ",
                                            m->nonce, " hold ", value.size(), " bytes, not ",
                                            m->bytes));
  }
  return value;
}

absl::Status RemoteStore::DropParts(std::string_view stored) {
  const std::optional<Manifest> m = ParseManifest(stored);
  absl::Status status;
  for (uint64_t i = 0; m && i < m->parts; ++i) {
    const std::string key = PartKey(m->nonce, i);
    if (auto r = Command({"DEL", key}); !r.ok()) status.Update(r.status());
  }
  return status;
}

bool RemoteStore::IsManifest(std::string_view stored) { return ParseManifest(stored).has_value(); }

absl::Status RemoteStore::Settle(const std::string& key, std::string_view stored,
                                 absl::Status failed) {
  if (!IsManifest(stored)) return failed;  // no parts
  auto held = Eval("return {redis.call('GETRANGE', KEYS[1], 0, ARGV[1])}", {key},
                   {absl::StrCat(kManifestBytes - 1)});
  if (!held.ok()) return failed;  // unknown still: the parts stay
  if (!held->empty() && (*held)[0] == stored) return absl::OkStatus();
  DropParts(stored).IgnoreError();
  return failed;
}

absl::Status RemoteStore::PartsGone(std::string_view stored) {
  DropParts(stored).IgnoreError();
  return absl::UnavailableError(absl::StrCat(
      "remote ", address_, ": a part of the value was gone before its manifest was stored (it ",
      "expired, its writing slower than ", options_.part_ttl_ms,
      " ms, or Redis evicted it): nothing stored"));
}

absl::Status RemoteStore::Put(const std::string& key, const std::string& value) {
  ASSIGN_OR_RETURN(const std::optional<std::string> manifest, StoreParts(value));
  const std::string& stored = manifest ? *manifest : value;
  auto r = Eval(kReplace, {key}, {stored});
  if (!r.ok()) return Settle(key, stored, r.status());
  if (!r->empty() && (*r)[0] == "parts gone") return PartsGone(stored);
  return absl::OkStatus();
}

absl::StatusOr<std::optional<std::string>> RemoteStore::Get(const std::string& key) {
  auto r = Command({"GET", key});
  if (!r.ok()) return r.status();
  if (r->type == REDIS_REPLY_NIL) return std::optional<std::string>();
  ASSIGN_OR_RETURN(std::string value, LoadParts(std::move(r->str)));
  return std::optional<std::string>(std::move(value));
}

absl::StatusOr<bool> RemoteStore::Delete(const std::string& key) {
  ASSIGN_OR_RETURN(auto r, Eval(kDelete, {key}, {}));
  return !r.empty() && r[0] == "1";
}

absl::StatusOr<std::vector<std::optional<std::string>>> RemoteStore::Eval(
    std::string_view script, const std::vector<std::string_view>& keys,
    const std::vector<std::string_view>& args) {
  const std::string nkeys = absl::StrCat(keys.size());
  std::vector<std::string_view> argv = {"EVAL", script, nkeys};
  argv.insert(argv.end(), keys.begin(), keys.end());
  argv.insert(argv.end(), args.begin(), args.end());
  ASSIGN_OR_RETURN(Reply r, Command(argv));
  if (r.type != REDIS_REPLY_ARRAY) {
    return absl::InternalError(absl::StrCat("remote ", address_, ": a script answered no array"));
  }
  return std::move(r.elements);
}

absl::StatusOr<bool> RemoteStore::Exists(const std::string& key) {
  auto r = Command({"EXISTS", key});
  if (!r.ok()) return r.status();
  return r->integer > 0;
}

}  // namespace kvtier
