// SessionManager: ids, limits and tenants; the remote tier below the host tier.
#include "server/session/session_manager.h"

#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <csignal>
#include <future>
#include <mutex>
#include <optional>
#include <thread>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_split.h"
#include "kvtier/local_daemon.h"
#include "server/common/error.h"
#include "server/session/remote_records.h"
#include "server/session/session_record.h"
#include "server/tier/remote_store.h"
#include "tests/session_fixture.h"

namespace kvtier {
namespace {

using namespace ::kvtier::testing;

TEST(SessionManager, LimitsIdsAndTenants) {
  Env e;
  ServerOptions o;
  o.max_sessions = 2;
  o.default_policy = BuiltinPolicy();
  o.quotas["carol"].max_sessions = 1;
  SessionManager m(o, e.env, /*remote=*/nullptr);
  v1::CreateSessionRequest req = SmallestSession();
  ASSERT_OK_AND_ASSIGN(auto a, m.Create("alice", req));
  EXPECT_EQ(a.policy().sink_tokens(), 16u);  // the effective policy comes back
  req.set_session_id("has space");
  EXPECT_THAT(m.Create("alice", req), StatusIs(Code::kInvalidArgument, "session_id"));
  req.set_session_id(a.session_id());
  EXPECT_THAT(m.Create("alice", req), StatusIs(Code::kAlreadyExists));
  req.set_session_id("bob-1");
  ASSERT_OK(m.Create("bob", req).status());
  req.set_session_id("third");
  EXPECT_THAT(m.Create("alice", req), StatusIs(Code::kResourceExhausted, "max_sessions"));
  {  // a tenant's own quota, below the daemon's limit
    ServerOptions q = o;
    q.max_sessions = 100;
    SessionManager quota(q, e.env, /*remote=*/nullptr);
    req.set_session_id("c1");
    ASSERT_OK(quota.Create("carol", req).status());
    req.set_session_id("c2");
    EXPECT_THAT(quota.Create("carol", req),
                StatusIs(Code::kResourceExhausted, "quota: tenant \"carol\" max_sessions 1"));
    ASSERT_OK(quota.Create("dave", req).status());
    v1::ForkSessionRequest fork;
    fork.set_session_id("c1");
    EXPECT_THAT(quota.Fork("carol", fork), StatusIs(Code::kResourceExhausted, "quota"));
  }
  EXPECT_THAT(m.Get("alice", "bob-1"), StatusIs(Code::kPermissionDenied));
  EXPECT_OK(m.Get("", "bob-1").status());  // the admin view
  EXPECT_THAT(m.Get("alice", "nope"), StatusIs(Code::kNotFound, "nope"));
  EXPECT_THAT(m.Close("alice", "bob-1"), StatusIs(Code::kPermissionDenied));
  ASSERT_OK_AND_ASSIGN(bool existed, m.Close("bob", "bob-1"));
  EXPECT_TRUE(existed);
  ASSERT_OK_AND_ASSIGN(existed, m.Close("bob", "bob-1"));
  EXPECT_FALSE(existed);
  v1::ForkSessionRequest fork;
  fork.set_session_id(a.session_id());
  fork.set_new_session_id(a.session_id());
  EXPECT_THAT(m.Fork("alice", fork), StatusIs(Code::kAlreadyExists, "new_session_id"));
  fork.set_new_session_id("");
  ASSERT_OK_AND_ASSIGN(auto forked, m.Fork("alice", fork));
  EXPECT_NE(forked.session_id(), a.session_id());
  EXPECT_EQ(m.size(), 2u);
}

// A remote tier for a manager: redis-server, and a connection to it.
struct Remote {
  explicit Remote(RemoteStore::Options options = {}) {
    // As kvtierd's main does: a write to a connection Redis closed is EPIPE, not a signal
    // (before, a test of it alone died of SIGPIPE; run after others, it passed).
    signal(SIGPIPE, SIG_IGN);
    EXPECT_TRUE(redis.started()) << "redis-server did not start (scripts/install-deps)";
    auto connected = RemoteStore::Connect(redis.address(), options);
    EXPECT_TRUE(connected.ok()) << connected.status();
    if (connected.ok()) store = *std::move(connected);
  }
  LocalRedis redis;
  std::unique_ptr<RemoteStore> store;
};

// A redis-server frozen (SIGSTOP) for the guard's life, a hung Redis: thawed when the guard
// goes, even when an assertion ends the test first. A test whose futures may still wait on
// Redis then declares it after them, so that it goes (and thaws) before they are joined.
struct Frozen {
  explicit Frozen(LocalRedis& r) : redis(r) { redis.Pause(); }
  ~Frozen() { redis.Resume(); }
  LocalRedis& redis;
};

// A Redis slow for one session alone: a proxy in front of a redis-server (its Unix socket)
// that forwards every connection both ways, and holds back the command it is told to (a
// client's write holding `match`, past the first `skip` such) until Release.
class HoldingProxy {
 public:
  explicit HoldingProxy(const LocalRedis& redis)
      : target_(redis.address().substr(5)), path_(dir_.path() + "/proxy.sock") {
    listener_ = socket(AF_UNIX, SOCK_STREAM, 0);
    const sockaddr_un addr = At(path_);
    EXPECT_EQ(bind(listener_, reinterpret_cast<const sockaddr*>(&addr), sizeof addr), 0);
    EXPECT_EQ(listen(listener_, 16), 0);
    accept_ = std::thread([this] { Accept(); });
  }
  ~HoldingProxy() {
    Release();
    stop_ = true;
    accept_.join();
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (int fd : fds_) shutdown(fd, SHUT_RDWR);  // each pump's read returns
    }
    for (std::thread& t : pumps_) t.join();
    for (int fd : fds_) close(fd);
    close(listener_);
  }
  std::string address() const { return "unix:" + path_; }

  void Hold(std::string match, int skip) {
    std::lock_guard<std::mutex> lock(mu_);
    match_ = std::move(match);
    skip_ = skip;
    seen_ = 0;
    holding_ = released_ = false;
  }
  // Whether the command is held back now, waiting `within` at most for it to come.
  bool WaitHeld(std::chrono::seconds within) {
    std::unique_lock<std::mutex> lock(mu_);
    return cv_.wait_for(lock, within, [&] { return holding_; });
  }
  // Whether `n` commands that match have come since Hold (each held until Release), waiting
  // `within` at most.
  bool WaitSeen(int n, std::chrono::seconds within) {
    std::unique_lock<std::mutex> lock(mu_);
    return cv_.wait_for(lock, within, [&] { return seen_ >= n; });
  }
  void Release() {
    std::lock_guard<std::mutex> lock(mu_);
    match_.clear();
    released_ = true;
    cv_.notify_all();
  }

 private:
  static sockaddr_un At(const std::string& path) {
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::snprintf(addr.sun_path, sizeof addr.sun_path, "%s", path.c_str());
    return addr;
  }
  void Accept() {
    while (!stop_) {
      pollfd p{listener_, POLLIN, 0};
      if (poll(&p, 1, 20) != 1) continue;
      const int client = accept(listener_, nullptr, nullptr);
      if (client < 0) continue;
      const int server = socket(AF_UNIX, SOCK_STREAM, 0);
      const sockaddr_un addr = At(target_);
      EXPECT_EQ(connect(server, reinterpret_cast<const sockaddr*>(&addr), sizeof addr), 0);
      std::lock_guard<std::mutex> lock(mu_);
      fds_.insert(fds_.end(), {client, server});
      pumps_.emplace_back([this, client, server] { Pump(client, server, true); });
      pumps_.emplace_back([this, client, server] { Pump(server, client, false); });
    }
  }
  void Pump(int from, int to, bool commands) {
    char buf[1 << 16];
    for (;;) {
      const ssize_t n = read(from, buf, sizeof buf);
      if (n <= 0) break;
      if (commands) Check(std::string_view(buf, static_cast<size_t>(n)));
      for (ssize_t sent = 0; sent < n;) {
        const ssize_t k = write(to, buf + sent, static_cast<size_t>(n - sent));
        if (k <= 0) return;
        sent += k;
      }
    }
    shutdown(to, SHUT_WR);
  }
  // Holds the caller here while the command matches and Release has not come: the commands
  // that match until then (the hold then ends, so that a test failing with one held never
  // waits on others).
  void Check(std::string_view command) {
    std::unique_lock<std::mutex> lock(mu_);
    if (match_.empty() || command.find(match_) == std::string_view::npos) return;
    if (skip_-- > 0) return;
    ++seen_;
    holding_ = true;
    cv_.notify_all();
    cv_.wait(lock, [&] { return released_; });
    match_.clear();
  }

  TempDir dir_;
  const std::string target_, path_;
  int listener_ = -1;
  std::atomic<bool> stop_{false};
  std::thread accept_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::string match_;  // empty: nothing held
  int skip_ = 0, seen_ = 0;
  bool holding_ = false, released_ = false;
  std::vector<int> fds_;
  std::vector<std::thread> pumps_;
};

ServerOptions Options() {
  ServerOptions o;
  o.default_policy = BuiltinPolicy();
  return o;
}

// One layer, one KV head, head_dim 64, lossless: a 16-token chunk is one 4 KiB slot.
v1::CreateSessionRequest SmallSession(const std::string& id) {
  v1::CreateSessionRequest req;
  req.set_session_id(id);
  req.mutable_shape()->set_num_layers(1);
  req.mutable_shape()->set_num_q_heads(1);
  req.mutable_shape()->set_num_kv_heads(1);
  req.mutable_shape()->set_head_dim(64);
  req.mutable_policy()->set_lossless(true);
  return req;
}

v1::AppendKVRequest Tokens(const std::string& id, int start, int n) {
  std::mt19937 rng(start + 1);
  v1::AppendKVRequest r;
  r.set_session_id(id);
  r.set_start_token(start);
  r.set_num_tokens(n);
  r.set_keys(AsBytes(RandomHalfs(size_t(n) * 64, rng)));
  r.set_values(AsBytes(RandomHalfs(size_t(n) * 64, rng)));
  return r;
}

// An append run through the manager, with its retries.
absl::Status RunAppend(SessionManager& m, const std::string& tenant, const v1::AppendKVRequest& r) {
  return m.Run(tenant, r.session_id(),
               [&](const std::shared_ptr<Session>& s) { return s->Append(r).status(); });
}

// A manager over tiers of `host_capacity` bytes with a remote tier, and session "s" of tenant
// "t" holding 32 tokens.
struct RemoteManager {
  explicit RemoteManager(uint64_t host_capacity = 64 << 20) : e(host_capacity) {
    EXPECT_OK(m.Create("t", SmallSession("s")).status());
    EXPECT_OK(RunAppend(m, "t", Tokens("s", 0, 32)));
  }
  const ServerOptions options = Options();
  Remote remote;
  Env e;
  SessionManager m{options, e.env, remote.store.get()};
};

// A write-behind pass asks its stop before each session: a shutdown ends it there (each put may
// wait on a hung Redis), and the next pass stores what was left.
TEST(SessionManager, AWriteBehindPassEndsWhenToldToStop) {
  Remote remote;
  Env e;
  ServerOptions o = Options();
  o.persist_interval_ms = 1000;
  SessionManager m(o, e.env, remote.store.get());
  for (const char* id : {"a", "b", "c"}) {
    ASSERT_OK(m.Create("t", SmallSession(id)).status());
    ASSERT_OK(RunAppend(m, "t", Tokens(id, 0, 32)));
  }
  int asked = 0;
  const SessionManager::PersistCounts cut = m.PersistChanged([&] { return ++asked > 1; });
  EXPECT_EQ(cut.sessions, 1u);
  EXPECT_EQ(asked, 2);
  EXPECT_EQ(m.PersistChanged().sessions, 2u);  // the two it left
  EXPECT_EQ(m.PersistChanged().sessions, 0u);
}

TEST(SessionManager, AFullHostTierDemotesTheLeastRecentlyUsedIdleSessionAndTriesAgain) {
  Remote remote;
  Env e(/*host_capacity=*/8 * 4096);
  const ServerOptions o = Options();
  SessionManager m(o, e.env, remote.store.get());
  for (const char* id : {"old", "new"}) {
    ASSERT_OK(m.Create("t", SmallSession(id)).status());
    ASSERT_OK(RunAppend(m, "t", Tokens(id, 0, 64)));  // 4 slots each: the tier is full
    e.clock.AdvanceMs(10);
  }
  ASSERT_OK(RunAppend(m, "t", Tokens("new", 64, 16)));  // a fifth slot for "new"
  EXPECT_EQ(m.remote_counters().demotions, 1u);
  ASSERT_OK_AND_ASSIGN(bool there, remote.store->Exists(RecordKey("old")));
  EXPECT_TRUE(there);
  EXPECT_FALSE(*remote.store->Exists(RecordKey("new")));
  ASSERT_OK_AND_ASSIGN(auto s, m.Get("t", "new"));
  EXPECT_EQ(s->Info().num_tokens(), 80u);
}

// A session's metadata is the tenant's too: a shape of 65,536 streams and no tokens (some
// 10 MiB of stream records) is refused by a 1 MiB quota, and by a small host tier, before it
// is made; what a session holds is charged while it lives and given back when it closes.
TEST(SessionManager, SessionMetadataCountsAgainstTheQuotaAndTheTier) {
  Env e(64 << 20, 16 << 20,
        [](const std::string& tenant) -> uint64_t { return tenant == "small" ? 1 << 20 : 0; });
  const ServerOptions o = Options();
  SessionManager m(o, e.env, /*remote=*/nullptr);
  v1::CreateSessionRequest wide = SmallSession("wide");
  wide.mutable_shape()->set_num_layers(4096);
  wide.mutable_shape()->set_num_q_heads(16);
  wide.mutable_shape()->set_num_kv_heads(16);
  const absl::Status refused = m.Create("small", wide).status();
  EXPECT_THAT(refused, StatusIs(Code::kResourceExhausted, "session metadata"));
  EXPECT_EQ(ReasonOf(refused), ErrorReason::kQuota);
  EXPECT_EQ(e.host.Stats().metadata_bytes, 0u);
  EXPECT_FALSE(m.Get("small", "wide").ok());

  ASSERT_OK(m.Create("small", SmallSession("s")).status());
  ASSERT_OK(RunAppend(m, "small", Tokens("s", 0, 64)));
  ASSERT_OK_AND_ASSIGN(auto s, m.Get("small", "s"));
  const uint64_t held = s->Info().metadata_bytes();
  EXPECT_GT(held, 4 * sizeof(Chunk));
  EXPECT_EQ(e.host.Stats().metadata_bytes, held);
  EXPECT_EQ(e.host.TenantUsed("small"), 4 * 4096 + held);
  ASSERT_OK(m.Close("small", "s").status());
  s.reset();
  EXPECT_EQ(e.host.Stats().metadata_bytes, 0u);
  EXPECT_EQ(e.host.TenantUsed("small"), 0u);

  // No quota, a small tier: the tier's own limit.
  Env tiny(1 << 20);
  SessionManager local(o, tiny.env, /*remote=*/nullptr);
  const absl::Status full = local.Create("t", wide).status();
  EXPECT_THAT(full, StatusIs(Code::kResourceExhausted, "host tier full"));
  EXPECT_EQ(tiny.host.Stats().metadata_bytes, 0u);
}

TEST(SessionManager, AQuotaOrAMissingRemoteTierIsNotRelievedByDemotion) {
  // Room for one session of 64 tokens: 4 slots, and its metadata (measured on a twin of the
  // same tenant and session names, which the metadata counts; an append is refused when its
  // pre-counted growth would not fit, so a byte short is short).
  const ServerOptions twin_options = Options();
  const uint64_t meta = MetadataOfTwin([&](Env& twin) {
    SessionManager m(twin_options, twin.env, /*remote=*/nullptr);
    EXPECT_OK(m.Create("small", SmallSession("s")).status());
    EXPECT_OK(RunAppend(m, "small", Tokens("s", 0, 64)));
    return twin.host.Stats().metadata_bytes;
  });
  Remote remote;
  Env e(64 << 20, 16 << 20, [meta](const std::string& tenant) -> uint64_t {
    return tenant == "small" ? 4 * 4096 + meta : 0;
  });
  const ServerOptions o = Options();
  SessionManager m(o, e.env, remote.store.get());
  ASSERT_OK(m.Create("other", SmallSession("idle")).status());
  ASSERT_OK(RunAppend(m, "other", Tokens("idle", 0, 64)));
  ASSERT_OK(m.Create("small", SmallSession("s")).status());
  ASSERT_OK(RunAppend(m, "small", Tokens("s", 0, 64)));
  const absl::Status over = RunAppend(m, "small", Tokens("s", 64, 16));
  EXPECT_THAT(over, StatusIs(Code::kResourceExhausted, "quota"));
  EXPECT_EQ(ReasonOf(over), ErrorReason::kQuota);
  EXPECT_EQ(m.remote_counters().demotions, 0u);  // another tenant's idle session stays
  // Without a remote tier a full host tier is the answer as it is.
  Env full(4 * 4096 + meta);
  SessionManager local(o, full.env, /*remote=*/nullptr);
  ASSERT_OK(local.Create("small", SmallSession("s")).status());
  ASSERT_OK(RunAppend(local, "small", Tokens("s", 0, 64)));
  const absl::Status refused = RunAppend(local, "small", Tokens("s", 64, 1));
  EXPECT_THAT(refused, StatusIs(Code::kResourceExhausted, "host tier full"));
  EXPECT_EQ(ReasonOf(refused), ErrorReason::kHostTierFull);
}

TEST(SessionManager, ASessionMovedWhileACallWaitedIsRestoredAndTheCallRuns) {
  RemoteManager rm;
  SessionManager& m = rm.m;
  ASSERT_OK_AND_ASSIGN(std::shared_ptr<Session> stale, m.Get("t", "s"));
  ASSERT_OK(m.Demote("t", "s").status());
  // The object a call still holds says the session moved, with a reason, not only words.
  const absl::Status moved = stale->Append(Tokens("s", 32, 16)).status();
  EXPECT_THAT(moved, StatusIs(Code::kUnavailable, "remote tier"));
  EXPECT_EQ(ReasonOf(moved), ErrorReason::kSessionMoved);
  // So does every other call on it, those that only size or check a request too (they read
  // streams the moved session no longer holds: a Select found it just before it moved).
  v1::SelectRequest sel;
  sel.set_session_id("s");
  sel.set_layer(0);
  EXPECT_EQ(stale->ReplyBytesBound(sel), 0u);
  EXPECT_THAT(stale->CheckChunkIds({EncodeChunkId({0, 0, 0})}),
              StatusIs(Code::kUnavailable, "remote tier"));
  EXPECT_THAT(stale->ReadChunks({EncodeChunkId({0, 0, 0})}).status(),
              StatusIs(Code::kUnavailable, "remote tier"));
  // Its views too: never an empty list for a session whose chunks only moved.
  EXPECT_THAT(stale->ListChunks(std::nullopt, 100).status(),
              StatusIs(Code::kUnavailable, "remote tier"));
  EXPECT_THAT(stale->Layers().status(), StatusIs(Code::kUnavailable, "remote tier"));
  // Run restores it and applies the call there; the cached pointer follows.
  const auto r = Tokens("s", 32, 16);
  ASSERT_OK(m.Run(
      "t", "s", [&](const auto& s) { return s->Append(r).status(); }, &stale));
  EXPECT_FALSE(stale->demoted());
  EXPECT_EQ(stale->Info().num_tokens(), 48u);
  EXPECT_EQ(m.remote_counters().restores, 1u);
  EXPECT_FALSE(*rm.remote.store->Exists(RecordKey("s")));  // served from here only
}

// A restored session is held here again: it needs room under max_sessions and its tenant's
// quota as a new one does. Refused, it stays in the remote tier, whole, and is restored once
// a session closes.
// A manager with a remote tier under max_sessions 2, or (by_quota) under 100 and tenant "t"'s
// quota of `quota`, holding session "a" of "t" with 32 tokens.
struct Limited {
  Limited(bool by_quota, uint32_t quota)
      : options([&] {
          ServerOptions o = Options();
          o.max_sessions = by_quota ? 100 : 2;
          if (by_quota) o.quotas["t"].max_sessions = quota;
          return o;
        }()) {
    EXPECT_OK(m.Create("t", SmallSession("a")).status());
    EXPECT_OK(RunAppend(m, "t", Tokens("a", 0, 32)));
  }
  Remote remote;
  Env e;
  const ServerOptions options;
  SessionManager m{options, e.env, remote.store.get()};
};

TEST(SessionManager, ARestoreNeedsRoomUnderMaxSessionsAndTheTenantsQuota) {
  for (const bool by_quota : {false, true}) {
    SCOPED_TRACE(by_quota ? "the tenant's quota" : "max_sessions");
    Limited l(by_quota, /*quota=*/1);
    Remote& remote = l.remote;
    SessionManager& m = l.m;
    ASSERT_OK(m.Demote("t", "a").status());
    ASSERT_OK(m.Create("t", SmallSession("b")).status());
    if (!by_quota) {
      ASSERT_OK(m.Create("u", SmallSession("c")).status());
    }
    EXPECT_THAT(m.Get("t", "a"),
                StatusIs(Code::kResourceExhausted, by_quota ? "quota: tenant \"t\" max_sessions 1"
                                                            : "the daemon holds max_sessions 2"));
    EXPECT_THAT(m.Get("t", "a"), StatusIs(Code::kResourceExhausted, "stays in the remote tier"));
    EXPECT_TRUE(*remote.store->Exists(RecordKey("a")));
    EXPECT_EQ(m.size(), 2u - (by_quota ? 1 : 0));
    EXPECT_EQ(m.remote_counters().restores, 0u);
    // Another tenant, under its own quota, still creates (the refused restore holds no place).
    if (by_quota) {
      ASSERT_OK(m.Create("u", SmallSession("c")).status());
    }
    ASSERT_OK(m.Close("t", "b").status());
    ASSERT_OK_AND_ASSIGN(std::shared_ptr<Session> a, m.Get("t", "a"));
    EXPECT_EQ(a->Info().num_tokens(), 32u);
    EXPECT_FALSE(*remote.store->Exists(RecordKey("a")));
  }
}

// A manager over a Redis that holds back what HoldingProxy is told to, with sessions
// "slow-session", "quick-session" and "third" of tenant "t" (32 tokens each), the first two
// demoted, under max_sessions 3; `slow` restores slow-session once Hold has been called.
struct SlowRestore {
  SlowRestore() {
    EXPECT_TRUE(redis.started()) << "redis-server did not start (scripts/install-deps)";
    // Its commands wait longer than a test for a reply: a held one never times out meanwhile.
    auto connected = RemoteStore::Connect(proxy.address(), {.timeout_ms = 120'000});
    EXPECT_TRUE(connected.ok()) << connected.status();
    if (!connected.ok()) return;
    store = *std::move(connected);
    options.max_sessions = 3;
    m.emplace(options, e.env, store.get());
    for (const char* id : {"slow-session", "quick-session", "third"}) {
      EXPECT_OK(m->Create("t", SmallSession(id)).status());
      EXPECT_OK(RunAppend(*m, "t", Tokens(id, 0, 32)));
    }
    EXPECT_OK(m->Demote("t", "slow-session").status());
    EXPECT_OK(m->Demote("t", "quick-session").status());
  }
  ~SlowRestore() { proxy.Release(); }  // before `slow` waits on what the proxy holds
  // Starts slow-session's restore, held back at its Finish (the second command that names
  // it, after the import) until proxy.Release; false when it never got there.
  bool StartSlow() {
    proxy.Hold("slow-session", /*skip=*/1);
    slow = std::async(std::launch::async, [this] { return m->Get("t", "slow-session"); });
    return proxy.WaitHeld(std::chrono::seconds(20));
  }
  LocalRedis redis;
  HoldingProxy proxy{redis};
  std::unique_ptr<RemoteStore> store;
  Env e;
  ServerOptions options = Options();
  std::optional<SessionManager> m;
  std::future<absl::StatusOr<std::shared_ptr<Session>>> slow;
};

// Restores of different sessions go side by side: one whose Redis is slow (its Finish held
// back) keeps its place under max_sessions meanwhile, and another session's restore is not
// held up behind it. A second call for the slow one waits for it, and both get the one
// session, restored once.
TEST(SessionManager, RestoresOfDifferentSessionsGoSideBySide) {
  SlowRestore r;
  ASSERT_TRUE(r.m.has_value());
  SessionManager& m = *r.m;
  ASSERT_TRUE(r.StartSlow()) << "the slow restore never came";
  auto again = std::async(std::launch::async, [&] { return m.Get("t", "slow-session"); });
  auto quick = std::async(std::launch::async, [&] { return m.Get("t", "quick-session"); });
  absl::Cleanup release = [&] { r.proxy.Release(); };  // before the futures wait, however it ends
  const bool side_by_side = quick.wait_for(std::chrono::seconds(20)) == std::future_status::ready;
  EXPECT_TRUE(side_by_side) << "the quick restore waited for the slow one";
  if (side_by_side) {
    ASSERT_OK_AND_ASSIGN(std::shared_ptr<Session> q, quick.get());
    EXPECT_EQ(q->Info().num_tokens(), 32u);
    // third and quick-session held, slow-session on its way in: no room for a fourth.
    EXPECT_THAT(m.Create("t", SmallSession("fourth")),
                StatusIs(Code::kResourceExhausted, "max_sessions 3"));
    EXPECT_EQ(again.wait_for(std::chrono::milliseconds(100)), std::future_status::timeout)
        << "the second call for the slow session did not wait for its restore";
  }
  r.proxy.Release();
  ASSERT_OK_AND_ASSIGN(std::shared_ptr<Session> s, r.slow.get());
  ASSERT_OK_AND_ASSIGN(std::shared_ptr<Session> s2, again.get());
  EXPECT_EQ(s.get(), s2.get());
  EXPECT_EQ(s->Info().num_tokens(), 32u);
  EXPECT_EQ(m.remote_counters().restores, 2u);
  EXPECT_EQ(m.size(), 3u);
}

// A demotion of a session on its way in waits for the restore, then moves it down again:
// never NOT_FOUND for a session between its record and the map.
TEST(SessionManager, ADemotionDuringARestoreWaitsForIt) {
  SlowRestore r;
  ASSERT_TRUE(r.m.has_value());
  SessionManager& m = *r.m;
  ASSERT_TRUE(r.StartSlow()) << "the slow restore never came";
  auto demote = std::async(std::launch::async, [&] { return m.Demote("t", "slow-session"); });
  absl::Cleanup release = [&] { r.proxy.Release(); };  // before the future waits, however it ends
  EXPECT_EQ(demote.wait_for(std::chrono::milliseconds(100)), std::future_status::timeout)
      << "the demotion did not wait for the restore";
  r.proxy.Release();
  ASSERT_OK_AND_ASSIGN(std::shared_ptr<Session> s, r.slow.get());
  ASSERT_OK_AND_ASSIGN(uint64_t bytes, demote.get());
  EXPECT_GT(bytes, 0u);
  EXPECT_TRUE(s->demoted());
  EXPECT_TRUE(*r.store->Exists(RecordKey("slow-session")));
  EXPECT_EQ(m.size(), 1u);  // third
}

// A demotion whose reply from Redis is lost (its script ran, the answer came past the
// timeout) sends the script once more and goes by that answer: the session is in the remote
// tier and no longer held here. Before, the demotion failed UNAVAILABLE and the session
// stayed live here while its record, stored, let the id go to any daemon that asked.
TEST(SessionManager, ADemotionWhoseReplyIsLostStandsOnceRedisAnswers) {
  signal(SIGPIPE, SIG_IGN);  // the proxy writes the first reply to a connection closed
  LocalRedis redis;
  ASSERT_TRUE(redis.started()) << "redis-server did not start (scripts/install-deps)";
  HoldingProxy proxy(redis);
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<RemoteStore> store,
                       RemoteStore::Connect(proxy.address(), {.timeout_ms = 1000}));
  Env e;
  const ServerOptions options = Options();
  SessionManager m(options, e.env, store.get());
  ASSERT_OK(m.Create("t", SmallSession("lost-reply")).status());
  ASSERT_OK(RunAppend(m, "t", Tokens("lost-reply", 0, 32)));
  ASSERT_OK_AND_ASSIGN(std::shared_ptr<Session> s, m.Get("t", "lost-reply"));
  const std::vector<v1::BlockHandle> before = AllChunks(*s);
  s.reset();
  // The demotion's script held back past the store's timeout, and its second sending too; both
  // then reach Redis, the first's reply to a connection the store has given up.
  proxy.Hold("lost-reply", /*skip=*/0);
  auto demote = std::async(std::launch::async, [&] { return m.Demote("t", "lost-reply"); });
  absl::Cleanup release = [&] { proxy.Release(); };  // before the future waits, however it ends
  ASSERT_TRUE(proxy.WaitSeen(2, std::chrono::seconds(20))) << "the script was not sent again";
  proxy.Release();
  ASSERT_OK_AND_ASSIGN(const uint64_t bytes, demote.get());
  EXPECT_GT(bytes, 0u);
  EXPECT_EQ(m.size(), 0u) << "the demoted session is still held here";
  ASSERT_OK_AND_ASSIGN(bool stored, store->Exists(RecordKey("lost-reply")));
  EXPECT_TRUE(stored);
  EXPECT_EQ(m.remote_counters().demotions, 1u);
  ASSERT_OK_AND_ASSIGN(s, m.Get("t", "lost-reply"));  // restored
  EXPECT_EQ(m.remote_counters().restores, 1u);
  const std::vector<v1::BlockHandle> after = AllChunks(*s);
  ASSERT_EQ(after.size(), before.size());
  for (size_t i = 0; i < before.size(); ++i) {
    EXPECT_EQ(after[i].keys(), before[i].keys()) << i;
    EXPECT_EQ(after[i].values(), before[i].values()) << i;
  }
}

// A session demoted and not yet out of the map (its demotion between the record's write and
// the map's removal) holds no place under max_sessions or its tenant's quota: its restore,
// asked for in that moment, is not refused for the room it takes itself.
TEST(SessionManager, ASessionOnItsWayOutHoldsNoPlace) {
  for (const bool by_quota : {false, true}) {
    SCOPED_TRACE(by_quota ? "the tenant's quota" : "max_sessions");
    Limited l(by_quota, /*quota=*/2);
    ASSERT_NE(l.remote.store, nullptr);
    Remote& remote = l.remote;
    SessionManager& m = l.m;
    ASSERT_OK(m.Create("t", SmallSession("b")).status());
    // The demotion's first half, as SessionManager::Demote does it (the record stored and the
    // id let go, by this daemon's name), without its second (the map's removal).
    ASSERT_OK_AND_ASSIGN(std::shared_ptr<Session> a, m.Get("t", "a"));
    ASSERT_OK_AND_ASSIGN(std::optional<std::string> self, remote.store->Get("kvtier:owner:a"));
    ASSERT_TRUE(self.has_value());
    RemoteRecords records(remote.store.get(), *self);
    auto store = [&](const v1::SessionRecord& r) -> absl::Status {
      absl::StatusOr<std::string> bytes = EncodeRecord(r);
      return bytes.ok() ? records.Put("a", *bytes) : bytes.status();
    };
    ASSERT_OK(a->Demote(store).status());
    ASSERT_OK_AND_ASSIGN(std::shared_ptr<Session> back, m.Get("t", "a"));  // restored
    EXPECT_EQ(back->Info().num_tokens(), 32u);
    EXPECT_EQ(m.size(), 2u);
  }
}

TEST(SessionManager, CloseOfADemotedSessionDeletesItsRecordForItsOwnerOnly) {
  RemoteManager rm;
  SessionManager& m = rm.m;
  ASSERT_OK(m.Demote("t", "s").status());
  EXPECT_THAT(m.Close("mallory", "s"), StatusIs(Code::kPermissionDenied));
  ASSERT_OK_AND_ASSIGN(bool existed, m.Close("t", "s"));
  EXPECT_TRUE(existed);
  EXPECT_FALSE(*rm.remote.store->Exists(RecordKey("s")));
  ASSERT_OK_AND_ASSIGN(existed, m.Close("t", "s"));
  EXPECT_FALSE(existed);
  EXPECT_THAT(m.Get("t", "s"), StatusIs(Code::kNotFound));
}

// A restore's Finish is idempotent: sent again after its reply was lost (the store resends a
// command whose connection dropped), it finds the id this daemon's and the record gone, and
// is done; the restored session was thrown away (and lost) before. A record closed elsewhere
// meanwhile is still NOT_FOUND, and another daemon's Finish after it is refused.
TEST(RemoteRecords, AFinishSentAgainIsDone) {
  Remote remote;
  ASSERT_NE(remote.store, nullptr);
  RemoteRecords a(remote.store.get(), "daemon-a"), b(remote.store.get(), "daemon-b");
  ASSERT_OK(a.Put("x", "record"));
  ASSERT_OK(a.Finish("x"));
  EXPECT_OK(a.Finish("x"));  // its reply lost, sent again
  EXPECT_THAT(b.Finish("x"), StatusIs(Code::kNotFound, "is held by kvtierd \"daemon-a\""));
  ASSERT_OK(a.Put("y", "record"));
  ASSERT_OK_AND_ASSIGN(const bool dropped, b.Drop("y"));  // closed on another daemon
  EXPECT_TRUE(dropped);
  EXPECT_THAT(a.Finish("y"), StatusIs(Code::kNotFound, "was closed while it was restored"));
}

// A put sent again (its first reply lost) with its token finds that the first ran, and is
// done, whatever another daemon did with the record meanwhile: restored it (the second once
// answered that daemon held the id, and the session stayed live on both), closed it (the
// second stored the closed record again), or restored and demoted it anew (the second wrote
// the older record over the newer). A put with a token of its own still runs.
TEST(RemoteRecords, APutSentAgainIsDoneWhateverBecameOfItsRecord) {
  Remote remote;
  ASSERT_NE(remote.store, nullptr);
  RemoteRecords a(remote.store.get(), "daemon-a"), b(remote.store.get(), "daemon-b");
  ASSERT_OK(a.Put("x", "record", "token-1"));
  ASSERT_OK_AND_ASSIGN(std::optional<std::string> got, b.Get("x"));  // restored on b
  ASSERT_OK(b.Finish("x"));
  EXPECT_OK(a.Put("x", "record", "token-1"));
  EXPECT_FALSE(*remote.store->Exists(RecordKey("x")));
  ASSERT_OK_AND_ASSIGN(const std::optional<std::string> owner, remote.store->Get("kvtier:owner:x"));
  EXPECT_EQ(owner, std::optional<std::string>("daemon-b"));
  EXPECT_THAT(a.Put("x", "record", "token-2"),
              StatusIs(Code::kFailedPrecondition, "is held by kvtierd \"daemon-b\""));
  ASSERT_OK(a.Put("y", "record", "token-3"));
  ASSERT_OK_AND_ASSIGN(const bool dropped, b.Drop("y"));  // closed on b
  EXPECT_TRUE(dropped);
  EXPECT_OK(a.Put("y", "record", "token-3"));
  EXPECT_FALSE(*remote.store->Exists(RecordKey("y"))) << "the closed record was stored again";
  // Restored on b and demoted anew there (a put of b's own): a's second sending leaves the
  // newer record alone.
  ASSERT_OK(a.Put("z", "older", "token-4"));
  ASSERT_OK(b.Get("z").status());
  ASSERT_OK(b.Finish("z"));
  ASSERT_OK(b.Put("z", "newer", "token-5"));
  EXPECT_OK(a.Put("z", "older", "token-4"));
  ASSERT_OK_AND_ASSIGN(got, b.Get("z"));
  EXPECT_EQ(got, std::optional<std::string>("newer"));
}

// Letting a live session's hold go never deletes a record of its id: one there is another
// session's (demoted before this one was made while Redis was out of reach, so that its claim
// went unchecked), which a close of this one once deleted.
TEST(RemoteRecords, ReleasingAHoldLeavesARecordOfTheIdAlone) {
  Remote remote;
  ASSERT_NE(remote.store, nullptr);
  RemoteRecords a(remote.store.get(), "daemon-a");
  ASSERT_OK(a.Put("x", "demoted"));
  ASSERT_OK(a.Release("x"));
  ASSERT_OK_AND_ASSIGN(std::optional<std::string> kept, a.Get("x"));
  EXPECT_EQ(kept, std::optional<std::string>("demoted"));
  ASSERT_OK_AND_ASSIGN(const bool claimed, a.Claim("y"));
  EXPECT_TRUE(claimed);
  ASSERT_OK(a.Release("y"));
  ASSERT_OK_AND_ASSIGN(const bool again, a.Claim("y"));  // let go: claimed anew
  EXPECT_TRUE(again);
}

// Redis closing the connection (a restart, an idle timeout; here CLIENT KILL) costs no call an
// error: the command that finds it closed is sent again on a new connection.
TEST(RemoteStore, TheFirstCallAfterTheServerDropsTheConnectionSucceeds) {
  Remote remote;
  ASSERT_NE(remote.store, nullptr);
  ASSERT_OK(remote.store->Put("k", "v"));
  const std::string sock = remote.redis.address().substr(5);  // "unix:PATH"
  auto [rc, out] = RunCommand("redis-cli -s " + sock + " CLIENT KILL TYPE normal 2>&1");
  ASSERT_EQ(rc, 0) << out;
  ASSERT_OK_AND_ASSIGN(std::optional<std::string> got, remote.store->Get("k"));
  EXPECT_EQ(got, std::optional<std::string>("v"));
}

// With Redis down, new sessions are still created (the remote tier delays only the calls that
// need it); their ids are checked against this daemon's sessions alone.
TEST(SessionManager, NewSessionsAreCreatedWhileRedisIsDown) {
  // As kvtierd's main does: a write to the dead server is EPIPE, not a signal.
  signal(SIGPIPE, SIG_IGN);
  auto redis = std::make_unique<LocalRedis>();
  ASSERT_TRUE(redis->started());
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<RemoteStore> store, RemoteStore::Connect(redis->address()));
  redis.reset();  // stopped
  const ServerOptions options = Options();
  Env e;
  SessionManager m{options, e.env, store.get()};
  ASSERT_OK(m.Create("t", SmallSession("while-down")).status());
  ASSERT_OK(RunAppend(m, "t", Tokens("while-down", 0, 16)));
  EXPECT_THAT(m.Create("t", SmallSession("while-down")), StatusIs(Code::kAlreadyExists));
}

// A close that waits on Redis (here: a frozen redis-server) holds no lock that lookups need:
// other sessions are served meanwhile.
// A close that takes a session while its demotion stores the record (the demotion holds the
// session; the close waits for it) removes that record too: the closed session does not come
// back on the id's next use, and the id is free again.
TEST(SessionManager, ACloseDuringADemotionRemovesTheRecordItStored) {
  RemoteManager rm;
  SessionManager& m = rm.m;
  Frozen frozen(rm.remote.redis);
  auto demoting = std::async(std::launch::async, [&] { return m.Demote("t", "s"); });
  ASSERT_EQ(demoting.wait_for(std::chrono::milliseconds(300)), std::future_status::timeout)
      << "the demotion should be storing the record in the frozen Redis";
  auto closing = std::async(std::launch::async, [&] { return m.Close("t", "s"); });
  absl::SleepFor(absl::Milliseconds(300));  // the close has taken it and waits for the demotion
  rm.remote.redis.Resume();
  ASSERT_OK(demoting.get().status());
  ASSERT_OK_AND_ASSIGN(const bool closed, closing.get());
  EXPECT_TRUE(closed);
  RemoteRecords records(rm.remote.store.get(), "anyone");
  ASSERT_OK_AND_ASSIGN(std::optional<std::string> left, records.Get("s"));
  EXPECT_FALSE(left.has_value()) << "the closed session's record stayed in the remote tier";
  EXPECT_THAT(m.Get("t", "s").status(), StatusIs(Code::kNotFound));
  EXPECT_OK(m.Create("t", SmallSession("s")).status());
}

// The metrics' read of a session's aging backlog never waits for the session: a demotion that
// holds it across its Redis write (a frozen redis-server here) does not stall a scrape for as
// long as the write takes. (Its count against the session's own: aging_pool_test.)
TEST(SessionManager, TheBacklogReadForMetricsDoesNotWaitForADemotion) {
  RemoteManager rm;
  SessionManager& m = rm.m;
  ASSERT_OK_AND_ASSIGN(std::shared_ptr<Session> s, m.Get("t", "s"));
  Frozen frozen(rm.remote.redis);
  auto demoting = std::async(std::launch::async, [&] { return m.Demote("t", "s"); });
  ASSERT_EQ(demoting.wait_for(std::chrono::milliseconds(300)), std::future_status::timeout)
      << "the demotion should be storing the record in the frozen Redis";
  auto read = std::async(std::launch::async, [&] { return s->aging_backlog_tokens(); });
  const bool answered = read.wait_for(std::chrono::seconds(2)) == std::future_status::ready;
  rm.remote.redis.Resume();
  EXPECT_TRUE(answered) << "the read waited for the demotion's Redis write";
  read.get();
  ASSERT_OK(demoting.get().status());
}

TEST(SessionManager, ACloseWaitingOnRedisDoesNotBlockLookups) {
  RemoteManager rm;
  SessionManager& m = rm.m;
  ASSERT_OK(m.Create("t", SmallSession("away")).status());
  ASSERT_OK(m.Demote("t", "away").status());
  std::future<absl::StatusOr<bool>> closing;
  std::future<absl::StatusOr<std::shared_ptr<Session>>> lookup;
  Frozen frozen(rm.remote.redis);
  closing = std::async(std::launch::async, [&] { return m.Close("t", "away"); });
  ASSERT_EQ(closing.wait_for(std::chrono::milliseconds(300)), std::future_status::timeout)
      << "the close should be waiting on the frozen Redis";
  lookup = std::async(std::launch::async, [&] { return m.Get("t", "s"); });
  const bool served = lookup.wait_for(std::chrono::seconds(5)) == std::future_status::ready;
  rm.remote.redis.Resume();
  EXPECT_TRUE(served) << "a lookup waited on another call's Redis I/O";
  EXPECT_OK(lookup.get().status());
  ASSERT_OK_AND_ASSIGN(bool existed, closing.get());
  EXPECT_TRUE(existed);
}

}  // namespace
}  // namespace kvtier

namespace kvtier {
namespace {

// The keys Redis holds that match `pattern`, counted by a script.
size_t Keys(RemoteStore& store, const std::string& pattern) {
  auto r = store.Eval("return {#redis.call('KEYS', ARGV[1])}", {}, {pattern});
  EXPECT_TRUE(r.ok()) << r.status();
  return r.ok() && !r->empty() && (*r)[0] ? std::stoul(*(*r)[0]) : 0;
}

// `n` bytes from `rng`.
std::string RandomBytes(std::mt19937& rng, size_t n) {
  std::string v(n, '\0');
  for (char& c : v) c = static_cast<char>(rng());
  return v;
}

// What the key itself holds (a manifest, for a value in parts), read by a script.
std::string Raw(RemoteStore& store, const std::string& key) {
  auto r = store.Eval("return {redis.call('GET', KEYS[1])}", {key}, {});
  return r.ok() && !r->empty() && (*r)[0] ? *(*r)[0] : "";
}

// A value larger than a part is stored in parts under keys of their own, its key holding
// their manifest, and read back whole; replacing or deleting the value drops its parts, and
// a part gone is DATA_LOSS naming it, never a shorter value.
TEST(RemoteStore, AValueLargerThanAPartIsStoredInPartsAndReadBackWhole) {
  Remote remote({.part_bytes = 1000});
  ASSERT_NE(remote.store, nullptr);
  RemoteStore& store = *remote.store;
  std::mt19937 rng(7);
  auto bytes = [&](size_t n) { return RandomBytes(rng, n); };
  const std::string big = bytes(10'500);
  ASSERT_OK(store.Put("k", big));
  EXPECT_THAT(Raw(store, "k"), ::testing::StartsWith("KVPARTS1 "));
  EXPECT_EQ(Keys(store, "kvtier:part:*"), 11u);
  ASSERT_OK_AND_ASSIGN(std::optional<std::string> got, store.Get("k"));
  EXPECT_EQ(got, big);
  const std::string other = bytes(3'000);  // replaced: the old parts go
  ASSERT_OK(store.Put("k", other));
  EXPECT_EQ(Keys(store, "kvtier:part:*"), 3u);
  ASSERT_OK_AND_ASSIGN(got, store.Get("k"));
  EXPECT_EQ(got, other);
  const std::string small = bytes(1'000);  // one part's size: stored as it is
  ASSERT_OK(store.Put("k", small));
  EXPECT_EQ(Keys(store, "kvtier:part:*"), 0u);
  EXPECT_EQ(Raw(store, "k"), small);
  ASSERT_OK(store.Put("k", big));
  ASSERT_OK_AND_ASSIGN(bool existed, store.Delete("k"));
  EXPECT_TRUE(existed);
  EXPECT_EQ(Keys(store, "kvtier:part:*"), 0u);
  // A manifest damaged to claim far more than its parts hold: DATA_LOSS, nothing reserved.
  ASSERT_OK(store.Put("k", big));
  const std::vector<std::string> fields = absl::StrSplit(Raw(store, "k"), ' ');
  ASSERT_EQ(fields.size(), 4u);
  ASSERT_OK(store
                .Eval("redis.call('SET', KEYS[1], ARGV[1]) return {}", {"k"},
                      {absl::StrCat("KVPARTS1 ", fields[1], " 11 999999999999999")})
                .status());
  EXPECT_THAT(store.Get("k"), StatusIs(Code::kDataLoss, "whose first part holds 1000"));
  // A part lost (deleted behind the store's back).
  ASSERT_OK(store.Put("k", big));
  ASSERT_OK(
      store.Eval("redis.call('DEL', redis.call('KEYS', 'kvtier:part:*:4')[1]) return {}", {}, {})
          .status());
  EXPECT_THAT(store.Get("k"), StatusIs(Code::kDataLoss, "part 4 of 11"));
  // A store whose outcome is unknown (a lost reply) is settled by what the key holds: stored,
  // it stands; not, its parts go; never a manifest left naming parts that are gone.
  ASSERT_OK_AND_ASSIGN(const std::optional<std::string> written, store.StoreParts(big));
  ASSERT_TRUE(written.has_value());
  ASSERT_OK(
      store.Eval("redis.call('SET', KEYS[1], ARGV[1]) return {}", {"ran"}, {*written}).status());
  EXPECT_OK(store.Settle("ran", *written, absl::UnavailableError("lost")));
  ASSERT_OK_AND_ASSIGN(got, store.Get("ran"));
  EXPECT_EQ(got, big);
  ASSERT_OK_AND_ASSIGN(const std::optional<std::string> unstored, store.StoreParts(big));
  ASSERT_TRUE(unstored.has_value());
  const size_t parts = Keys(store, "kvtier:part:*");
  EXPECT_THAT(store.Settle("never", *unstored, absl::UnavailableError("lost")),
              StatusIs(Code::kUnavailable, "lost"));
  EXPECT_EQ(Keys(store, "kvtier:part:*"), parts - 11);
}

// How many of the parts ("kvtier:part:*") expire (`expiring`) or are kept for good.
size_t Parts(RemoteStore& store, bool expiring) {
  auto r = store.Eval(R"lua(
local n = 0
for _, k in ipairs(redis.call('KEYS', 'kvtier:part:*')) do
  local ttl = redis.call('PTTL', k)
  if (ARGV[1] == '1' and ttl > 0) or (ARGV[1] == '0' and ttl == -1) then n = n + 1 end
end
return {n})lua",
                      {}, {expiring ? "1" : "0"});
  EXPECT_TRUE(r.ok()) << r.status();
  return r.ok() && !r->empty() && (*r)[0] ? std::stoul(*(*r)[0]) : 0;
}

// The parts of a value whose manifest never came (its writer killed, or its store refused)
// expire by themselves; those of a stored value are kept for good. A store whose parts
// expired before its manifest came is refused, and nothing changes. Before, such parts stayed
// in Redis for good, unnamed by any manifest.
TEST(RemoteStore, PartsExpireUnlessTheirManifestIsStored) {
  signal(SIGPIPE, SIG_IGN);
  LocalRedis redis;
  ASSERT_TRUE(redis.started()) << "redis-server did not start (scripts/install-deps)";
  HoldingProxy proxy(redis);
  // Two stores on one Redis: parts that expire after an hour, and after 2 s.
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<RemoteStore> lasting,
                       RemoteStore::Connect(proxy.address(), {.part_bytes = 1000}));
  ASSERT_OK_AND_ASSIGN(
      std::unique_ptr<RemoteStore> brief,
      RemoteStore::Connect(proxy.address(), {.part_bytes = 1000, .part_ttl_ms = 2000}));
  RemoteStore& store = *lasting;
  std::mt19937 rng(11);
  auto bytes = [&](size_t n) { return RandomBytes(rng, n); };
  const std::string big = bytes(10'500);
  ASSERT_OK(store.Put("k", big));
  EXPECT_EQ(Parts(store, /*expiring=*/false), 11u);
  // Parts whose manifest is never stored (as a daemon killed after writing them leaves them).
  ASSERT_OK_AND_ASSIGN(const std::optional<std::string> orphan, brief->StoreParts(bytes(5'500)));
  ASSERT_TRUE(orphan.has_value());
  EXPECT_EQ(Parts(store, /*expiring=*/true), 6u);
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  while (Keys(store, "kvtier:part:*") > 11u && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(50));
  }
  EXPECT_EQ(Keys(store, "kvtier:part:*"), 11u) << "the orphan parts did not expire";
  EXPECT_EQ(Parts(store, /*expiring=*/false), 11u);
  // A replacement whose script comes after its parts expired: refused, the old value stays.
  proxy.Hold("KVPARTS1", /*skip=*/0);
  auto put = std::async(std::launch::async, [&] { return brief->Put("k", bytes(4'500)); });
  absl::Cleanup release = [&] { proxy.Release(); };  // before the future waits, however it ends
  ASSERT_TRUE(proxy.WaitHeld(std::chrono::seconds(20))) << "the replacement never came";
  absl::SleepFor(absl::Milliseconds(2500));
  proxy.Release();
  EXPECT_THAT(put.get(), StatusIs(Code::kUnavailable, "was gone before its manifest was stored"));
  ASSERT_OK_AND_ASSIGN(std::optional<std::string> got, store.Get("k"));
  EXPECT_EQ(got, big);
  EXPECT_EQ(Keys(store, "kvtier:part:*"), 11u);
}

// Past Redis's limit on one value (512 MB): stored in parts, read back byte for byte. (Sent
// whole, Redis closes the connection mid-write: UNAVAILABLE, "Broken pipe".)
TEST(RemoteStore, AValuePastRedisLimitOnOneValueRoundTrips) {
  signal(SIGPIPE, SIG_IGN);  // a value Redis refuses ends the connection mid-write
  Remote remote;
  ASSERT_NE(remote.store, nullptr);
  std::string big((uint64_t{520} << 20) + 123, '\0');
  for (size_t i = 0; i < big.size(); i += 4096) big[i] = static_cast<char>(i / 4096);
  ASSERT_OK(remote.store->Put("huge", big));
  ASSERT_OK_AND_ASSIGN(std::optional<std::string> got, remote.store->Get("huge"));
  ASSERT_TRUE(got.has_value());
  EXPECT_TRUE(*got == big);  // (not EXPECT_EQ: a failure would print both)
  got.reset();
  ASSERT_OK(remote.store->Delete("huge").status());
  EXPECT_EQ(Keys(*remote.store, "kvtier:part:*"), 0u);
}

// A session whose record is larger than a part: demoted in parts, restored byte for byte,
// and no part left behind by the restore, nor by a close of the demoted session.
TEST(SessionManager, ASessionLargerThanAPartMovesDownAndBackInParts) {
  Remote remote({.part_bytes = 4096});
  ASSERT_NE(remote.store, nullptr);
  Env e;
  const ServerOptions o = Options();
  SessionManager m(o, e.env, remote.store.get());
  ASSERT_OK(m.Create("t", SmallSession("s")).status());
  ASSERT_OK(RunAppend(m, "t", Tokens("s", 0, 48)));
  ASSERT_OK_AND_ASSIGN(std::shared_ptr<Session> s, m.Get("t", "s"));
  const std::vector<v1::BlockHandle> before = AllChunks(*s);
  ASSERT_EQ(before.size(), 3u);
  ASSERT_OK_AND_ASSIGN(uint64_t bytes, m.Demote("t", "s"));
  EXPECT_GT(bytes, 4096u);
  EXPECT_THAT(Raw(*remote.store, RecordKey("s")), ::testing::StartsWith("KVPARTS1 "));
  EXPECT_GT(Keys(*remote.store, "kvtier:part:*"), 1u);
  ASSERT_OK_AND_ASSIGN(s, m.Get("t", "s"));  // restored
  EXPECT_EQ(Keys(*remote.store, "kvtier:part:*"), 0u);
  const std::vector<v1::BlockHandle> after = AllChunks(*s);
  ASSERT_EQ(after.size(), before.size());
  for (size_t i = 0; i < before.size(); ++i) {
    EXPECT_EQ(after[i].keys(), before[i].keys()) << i;
    EXPECT_EQ(after[i].values(), before[i].values()) << i;
  }
  ASSERT_OK(m.Demote("t", "s").status());
  EXPECT_GT(Keys(*remote.store, "kvtier:part:*"), 1u);
  // A part lost: the restore is DATA_LOSS, counted corrupt, and the record stays for
  // inspection; a close still deletes it, parts and all.
  ASSERT_OK(
      remote.store
          ->Eval("redis.call('DEL', redis.call('KEYS', 'kvtier:part:*:1')[1]) return {}", {}, {})
          .status());
  EXPECT_THAT(m.Get("t", "s"), StatusIs(Code::kDataLoss, "part 1 of"));
  EXPECT_EQ(m.remote_counters().corrupt, 1u);
  EXPECT_TRUE(*remote.store->Exists(RecordKey("s")));
  ASSERT_OK_AND_ASSIGN(bool existed, m.Close("t", "s"));
  EXPECT_TRUE(existed);
  EXPECT_EQ(Keys(*remote.store, "kvtier:part:*"), 0u);
  EXPECT_FALSE(*remote.store->Exists(RecordKey("s")));
}

// The pool: calls to a hung Redis end with UNAVAILABLE after about the timeout, never
// later, however many are waiting (each on a connection of its own, or for one); once Redis
// answers again every connection serves.
TEST(RemoteStore, AHungRedisCostsEachCallAtMostTheTimeout) {
  signal(SIGPIPE, SIG_IGN);
  LocalRedis redis;
  ASSERT_TRUE(redis.started());
  ASSERT_OK_AND_ASSIGN(
      std::unique_ptr<RemoteStore> store,
      RemoteStore::Connect(redis.address(), {.connections = 2, .timeout_ms = 300}));
  ASSERT_OK(store->Put("k", "v"));
  Frozen frozen(redis);
  const absl::Time t0 = absl::Now();
  std::vector<std::future<absl::StatusOr<std::optional<std::string>>>> calls;
  for (int i = 0; i < 4; ++i) {  // two on connections, two waiting for one
    calls.push_back(std::async(std::launch::async, [&] { return store->Get("k"); }));
  }
  for (auto& c : calls) {
    EXPECT_THAT(c.get(), StatusIs(Code::kUnavailable, "remote"));
  }
  // Waiting for a connection and a command each take up to the timeout, once or twice.
  EXPECT_LT(absl::Now() - t0, absl::Seconds(3));
  redis.Resume();
  for (int i = 0; i < 4; ++i) {
    ASSERT_OK_AND_ASSIGN(std::optional<std::string> v, store->Get("k"));
    EXPECT_EQ(v, "v");
  }
}

}  // namespace
}  // namespace kvtier

namespace kvtier {
namespace {

// Two daemons ("a" and "b") sharing one Redis, each with tiers of its own.
struct TwoDaemons {
  static ServerOptions Named(const char* instance) {
    ServerOptions o = Options();
    o.instance = instance;
    return o;
  }
  Remote remote;
  Env ea, eb;
  const ServerOptions oa = Named("a"), ob = Named("b");
  SessionManager a{oa, ea.env, remote.store.get()}, b{ob, eb.env, remote.store.get()};
};

// Two daemons on one Redis: an id has one owner. Before, the second daemon created its own
// session under an id the first held live, both demoted, the last writer won, and the first
// then served the second's bytes.
TEST(SessionManager, TwoDaemonsOnOneRedisNeverHoldOneIdAtOnce) {
  TwoDaemons two;
  SessionManager &a = two.a, &b = two.b;
  ASSERT_OK(a.Create("t", SmallSession("x")).status());
  ASSERT_OK(RunAppend(a, "t", Tokens("x", 0, 32)));
  EXPECT_THAT(b.Create("t", SmallSession("x")),
              StatusIs(Code::kAlreadyExists, "held by kvtierd \"a@"));
  v1::ForkSessionRequest fork;
  ASSERT_OK(b.Create("t", SmallSession("y")).status());
  fork.set_session_id("y");
  fork.set_new_session_id("x");
  EXPECT_THAT(b.Fork("t", fork), StatusIs(Code::kAlreadyExists, "new_session_id: \"x\" is held"));
  EXPECT_THAT(b.Get("t", "x"), StatusIs(Code::kNotFound, "held by kvtierd \"a@"));
  ASSERT_OK_AND_ASSIGN(bool closed, b.Close("t", "x"));  // not b's to close
  EXPECT_FALSE(closed);
  ASSERT_OK(a.Get("t", "x").status());

  // Demoted, the id is free: b restores it, bytes and all, and holds it from then on.
  ASSERT_OK(a.Demote("t", "x").status());
  ASSERT_OK_AND_ASSIGN(std::shared_ptr<Session> moved, b.Get("t", "x"));
  EXPECT_EQ(moved->Info().num_tokens(), 32u);
  EXPECT_THAT(a.Get("t", "x"), StatusIs(Code::kNotFound, "held by kvtierd \"b@"));
  EXPECT_THAT(a.Create("t", SmallSession("x")), StatusIs(Code::kAlreadyExists));
  ASSERT_OK(RunAppend(b, "t", Tokens("x", 32, 16)));
  // b demotes it again; a restores b's 48 tokens, not its own 32.
  ASSERT_OK(b.Demote("t", "x").status());
  ASSERT_OK_AND_ASSIGN(std::shared_ptr<Session> back, a.Get("t", "x"));
  EXPECT_EQ(back->Info().num_tokens(), 48u);

  // A close lets the id go: the other daemon may create it anew.
  ASSERT_OK_AND_ASSIGN(closed, a.Close("t", "x"));
  EXPECT_TRUE(closed);
  ASSERT_OK(b.Create("t", SmallSession("x")).status());
  // A refused create (past max_sessions) leaves no claim behind.
  ServerOptions full = Options();
  full.instance = "c";
  full.max_sessions = 0;
  Env ec;
  SessionManager c{full, ec.env, two.remote.store.get()};
  EXPECT_THAT(c.Create("t", SmallSession("z")), StatusIs(Code::kResourceExhausted));
  ASSERT_OK(a.Create("t", SmallSession("z")).status());
}

}  // namespace
}  // namespace kvtier

namespace kvtier {
namespace {

// A session this daemon demoted whose record then vanished is DATA_LOSS, not NOT_FOUND; one
// that another daemon took over, or closed, is NOT_FOUND as before.
TEST(SessionManager, ADemotedSessionWhoseRecordVanishedIsDataLoss) {
  TwoDaemons two;
  SessionManager &a = two.a, &b = two.b;
  for (const char* id : {"lost", "taken", "closed", "moved"}) {
    ASSERT_OK(a.Create("t", SmallSession(id)).status());
    ASSERT_OK(RunAppend(a, "t", Tokens(id, 0, 16)));
    ASSERT_OK(a.Demote("t", id).status());
  }
  ASSERT_OK_AND_ASSIGN(bool deleted, two.remote.store->Delete(RecordKey("lost")));  // Redis lost it
  ASSERT_TRUE(deleted);
  EXPECT_THAT(a.Get("t", "lost"), StatusIs(Code::kDataLoss, "Redis lost it"));
  EXPECT_EQ(a.remote_counters().lost, 1u);
  EXPECT_THAT(b.Get("t", "lost"), StatusIs(Code::kNotFound));  // b never had it

  ASSERT_OK(b.Get("t", "taken").status());
  EXPECT_THAT(a.Get("t", "taken"), StatusIs(Code::kNotFound, "held by kvtierd \"b@"));
  ASSERT_OK_AND_ASSIGN(bool closed, b.Close("t", "closed"));
  EXPECT_TRUE(closed);
  EXPECT_THAT(a.Get("t", "closed"), StatusIs(Code::kNotFound, "not found"));
  EXPECT_EQ(a.remote_counters().lost, 1u);
  // Taken over, then closed where it lives, before the daemon that demoted it looked: that
  // daemon finds the tombstone, not a loss (before, the live close left none). A session
  // never demoted leaves none.
  ASSERT_OK(b.Get("t", "moved").status());
  ASSERT_OK_AND_ASSIGN(closed, b.Close("t", "moved"));
  EXPECT_TRUE(closed);
  EXPECT_THAT(a.Get("t", "moved"), StatusIs(Code::kNotFound, "not found"));
  EXPECT_EQ(a.remote_counters().lost, 1u);
  ASSERT_OK(b.Create("t", SmallSession("fresh")).status());
  ASSERT_OK(b.Close("t", "fresh").status());
  EXPECT_FALSE(*two.remote.store->Exists("kvtier:closed:fresh"));
}

// The same through a crash: the daemon that restored the session stops without closing it (as
// SIGKILL leaves it: its snapshot and its hold stay), starts again, restores the session from
// its own snapshot and closes it. The daemon that demoted it still finds the tombstone.
TEST(SessionManager, ASessionRestoredFromASnapshotOfARestoredOneLeavesTheTombstoneToo) {
  Remote remote;
  Env ea, eb;
  ServerOptions oa = Options(), ob = Options();
  oa.instance = "a";
  ob.instance = "b";
  ob.persist_interval_ms = 1000;
  SessionManager a(oa, ea.env, remote.store.get());
  ASSERT_OK(a.Create("t", SmallSession("x")).status());
  ASSERT_OK(RunAppend(a, "t", Tokens("x", 0, 32)));
  ASSERT_OK(a.Demote("t", "x").status());
  {
    SessionManager b(ob, eb.env, remote.store.get());
    ASSERT_OK(b.Get("t", "x").status());  // restored from a's record
    EXPECT_EQ(b.PersistChanged().sessions, 1u);
  }  // b stops: with write-behind on, its snapshot and hold stay
  SessionManager b(ob, eb.env, remote.store.get());
  ASSERT_OK_AND_ASSIGN(std::shared_ptr<Session> x, b.Get("t", "x"));  // from its snapshot
  EXPECT_EQ(x->Info().num_tokens(), 32u);
  ASSERT_OK_AND_ASSIGN(bool closed, b.Close("t", "x"));
  EXPECT_TRUE(closed);
  EXPECT_THAT(a.Get("t", "x"), StatusIs(Code::kNotFound, "not found"));
  EXPECT_EQ(a.remote_counters().lost, 0u);
}

}  // namespace
}  // namespace kvtier
