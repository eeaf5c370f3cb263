// Tier management figures, in process, each against a baseline measured in the same run:
//   remote_demote_throughput   a SmolLM2-shaped int4 session (4096 tokens) demoted to a real
//                              Redis (started here), record bytes per second, against Redis's
//                              own SET of a value of the same size;
//   remote_restore_throughput  the same session restored (GET, checksum, import, index
//                              rebuilt), against a plain GET of the same size;
//   promotion_cost_per_chunk   dequantizing a cold chunk into the host copy cache during a
//                              Select, per chunk, against memcpy of the chunk's fp16 bytes;
//   prefetch_hit_rate          over a decode loop whose query drifts, the share of selected
//                              cold chunks whose copy was cached, with prefetch (25% more
//                              budget after each Select) against without;
//   select_scaling_in_process  Selects per second (each released) of two threads at once, each
//                              on a session of its own over the same tiers, copy caches and
//                              lease table, against one thread alone: the daemon's own work,
//                              without a transport (select_bench's select_scaling has gRPC).
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <random>
#include <thread>

#include "bench/bench_util.h"
#include "server/common/fp16.h"
#include "server/config/policy.h"
#include "server/config/shape.h"
#include "server/session/session.h"
#include "server/session/session_record.h"
#include "server/tier/remote_store.h"

using namespace kvtier;
using namespace kvtier::bench;

namespace {

constexpr int kLayers = 30, kQ = 9, kKv = 3, kD = 64, kTokens = 4096;

struct Env {
  explicit Env(const std::string& name)
      : host(Opts(v1::TIER_HOST, name)), device(Opts(v1::TIER_DEVICE, name)) {
    env.host = &host;
    env.host_copies = &host_copies;
    env.device_copies = &device_copies;
    env.leases = &leases;
    env.clock = &SystemClock();
  }
  static TierOptions Opts(v1::Tier t, const std::string& name) {
    TierOptions o;
    o.tier = t;
    o.instance = "tierbench-" + name + "-" + std::to_string(getpid());
    o.capacity_bytes = 4ull << 30;
    o.emulated = t == v1::TIER_DEVICE;
    return o;
  }
  Tier host, device;
  PromotionCache host_copies{&host, &SystemClock(), MakeLruPolicy()};
  PromotionCache device_copies{&device, &SystemClock(), MakeLruPolicy()};
  LeaseTable leases{&SystemClock()};
  SessionEnv env;
};

std::unique_ptr<Session> MakeSession(Env& e, const std::string& id, uint32_t seed) {
  v1::ModelShape shape;
  shape.set_num_layers(kLayers);
  shape.set_num_q_heads(kQ);
  shape.set_num_kv_heads(kKv);
  shape.set_head_dim(kD);
  auto s = std::make_unique<Session>(id, "bench", *ResolveShape(shape),
                                     *ResolvePolicy({}, BuiltinPolicy(), "policy"),
                                     std::map<std::string, std::string>{}, e.env);
  std::mt19937 rng(seed);
  std::normal_distribution<float> g(0, 1);
  std::vector<uint16_t> k(size_t(kKv) * 256 * kD), v(k.size());
  for (int start = 0; start < kTokens; start += 256) {
    for (int l = 0; l < kLayers; ++l) {
      for (size_t i = 0; i < k.size(); ++i) {
        k[i] = FloatToHalf(g(rng));
        v[i] = FloatToHalf(g(rng));
      }
      v1::AppendKVRequest r;
      r.set_layer(l);
      r.set_start_token(start);
      r.set_num_tokens(256);
      r.set_keys(k.data(), k.size() * 2);
      r.set_values(v.data(), v.size() * 2);
      if (!s->Append(r).ok()) std::abort();
    }
  }
  return s;
}

v1::SelectRequest Query(const std::vector<float>& q, uint32_t layer, uint32_t budget) {
  v1::SelectRequest r;
  r.set_layer(layer);
  r.set_query(q.data(), q.size() * sizeof(float));
  r.set_budget_tokens(budget);
  return r;
}

std::map<std::string, std::string> Params(std::map<std::string, std::string> extra) {
  std::map<std::string, std::string> p = {
      {"layers", std::to_string(kLayers)},
      {"kv_heads", std::to_string(kKv)},
      {"head_dim", std::to_string(kD)},
      {"tokens", std::to_string(kTokens)},
      {"policy",
       "default: int4 cold chunks, semantic chunks, LSE-peak, rows refined from 8x pools"}};
  p.insert(extra.begin(), extra.end());
  return p;
}

}  // namespace

int main() {
  LocalRedis redis;
  if (!redis.started()) {
    std::fprintf(stderr, "tier_bench: redis-server did not start (scripts/install-deps)\n");
    return 1;
  }
  auto store = RemoteStore::Connect(redis.address());
  if (!store.ok()) {
    std::fprintf(stderr, "tier_bench: %s\n", std::string(store.status().message()).c_str());
    return 1;
  }
  RemoteStore& r = **store;

  // Demote and restore, against Redis's own SET and GET of as many bytes. Median of 5.
  {
    Env e("remote");
    std::vector<double> demote, restore, set, get;
    uint64_t record_bytes = 0;
    for (int rep = 0; rep < 5; ++rep) {
      auto s = MakeSession(e, "s", 1);
      const std::string key = RecordKey("s");
      double t0 = NowSeconds();
      auto bytes =
          s->Demote([&](const v1::SessionRecord& rec) { return r.Put(key, *EncodeRecord(rec)); });
      double t1 = NowSeconds();
      if (!bytes.ok()) return 1;
      auto got = r.Get(key);
      if (!got.ok() || !*got) return 1;
      record_bytes = (*got)->size();
      demote.push_back(record_bytes / (t1 - t0) / 1e9);
      double t2 = NowSeconds();
      auto value = r.Get(key);
      auto record = DecodeRecord(**value, key);
      if (!record.ok()) return 1;
      auto back = Session::Import(*record, e.env);
      double t3 = NowSeconds();
      if (!back.ok()) return 1;
      restore.push_back(record_bytes / (t3 - t2) / 1e9);
      const std::string blob(record_bytes, 'x');
      double t4 = NowSeconds();
      if (!r.Put("blob", blob).ok()) return 1;
      double t5 = NowSeconds();
      auto again = r.Get("blob");
      double t6 = NowSeconds();
      if (!again.ok()) return 1;
      set.push_back(record_bytes / (t5 - t4) / 1e9);
      get.push_back(record_bytes / (t6 - t5) / 1e9);
      (void)r.Delete(key);
      (void)r.Delete("blob");
    }
    Print({"remote_demote_throughput", Median(demote), "GB/s", Median(set), "redis SET",
           Params({{"record_bytes", std::to_string(record_bytes)},
                   {"reps", "5"},
                   {"redis", "unix socket, same host"}})});
    Print({"remote_restore_throughput", Median(restore), "GB/s", Median(get), "redis GET",
           Params({{"record_bytes", std::to_string(record_bytes)},
                   {"reps", "5"},
                   {"includes", "GET, checksum, decode, slot allocation, sums, peaks, index"}})});
  }

  // Promotion: a Select that dequantizes every chosen cold chunk, then the same Select with
  // every copy cached; the difference per promoted chunk, against memcpy of its fp16 bytes.
  {
    Env e("promote");
    auto s = MakeSession(e, "p", 2);
    std::vector<float> q(kQ * kD, 0.1f);
    std::vector<double> cost;
    uint64_t chunks = 0;
    for (uint32_t layer = 2; layer < kLayers; ++layer) {
      v1::SelectResponse first, second;
      const auto before = e.host_copies.counters().misses;
      double t0 = NowSeconds();
      if (!s->Select(Query(q, layer, 1024), &first).ok()) return 1;
      double t1 = NowSeconds();
      if (!s->Select(Query(q, layer, 1024), &second).ok()) return 1;
      double t2 = NowSeconds();
      const uint64_t promoted = e.host_copies.counters().misses - before;
      chunks += promoted;
      cost.push_back(((t1 - t0) - (t2 - t1)) / double(promoted) * 1e6);
      (void)e.leases.Release("bench", first.lease_id());
      (void)e.leases.Release("bench", second.lease_id());
    }
    const size_t bytes = 2 * 16 * kD * 2;
    std::vector<char> src(bytes * 4096, 1), dst(src.size());
    double t0 = NowSeconds();
    for (int i = 0; i < 4096; ++i) std::memcpy(&dst[i * bytes], &src[i * bytes], bytes);
    double t1 = NowSeconds();
    if (dst[12345] == 7) std::puts("");
    Print({"promotion_cost_per_chunk", Median(cost), "us", (t1 - t0) / 4096 * 1e6,
           "memcpy of the chunk's fp16 K and V",
           Params({{"chunk_tokens", "16"},
                   {"chunk_fp16_bytes", std::to_string(bytes)},
                   {"chunks_promoted", std::to_string(chunks)},
                   {"what", "dequantize int4 into a cached host copy, in a Select"}})});
  }

  // Prefetch: a decode loop on one layer whose query drifts step by step.
  {
    double rates[2];
    for (int prefetch = 0; prefetch < 2; ++prefetch) {
      Env e(prefetch ? "pf1" : "pf0");
      auto s = MakeSession(e, "d", 3);
      std::mt19937 rng(4);
      std::normal_distribution<float> g(0, 1);
      std::vector<float> q(kQ * kD);
      for (auto& x : q) x = g(rng);
      for (int step = 0; step < 200; ++step) {
        for (auto& x : q) x = 0.95f * x + 0.3f * g(rng);
        v1::SelectResponse resp;
        const auto req = Query(q, 10, 256);
        PrefetchGuess guess;
        if (!s->Select(req, &resp, nullptr, prefetch ? &guess : nullptr, 25).ok()) return 1;
        (void)e.leases.Release("bench", resp.lease_id());
        if (prefetch && !s->Prefetch(guess).ok()) return 1;
      }
      const auto c = e.host_copies.counters();
      rates[prefetch] = double(c.hits) / double(c.hits + c.misses);
    }
    Print({"prefetch_hit_rate", rates[1], "fraction", rates[0], "no prefetch (cache reuse only)",
           Params({{"steps", "200"},
                   {"budget", "256"},
                   {"extra_budget_percent", "25"},
                   {"query", "AR(1) drift: q = 0.95 q + 0.3 noise"},
                   {"counted", "selected cold chunks needing an fp16 host copy"}})});
  }
  {
    // Two sessions of one tenant; each thread Selects every layer in turn (a decode loop's
    // pattern), releasing each lease before the next Select. One pass over the layers first,
    // so that the copies are cached and the gathered blocks' slots kept.
    Env e("scaling");
    std::vector<std::unique_ptr<Session>> sessions;
    for (uint32_t i = 0; i < 2; ++i)
      sessions.push_back(MakeSession(e, "s" + std::to_string(i), 7 + i));
    std::mt19937 rng(11);
    std::normal_distribution<float> g(0, 1);
    std::vector<float> q(kQ * kD);
    for (float& x : q) x = g(rng);
    constexpr int kSteps = 600;
    auto loop = [&](Session& s, int steps) {
      v1::SelectResponse resp;
      for (int i = 0; i < steps; ++i) {
        if (!s.Select(Query(q, i % kLayers, 256), &resp).ok()) std::abort();
        if (!e.leases.Release("bench", resp.lease_id()).ok()) std::abort();
      }
    };
    for (auto& s : sessions) loop(*s, kLayers);
    auto throughput = [&](int threads) {
      std::vector<std::thread> running;
      const double t0 = NowSeconds();
      for (int t = 0; t < threads; ++t) running.emplace_back(loop, std::ref(*sessions[t]), kSteps);
      for (std::thread& t : running) t.join();
      return threads * kSteps / (NowSeconds() - t0);
    };
    std::vector<double> one, two;
    for (int rep = 0; rep < 5; ++rep) {
      one.push_back(throughput(1));
      two.push_back(throughput(2));
    }
    Print({"select_scaling_in_process", Median(two), "selects/s", Median(one), "one_thread",
           Params({{"steps", std::to_string(kSteps)},
                   {"budget", "256"},
                   {"threads", "2, each on a session of its own (one tenant), Select then Release"},
                   {"cores", std::to_string(std::thread::hardware_concurrency())},
                   {"reps", "5"}})});
  }
  return 0;
}
