// The fixture the session tests share: tiers and a session over them, the K and V each test
// appends (kept here as the independent expectation), and brute-force expectations of what a
// Select returns, computed in double from the original data.
#ifndef KVTIER_TESTS_SESSION_FIXTURE_H_
#define KVTIER_TESTS_SESSION_FIXTURE_H_

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "kernels/quant_layout.h"
#include "server/common/fp16.h"
#include "server/config/policy.h"
#include "server/config/shape.h"
#include "server/session/session.h"
#include "tests/fake_device.h"
#include "tests/test_util.h"

namespace kvtier::testing {

using Code = absl::StatusCode;

inline TierOptions TierOpts(v1::Tier t, uint64_t capacity,
                            std::function<uint64_t(const std::string&)> tenant_limit = {}) {
  static int n = 0;
  TierOptions o;
  o.tier = t;
  o.instance = "sesstest-" + std::to_string(getpid()) + "-" + std::to_string(n++);
  o.capacity_bytes = capacity;
  o.segment_bytes = 1 << 20;
  o.emulated = t == v1::TIER_DEVICE;
  o.tenant_limit = std::move(tenant_limit);
  return o;
}

// The device tier over device memory (the GPU path's CPU twin): FakeDeviceMemory regions.
inline TierOptions FakeDeviceTierOpts(uint64_t capacity, std::shared_ptr<FakeDeviceState> state) {
  TierOptions o = TierOpts(v1::TIER_DEVICE, capacity);
  o.emulated = false;
  o.device_memory = FakeDeviceAllocator(std::move(state));
  return o;
}

// Tiers first: everything holding slots is destroyed before them. `host_quota`: each
// tenant's bytes on the host tier (0: no limit). `fake_device`: the device tier's slots in
// fake device memory (else host shared memory, as an emulated tier).
struct Env {
  explicit Env(uint64_t host_capacity = 64 << 20, uint64_t device_capacity = 16 << 20,
               std::function<uint64_t(const std::string&)> host_quota = {},
               std::shared_ptr<FakeDeviceState> fake_device = nullptr)
      : host(TierOpts(v1::TIER_HOST, host_capacity, std::move(host_quota))),
        device(fake_device ? FakeDeviceTierOpts(device_capacity, fake_device)
                           : TierOpts(v1::TIER_DEVICE, device_capacity)) {
    env.host = &host;
    env.host_copies = &host_copies;
    env.device_copies = &device_copies;
    env.leases = &leases;
    env.clock = &clock;
    env.lease_ttl_ms = 1000;
    env.max_lease_ms = 5000;
  }
  ManualClock clock;
  Tier host;
  Tier device;
  PromotionCache host_copies{&host, &clock, MakeLruPolicy()};
  PromotionCache device_copies{&device, &clock, MakeLruPolicy()};
  LeaseTable leases{&clock};
  SessionEnv env;
};

// A session plus the full K and V it was given, [layer] -> [kv_heads][tokens][d].
struct Fixture {
  int layers, qh, kvh, d, total;
  std::vector<std::vector<uint16_t>> k, v;
  std::shared_ptr<Session> session;  // shared: an aging pool holds it weakly
};

// A CreateSession of the smallest shape (one layer, one head, head_dim 8): for tests of the
// session map, whose sessions hold nothing.
inline v1::CreateSessionRequest SmallestSession() {
  v1::CreateSessionRequest req;
  req.mutable_shape()->set_num_layers(1);
  req.mutable_shape()->set_num_q_heads(1);
  req.mutable_shape()->set_num_kv_heads(1);
  req.mutable_shape()->set_head_dim(8);
  return req;
}

// The tests below check whole contiguous 16-token chunks against brute force: they say so,
// the daemon's defaults being semantic chunking and token-level refinement.
inline v1::SessionPolicy WholeContiguousChunks() {
  v1::SessionPolicy p;
  p.set_chunking(v1::CHUNKING_CONTIGUOUS);
  p.set_refine_factor(1);
  return p;
}

inline v1::SessionPolicy Lossless() {
  v1::SessionPolicy p = WholeContiguousChunks();
  p.set_lossless(true);
  return p;
}

// Sessions default to lossless here: these tests check bytes exactly. Cold chunks have their
// own tests below.
inline Fixture Make(Env& e, int layers, int qh, int kvh, int d, int total,
                    v1::SessionPolicy policy = Lossless(), uint32_t seed = 1) {
  Fixture f{layers, qh, kvh, d, total, {}, {}, nullptr};
  std::mt19937 rng(seed);
  for (int l = 0; l < layers; ++l) {
    f.k.push_back(RandomHalfs(size_t(kvh) * total * d, rng));
    f.v.push_back(RandomHalfs(size_t(kvh) * total * d, rng));
  }
  v1::ModelShape shape;
  shape.set_num_layers(layers);
  shape.set_num_q_heads(qh);
  shape.set_num_kv_heads(kvh);
  shape.set_head_dim(d);
  auto resolved = ResolvePolicy(policy, BuiltinPolicy(), "policy");
  EXPECT_TRUE(resolved.ok()) << resolved.status();
  f.session = std::make_unique<Session>("s", "t", *ResolveShape(shape), *resolved,
                                        std::map<std::string, std::string>{}, e.env);
  return f;
}

// The host tier holds sessions' metadata beside their slots (Session::metadata_bytes): a
// test of an exact fit adds what `build`, run on a roomy tier of its own, says its sessions
// hold there (it reads twin.host.Stats().metadata_bytes while they live).
inline uint64_t MetadataOfTwin(const std::function<uint64_t(Env& twin)>& build) {
  Env twin;
  return build(twin);
}

inline v1::AppendKVRequest Req(const Fixture& f, int layer, int start, int n) {
  v1::AppendKVRequest r;
  r.set_session_id("s");
  r.set_layer(layer);
  r.set_start_token(start);
  r.set_num_tokens(n);
  r.set_keys(AsBytes(Slice(f.k[layer], f.kvh, f.total, f.d, start, n)));
  r.set_values(AsBytes(Slice(f.v[layer], f.kvh, f.total, f.d, start, n)));
  return r;
}

inline absl::Status AppendAll(Fixture& f, int upto, int step) {
  for (int s = 0; s < upto; s += step) {
    for (int l = 0; l < f.layers; ++l) {
      auto r = f.session->Append(Req(f, l, s, std::min(step, upto - s)));
      if (!r.ok()) return r.status();
    }
  }
  return absl::OkStatus();
}

inline std::vector<uint64_t> AllChunkIds(const Fixture& f, int layer, int head, int tokens,
                                         int ct = 16) {
  std::vector<uint64_t> ids;
  for (int c = 0; c * ct < tokens; ++c) {
    ids.push_back(EncodeChunkId({uint32_t(layer), uint32_t(head), uint32_t(c)}));
  }
  return ids;
}

// Rows [start, start+n) of one head of a [kv_heads][total][d] tensor.
inline std::vector<uint16_t> HeadRows(const std::vector<uint16_t>& all, const Fixture& f, int head,
                                      int start, int n) {
  auto b = all.begin() + (size_t(head) * f.total + start) * f.d;
  return std::vector<uint16_t>(b, b + size_t(n) * f.d);
}

// Concatenated K, V and positions of handles carrying inline data.
struct Gathered {
  std::vector<uint16_t> k, v;
  std::vector<int64_t> pos;
};
inline Gathered Gather(const google::protobuf::RepeatedPtrField<v1::BlockHandle>& handles) {
  Gathered g;
  for (const auto& h : handles) {
    const auto* kp = reinterpret_cast<const uint16_t*>(h.keys().data());
    const auto* vp = reinterpret_cast<const uint16_t*>(h.values().data());
    g.k.insert(g.k.end(), kp, kp + h.keys().size() / 2);
    g.v.insert(g.v.end(), vp, vp + h.values().size() / 2);
    g.pos.insert(g.pos.end(), h.positions().begin(), h.positions().end());
  }
  return g;
}

// The chunk indices of one KV head's selection.
inline std::set<uint32_t> ChunkIndices(const v1::HeadSelection& head) {
  std::set<uint32_t> out;
  for (const auto& b : head.blocks()) out.insert(DecodeChunkId(b.chunk_id()).index);
  return out;
}

// Reads a stream back through ReadChunks and compares every row with what was appended.
inline void ExpectStreamExact(Fixture& f, int layer, int head, int tokens) {
  ASSERT_OK_AND_ASSIGN(auto handles, f.session->ReadChunks(AllChunkIds(f, layer, head, tokens)));
  google::protobuf::RepeatedPtrField<v1::BlockHandle> rep(handles.begin(), handles.end());
  for (const auto& h : handles) {
    ASSERT_EQ(h.keys().size(), h.num_tokens() * f.d * 2u);
    ASSERT_EQ(h.length(), 2 * h.keys().size());
  }
  Gathered g = Gather(rep);
  std::vector<int64_t> want_pos(tokens);
  std::iota(want_pos.begin(), want_pos.end(), 0);
  EXPECT_EQ(g.pos, want_pos);
  EXPECT_EQ(g.k, HeadRows(f.k[layer], f, head, 0, tokens));
  EXPECT_EQ(g.v, HeadRows(f.v[layer], f, head, 0, tokens));
}

inline std::string Query(const Fixture& f, uint32_t seed, std::vector<float>* out = nullptr) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> n(0, 1);
  std::vector<float> q(size_t(f.qh) * f.d);
  for (auto& x : q) x = n(rng);
  if (out) *out = q;
  return std::string(reinterpret_cast<const char*>(q.data()), q.size() * 4);
}

inline v1::SelectRequest SelectReq(const Fixture& f, int layer, uint32_t budget,
                                   uint32_t seed = 9) {
  v1::SelectRequest r;
  r.set_session_id("s");
  r.set_layer(layer);
  r.set_query(Query(f, seed));
  r.set_budget_tokens(budget);
  r.set_include_data(true);
  return r;
}

// Independent expectation of one head's chunks, for any chunking (`chunks`: each chunk's
// positions, by chunk index): the chunks with a row among the sinks or in the window, then
// the best scores (computed here in double from the original fp16 data, against the query on
// its 8-bit grid) that fit in the budget, greedily: the mean score, or log((n-1) e^(q.mu/sqrt d) +
// e^(q.peak/sqrt d)) with the peak the key farthest from the mean.
inline std::set<uint32_t> ExpectedSelection(const Fixture& f, int layer, int head, int tokens,
                                            const std::vector<std::vector<int64_t>>& chunks,
                                            uint32_t budget, uint32_t seed, int sink = 16,
                                            int window = 64,
                                            v1::Ranking ranking = v1::RANKING_LSE_PEAK,
                                            bool compact = true) {
  const int group = f.qh / f.kvh;
  std::vector<float> q;
  Query(f, seed, &q);
  OnQueryGrid(&q, f.d);  // every chunk is ranked against the query on its 8-bit grid
  std::set<uint32_t> out;
  uint64_t used = 0;
  std::vector<std::pair<double, uint32_t>> scored;
  for (uint32_t c = 0; c < chunks.size(); ++c) {
    const std::vector<int64_t>& rows = chunks[c];
    const int64_t lo = *std::min_element(rows.begin(), rows.end());
    const int64_t hi = *std::max_element(rows.begin(), rows.end()) + 1;
    if (lo < sink || hi > tokens - window) {
      out.insert(c);
      used += rows.size();
      continue;
    }
    auto key = [&](int64_t t, int j) {
      return double(HalfToFloat(f.k[layer][(size_t(head) * f.total + t) * f.d + j]));
    };
    std::vector<double> mu(f.d, 0.0);
    for (int j = 0; j < f.d; ++j) {
      for (int64_t t : rows) mu[j] += key(t, j);
      mu[j] /= double(rows.size());
    }
    int64_t peak = rows[0];
    double far = -1;
    for (int64_t t : rows) {
      double dist = 0;
      for (int j = 0; j < f.d; ++j) dist += (key(t, j) - mu[j]) * (key(t, j) - mu[j]);
      if (dist > far) far = dist, peak = t;
    }
    // A chunk outside the sinks and the window has aged, so its statistics are compact
    // (ChunkStats): each vector as bytes, rounded to nearest, times its largest magnitude over
    // 127. (`compact` false: aging has not finished, and they are still floats.)
    std::vector<double> pk(f.d);
    for (int j = 0; j < f.d; ++j) pk[j] = key(peak, j);
    if (compact) {
      for (std::vector<double>* v : {&mu, &pk}) {
        float top = 0;
        for (double x : *v) top = std::max(top, std::fabs(float(x)));
        const float inv = top > 0 ? 127.f / top : 0.f, step = top / 127.f;
        for (double& x : *v) x = double(std::nearbyint(float(x) * inv) * step);
      }
    }
    double best = -1e300;
    for (int g = 0; g < group; ++g) {
      double a = 0, b = 0;
      for (int j = 0; j < f.d; ++j) {
        a += q[(size_t(head) * group + g) * f.d + j] * mu[j];
        b += q[(size_t(head) * group + g) * f.d + j] * pk[j];
      }
      const double rd = std::sqrt(double(f.d));
      best = std::max(
          best, ranking == v1::RANKING_MEAN
                    ? a
                    : std::log(double(rows.size() - 1) * std::exp(a / rd) + std::exp(b / rd)));
    }
    scored.push_back({-best, c});
  }
  std::sort(scored.begin(), scored.end());
  for (auto [neg, c] : scored) {
    if (used + chunks[c].size() > budget) continue;
    used += chunks[c].size();
    out.insert(c);
  }
  return out;
}

// The same for contiguous 16-token chunks.
inline std::set<uint32_t> ExpectedChunks(const Fixture& f, int layer, int head, int tokens,
                                         uint32_t budget, uint32_t seed, int sink = 16,
                                         int window = 64,
                                         v1::Ranking ranking = v1::RANKING_LSE_PEAK) {
  std::vector<std::vector<int64_t>> chunks;
  for (int lo = 0; lo < tokens; lo += 16) {
    chunks.emplace_back();
    for (int t = lo; t < std::min(lo + 16, tokens); ++t) chunks.back().push_back(t);
  }
  return ExpectedSelection(f, layer, head, tokens, chunks, budget, seed, sink, window, ranking);
}

// The default precision (int4 cold chunks), sinks 16, window 64, whole contiguous chunks of 16.
inline v1::SessionPolicy Cold(v1::Precision p = v1::PRECISION_INT4) {
  v1::SessionPolicy policy = WholeContiguousChunks();
  policy.set_cold_precision(p);
  return policy;
}

// Half an fp16 ulp at |y|.
inline float HalfUlpAt(float y) {
  uint16_t h = FloatToHalf(std::fabs(y));
  return (HalfToFloat(HalfNextUp(h)) - HalfToFloat(h)) / 2;
}

inline v1::AppendKVRequest ReqIds(const Fixture& f, int layer, int start, int n,
                                  const std::vector<int32_t>& ids) {
  v1::AppendKVRequest r = Req(f, layer, start, n);
  for (int t = start; t < start + n; ++t) r.add_token_ids(ids[t]);
  return r;
}

// Layer 2, head 0 of a long session: Selects at budgets 256 and 1024 (query `seed`, handles
// without data) return the chunks brute force picks.
inline void ExpectLongContextSelections(Fixture& f, int tokens,
                                        const std::vector<std::vector<int64_t>>& chunks,
                                        uint32_t seed, bool compact = true) {
  for (uint32_t budget : {256u, 1024u}) {
    v1::SelectResponse resp;
    auto req = SelectReq(f, 2, budget, seed);
    req.set_include_data(false);
    ASSERT_OK(f.session->Select(req, &resp));
    EXPECT_EQ(ChunkIndices(resp.heads(0)), ExpectedSelection(f, 2, 0, tokens, chunks, budget, seed,
                                                             16, 64, v1::RANKING_LSE_PEAK, compact))
        << "budget " << budget;
  }
}

// Every chunk of one stream, read back through ListChunks' ids and ReadChunks.
inline std::vector<v1::BlockHandle> StreamHandles(Fixture& f, int layer, int head) {
  std::vector<uint64_t> ids;
  const v1::ListChunksResponse listed = *f.session->ListChunks(layer, 1u << 30);
  for (const auto& c : listed.chunks()) {
    if (int(c.kv_head()) == head) ids.push_back(c.chunk_id());
  }
  auto handles = f.session->ReadChunks(ids);
  EXPECT_TRUE(handles.ok()) << handles.status();
  return handles.ok() ? *handles : std::vector<v1::BlockHandle>{};
}

// Checks that a stream's chunks hold each position of [0, tokens) exactly once, every row
// within `tolerance` of what was appended at its position (0: the same bytes), and returns
// each chunk's positions.
inline std::vector<std::vector<int64_t>> ExpectRowsAtTheirPositions(Fixture& f, int layer, int head,
                                                                    int tokens,
                                                                    float tolerance = 0) {
  std::vector<std::vector<int64_t>> chunks;
  std::vector<int> seen(tokens, 0);
  for (const v1::BlockHandle& h : StreamHandles(f, layer, head)) {
    chunks.emplace_back(h.positions().begin(), h.positions().end());
    const auto* k = reinterpret_cast<const uint16_t*>(h.keys().data());
    const auto* v = reinterpret_cast<const uint16_t*>(h.values().data());
    for (int r = 0; r < int(h.num_tokens()); ++r) {
      const int64_t t = h.positions(r);
      if (t < 0 || t >= tokens) {
        ADD_FAILURE() << "position " << t;
        continue;
      }
      ++seen[t];
      auto same = [&](uint16_t got, uint16_t want) {
        return tolerance == 0 ? got == want
                              : std::abs(HalfToFloat(got) - HalfToFloat(want)) <= tolerance;
      };
      for (int j = 0; j < f.d; ++j) {
        const size_t at = (size_t(head) * f.total + t) * f.d + j;
        if (!same(k[r * f.d + j], f.k[layer][at]) || !same(v[r * f.d + j], f.v[layer][at])) {
          ADD_FAILURE() << "row " << r << " of chunk " << chunks.size() - 1 << " differs from "
                        << "position " << t << " at channel " << j;
          break;
        }
      }
    }
  }
  for (int t = 0; t < tokens; ++t) EXPECT_EQ(seen[t], 1) << "position " << t;
  return chunks;
}

inline constexpr int32_t kDelimiter = 7;

inline v1::SessionPolicy BoundaryPolicy(bool lossless) {
  v1::SessionPolicy p = WholeContiguousChunks();
  p.set_lossless(lossless);
  p.set_chunking(v1::CHUNKING_BOUNDARY);
  p.add_delimiter_token_ids(kDelimiter);
  p.add_delimiter_token_ids(kDelimiter + 1);
  return p;
}

// Token ids with a delimiter about one token in eight.
inline std::vector<int32_t> TokenIds(int n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<int32_t> ids(n);
  for (auto& id : ids)
    id = rng() % 8 == 0 ? kDelimiter + int32_t(rng() % 2) : 20 + int32_t(rng() % 100);
  return ids;
}

// The boundary rule, written out: a chunk ends after a delimiter once it holds 8 tokens, and
// at 32 tokens in any case.
inline std::vector<std::vector<int64_t>> BoundaryChunks(const std::vector<int32_t>& ids,
                                                        int tokens) {
  std::vector<std::vector<int64_t>> chunks;
  bool open = false;
  for (int t = 0; t < tokens; ++t) {
    if (!open) chunks.emplace_back(), open = true;
    chunks.back().push_back(t);
    const size_t n = chunks.back().size();
    if (n == 32 || (n >= 8 && (ids[t] == kDelimiter || ids[t] == kDelimiter + 1))) open = false;
  }
  return chunks;
}

inline v1::SessionPolicy SemanticPolicy(bool lossless) {
  v1::SessionPolicy p = WholeContiguousChunks();
  p.set_lossless(lossless);
  p.set_chunking(v1::CHUNKING_SEMANTIC);
  return p;
}

// Keys planted in 8 clusters, position t (past the sinks) in cluster (5t + head) % 8: every
// contiguous chunk mixes all 8, every 128-token span holds 16 of each.
inline int PlantedCluster(int64_t t, int head) { return int((5 * t + head) % 8); }

inline void PlantClusters(Fixture& f, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> n(0, 1);
  for (int l = 0; l < f.layers; ++l) {
    std::vector<float> centers(8 * f.d);
    for (auto& c : centers) c = 2.f * n(rng);
    for (int h = 0; h < f.kvh; ++h) {
      for (int t = 0; t < f.total; ++t) {
        for (int j = 0; j < f.d; ++j) {
          f.k[l][(size_t(h) * f.total + t) * f.d + j] =
              FloatToHalf(centers[PlantedCluster(t, h) * f.d + j] + 0.2f * n(rng));
        }
      }
    }
  }
}

inline std::vector<v1::BlockHandle> AllChunks(Session& s) {
  std::vector<uint64_t> ids;
  const v1::ListChunksResponse listed = *s.ListChunks(std::nullopt, 1u << 30);
  for (const auto& c : listed.chunks()) ids.push_back(c.chunk_id());
  auto r = s.ReadChunks(ids);
  EXPECT_TRUE(r.ok()) << r.status();
  return r.ok() ? *r : std::vector<v1::BlockHandle>{};
}

}  // namespace kvtier::testing

#endif  // KVTIER_TESTS_SESSION_FIXTURE_H_
