// Many workers at once against one in-process daemon (so ThreadSanitizer sees kvtier's own
// code): 8 threads append and select on their own sessions, checking every byte they get
// back, and also select on shared "victim" sessions while another thread closes those and
// churns sessions of its own, with the daemon's aging pool ageing their chunks all the while.
// `make tsan` runs this under ThreadSanitizer.
#include <atomic>
#include <cmath>
#include <thread>

#include "kvtier/client.h"
#include "kvtier/local_daemon.h"
#include "server/common/fp16.h"
#include "server/common/status_macros.h"
#include "server/config/policy.h"
#include "server/rpc/daemon.h"
#include "spdlog/spdlog.h"
#include "tests/test_util.h"

namespace kvtier {
namespace {

using testing::AsBytes;
using testing::RandomHalfs;
using testing::Slice;

const bool kQuiet = [] {
  spdlog::set_level(spdlog::level::warn);
  return true;
}();

constexpr int kLayers = 3, kQ = 4, kKv = 2, kD = 32;
constexpr int kWorkers = 8;
constexpr int kVictims = 6;

v1::CreateSessionRequest Shape(const std::string& id, bool lossless = true) {
  v1::CreateSessionRequest r;
  r.set_session_id(id);
  r.mutable_shape()->set_num_layers(kLayers);
  r.mutable_shape()->set_num_q_heads(kQ);
  r.mutable_shape()->set_num_kv_heads(kKv);
  r.mutable_shape()->set_head_dim(kD);
  r.mutable_policy()->set_recent_window(32);
  // Lossless workers check bytes exactly; the others check their cold (int4) chunks against
  // the quantization bound.
  r.mutable_policy()->set_lossless(lossless);
  // Whole contiguous chunks, quantized as soon as they leave the window: what the workers
  // check (the daemon's default is semantic, with refined rows).
  r.mutable_policy()->set_chunking(v1::CHUNKING_CONTIGUOUS);
  r.mutable_policy()->set_refine_factor(1);
  return r;
}

std::string Query(std::mt19937& rng) {
  std::normal_distribution<float> n(0, 1);
  std::vector<float> q(kQ * kD);
  for (auto& x : q) x = n(rng);
  return std::string(reinterpret_cast<const char*>(q.data()), q.size() * 4);
}

// Appends `total` tokens to every layer in steps of `step`.
// `wait_aged`: the reply waits for each layer's aging (otherwise the daemon's pool ages them).
absl::Status Fill(Client& c, const std::string& sid, const std::vector<std::vector<uint16_t>>& k,
                  const std::vector<std::vector<uint16_t>>& v, int total, int from, int to,
                  bool wait_aged = false) {
  std::vector<v1::AppendKVRequest> reqs;
  for (int l = 0; l < kLayers; ++l) {
    v1::AppendKVRequest r;
    r.set_session_id(sid);
    r.set_layer(l);
    r.set_start_token(from);
    r.set_num_tokens(to - from);
    r.set_keys(AsBytes(Slice(k[l], kKv, total, kD, from, to - from)));
    r.set_values(AsBytes(Slice(v[l], kKv, total, kD, from, to - from)));
    r.set_wait_aged(wait_aged);
    reqs.push_back(std::move(r));
  }
  return c.AppendKV(reqs).status();
}

// Every chunk session `id` holds has the keys of k[layer] ([kv_head][total][head_dim]) at its
// positions, byte for byte (lossless chunks): a failure when not. How many chunks it read, or
// the calls' error.
absl::StatusOr<size_t> CheckKeys(Client& c, const std::string& id,
                                 const std::vector<std::vector<uint16_t>>& k, int total) {
  ASSIGN_OR_RETURN(v1::DescribeSessionResponse d, c.DescribeSession(id));
  v1::ListChunksRequest list;
  list.set_session_id(id);
  list.set_limit(100000);
  ASSIGN_OR_RETURN(v1::ListChunksResponse chunks, c.ListChunks(list));
  std::vector<uint64_t> ids;
  for (const auto& ch : chunks.chunks()) ids.push_back(ch.chunk_id());
  ASSIGN_OR_RETURN(auto read, c.ReadChunks(id, ids));
  for (const auto& h : read) {
    EXPECT_LE(h.positions(0) + h.num_tokens(), d.layers(h.layer()).num_tokens());
    const auto want = Slice(k[h.layer()], kKv, total, kD, h.positions(0), h.num_tokens());
    const size_t off = size_t(h.kv_head()) * h.num_tokens() * kD;
    EXPECT_EQ(h.keys(), std::string(reinterpret_cast<const char*>(want.data() + off),
                                    size_t(h.num_tokens()) * kD * 2));
  }
  return read.size();
}

TEST(Concurrency, WorkersAppendSelectAndCloseAtOnce) {
  testing::TempDir dir;
  ServerOptions o;
  o.listen = "unix:" + dir.path() + "/kvtier.sock";
  o.instance = "conc-" + std::to_string(getpid());
  o.host_capacity = 256ull << 20;
  o.device_capacity = 64ull << 20;
  o.lease_ttl_ms = 200;  // the reaper runs during the test too
  o.default_policy = BuiltinPolicy();
  auto daemon = Daemon::Start(o);
  ASSERT_TRUE(daemon.ok()) << daemon.status();

  {
    auto admin = Client::Connect(o.listen);
    ASSERT_TRUE(admin.ok());
    for (int i = 0; i < kVictims; ++i) {
      ASSERT_TRUE((*admin)->CreateSession(Shape("victim-" + std::to_string(i))).ok());
    }
  }

  constexpr int kTotal = 320, kStep = 20;
  std::atomic<int> failures{0};
  std::atomic<int> selects{0}, victim_ok{0}, victim_gone{0};
  auto fail = [&](const std::string& what) {
    ADD_FAILURE() << what;
    failures.fetch_add(1);
  };

  std::vector<std::thread> workers;
  for (int w = 0; w < kWorkers; ++w) {
    workers.emplace_back([&, w] {
      auto c = Client::Connect(o.listen);
      if (!c.ok()) return fail("connect");
      std::mt19937 rng(100 + w);
      std::vector<std::vector<uint16_t>> k, v;
      for (int l = 0; l < kLayers; ++l) {
        k.push_back(RandomHalfs(size_t(kKv) * kTotal * kD, rng));
        v.push_back(RandomHalfs(size_t(kKv) * kTotal * kD, rng));
      }
      const std::string sid = "worker-" + std::to_string(w);
      const bool lossless = w % 2 == 0;
      if (!(*c)->CreateSession(Shape(sid, lossless)).ok()) return fail("create " + sid);
      SegmentMap segments;
      for (int t = 0; t < kTotal; t += kStep) {
        // Every other append of a cold worker waits for aging, and its Select then finds every
        // chunk out of the window cold; the others leave aging to the daemon's pool.
        const bool aged = !lossless && (t / kStep) % 2 == 0;
        if (auto s = Fill(**c, sid, k, v, kTotal, t, t + kStep, aged); !s.ok()) {
          return fail("append: " + std::string(s.message()));
        }
        v1::SelectRequest req;
        req.set_session_id(sid);
        req.set_layer(kLayers - 1);
        req.set_query(Query(rng));
        req.set_budget_tokens(96);
        req.set_placement(t % 40 == 0 ? v1::TIER_DEVICE : v1::TIER_HOST);
        auto sel = (*c)->Select(req);
        if (!sel.ok()) return fail("select: " + std::string(sel.status().message()));
        selects.fetch_add(1);
        for (const auto& head : sel->heads()) {
          size_t tokens = 0;
          for (const auto& b : head.blocks()) {
            tokens += b.num_tokens();
            auto view = segments.View(**c, b);
            if (!view.ok()) return fail("view: " + std::string(view.status().message()));
            auto want = Slice(k[kLayers - 1], kKv, kTotal, kD, b.positions(0), b.num_tokens());
            const uint16_t* expect = want.data() + size_t(head.kv_head()) * b.num_tokens() * kD;
            if (b.stored_precision() == v1::PRECISION_INT4) {
              // Inputs lie in [-4, 4]: a key channel's range is at most 8, half a step 8/30.
              for (size_t i = 0; i < view->keys.size(); ++i) {
                if (std::fabs(HalfToFloat(view->keys[i]) - HalfToFloat(expect[i])) > 0.3f) {
                  return fail("cold key beyond the quantization bound in " + sid);
                }
              }
            } else if (!std::equal(view->keys.begin(), view->keys.end(), expect)) {
              return fail("bytes differ in " + sid);
            } else if (aged && b.positions(0) >= 16 &&
                       b.positions(0) + b.num_tokens() + 32 <= t + kStep) {
              return fail("a chunk out of the window is still fp16 in " + sid);
            }
          }
          // All of a context that fits; otherwise greedy whole chunks leave less than one
          // 16-token chunk of the budget unused.
          const size_t context = t + kStep;
          if (context <= 96 ? tokens != context : (tokens > 96 || tokens <= 96 - 16)) {
            return fail("budget broken: " + std::to_string(tokens));
          }
        }
        if (t % 60 == 0) (void)(*c)->Release(sel->lease_id());  // others expire by TTL
        // A victim may be closed under us: OK or NOT_FOUND, nothing else.
        req.set_session_id("victim-" + std::to_string((w + t) % kVictims));
        req.set_placement(v1::TIER_HOST);
        auto vs = (*c)->Select(req);
        if (vs.ok()) {
          victim_ok.fetch_add(1);
        } else if (vs.status().code() == absl::StatusCode::kNotFound) {
          victim_gone.fetch_add(1);
        } else {
          return fail("victim select: " + vs.status().ToString());
        }
      }
      auto info = (*c)->DescribeSession(sid);
      if (!info.ok() || info->info().num_tokens() != kTotal) return fail("final tokens " + sid);
      if (!(*c)->CloseSession(sid).ok()) return fail("close " + sid);
    });
  }

  std::thread closer([&] {
    auto c = Client::Connect(o.listen);
    if (!c.ok()) return fail("connect closer");
    std::mt19937 rng(7);
    std::vector<std::vector<uint16_t>> k, v;
    for (int l = 0; l < kLayers; ++l) {
      k.push_back(RandomHalfs(size_t(kKv) * 64 * kD, rng));
      v.push_back(RandomHalfs(size_t(kKv) * 64 * kD, rng));
    }
    for (int i = 0; i < 24; ++i) {
      if (i % 4 == 0 && i / 4 < kVictims) {
        if (!(*c)->CloseSession("victim-" + std::to_string(i / 4)).ok()) fail("close victim");
      }
      const std::string sid = "churn-" + std::to_string(i);
      if (!(*c)->CreateSession(Shape(sid)).ok()) return fail("create churn");
      if (!Fill(**c, sid, k, v, 64, 0, 64).ok()) return fail("fill churn");
      if (!(*c)->ListSessions().ok() || !(*c)->GetTierStats().ok()) return fail("admin");
      (void)(*daemon)->metrics().Render();
      if (!(*c)->CloseSession(sid).ok()) return fail("close churn");
    }
  });

  for (auto& t : workers) t.join();
  closer.join();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_EQ(selects.load(), kWorkers * kTotal / kStep);
  EXPECT_GT(victim_ok.load() + victim_gone.load(), 0);

  auto admin = Client::Connect(o.listen);
  ASSERT_TRUE(admin.ok());
  auto list = (*admin)->ListSessions();
  ASSERT_TRUE(list.ok());
  EXPECT_EQ(list->sessions_size(), 0) << "every session was closed";
  (*daemon)->Shutdown();
}

// While draining, new calls are answered UNAVAILABLE and health says NOT_SERVING, and an
// AppendKV stream already open is served to its end.
TEST(Concurrency, DrainRefusesNewCallsAndFinishesOpenStreams) {
  testing::TempDir dir;
  ServerOptions o;
  o.listen = "unix:" + dir.path() + "/kvtier.sock";
  o.instance = "drain-" + std::to_string(getpid());
  o.default_policy = BuiltinPolicy();
  auto daemon = Daemon::Start(o);
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  auto c = Client::Connect(o.listen);
  ASSERT_TRUE(c.ok());
  ASSERT_TRUE((*c)->CreateSession(Shape("s")).ok());

  std::mt19937 rng(1);
  auto k = RandomHalfs(size_t(kKv) * 8 * kD, rng);
  grpc::ClientContext ctx;
  v1::AppendKVResponse resp;
  auto stream = (*c)->stub().AppendKV(&ctx, &resp);
  v1::AppendKVRequest r;
  r.set_session_id("s");
  r.set_layer(0);
  r.set_num_tokens(4);
  r.set_keys(AsBytes(Slice(k, kKv, 8, kD, 0, 4)));
  r.set_values(r.keys());
  ASSERT_TRUE(stream->Write(r));
  // The drain must begin after the server has taken the stream: wait for the first message.
  for (int i = 0; i < 500; ++i) {
    auto d = (*c)->DescribeSession("s");
    ASSERT_TRUE(d.ok());
    if (d->layers(0).num_tokens() == 4) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }

  (*daemon)->StartDrain();
  EXPECT_EQ((*c)->CreateSession(Shape("late")).status().code(), absl::StatusCode::kUnavailable);
  auto serving = (*c)->Health();
  ASSERT_TRUE(serving.ok());
  EXPECT_FALSE(*serving);

  r.set_start_token(4);
  r.set_keys(AsBytes(Slice(k, kKv, 8, kD, 4, 4)));
  r.set_values(r.keys());
  ASSERT_TRUE(stream->Write(r));
  stream->WritesDone();
  EXPECT_TRUE(stream->Finish().ok());
  (*daemon)->Shutdown();
}

// A session moved to a second daemon again and again while a worker appends to it and the
// aging pool ages it: each export is one moment of the session (every import passes its
// checks: each layer's KV heads agree and hold its tokens), and every byte a copy holds is
// the byte appended there.
TEST(Concurrency, MovesTakeOneMomentWhileAppendsAndAgingGoOn) {
  testing::TempDir dir;
  ServerOptions o;
  o.default_policy = BuiltinPolicy();
  o.listen = "unix:" + dir.path() + "/a.sock";
  o.instance = "move-a-" + std::to_string(getpid());
  auto a = Daemon::Start(o);
  ASSERT_TRUE(a.ok()) << a.status();
  o.listen = "unix:" + dir.path() + "/b.sock";
  o.instance = "move-b-" + std::to_string(getpid());
  auto b = Daemon::Start(o);
  ASSERT_TRUE(b.ok()) << b.status();
  auto from = Client::Connect("unix:" + dir.path() + "/a.sock");
  auto to = Client::Connect("unix:" + dir.path() + "/b.sock");
  ASSERT_TRUE(from.ok() && to.ok());
  ASSERT_TRUE((*from)->CreateSession(Shape("s")).ok());

  constexpr int kTotal = 640, kStep = 32;
  std::mt19937 rng(4);
  std::vector<std::vector<uint16_t>> k, v;
  for (int l = 0; l < kLayers; ++l) {
    k.push_back(RandomHalfs(size_t(kKv) * kTotal * kD, rng));
    v.push_back(RandomHalfs(size_t(kKv) * kTotal * kD, rng));
  }
  std::atomic<bool> done{false};
  std::thread writer([&] {
    for (int t = 0; t < kTotal; t += kStep) {
      EXPECT_TRUE(Fill(**from, "s", k, v, kTotal, t, t + kStep).ok());
    }
    done = true;
  });
  int moves = 0;
  while (!done || moves < 2) {
    // Every other move sends the chunks' bytes daemon to daemon (the socket carrier's thread).
    const auto carrier = moves % 2 == 1 ? v1::CHUNK_CARRIER_SOCKET : v1::CHUNK_CARRIER_PARTS;
    const std::string id = "copy-" + std::to_string(moves++);
    auto moved = (*from)->MoveSession("s", **to, id, carrier);
    ASSERT_TRUE(moved.ok()) << moved.status();
    auto read = CheckKeys(**to, id, k, kTotal);
    ASSERT_TRUE(read.ok()) << read.status();
    ASSERT_TRUE((*to)->CloseSession(id).ok());
  }
  writer.join();
  EXPECT_GE(moves, 2);
  std::printf("moves: %d\n", moves);
  (*a)->Shutdown();
  (*b)->Shutdown();
}

// Sessions moved to the remote tier and back by several threads at once, two threads on each:
// restores of different sessions run side by side, and two calls for one session restore it
// once; every restore holds the session's bytes.
TEST(Concurrency, SessionsGoToTheRemoteTierAndBackSideBySide) {
  LocalRedis redis;
  ASSERT_TRUE(redis.started()) << "redis-server did not start (scripts/install-deps)";
  testing::TempDir dir;
  ServerOptions o;
  o.default_policy = BuiltinPolicy();
  o.listen = "unix:" + dir.path() + "/kvtier.sock";
  o.instance = "remote-" + std::to_string(getpid());
  o.remote = redis.address();
  auto daemon = Daemon::Start(o);
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  constexpr int kSessions = 3, kRounds = 6, kTotal = 64;
  std::mt19937 rng(5);
  std::vector<std::vector<uint16_t>> k, v;
  for (int l = 0; l < kLayers; ++l) {
    k.push_back(RandomHalfs(size_t(kKv) * kTotal * kD, rng));
    v.push_back(RandomHalfs(size_t(kKv) * kTotal * kD, rng));
  }
  {
    auto c = Client::Connect(o.listen);
    ASSERT_TRUE(c.ok());
    for (int i = 0; i < kSessions; ++i) {
      const std::string id = "moved-" + std::to_string(i);
      ASSERT_TRUE((*c)->CreateSession(Shape(id)).ok());
      ASSERT_TRUE(Fill(**c, id, k, v, kTotal, 0, kTotal, /*wait_aged=*/true).ok());
    }
  }
  std::vector<std::thread> threads;
  for (int t = 0; t < 2 * kSessions; ++t) {
    threads.emplace_back([&, t] {
      auto c = Client::Connect(o.listen);
      ASSERT_TRUE(c.ok());
      const std::string id = "moved-" + std::to_string(t / 2);
      for (int r = 0; r < kRounds; ++r) {
        // Down (or already there, by the other thread), then back by the next call.
        auto evicted = (*c)->Evict(id, v1::TIER_HOST);
        ASSERT_TRUE(evicted.ok()) << evicted.status();
        // The other thread may move it down again between the calls: each says so
        // (UNAVAILABLE), and a worker tries again.
        absl::StatusOr<size_t> read = CheckKeys(**c, id, k, kTotal);
        for (int again = 0; absl::IsUnavailable(read.status()) && again < 100; ++again) {
          read = CheckKeys(**c, id, k, kTotal);
        }
        ASSERT_TRUE(read.ok()) << read.status();
        EXPECT_EQ(*read, size_t{kLayers} * kKv * kTotal / 16);  // 16-token chunks
      }
    });
  }
  for (std::thread& t : threads) t.join();
  auto c = Client::Connect(o.listen);
  ASSERT_TRUE(c.ok());
  auto stats = (*c)->GetTierStats();
  ASSERT_TRUE(stats.ok());
  for (const auto& tier : stats->tiers()) {
    if (tier.tier() != v1::TIER_REMOTE) continue;
    std::printf("demotions %d, restores %d\n", static_cast<int>(tier.evictions()),
                static_cast<int>(tier.promotions()));
    EXPECT_GE(tier.promotions(), uint64_t{kSessions});
    EXPECT_LE(tier.promotions(), tier.evictions());  // never restored twice for one demotion
  }
  (*daemon)->Shutdown();
}

}  // namespace
}  // namespace kvtier
