#include "server/session/session.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <set>

#include "server/common/fp16.h"
#include "server/config/policy.h"
#include "server/session/prefetcher.h"
#include "server/session/session_manager.h"
#include "server/session/session_record.h"
#include "kernels/quant_layout.h"
#include "tests/test_util.h"

namespace kvtier {
namespace {

using testing::AsBytes;
using testing::RandomHalfs;
using testing::Slice;
using testing::StatusIs;
using Code = absl::StatusCode;

TierOptions TierOpts(v1::Tier t, uint64_t capacity) {
  static int n = 0;
  TierOptions o;
  o.tier = t;
  o.instance = "sesstest-" + std::to_string(getpid()) + "-" + std::to_string(n++);
  o.capacity_bytes = capacity;
  o.segment_bytes = 1 << 20;
  o.emulated = t == v1::TIER_DEVICE;
  return o;
}

// Tiers first: everything holding slots is destroyed before them.
struct Env {
  explicit Env(uint64_t host_capacity = 64 << 20, uint64_t device_capacity = 16 << 20)
      : host(TierOpts(v1::TIER_HOST, host_capacity)),
        device(TierOpts(v1::TIER_DEVICE, device_capacity)) {
    env.host = &host;
    env.device = &device;
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
  std::unique_ptr<Session> session;
};

v1::SessionPolicy Lossless() {
  v1::SessionPolicy p;
  p.set_lossless(true);
  return p;
}

// Sessions default to lossless here: these tests check bytes exactly. Cold chunks have their
// own tests below.
Fixture Make(Env& e, int layers, int qh, int kvh, int d, int total,
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

v1::AppendKVRequest Req(const Fixture& f, int layer, int start, int n) {
  v1::AppendKVRequest r;
  r.set_session_id("s");
  r.set_layer(layer);
  r.set_start_token(start);
  r.set_num_tokens(n);
  r.set_keys(AsBytes(Slice(f.k[layer], f.kvh, f.total, f.d, start, n)));
  r.set_values(AsBytes(Slice(f.v[layer], f.kvh, f.total, f.d, start, n)));
  return r;
}

absl::Status AppendAll(Fixture& f, int upto, int step) {
  for (int s = 0; s < upto; s += step) {
    for (int l = 0; l < f.layers; ++l) {
      auto r = f.session->Append(Req(f, l, s, std::min(step, upto - s)));
      if (!r.ok()) return r.status();
    }
  }
  return absl::OkStatus();
}

std::vector<uint64_t> AllChunkIds(const Fixture& f, int layer, int head, int tokens, int ct = 16) {
  std::vector<uint64_t> ids;
  for (int c = 0; c * ct < tokens; ++c) {
    ids.push_back(EncodeChunkId({uint32_t(layer), uint32_t(head), uint32_t(c)}));
  }
  return ids;
}

// Rows [start, start+n) of one head of a [kv_heads][total][d] tensor.
std::vector<uint16_t> HeadRows(const std::vector<uint16_t>& all, const Fixture& f, int head,
                               int start, int n) {
  auto b = all.begin() + (size_t(head) * f.total + start) * f.d;
  return std::vector<uint16_t>(b, b + size_t(n) * f.d);
}

// Concatenated K, V and positions of handles carrying inline data.
struct Gathered {
  std::vector<uint16_t> k, v;
  std::vector<int64_t> pos;
};
Gathered Gather(const google::protobuf::RepeatedPtrField<v1::BlockHandle>& handles) {
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
std::set<uint32_t> ChunkIndices(const v1::HeadSelection& head) {
  std::set<uint32_t> out;
  for (const auto& b : head.blocks()) out.insert(DecodeChunkId(b.chunk_id()).index);
  return out;
}

// Reads a stream back through ReadChunks and compares every row with what was appended.
void ExpectStreamExact(Fixture& f, int layer, int head, int tokens) {
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

std::string Query(const Fixture& f, uint32_t seed, std::vector<float>* out = nullptr) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> n(0, 1);
  std::vector<float> q(size_t(f.qh) * f.d);
  for (auto& x : q) x = n(rng);
  if (out) *out = q;
  return std::string(reinterpret_cast<const char*>(q.data()), q.size() * 4);
}

v1::SelectRequest SelectReq(const Fixture& f, int layer, uint32_t budget, uint32_t seed = 9) {
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
// the best scores (computed here in double from the original fp16 data) that fit in the
// budget, greedily: the mean score, or log((n-1) e^(q.mu/sqrt d) + e^(q.peak/sqrt d)) with
// the peak the key farthest from the mean.
std::set<uint32_t> ExpectedSelection(const Fixture& f, int layer, int head, int tokens,
                                     const std::vector<std::vector<int64_t>>& chunks,
                                     uint32_t budget, uint32_t seed, int sink = 16,
                                     int window = 64,
                                     v1::Ranking ranking = v1::RANKING_LSE_PEAK) {
  const int group = f.qh / f.kvh;
  std::vector<float> q;
  Query(f, seed, &q);
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
    double best = -1e300;
    for (int g = 0; g < group; ++g) {
      double a = 0, b = 0;
      for (int j = 0; j < f.d; ++j) {
        a += q[(size_t(head) * group + g) * f.d + j] * mu[j];
        b += q[(size_t(head) * group + g) * f.d + j] * key(peak, j);
      }
      const double rd = std::sqrt(double(f.d));
      best = std::max(best, ranking == v1::RANKING_MEAN
                                ? a
                                : std::log(double(rows.size() - 1) * std::exp(a / rd) +
                                           std::exp(b / rd)));
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
std::set<uint32_t> ExpectedChunks(const Fixture& f, int layer, int head, int tokens,
                                  uint32_t budget, uint32_t seed, int sink = 16, int window = 64,
                                  v1::Ranking ranking = v1::RANKING_LSE_PEAK) {
  std::vector<std::vector<int64_t>> chunks;
  for (int lo = 0; lo < tokens; lo += 16) {
    chunks.emplace_back();
    for (int t = lo; t < std::min(lo + 16, tokens); ++t) chunks.back().push_back(t);
  }
  return ExpectedSelection(f, layer, head, tokens, chunks, budget, seed, sink, window, ranking);
}

TEST(Session, AppendThenReadBackIsExactAcrossChunkBoundaries) {
  for (int step : {1, 3, 7, 16, 17, 250}) {
    Env e;
    Fixture f = Make(e, 2, 4, 2, 64, 300);
    ASSERT_OK(AppendAll(f, 300, step));
    for (int l = 0; l < 2; ++l) {
      for (int h = 0; h < 2; ++h) ExpectStreamExact(f, l, h, 300);
    }
    EXPECT_EQ(f.session->Info().num_tokens(), 300u) << "step " << step;
  }
}

TEST(Session, AppendReportsTheTokensStoredInEveryLayer) {
  Env e;
  Fixture f = Make(e, 3, 2, 1, 32, 64);
  ASSERT_OK_AND_ASSIGN(uint64_t n, f.session->Append(Req(f, 0, 0, 40)));
  EXPECT_EQ(n, 0u);  // layers 1 and 2 hold nothing yet
  ASSERT_OK(f.session->Append(Req(f, 1, 0, 30)).status());
  ASSERT_OK_AND_ASSIGN(n, f.session->Append(Req(f, 2, 0, 50)));
  EXPECT_EQ(n, 30u);
}

TEST(Session, RewritesGapsAndConflicts) {
  Env e;
  Fixture f = Make(e, 1, 2, 2, 16, 100);
  ASSERT_OK(f.session->Append(Req(f, 0, 0, 40)).status());
  const uint64_t gen_before = f.session->ListChunks(0, 100).chunks(2).generation();
  // identical repeat: a no-op, nothing rewritten
  ASSERT_OK_AND_ASSIGN(uint64_t n, f.session->Append(Req(f, 0, 10, 20)));
  EXPECT_EQ(n, 40u);
  EXPECT_EQ(f.session->ListChunks(0, 100).chunks(2).generation(), gen_before);
  // overlap that extends: the stored part must match, the rest is appended
  ASSERT_OK_AND_ASSIGN(n, f.session->Append(Req(f, 0, 30, 30)));
  EXPECT_EQ(n, 60u);
  // a gap
  EXPECT_THAT(f.session->Append(Req(f, 0, 61, 5)), StatusIs(Code::kOutOfRange, "start_token"));
  // a conflicting rewrite, in the values of the second head
  auto bad = Req(f, 0, 5, 4);
  std::string vals = bad.values();
  vals[vals.size() - 1] ^= 0x01;
  bad.set_values(vals);
  EXPECT_THAT(f.session->Append(bad), StatusIs(Code::kFailedPrecondition, "kv_head 1"));
  ExpectStreamExact(f, 0, 0, 60);
  ExpectStreamExact(f, 0, 1, 60);
}

TEST(Session, BadAppendsNameTheField) {
  Env e;
  Fixture f = Make(e, 2, 2, 2, 16, 32);
  auto r = Req(f, 0, 0, 4);
  r.set_keys(r.keys().substr(2));
  EXPECT_THAT(f.session->Append(r), StatusIs(Code::kInvalidArgument, "keys"));
  r = Req(f, 0, 0, 4);
  r.set_values(r.values() + "xx");
  EXPECT_THAT(f.session->Append(r), StatusIs(Code::kInvalidArgument, "values"));
  r = Req(f, 0, 0, 4);
  r.set_layer(2);
  EXPECT_THAT(f.session->Append(r), StatusIs(Code::kInvalidArgument, "layer"));
  r = Req(f, 0, 0, 4);
  r.set_num_tokens(0);
  EXPECT_THAT(f.session->Append(r), StatusIs(Code::kInvalidArgument, "num_tokens"));
  r = Req(f, 0, 0, 4);
  r.add_token_ids(1);
  EXPECT_THAT(f.session->Append(r), StatusIs(Code::kInvalidArgument, "token_ids"));
  EXPECT_EQ(f.session->Info().num_tokens(), 0u);
}

TEST(Session, FullHostTierStoresNothingAndKeepsWhatWasThere) {
  // 2 kv heads, d 16: a slot is 16*16*4 = 1 KiB; room for 6 slots.
  Env e(6 * 1024);
  Fixture f = Make(e, 1, 2, 2, 16, 100);
  ASSERT_OK(f.session->Append(Req(f, 0, 0, 40)).status());  // 3 chunks per head: 6 slots
  EXPECT_THAT(f.session->Append(Req(f, 0, 40, 20)), StatusIs(Code::kResourceExhausted, "full"));
  EXPECT_EQ(f.session->Info().num_tokens(), 40u);
  ExpectStreamExact(f, 0, 0, 40);
  ExpectStreamExact(f, 0, 1, 40);
  EXPECT_EQ(e.host.Stats().used_bytes, 6u * 1024);
  // Filling the partial chunk needs no new slot and still fits.
  ASSERT_OK(f.session->Append(Req(f, 0, 40, 8)).status());
  ExpectStreamExact(f, 0, 1, 48);
}

TEST(Session, SelectReturnsEverythingWhenItFitsOrTheLayerIsDense) {
  Env e;
  Fixture f = Make(e, 3, 4, 2, 32, 200);
  ASSERT_OK(AppendAll(f, 200, 64));
  for (auto [layer, budget] : {std::pair{2, 200}, std::pair{0, 64}, std::pair{1, 64}}) {
    v1::SelectResponse resp;
    ASSERT_OK(f.session->Select(SelectReq(f, layer, budget), &resp));
    EXPECT_EQ(resp.context_tokens(), 200u);
    ASSERT_EQ(resp.heads_size(), 2);
    for (int h = 0; h < 2; ++h) {
      Gathered g = Gather(resp.heads(h).blocks());
      EXPECT_EQ(g.pos.size(), 200u);
      EXPECT_EQ(g.k, HeadRows(f.k[layer], f, h, 0, 200));
      EXPECT_EQ(g.v, HeadRows(f.v[layer], f, h, 0, 200));
    }
  }
}

TEST(Session, SelectBudgetSemanticsMatchBruteForce) {
  for (auto [tokens, ranking] : {std::pair{1000, v1::RANKING_LSE_PEAK},  // whole last chunk
                                 std::pair{1003, v1::RANKING_LSE_PEAK},  // partial last chunk
                                 std::pair{1003, v1::RANKING_MEAN}}) {
    Env e;
    v1::SessionPolicy policy = Lossless();
    policy.set_ranking(ranking);
    Fixture f = Make(e, 3, 6, 2, 64, tokens, policy, tokens);
    ASSERT_OK(AppendAll(f, tokens, 128));
    for (uint32_t budget : {96u, 128u, 256u, 500u}) {
      for (uint32_t seed : {1u, 2u, 3u}) {
        auto req = SelectReq(f, 2, budget, seed);
        v1::SelectResponse resp;
        ASSERT_OK(f.session->Select(req, &resp));
        for (int h = 0; h < 2; ++h) {
          Gathered g = Gather(resp.heads(h).blocks());
          EXPECT_LE(g.pos.size(), budget);
          std::set<int64_t> pos(g.pos.begin(), g.pos.end());
          EXPECT_EQ(pos.size(), g.pos.size()) << "duplicate positions";
          for (int t = 0; t < 16; ++t) EXPECT_TRUE(pos.count(t)) << "sink " << t;
          for (int t = tokens - 64; t < tokens; ++t) EXPECT_TRUE(pos.count(t)) << "window " << t;
          std::set<uint32_t> chunks;
          for (const auto& b : resp.heads(h).blocks()) {
            chunks.insert(DecodeChunkId(b.chunk_id()).index);
            // every handle's rows are the appended rows at its positions
            const int64_t p0 = b.positions(0);
            EXPECT_EQ(b.keys(), AsBytes(HeadRows(f.k[2], f, h, p0, b.num_tokens())));
            EXPECT_EQ(b.values(), AsBytes(HeadRows(f.v[2], f, h, p0, b.num_tokens())));
          }
          EXPECT_EQ(chunks, ExpectedChunks(f, 2, h, tokens, budget, seed, 16, 64, ranking))
              << "tokens " << tokens << " budget " << budget << " seed " << seed << " "
              << v1::Ranking_Name(ranking);
        }
      }
    }
  }
}

// Past 1024 candidate chunks Select searches the cluster index instead of scanning; the
// chunks it returns must be the same as the brute-force ranking's.
TEST(Session, IndexedSelectMatchesBruteForceOnALongContext) {
  Env e(160 << 20);
  const int tokens = 70000;
  Fixture f = Make(e, 3, 3, 1, 64, tokens, Lossless(), 21);
  for (int s = 0; s < tokens; s += 4096) {
    ASSERT_OK(f.session->Append(Req(f, 2, s, std::min(4096, tokens - s))).status());
  }
  const v1::LayerStats before = f.session->Layers()[2];
  const uint64_t aged_out = (tokens - 64) / 16 - 1;  // wholly before the window, sink chunk out
  EXPECT_EQ(before.indexed_chunks(), aged_out);
  EXPECT_GT(before.clusters(), aged_out / 16);
  EXPECT_GT(before.units(), 0u);
  for (uint32_t budget : {256u, 1024u}) {
    for (uint32_t seed : {1u, 2u}) {
      v1::SelectResponse resp;
      auto req = SelectReq(f, 2, budget, seed);
      req.set_include_data(false);
      ASSERT_OK(f.session->Select(req, &resp));
      const std::set<uint32_t> chunks = ChunkIndices(resp.heads(0));
      EXPECT_EQ(chunks, ExpectedChunks(f, 2, 0, tokens, budget, seed))
          << "budget " << budget << " seed " << seed;
    }
  }
  const v1::LayerStats after = f.session->Layers()[2];
  EXPECT_EQ(after.select_candidates(), 4 * aged_out);
  // The index pruned something, even on random keys (so it, not the scan, answered).
  EXPECT_LT(after.select_chunks_scored(), after.select_candidates());
}

// A policy change mid-session moves the window: chunks that age out then must be ranked
// (with their peaks) like any other, and the ranking itself may change.
TEST(Session, SetPolicyWindowAndRankingChangesKeepSelectExact) {
  Env e;
  Fixture f = Make(e, 3, 6, 2, 64, 900, Lossless(), 17);
  ASSERT_OK(AppendAll(f, 900, 300));
  v1::SessionPolicy next;
  next.set_recent_window(16);
  next.set_ranking(v1::RANKING_MEAN);
  ASSERT_OK(f.session->SetPolicy(next).status());
  for (auto ranking : {v1::RANKING_MEAN, v1::RANKING_LSE_PEAK}) {
    next.set_ranking(ranking);
    ASSERT_OK(f.session->SetPolicy(next).status());
    for (uint32_t budget : {64u, 200u}) {
      v1::SelectResponse resp;
      ASSERT_OK(f.session->Select(SelectReq(f, 2, budget, 3), &resp));
      for (int h = 0; h < 2; ++h) {
        const std::set<uint32_t> chunks = ChunkIndices(resp.heads(h));
        EXPECT_EQ(chunks, ExpectedChunks(f, 2, h, 900, budget, 3, 16, 16, ranking))
            << v1::Ranking_Name(ranking) << " budget " << budget;
      }
    }
  }
}

// A fork ranks its shared chunks with the parent's statistics and its own index.
TEST(Session, ForkSelectsLikeBruteForceOnItsOwnTokens) {
  Env e;
  Fixture f = Make(e, 3, 6, 2, 64, 900, Lossless(), 19);
  ASSERT_OK(AppendAll(f, 900, 300));
  ASSERT_OK_AND_ASSIGN(auto child, f.session->Fork("c", 700));
  for (uint32_t budget : {128u, 256u}) {
    auto req = SelectReq(f, 2, budget, 6);
    req.set_session_id("c");
    v1::SelectResponse resp;
    ASSERT_OK(child->Select(req, &resp));
    for (int h = 0; h < 2; ++h) {
      const std::set<uint32_t> chunks = ChunkIndices(resp.heads(h));
      EXPECT_EQ(chunks, ExpectedChunks(f, 2, h, 700, budget, 6)) << "budget " << budget;
    }
  }
}

TEST(Session, SelectRejectsBadRequestsByField) {
  Env e;
  Fixture f = Make(e, 3, 4, 2, 32, 500);
  ASSERT_OK(AppendAll(f, 500, 250));
  v1::SelectResponse resp;
  auto r = SelectReq(f, 2, 64);  // below 16 sink + 64 window tokens
  EXPECT_THAT(f.session->Select(r, &resp), StatusIs(Code::kInvalidArgument, "budget_tokens"));
  r = SelectReq(f, 3, 256);
  EXPECT_THAT(f.session->Select(r, &resp), StatusIs(Code::kInvalidArgument, "layer"));
  r = SelectReq(f, 2, 256);
  r.set_query(r.query().substr(4));
  EXPECT_THAT(f.session->Select(r, &resp), StatusIs(Code::kInvalidArgument, "query"));
  r = SelectReq(f, 2, 256);
  std::string q = r.query();
  float nan = std::nanf("");
  std::memcpy(q.data() + 8, &nan, 4);
  r.set_query(q);
  EXPECT_THAT(f.session->Select(r, &resp), StatusIs(Code::kInvalidArgument, "not finite"));
  r = SelectReq(f, 2, 256);
  r.set_placement(v1::TIER_REMOTE);
  EXPECT_THAT(f.session->Select(r, &resp), StatusIs(Code::kInvalidArgument, "placement"));
  r = SelectReq(f, 2, 256);
  r.set_lease_ms(6000);
  EXPECT_THAT(f.session->Select(r, &resp), StatusIs(Code::kInvalidArgument, "lease_ms"));
  EXPECT_EQ(e.leases.size(), 0u);
}

// Every chunk left out of a selection comes back as a summary: its mean key and mean value
// (fp32) and token count, checked against means computed here from the appended rows.
// Summaries group the left-out chunks by their cluster in the index: together they must
// account for every left-out token exactly (counts, and count-weighted mean keys and values
// summing to the left-out tokens' sums), in fewer entries than one per chunk.
TEST(Session, SummariesDescribeEveryLeftOutTokenByCluster) {
  Env e;
  Fixture f = Make(e, 3, 4, 2, 32, 640);
  ASSERT_OK(AppendAll(f, 640, 320));
  auto req = SelectReq(f, 2, 160);
  req.set_include_summaries(true);
  v1::SelectResponse resp;
  ASSERT_OK(f.session->Select(req, &resp));
  for (int h = 0; h < 2; ++h) {
    const auto& head = resp.heads(h);
    const std::set<uint32_t> chosen = ChunkIndices(head);
    const int left_out = 40 - static_cast<int>(chosen.size());
    ASSERT_GT(left_out, 0);
    EXPECT_GT(head.summaries_size(), 0);
    EXPECT_LT(head.summaries_size(), left_out);  // clusters hold several chunks
    std::vector<double> want_k(32, 0.0), want_v(32, 0.0), got_k(32, 0.0), got_v(32, 0.0);
    for (uint32_t c = 0; c < 40; ++c) {
      if (chosen.count(c)) continue;
      for (uint32_t t = c * 16; t < c * 16 + 16; ++t) {
        for (int j = 0; j < 32; ++j) {
          want_k[j] += HalfToFloat(f.k[2][(size_t(h) * 640 + t) * 32 + j]);
          want_v[j] += HalfToFloat(f.v[2][(size_t(h) * 640 + t) * 32 + j]);
        }
      }
    }
    uint32_t tokens = 0;
    for (const auto& sum : head.summaries()) {
      tokens += sum.num_tokens();
      EXPECT_EQ(sum.num_tokens() % 16, 0u);
      const auto* mk = reinterpret_cast<const float*>(sum.mean_key().data());
      const auto* mv = reinterpret_cast<const float*>(sum.mean_value().data());
      for (int j = 0; j < 32; ++j) {
        got_k[j] += double(mk[j]) * sum.num_tokens();
        got_v[j] += double(mv[j]) * sum.num_tokens();
      }
    }
    EXPECT_EQ(tokens, 16u * left_out);
    for (int j = 0; j < 32; ++j) {
      EXPECT_NEAR(got_k[j], want_k[j], 1e-3 * (1 + std::abs(want_k[j]))) << "channel " << j;
      EXPECT_NEAR(got_v[j], want_v[j], 1e-3 * (1 + std::abs(want_v[j]))) << "channel " << j;
    }
  }
}

TEST(Session, DefaultBudgetComesFromThePolicy) {
  Env e;
  v1::SessionPolicy p = Lossless();
  p.set_default_budget(160);
  Fixture f = Make(e, 3, 2, 1, 16, 1000, p);
  ASSERT_OK(AppendAll(f, 1000, 500));
  v1::SelectResponse resp;
  ASSERT_OK(f.session->Select(SelectReq(f, 2, 0), &resp));
  // 16 sink tokens + the window's chunks [928, 1000) (72 tokens) + 4 chunks of 16 = 152;
  // a fifth chunk would pass 160.
  EXPECT_EQ(Gather(resp.heads(0).blocks()).pos.size(), 152u);
}

TEST(Session, LeasePinsUntilReleaseOrExpiry) {
  Env e;
  Fixture f = Make(e, 3, 2, 1, 16, 500);
  ASSERT_OK(AppendAll(f, 500, 500));
  v1::SelectResponse resp;
  ASSERT_OK(f.session->Select(SelectReq(f, 2, 128), &resp));
  EXPECT_EQ(e.host.Stats().pinned_bytes, 8u * 1024);  // 128 tokens = 8 slots of 1 KiB
  EXPECT_EQ(f.session->Info().active_leases(), 1u);
  EXPECT_EQ(resp.lease_expires_unix_ms(), e.clock.NowMs() + 1000);
  EXPECT_THAT(e.leases.Release("other-tenant", resp.lease_id()),
              StatusIs(Code::kPermissionDenied));
  ASSERT_OK(e.leases.Release("t", resp.lease_id()));
  EXPECT_EQ(e.host.Stats().pinned_bytes, 0u);
  EXPECT_THAT(e.leases.Release("t", resp.lease_id()), StatusIs(Code::kNotFound, "lease_id"));
  EXPECT_EQ(f.session->Info().active_leases(), 0u);

  auto r = SelectReq(f, 2, 128);
  r.set_lease_ms(3000);
  ASSERT_OK(f.session->Select(r, &resp));
  e.clock.AdvanceMs(2999);
  EXPECT_EQ(e.leases.ExpireDue(), 0);
  e.clock.AdvanceMs(1);
  EXPECT_EQ(e.leases.ExpireDue(), 1);
  EXPECT_EQ(e.host.Stats().pinned_bytes, 0u);
  EXPECT_EQ(f.session->Info().active_leases(), 0u);
  EXPECT_EQ(e.leases.size(), 0u);
}

// A worker holding a lease keeps reading the bytes it was given, even while the session
// grows the chunk it points at and even after the session closes.
TEST(Session, LeasedMemoryIsNeverRewrittenOrFreed) {
  Env e;
  Fixture f = Make(e, 1, 2, 1, 16, 100);
  ASSERT_OK(f.session->Append(Req(f, 0, 0, 40)).status());  // last chunk holds 8 tokens
  v1::SelectResponse resp;
  ASSERT_OK(f.session->Select(SelectReq(f, 0, 40), &resp));
  const v1::BlockHandle last = resp.heads(0).blocks(2);
  ASSERT_EQ(last.num_tokens(), 8u);
  std::string name;
  for (const auto& seg : e.host.Segments()) {
    if (seg.segment_id == last.segment_id()) name = seg.shm_name;
  }
  ASSERT_OK_AND_ASSIGN(ShmSegment mapped, ShmSegment::OpenReadOnly(name));
  auto leased_bytes = [&] {
    return std::string(reinterpret_cast<const char*>(mapped.data() + last.offset()), last.length());
  };
  ASSERT_EQ(leased_bytes(), last.keys() + last.values());
  ASSERT_OK(f.session->Append(Req(f, 0, 40, 5)).status());  // grows the leased chunk
  EXPECT_EQ(leased_bytes(), last.keys() + last.values());
  auto now = f.session->ListChunks(0, 10).chunks(2);
  EXPECT_EQ(now.num_tokens(), 13u);
  EXPECT_NE(now.generation(), last.generation());  // a copy was grown, not the leased slot
  ExpectStreamExact(f, 0, 0, 45);

  f.session->Close();
  EXPECT_THAT(f.session->Append(Req(f, 0, 45, 1)), StatusIs(Code::kNotFound, "closed"));
  // Only the leased slots (3 chunks) remain allocated; the grown copy went with the session.
  EXPECT_EQ(e.host.Stats().used_bytes, 3u * 1024);
  EXPECT_EQ(leased_bytes(), last.keys() + last.values());
  ASSERT_OK(e.leases.Release("t", resp.lease_id()));
  EXPECT_EQ(e.host.Stats().used_bytes, 0u);
}

TEST(Session, UnsharedPartialChunkGrowsInPlaceWithANewGeneration) {
  Env e;
  Fixture f = Make(e, 1, 2, 1, 16, 100);
  ASSERT_OK(f.session->Append(Req(f, 0, 0, 20)).status());
  auto before = f.session->ListChunks(0, 10).chunks(1);
  ASSERT_OK(f.session->Append(Req(f, 0, 20, 3)).status());
  auto after = f.session->ListChunks(0, 10).chunks(1);
  EXPECT_GT(after.generation(), before.generation());
  EXPECT_EQ(e.host.Stats().num_slots, 2u);
  ExpectStreamExact(f, 0, 0, 23);
}

TEST(Session, ForkSharesWholeChunksAndCopiesTheStraddlingOne) {
  Env e;
  Fixture f = Make(e, 2, 2, 1, 16, 100);
  ASSERT_OK(AppendAll(f, 70, 70));
  const uint64_t used = e.host.Stats().used_bytes;  // 2 layers x 5 chunks
  ASSERT_OK_AND_ASSIGN(auto child, f.session->Fork("c", 40));
  // 2 whole chunks shared per layer, one 8-token chunk copied per layer
  EXPECT_EQ(e.host.Stats().used_bytes, used + 2 * 1024);
  EXPECT_EQ(child->Info().num_tokens(), 40u);
  // The child grows on its own; the parent is untouched.
  Fixture c{f.layers, f.qh, f.kvh, f.d, f.total, f.k, f.v, std::move(child)};
  std::mt19937 rng(99);
  for (int l = 0; l < 2; ++l) {
    auto other = RandomHalfs(size_t(30) * 16, rng);
    std::copy(other.begin(), other.end(), c.k[l].begin() + 40 * 16);
    std::copy(other.begin(), other.end(), c.v[l].begin() + 40 * 16);
    ASSERT_OK(c.session->Append(Req(c, l, 40, 30)).status());
  }
  for (int l = 0; l < 2; ++l) {
    ExpectStreamExact(c, l, 0, 70);
    ExpectStreamExact(f, l, 0, 70);
  }
  EXPECT_THAT(f.session->Fork("x", 71), StatusIs(Code::kInvalidArgument, "num_tokens"));
  c.session->Close();
}

// Copy on write both ways: a fork of everything shares every chunk, the partial last one
// included; whichever side appends first grows its own copy, and closing the parent leaves
// the child whole.
TEST(Session, ForkIsCopyOnWriteBothWaysAndOutlivesItsParent) {
  Env e;
  Fixture f = Make(e, 2, 2, 1, 16, 100);
  ASSERT_OK(AppendAll(f, 40, 40));  // chunks 0, 1 whole, chunk 2 holds 8 tokens
  const uint64_t used = e.host.Stats().used_bytes;
  ASSERT_OK_AND_ASSIGN(auto child, f.session->Fork("c", 0));
  EXPECT_EQ(e.host.Stats().used_bytes, used) << "a fork of whole and partial chunks copies nothing";
  Fixture c{f.layers, f.qh, f.kvh, f.d, f.total, f.k, f.v, std::move(child)};
  std::mt19937 rng(7);
  for (int l = 0; l < 2; ++l) {  // the child's continuation differs from the parent's
    auto other = RandomHalfs(size_t(60) * 16, rng);
    std::copy(other.begin(), other.end(), c.k[l].begin() + 40 * 16);
    std::copy(other.begin(), other.end(), c.v[l].begin() + 40 * 16);
  }
  for (int l = 0; l < 2; ++l) ASSERT_OK(f.session->Append(Req(f, l, 40, 20)).status());
  for (int l = 0; l < 2; ++l) ExpectStreamExact(c, l, 0, 40);  // the parent's append: unseen
  for (int l = 0; l < 2; ++l) ASSERT_OK(c.session->Append(Req(c, l, 40, 30)).status());
  for (int l = 0; l < 2; ++l) {
    ExpectStreamExact(f, l, 0, 60);
    ExpectStreamExact(c, l, 0, 70);
  }
  f.session->Close();
  for (int l = 0; l < 2; ++l) ExpectStreamExact(c, l, 0, 70);
  c.session->Close();
  EXPECT_EQ(e.host.Stats().used_bytes, 0u);
}

TEST(Session, DevicePlacementPromotesCopiesAndEvictDropsThem) {
  Env e(64 << 20, 3 * 1024);  // room for three promoted chunks
  Fixture f = Make(e, 1, 2, 1, 16, 64);
  ASSERT_OK(f.session->Append(Req(f, 0, 0, 48)).status());
  auto r = SelectReq(f, 0, 64);
  r.set_placement(v1::TIER_DEVICE);
  v1::SelectResponse first, second, refused;
  ASSERT_OK(f.session->Select(r, &first));
  for (const auto& b : first.heads(0).blocks()) EXPECT_EQ(b.tier(), v1::TIER_DEVICE);
  Gathered g = Gather(first.heads(0).blocks());
  EXPECT_EQ(g.k, HeadRows(f.k[0], f, 0, 0, 48));
  EXPECT_EQ(g.v, HeadRows(f.v[0], f, 0, 0, 48));
  EXPECT_EQ(e.device.Stats().used_bytes, 3u * 1024);
  EXPECT_EQ(e.device.Stats().promotions, 3u);
  ASSERT_OK(f.session->Select(r, &second));  // cached: no new promotion
  EXPECT_EQ(e.device.Stats().promotions, 3u);
  // A fourth chunk does not fit: refused, and nothing half-promoted stays.
  ASSERT_OK(f.session->Append(Req(f, 0, 48, 16)).status());
  EXPECT_THAT(f.session->Select(r, &refused), StatusIs(Code::kResourceExhausted, "device"));
  EXPECT_EQ(refused.heads_size(), 0);
  EXPECT_EQ(e.device.Stats().used_bytes, 3u * 1024);
  ASSERT_OK_AND_ASSIGN(uint64_t freed, f.session->Evict(v1::TIER_DEVICE));
  EXPECT_EQ(freed, 3u * 1024);
  EXPECT_EQ(e.device.Stats().evictions, 3u);
  EXPECT_EQ(e.device.Stats().used_bytes, 3u * 1024);  // the leases still hold the copies
  ASSERT_OK(e.leases.Release("t", first.lease_id()));
  ASSERT_OK(e.leases.Release("t", second.lease_id()));
  EXPECT_EQ(e.device.Stats().used_bytes, 0u);
  EXPECT_THAT(f.session->Evict(v1::TIER_HOST), StatusIs(Code::kFailedPrecondition, "remote"));
  EXPECT_THAT(f.session->Evict(v1::TIER_REMOTE), StatusIs(Code::kInvalidArgument, "tier"));
}

TEST(Session, SetPolicyKeepsChunkingOnceTokensAreStored) {
  Env e;
  Fixture f = Make(e, 1, 2, 1, 16, 64);
  v1::SessionPolicy p;
  p.set_chunk_tokens(32);
  ASSERT_OK_AND_ASSIGN(auto got, f.session->SetPolicy(p));
  EXPECT_EQ(got.chunk_tokens(), 32u);
  EXPECT_EQ(got.sink_tokens(), 16u);
  ASSERT_OK(f.session->Append(Req(f, 0, 0, 8)).status());
  p.set_chunk_tokens(16);
  EXPECT_THAT(f.session->SetPolicy(p), StatusIs(Code::kFailedPrecondition, "chunk_tokens"));
  p.set_chunk_tokens(0);
  p.set_recent_window(128);
  ASSERT_OK_AND_ASSIGN(got, f.session->SetPolicy(p));
  EXPECT_EQ(got.recent_window(), 128u);
}

TEST(Session, ReadChunksRejectsUnknownIds) {
  Env e;
  Fixture f = Make(e, 1, 2, 1, 16, 64);
  ASSERT_OK(f.session->Append(Req(f, 0, 0, 20)).status());
  EXPECT_THAT(f.session->ReadChunks({EncodeChunkId({0, 0, 2})}),
              StatusIs(Code::kNotFound, "chunk_ids"));
  EXPECT_THAT(f.session->ReadChunks({EncodeChunkId({1, 0, 0})}), StatusIs(Code::kNotFound));
  EXPECT_THAT(f.session->ReadChunks({~0ull}), StatusIs(Code::kNotFound));
}

// Default policy (int4 cold chunks), sinks 16, window 64, chunks of 16.
v1::SessionPolicy Cold(v1::Precision p = v1::PRECISION_INT4) {
  v1::SessionPolicy policy;
  policy.set_cold_precision(p);
  return policy;
}

// Half an fp16 ulp at |y|.
float HalfUlpAt(float y) {
  uint16_t h = FloatToHalf(std::fabs(y));
  return (HalfToFloat(HalfNextUp(h)) - HalfToFloat(h)) / 2;
}

TEST(ColdChunks, LeavingTheWindowQuantizesAndSelectReadsFp16WithinTheBound) {
  for (auto [precision, levels] : {std::pair{v1::PRECISION_INT4, 15.f}, {v1::PRECISION_INT8, 255.f}}) {
    Env e;
    Fixture f = Make(e, 3, 4, 2, 64, 300, Cold(precision));
    ASSERT_OK(AppendAll(f, 300, 37));
    // Chunks wholly before token 300 - 64 = 236 (chunks 0..13) are cold, except the sink chunk.
    auto chunks = f.session->ListChunks(2, 1000);
    for (const auto& c : chunks.chunks()) {
      const bool cold = c.index() >= 1 && c.index() <= 13;
      EXPECT_EQ(c.precision(), cold ? precision : v1::PRECISION_FP16) << c.index();
    }
    const v1::SessionInfo info = f.session->Info();
    EXPECT_EQ(info.chunks_by_precision().at(v1::Precision_Name(precision)), 3u * 2 * 13);
    EXPECT_EQ(info.chunks_by_precision().at("PRECISION_FP16"), 3u * 2 * 6);
    // Host bytes: 6 warm slots of 4 KiB and 13 cold slots per stream, no fp16 left for them.
    const uint64_t cold_slot = QuantLayout{64, 16, levels == 15.f ? 4u : 8u}.Bytes();
    EXPECT_EQ(info.bytes_by_tier().at("TIER_HOST"), 3u * 2 * (6 * 4096 + 13 * cold_slot));
    EXPECT_EQ(e.host.Stats().used_bytes, 3u * 2 * (6 * 4096 + 13 * cold_slot));

    v1::SelectResponse resp;
    ASSERT_OK(f.session->Select(SelectReq(f, 2, 1000), &resp));
    for (int h = 0; h < 2; ++h) {
      for (const auto& b : resp.heads(h).blocks()) {
        const uint32_t index = DecodeChunkId(b.chunk_id()).index;
        const bool cold = index >= 1 && index <= 13;
        EXPECT_EQ(b.precision(), v1::PRECISION_FP16);
        EXPECT_EQ(b.stored_precision(), cold ? precision : v1::PRECISION_FP16);
        auto want_k = HeadRows(f.k[2], f, h, b.positions(0), b.num_tokens());
        auto want_v = HeadRows(f.v[2], f, h, b.positions(0), b.num_tokens());
        const auto* k = reinterpret_cast<const uint16_t*>(b.keys().data());
        const auto* v = reinterpret_cast<const uint16_t*>(b.values().data());
        if (!cold) {
          EXPECT_EQ(b.keys(), AsBytes(want_k));
          continue;
        }
        // Keys per channel over the chunk, values per token over 32 channels: the step is at
        // most the range over levels, rounded up to fp16.
        for (uint32_t t = 0; t < b.num_tokens(); ++t) {
          for (int j = 0; j < 64; ++j) {
            float kmin = 1e9, kmax = -1e9, vmin = 1e9, vmax = -1e9;
            for (uint32_t u = 0; u < b.num_tokens(); ++u) {
              kmin = std::min(kmin, HalfToFloat(want_k[u * 64 + j]));
              kmax = std::max(kmax, HalfToFloat(want_k[u * 64 + j]));
            }
            for (int i = j / 32 * 32; i < j / 32 * 32 + 32; ++i) {
              vmin = std::min(vmin, HalfToFloat(want_v[t * 64 + i]));
              vmax = std::max(vmax, HalfToFloat(want_v[t * 64 + i]));
            }
            const float kx = HalfToFloat(want_k[t * 64 + j]), ky = HalfToFloat(k[t * 64 + j]);
            const float vx = HalfToFloat(want_v[t * 64 + j]), vy = HalfToFloat(v[t * 64 + j]);
            EXPECT_LE(std::fabs(kx - ky), (kmax - kmin) / levels * 0.5f * 1.01f + HalfUlpAt(ky) + 1e-3f);
            EXPECT_LE(std::fabs(vx - vy), (vmax - vmin) / levels * 0.5f * 1.01f + HalfUlpAt(vy) + 1e-3f);
          }
        }
      }
    }
    // The dequantized copies are cached: a second Select promotes nothing new.
    const uint64_t promotions = e.host.Stats().promotions;
    EXPECT_EQ(promotions, 2u * 13);  // layer 2: 2 heads x 13 cold chunks, dequantized once
    v1::SelectResponse again;
    ASSERT_OK(f.session->Select(SelectReq(f, 2, 1000), &again));
    EXPECT_EQ(e.host.Stats().promotions, promotions);
  }
}

// A cold chunk is ranked on what attention reads: its dequantized keys. The expectation takes
// those rows from a Select that returns everything, then ranks in double by brute force.
TEST(ColdChunks, RankingUsesTheDequantizedKeys) {
  Env e;
  Fixture f = Make(e, 3, 6, 2, 64, 700, Cold(v1::PRECISION_INT4), 11);
  ASSERT_OK(AppendAll(f, 700, 100));
  v1::SelectResponse all;
  ASSERT_OK(f.session->Select(SelectReq(f, 2, 700), &all));
  Fixture read{f.layers, f.qh, f.kvh, f.d, f.total, f.k, f.v, nullptr};
  for (int h = 0; h < 2; ++h) {
    for (const auto& b : all.heads(h).blocks()) {
      const auto* k = reinterpret_cast<const uint16_t*>(b.keys().data());
      std::copy(k, k + b.num_tokens() * 64,
                read.k[2].begin() + (size_t(h) * f.total + b.positions(0)) * f.d);
    }
  }
  ASSERT_NE(read.k[2], f.k[2]) << "int4 should have changed some keys";
  for (uint32_t budget : {96u, 160u, 256u}) {
    for (uint32_t seed : {4u, 5u}) {
      v1::SelectResponse resp;
      ASSERT_OK(f.session->Select(SelectReq(f, 2, budget, seed), &resp));
      for (int h = 0; h < 2; ++h) {
        const std::set<uint32_t> chunks = ChunkIndices(resp.heads(h));
        EXPECT_EQ(chunks, ExpectedChunks(read, 2, h, 700, budget, seed))
            << "budget " << budget << " seed " << seed << " head " << h;
      }
    }
  }
}

TEST(ColdChunks, LosslessAndBf16KeepEverythingExact) {
  Env e;
  Fixture f = Make(e, 1, 2, 1, 32, 400, Lossless());
  ASSERT_OK(AppendAll(f, 400, 100));
  EXPECT_EQ(f.session->Info().chunks_by_precision().size(), 1u);
  EXPECT_EQ(f.session->Info().chunks_by_precision().at("PRECISION_FP16"), 25u);
  ExpectStreamExact(f, 0, 0, 400);
}

TEST(ColdChunks, NonFiniteInputIsRefusedByField) {
  Env e;
  Fixture f = Make(e, 1, 2, 2, 16, 64, Cold());
  auto r = Req(f, 0, 0, 8);
  std::string k = r.keys();
  k[2 * (16 * 8 + 5) + 1] = 0x7c;  // kv_head 1, token 0, channel 5: +Inf (0x7c00)
  k[2 * (16 * 8 + 5)] = 0x00;
  r.set_keys(k);
  EXPECT_THAT(f.session->Append(r), StatusIs(Code::kInvalidArgument, "keys: element 133 (kv_head 1, token 0, channel 5)"));
  r = Req(f, 0, 0, 8);
  std::string v = r.values();
  v[7] = 0x7e;  // a NaN
  r.set_values(v);
  EXPECT_THAT(f.session->Append(r), StatusIs(Code::kInvalidArgument, "values"));
  EXPECT_EQ(f.session->Info().num_tokens(), 0u);
}

TEST(ColdChunks, RewritesOfColdTokensAreCheckedAgainstTheQuantizationBound) {
  Env e;
  Fixture f = Make(e, 1, 2, 1, 64, 200, Cold());
  ASSERT_OK(AppendAll(f, 200, 200));
  ASSERT_TRUE(f.session->ListChunks(0, 100).chunks(3).precision() == v1::PRECISION_INT4);
  // The same bytes again (a retried stream): a no-op.
  ASSERT_OK_AND_ASSIGN(uint64_t n, f.session->Append(Req(f, 0, 40, 30)));
  EXPECT_EQ(n, 200u);
  // Other bytes in a cold chunk: refused.
  auto bad = Req(f, 0, 48, 4);
  std::string k = bad.keys();
  reinterpret_cast<uint16_t*>(k.data())[3] = FloatToHalf(50.f);
  bad.set_keys(k);
  EXPECT_THAT(f.session->Append(bad), StatusIs(Code::kFailedPrecondition, "token 48"));
}

TEST(ColdChunks, DevicePlacementDequantizesIntoTheDeviceTier) {
  Env e;
  Fixture f = Make(e, 1, 2, 1, 64, 200, Cold());
  ASSERT_OK(AppendAll(f, 200, 200));
  auto host = SelectReq(f, 0, 1000);
  auto device = host;
  device.set_placement(v1::TIER_DEVICE);
  v1::SelectResponse on_host, on_device;
  ASSERT_OK(f.session->Select(host, &on_host));
  ASSERT_OK(f.session->Select(device, &on_device));
  ASSERT_EQ(on_host.heads(0).blocks_size(), on_device.heads(0).blocks_size());
  for (int i = 0; i < on_host.heads(0).blocks_size(); ++i) {
    const auto& a = on_host.heads(0).blocks(i);
    const auto& b = on_device.heads(0).blocks(i);
    EXPECT_EQ(b.tier(), v1::TIER_DEVICE);
    EXPECT_EQ(a.keys(), b.keys());
    EXPECT_EQ(a.values(), b.values());
    EXPECT_EQ(a.stored_precision(), b.stored_precision());
  }
  // ReadChunks of a cold chunk hands back the same fp16 bytes.
  ASSERT_OK_AND_ASSIGN(auto read, f.session->ReadChunks({EncodeChunkId({0, 0, 5})}));
  EXPECT_EQ(read[0].keys(), on_host.heads(0).blocks(5).keys());
  EXPECT_EQ(read[0].stored_precision(), v1::PRECISION_INT4);
}

// A full host tier makes room by evicting dequantized copies nobody is reading (the host
// promotion cache); the copies this very Select chose again are held and never evicted.
TEST(ColdChunks, MakingRoomForCopiesKeepsTheChosenOnes) {
  // Two layers (layer 0 dense) of one stream, 400 tokens, d 64: chunk 0 (sink) and 21..24
  // (window) fp16, 1..20 int4.
  const uint64_t warm = 2 * 5 * 4096, cold = 2 * 20 * QuantLayout{64, 16, 4}.Bytes();
  Env e(warm + cold + 6 * 4096);  // room for six dequantized copies
  v1::SessionPolicy policy = Cold();
  policy.set_dense_layers(1);
  Fixture f = Make(e, 2, 1, 1, 64, 400, policy);
  // Keys constant per chunk (exact under int4): channel 0 = chunk index, channel 1 = 100 for
  // chunks 3, 4, 5. A query along channel 0 ranks 20, 19, ...; along (1, 1), 5, 4, 3, 20, 19.
  for (int t = 0; t < 400; ++t) {
    for (int j = 0; j < 64; ++j) {
      const int c = t / 16;
      f.k[1][t * 64 + j] = FloatToHalf(j == 0 ? c : (j == 1 && c >= 3 && c <= 5 ? 100.f : 0.f));
    }
  }
  ASSERT_OK(AppendAll(f, 400, 16));  // 16 at a time: quantizing as it goes stays in capacity
  ASSERT_EQ(e.host.Stats().used_bytes, warm + cold);
  auto select = [&](float q1, std::set<uint32_t> want_cold) -> v1::SelectResponse {
    std::vector<float> q(64, 0.f);
    q[0] = 1.f;
    q[1] = q1;
    auto req = SelectReq(f, 1, 80 + 5 * 16);
    req.set_query(std::string(reinterpret_cast<const char*>(q.data()), q.size() * 4));
    v1::SelectResponse resp;
    EXPECT_OK(f.session->Select(req, &resp));
    std::set<uint32_t> got;
    for (const auto& b : resp.heads(0).blocks()) {
      if (b.stored_precision() == v1::PRECISION_INT4) got.insert(DecodeChunkId(b.chunk_id()).index);
      EXPECT_EQ(b.keys(), AsBytes(HeadRows(f.k[1], f, 0, b.positions(0), b.num_tokens())));
    }
    EXPECT_EQ(got, want_cold);
    return resp;
  };
  v1::SelectResponse first = select(0.f, {16, 17, 18, 19, 20});
  ASSERT_OK(e.leases.Release("t", first.lease_id()));
  // Needs 3 new copies beside the 5 unread ones: room for 6, so the 5 go and 5 are made.
  v1::SelectResponse second = select(1.f, {3, 4, 5, 19, 20});
  EXPECT_LE(e.host.Stats().used_bytes, warm + cold + 6 * 4096);
  ASSERT_OK(e.leases.Release("t", second.lease_id()));
}

// The device tier is one cache for every session: a session's promotion evicts another's
// unleased copies (least recently used first) instead of failing, and the evicted chunks
// come back exact when selected again.
TEST(ColdChunks, DeviceCopiesOfOneSessionMakeRoomForAnother) {
  // d 64, 1 KV head: a device slot is 16 * 64 * 4 = 4 KiB; room for 20.
  Env e(64 << 20, 20 * 4096);
  Fixture a = Make(e, 1, 2, 1, 64, 256, Cold(), 1);
  Fixture b = Make(e, 1, 2, 1, 64, 256, Cold(), 2);
  ASSERT_OK(AppendAll(a, 256, 64));
  ASSERT_OK(AppendAll(b, 256, 64));
  auto on_device = [&](Fixture& f) {
    auto req = SelectReq(f, 0, 160);  // dense layer 0: all 16 chunks
    req.set_placement(v1::TIER_DEVICE);
    v1::SelectResponse resp;
    EXPECT_OK(f.session->Select(req, &resp));
    for (const auto& blk : resp.heads(0).blocks()) {
      EXPECT_EQ(blk.tier(), v1::TIER_DEVICE);
      const auto want = HeadRows(f.k[0], f, 0, blk.positions(0), blk.num_tokens());
      for (size_t i = 0; i < want.size(); ++i) {  // int4 rows: within the quantization bound
        EXPECT_NEAR(HalfToFloat(reinterpret_cast<const uint16_t*>(blk.keys().data())[i]),
                    HalfToFloat(want[i]), 0.3f);
      }
    }
    EXPECT_OK(e.leases.Release("t", resp.lease_id()));
    return resp;
  };
  on_device(a);
  EXPECT_EQ(a.session->Info().bytes_by_tier().at("TIER_DEVICE"), 16u * 4096);
  e.clock.AdvanceMs(10);
  on_device(b);  // 16 more copies: 12 of a's go
  EXPECT_EQ(e.device.Stats().used_bytes, 20u * 4096);
  EXPECT_EQ(a.session->Info().bytes_by_tier().at("TIER_DEVICE"), 4u * 4096);
  EXPECT_EQ(b.session->Info().bytes_by_tier().at("TIER_DEVICE"), 16u * 4096);
  EXPECT_EQ(e.device.Stats().evictions, 12u);
  EXPECT_EQ(e.device_copies.counters().evictions, 12u);
  e.clock.AdvanceMs(10);
  on_device(a);  // a's 4 survivors are hits; 12 are made again, evicting b's oldest
  EXPECT_EQ(e.device_copies.counters().hits, 4u);
  EXPECT_EQ(e.device_copies.counters().misses, 16u + 16u + 12u);
  // A lease keeps its copies: with every copy leased, a promotion fails and changes nothing.
  auto req = SelectReq(b, 0, 160);
  req.set_placement(v1::TIER_DEVICE);
  v1::SelectResponse held_b;
  ASSERT_OK(b.session->Select(req, &held_b));
  auto req_a = SelectReq(a, 0, 160);
  req_a.set_placement(v1::TIER_DEVICE);
  v1::SelectResponse held_a;
  EXPECT_THAT(a.session->Select(req_a, &held_a), StatusIs(Code::kResourceExhausted));
  EXPECT_EQ(e.device.Stats().used_bytes, 20u * 4096);
  ASSERT_OK(e.leases.Release("t", held_b.lease_id()));
  ASSERT_OK(a.session->Select(req_a, &held_a));
  ASSERT_OK(e.leases.Release("t", held_a.lease_id()));
}

// Prefetch promotes what a 25% larger budget would add: a Select with that budget then finds
// every chunk cached, and the prefetch itself reads nothing and counts no Select work.
TEST(Prefetch, PromotesWhatALargerBudgetWouldAdd) {
  for (auto placement : {v1::TIER_DEVICE, v1::TIER_HOST}) {
    Env e;
    Fixture f = Make(e, 3, 4, 2, 64, 1200, Cold(), 5);
    ASSERT_OK(AppendAll(f, 1200, 300));
    PromotionCache& cache = placement == v1::TIER_DEVICE ? e.device_copies : e.host_copies;
    auto req = SelectReq(f, 2, 256, 7);
    req.set_placement(placement);
    v1::SelectResponse first;
    ASSERT_OK(f.session->Select(req, &first));
    const uint64_t made_first = cache.counters().misses;
    const auto stats_before = f.session->Layers()[2];
    ASSERT_OK_AND_ASSIGN(uint64_t prefetched, f.session->Prefetch(req, 25));
    EXPECT_GT(prefetched, 0u);
    EXPECT_EQ(cache.counters().prefetched, prefetched);
    EXPECT_EQ(cache.counters().hits, 0u) << "a prefetch is not a read";
    EXPECT_EQ(f.session->Layers()[2].select_candidates(), stats_before.select_candidates());
    // The larger selection: everything is cached now, the prefetched copies are hits.
    auto bigger = req;
    bigger.set_budget_tokens(320);
    v1::SelectResponse second;
    ASSERT_OK(f.session->Select(bigger, &second));
    EXPECT_EQ(cache.counters().misses, made_first) << v1::Tier_Name(placement);
    EXPECT_EQ(cache.counters().prefetch_hits, prefetched);
    // Which chunks: those of the 320-token choice that the 256-token one left out.
    std::set<uint64_t> small, large;
    for (const auto& h : first.heads()) {
      for (const auto& b : h.blocks()) small.insert(b.chunk_id());
    }
    size_t needs_copy = 0;
    for (const auto& h : second.heads()) {
      for (const auto& b : h.blocks()) {
        large.insert(b.chunk_id());
        const bool copied = placement == v1::TIER_DEVICE || b.stored_precision() == v1::PRECISION_INT4;
        needs_copy += copied && !small.count(b.chunk_id());
      }
    }
    EXPECT_EQ(prefetched, needs_copy);
    EXPECT_TRUE(std::includes(large.begin(), large.end(), small.begin(), small.end()));
    ASSERT_OK(e.leases.Release("t", first.lease_id()));
    ASSERT_OK(e.leases.Release("t", second.lease_id()));
  }
}

TEST(Prefetch, WorkerRunsTasksOffTheCallerAndSurvivesClosedSessions) {
  Env e;
  Fixture f = Make(e, 3, 4, 2, 64, 1200, Cold(), 6);
  ASSERT_OK(AppendAll(f, 1200, 400));
  std::shared_ptr<Session> session(std::move(f.session));
  Prefetcher prefetcher(25, /*max_queue=*/64);
  auto req = SelectReq(f, 2, 256, 3);
  req.set_placement(v1::TIER_DEVICE);
  for (uint32_t seed = 0; seed < 4; ++seed) {
    req.set_query(Query(f, seed));
    prefetcher.Enqueue(session, req);
  }
  prefetcher.WaitIdle();
  auto c = prefetcher.counters();
  EXPECT_EQ(c.tasks, 4u);
  EXPECT_EQ(c.failed, 0u);
  EXPECT_EQ(c.copies, e.device_copies.counters().prefetched);
  EXPECT_GT(c.copies, 0u);
  session->Close();
  prefetcher.Enqueue(session, req);
  prefetcher.WaitIdle();
  EXPECT_EQ(prefetcher.counters().failed, 1u);  // NOT_FOUND, quietly
}

TEST(ColdChunks, ForkAcrossAColdChunkCopiesItsDequantizedRows) {
  Env e;
  Fixture f = Make(e, 1, 2, 1, 64, 200, Cold());
  ASSERT_OK(AppendAll(f, 200, 200));
  ASSERT_OK_AND_ASSIGN(auto child, f.session->Fork("c", 40));  // chunk 2 (32..47) is cold
  ASSERT_OK_AND_ASSIGN(auto parent_rows, f.session->ReadChunks({EncodeChunkId({0, 0, 2})}));
  ASSERT_OK_AND_ASSIGN(auto child_rows, child->ReadChunks({EncodeChunkId({0, 0, 2})}));
  EXPECT_EQ(child_rows[0].num_tokens(), 8u);
  EXPECT_EQ(child_rows[0].keys(), parent_rows[0].keys().substr(0, 8 * 64 * 2));
  EXPECT_EQ(child_rows[0].stored_precision(), v1::PRECISION_FP16);
  child->Close();
}

// ---- Boundary and semantic chunking ----

v1::AppendKVRequest ReqIds(const Fixture& f, int layer, int start, int n,
                           const std::vector<int32_t>& ids) {
  v1::AppendKVRequest r = Req(f, layer, start, n);
  for (int t = start; t < start + n; ++t) r.add_token_ids(ids[t]);
  return r;
}

// Every chunk of one stream, read back through ListChunks' ids and ReadChunks.
std::vector<v1::BlockHandle> StreamHandles(Fixture& f, int layer, int head) {
  std::vector<uint64_t> ids;
  const v1::ListChunksResponse listed = f.session->ListChunks(layer, 1u << 30);
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
std::vector<std::vector<int64_t>> ExpectRowsAtTheirPositions(Fixture& f, int layer, int head,
                                                             int tokens, float tolerance = 0) {
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

constexpr int32_t kDelimiter = 7;

v1::SessionPolicy BoundaryPolicy(bool lossless) {
  v1::SessionPolicy p;
  p.set_lossless(lossless);
  p.set_chunking(v1::CHUNKING_BOUNDARY);
  p.add_delimiter_token_ids(kDelimiter);
  p.add_delimiter_token_ids(kDelimiter + 1);
  return p;
}

// Token ids with a delimiter about one token in eight.
std::vector<int32_t> TokenIds(int n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<int32_t> ids(n);
  for (auto& id : ids) id = rng() % 8 == 0 ? kDelimiter + int32_t(rng() % 2) : 20 + int32_t(rng() % 100);
  return ids;
}

// The boundary rule, written out: a chunk ends after a delimiter once it holds 8 tokens, and
// at 32 tokens in any case.
std::vector<std::vector<int64_t>> BoundaryChunks(const std::vector<int32_t>& ids, int tokens) {
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

TEST(Chunking, BoundaryCutsAfterDelimitersHoweverTheTokensArrive) {
  const int tokens = 700;
  const std::vector<int32_t> ids = TokenIds(tokens, 5);
  const auto want = BoundaryChunks(ids, tokens);
  std::set<size_t> sizes;
  for (const auto& c : want) sizes.insert(c.size());
  ASSERT_GT(sizes.size(), 5u) << "the ids should give chunks of many sizes";
  for (int step : {1, 5, 64, 700}) {
    Env e;
    Fixture f = Make(e, 3, 4, 2, 32, tokens, BoundaryPolicy(true), 3);
    for (int s = 0; s < tokens; s += step) {
      for (int l = 0; l < 3; ++l) {
        ASSERT_OK(f.session->Append(ReqIds(f, l, s, std::min(step, tokens - s), ids)).status());
      }
    }
    for (int h = 0; h < 2; ++h) {
      EXPECT_EQ(ExpectRowsAtTheirPositions(f, 2, h, tokens), want) << "step " << step;
    }
    // The ranking over chunks of many sizes, greedy within the budget, as brute force has it.
    for (uint32_t budget : {128u, 256u}) {
      for (uint32_t seed : {1u, 2u}) {
        v1::SelectResponse resp;
        ASSERT_OK(f.session->Select(SelectReq(f, 2, budget, seed), &resp));
        for (int h = 0; h < 2; ++h) {
          std::set<uint32_t> chunks;
          uint64_t used = 0;
          for (const auto& b : resp.heads(h).blocks()) {
            chunks.insert(DecodeChunkId(b.chunk_id()).index);
            used += b.num_tokens();
          }
          EXPECT_LE(used, budget);
          EXPECT_EQ(chunks, ExpectedSelection(f, 2, h, tokens, want, budget, seed))
              << "step " << step << " budget " << budget << " seed " << seed;
        }
      }
    }
  }
}

TEST(Chunking, BoundaryWithoutIdsCutsEveryChunkTokensAndColdChunksOfAnySizeQuantize) {
  Env e;
  const int tokens = 400;
  const std::vector<int32_t> ids = TokenIds(tokens, 8);
  Fixture f = Make(e, 3, 4, 2, 64, tokens, BoundaryPolicy(false), 4);
  // Layer 2 gets ids, layer 1 none: its cuts fall every 16 tokens.
  for (int s = 0; s < tokens; s += 50) {
    ASSERT_OK(f.session->Append(ReqIds(f, 2, s, 50, ids)).status());
    ASSERT_OK(f.session->Append(Req(f, 1, s, 50)).status());
    ASSERT_OK(f.session->Append(Req(f, 0, s, 50)).status());
  }
  const auto plain = ExpectRowsAtTheirPositions(f, 1, 0, tokens, 0.3f);
  for (size_t c = 0; c < plain.size(); ++c) {
    EXPECT_EQ(plain[c].front(), int64_t(c) * 16);
    EXPECT_EQ(plain[c].size(), std::min<size_t>(16, tokens - c * 16));
  }
  // Int4 rows of every chunk size come back within the quantization bound.
  EXPECT_EQ(ExpectRowsAtTheirPositions(f, 2, 1, tokens, 0.3f), BoundaryChunks(ids, tokens));
  const auto info = f.session->Info();
  EXPECT_GT(info.chunks_by_precision().at("PRECISION_INT4"), 0u);
  v1::SelectResponse resp;
  ASSERT_OK(f.session->Select(SelectReq(f, 2, 160, 3), &resp));
  for (const auto& b : resp.heads(0).blocks()) {
    EXPECT_EQ(b.precision(), v1::PRECISION_FP16);
    EXPECT_EQ(b.keys().size(), b.num_tokens() * 64u * 2);
  }
}

// Layer 2, head 0 of a long session: Selects at budgets 256 and 1024 (query `seed`, handles
// without data) return the chunks brute force picks.
void ExpectLongContextSelections(Fixture& f, int tokens,
                                 const std::vector<std::vector<int64_t>>& chunks, uint32_t seed) {
  for (uint32_t budget : {256u, 1024u}) {
    v1::SelectResponse resp;
    auto req = SelectReq(f, 2, budget, seed);
    req.set_include_data(false);
    ASSERT_OK(f.session->Select(req, &resp));
    EXPECT_EQ(ChunkIndices(resp.heads(0)), ExpectedSelection(f, 2, 0, tokens, chunks, budget, seed))
        << "budget " << budget;
  }
}

// Past 1024 candidates, boundary chunks (many sizes) are chosen through the index's greedy
// fill: the same chunks as brute force, with fewer scored.
TEST(Chunking, BoundaryChunksUseTheIndexOnALongContext) {
  Env e(160 << 20);
  const int tokens = 72000;  // chunks of 15 tokens on average
  const std::vector<int32_t> ids = TokenIds(tokens, 13);
  Fixture f = Make(e, 3, 3, 1, 64, tokens, BoundaryPolicy(true), 24);
  for (int s = 0; s < tokens; s += 4096) {
    ASSERT_OK(f.session->Append(ReqIds(f, 2, s, std::min(4096, tokens - s), ids)).status());
  }
  const auto chunks = ExpectRowsAtTheirPositions(f, 2, 0, tokens);
  ASSERT_GT(chunks.size(), 4300u);
  ExpectLongContextSelections(f, tokens, chunks, 5);
  const v1::LayerStats st = f.session->Layers()[2];
  EXPECT_GT(st.indexed_chunks(), 4000u);
  EXPECT_LT(st.select_chunks_scored(), st.select_candidates()) << "the index answered";
}

TEST(Chunking, PolicyChecksNameTheField) {
  Env e;
  v1::SessionPolicy p = BoundaryPolicy(true);
  p.clear_delimiter_token_ids();
  EXPECT_THAT(ResolvePolicy(p, BuiltinPolicy(), "policy"),
              StatusIs(Code::kInvalidArgument, "policy.delimiter_token_ids"));
  p = BoundaryPolicy(true);
  p.set_chunk_tokens(33);
  EXPECT_THAT(ResolvePolicy(p, BuiltinPolicy(), "policy"),
              StatusIs(Code::kInvalidArgument, "policy.chunk_tokens"));
  Fixture f = Make(e, 1, 2, 1, 16, 64);
  ASSERT_OK(f.session->Append(Req(f, 0, 0, 8)).status());
  v1::SessionPolicy next;
  next.set_chunking(v1::CHUNKING_SEMANTIC);
  EXPECT_THAT(f.session->SetPolicy(next), StatusIs(Code::kFailedPrecondition, "policy.chunking"));
}

v1::SessionPolicy SemanticPolicy(bool lossless) {
  v1::SessionPolicy p;
  p.set_lossless(lossless);
  p.set_chunking(v1::CHUNKING_SEMANTIC);
  return p;
}

// Keys planted in 8 clusters, position t (past the sinks) in cluster (5t + head) % 8: every
// contiguous chunk mixes all 8, every 128-token span holds 16 of each.
int PlantedCluster(int64_t t, int head) { return int((5 * t + head) % 8); }

void PlantClusters(Fixture& f, uint32_t seed) {
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

TEST(Chunking, SemanticRegroupsAgedOutSpansIntoTightChunks) {
  Env e;
  const int tokens = 16 + 3 * 128 + 64 + 20;  // sinks, three spans, window, and a partial
  Fixture f = Make(e, 3, 4, 2, 32, tokens, SemanticPolicy(true), 6);
  PlantClusters(f, 6);
  ASSERT_OK(AppendAll(f, tokens, 37));
  for (int h = 0; h < 2; ++h) {
    const auto chunks = ExpectRowsAtTheirPositions(f, 2, h, tokens);
    int regrouped = 0;
    for (const auto& c : chunks) {
      ASSERT_EQ(c.size(), std::min<size_t>(16, tokens - c.front()));
      if (c.front() < 16 || c.back() >= 16 + 3 * 128) {
        for (size_t r = 1; r < c.size(); ++r) EXPECT_EQ(c[r], c[r - 1] + 1);  // contiguous
        continue;
      }
      ++regrouped;
      const int64_t span = (c.front() - 16) / 128;
      for (int64_t t : c) {
        EXPECT_EQ((t - 16) / 128, span) << "rows stay within their span";
        EXPECT_EQ(PlantedCluster(t, h), PlantedCluster(c.front(), h)) << "one cluster per chunk";
      }
    }
    EXPECT_EQ(regrouped, 3 * 8);
    for (uint32_t budget : {128u, 224u}) {
      for (uint32_t seed : {1u, 4u}) {
        v1::SelectResponse resp;
        ASSERT_OK(f.session->Select(SelectReq(f, 2, budget, seed), &resp));
        const std::set<uint32_t> got = ChunkIndices(resp.heads(h));
        EXPECT_EQ(got, ExpectedSelection(f, 2, h, tokens, chunks, budget, seed))
            << "budget " << budget << " seed " << seed;
      }
    }
  }
  // The index holds the regrouped chunks; the aged-out chunk of the unfinished span waits.
  EXPECT_EQ(f.session->Layers()[2].indexed_chunks(), 2u * 3 * 8);
  const auto listed = f.session->ListChunks(2, 100);
  EXPECT_EQ(listed.chunks(1).first_position(), 16);
  // Rewrites of regrouped tokens are checked against the rows where they went.
  ASSERT_OK(f.session->Append(Req(f, 2, 20, 100)).status());
  auto bad = Req(f, 2, 100, 3);
  std::string keys = bad.keys();
  keys[2 * 32 * 2 + 1] ^= 0x40;  // head 0, third token
  bad.set_keys(keys);
  EXPECT_THAT(f.session->Append(bad), StatusIs(Code::kFailedPrecondition, "token 102"));
}

TEST(Chunking, SemanticForkInsideASpanKeepsBothSidesExact) {
  Env e;
  const int tokens = 16 + 3 * 128 + 64;
  Fixture f = Make(e, 3, 4, 2, 32, tokens, SemanticPolicy(true), 7);
  PlantClusters(f, 7);
  ASSERT_OK(AppendAll(f, 16 + 2 * 128 + 64 + 8, 64));  // two spans regrouped
  for (int at : {100, 16 + 128, 16 + 128 + 50}) {
    ASSERT_OK_AND_ASSIGN(auto child, f.session->Fork("c" + std::to_string(at), at));
    Fixture view{f.layers, f.qh, f.kvh, f.d, f.total, f.k, f.v, std::move(child)};
    for (int h = 0; h < 2; ++h) ExpectRowsAtTheirPositions(view, 2, h, at);
    // The child goes on to the end and regroups its own spans.
    for (int s = at; s < tokens; s += 64) {
      for (int l = 0; l < 3; ++l) {
        ASSERT_OK(view.session->Append(Req(view, l, s, std::min(64, tokens - s))).status());
      }
    }
    for (int h = 0; h < 2; ++h) {
      for (const auto& c : ExpectRowsAtTheirPositions(view, 2, h, tokens)) {
        if (c.front() < 16 || c.back() >= 16 + 3 * 128) continue;
        for (int64_t t : c) EXPECT_EQ(PlantedCluster(t, h), PlantedCluster(c.front(), h));
      }
    }
    EXPECT_EQ(view.session->Layers()[2].indexed_chunks(), 2u * 3 * 8) << "fork at " << at;
  }
  for (int h = 0; h < 2; ++h) ExpectRowsAtTheirPositions(f, 2, h, 16 + 2 * 128 + 64 + 8);
}

TEST(Chunking, SemanticInt4AndTheIndexOnALongContext) {
  Env e(160 << 20);
  const int tokens = 70000;
  Fixture f = Make(e, 3, 3, 1, 64, tokens, SemanticPolicy(true), 23);
  for (int s = 0; s < tokens; s += 4096) {
    ASSERT_OK(f.session->Append(Req(f, 2, s, std::min(4096, tokens - s))).status());
  }
  const uint64_t aged_out = (tokens - 64) / 16 - 1;
  EXPECT_EQ(f.session->Layers()[2].indexed_chunks(), aged_out / 8 * 8);
  const auto chunks = ExpectRowsAtTheirPositions(f, 2, 0, tokens);
  ExpectLongContextSelections(f, tokens, chunks, 2);
  const v1::LayerStats st = f.session->Layers()[2];
  EXPECT_LT(st.select_chunks_scored(), st.select_candidates()) << "the index answered";

  // The default int4 policy: regrouped chunks are quantized, and read back within the bound.
  Env e2;
  Fixture g = Make(e2, 3, 4, 2, 32, 16 + 2 * 128 + 64, SemanticPolicy(false), 8);
  PlantClusters(g, 8);
  ASSERT_OK(AppendAll(g, g.total, 50));
  EXPECT_EQ(g.session->Info().chunks_by_precision().at("PRECISION_INT4"), 3u * 2 * 16);
  for (const auto& c : ExpectRowsAtTheirPositions(g, 2, 1, g.total, 0.3f)) {
    if (c.front() < 16 || c.back() >= 16 + 2 * 128) continue;
    for (int64_t t : c) EXPECT_EQ(PlantedCluster(t, 1), PlantedCluster(c.front(), 1));
  }
}

// ---- The remote tier's records ----

// Every chunk of every stream, as ReadChunks returns it (ids from ListChunks).
std::vector<v1::BlockHandle> AllChunks(Session& s) {
  std::vector<uint64_t> ids;
  const v1::ListChunksResponse listed = s.ListChunks(std::nullopt, 1u << 30);
  for (const auto& c : listed.chunks()) ids.push_back(c.chunk_id());
  auto r = s.ReadChunks(ids);
  EXPECT_TRUE(r.ok()) << r.status();
  return r.ok() ? *r : std::vector<v1::BlockHandle>{};
}

TEST(Remote, DemoteAndImportRestoreEveryByteAndTheSameSelection) {
  std::vector<std::pair<std::string, v1::SessionPolicy>> policies = {
      {"lossless", Lossless()}, {"int4", Cold()}, {"semantic", SemanticPolicy(false)},
      {"boundary", BoundaryPolicy(false)}};
  for (const auto& [name, policy] : policies) {
    Env e;
    Fixture f = Make(e, 3, 4, 2, 64, 700, policy, 11);
    const std::vector<int32_t> ids = TokenIds(700, 12);
    for (int s = 0; s < 700; s += 100) {
      for (int l = 0; l < 3; ++l) ASSERT_OK(f.session->Append(ReqIds(f, l, s, 100, ids)).status());
    }
    const std::vector<v1::BlockHandle> before = AllChunks(*f.session);
    const uint64_t indexed = f.session->Layers()[2].indexed_chunks();
    std::vector<v1::SelectResponse> selected(3);
    for (uint32_t q = 0; q < 3; ++q) {
      ASSERT_OK(f.session->Select(SelectReq(f, 2, 200, q), &selected[q]));
      ASSERT_OK(e.leases.Release("t", selected[q].lease_id()));
    }
    std::string stored;
    ASSERT_OK_AND_ASSIGN(uint64_t bytes, f.session->Demote([&](const v1::SessionRecord& r) {
      stored = EncodeRecord(r);
      return absl::OkStatus();
    }));
    EXPECT_GT(bytes, 0u);
    EXPECT_EQ(e.host.Stats().used_bytes, 0u) << name << ": the demoted session's slots went back";
    v1::SelectResponse late;
    EXPECT_THAT(f.session->Select(SelectReq(f, 2, 200, 0), &late),
                StatusIs(Code::kUnavailable, "remote tier"));
    ASSERT_OK_AND_ASSIGN(v1::SessionRecord record, DecodeRecord(stored, "k"));
    EXPECT_EQ(record.shape().head_dim(), 64u);
    ASSERT_OK_AND_ASSIGN(std::unique_ptr<Session> back, Session::Import(record, e.env));
    const std::vector<v1::BlockHandle> after = AllChunks(*back);
    ASSERT_EQ(after.size(), before.size()) << name;
    for (size_t i = 0; i < after.size(); ++i) {
      EXPECT_EQ(after[i].keys(), before[i].keys()) << name << " chunk " << i;
      EXPECT_EQ(after[i].values(), before[i].values()) << name << " chunk " << i;
      EXPECT_EQ(after[i].stored_precision(), before[i].stored_precision());
      EXPECT_EQ(std::vector<int64_t>(after[i].positions().begin(), after[i].positions().end()),
                std::vector<int64_t>(before[i].positions().begin(), before[i].positions().end()));
    }
    EXPECT_EQ(back->Info().num_tokens(), 700u);
    EXPECT_EQ(back->Layers()[2].indexed_chunks(), indexed) << name << ": the index is rebuilt";
    EXPECT_EQ(back->Info().policy().chunking(), policy.chunking() ? policy.chunking()
                                                                  : v1::CHUNKING_CONTIGUOUS);
    for (uint32_t q = 0; q < 3; ++q) {
      v1::SelectResponse again;
      auto req = SelectReq(f, 2, 200, q);
      ASSERT_OK(back->Select(req, &again));
      for (int h = 0; h < 2; ++h) {
        ASSERT_EQ(again.heads(h).blocks_size(), selected[q].heads(h).blocks_size()) << name;
        for (int b = 0; b < again.heads(h).blocks_size(); ++b) {
          EXPECT_EQ(again.heads(h).blocks(b).chunk_id(), selected[q].heads(h).blocks(b).chunk_id());
          EXPECT_EQ(again.heads(h).blocks(b).keys(), selected[q].heads(h).blocks(b).keys());
        }
      }
      ASSERT_OK(e.leases.Release("t", again.lease_id()));
    }
  }
}

TEST(Remote, BadRecordsAreRefusedAndLeasedSessionsStay) {
  Env e;
  Fixture f = Make(e, 1, 2, 1, 16, 100);
  ASSERT_OK(AppendAll(f, 100, 100));
  v1::SelectResponse held;
  ASSERT_OK(f.session->Select(SelectReq(f, 0, 100), &held));
  auto keep = [](const v1::SessionRecord&) { return absl::OkStatus(); };
  EXPECT_THAT(f.session->Demote(keep), StatusIs(Code::kFailedPrecondition, "1 active leases"));
  ASSERT_OK(e.leases.Release("t", held.lease_id()));
  std::string stored;
  auto fail = [](const v1::SessionRecord&) { return absl::UnavailableError("redis down"); };
  EXPECT_THAT(f.session->Demote(fail), StatusIs(Code::kUnavailable, "redis down"));
  ExpectStreamExact(f, 0, 0, 100);  // a failed store leaves the session as it was
  ASSERT_OK(f.session->Demote([&](const v1::SessionRecord& r) {
    stored = EncodeRecord(r);
    return absl::OkStatus();
  }).status());
  std::string flipped = stored;
  flipped[flipped.size() / 2] ^= 0x10;
  EXPECT_THAT(DecodeRecord(flipped, "kvtier:session:s"), StatusIs(Code::kDataLoss, "checksum"));
  std::string versioned = stored;
  versioned[4] = 9;
  EXPECT_THAT(DecodeRecord(versioned, "k"), StatusIs(Code::kFailedPrecondition, "version 9"));
  EXPECT_THAT(DecodeRecord("KVT", "k"), StatusIs(Code::kDataLoss, "not a kvtier record"));
  ASSERT_OK_AND_ASSIGN(v1::SessionRecord r, DecodeRecord(stored, "k"));
  r.mutable_streams(0)->mutable_chunks(0)->mutable_data()->pop_back();
  EXPECT_THAT(Session::Import(r, e.env), StatusIs(Code::kInvalidArgument, "bytes"));
  EXPECT_EQ(e.host.Stats().used_bytes, 0u);
}

TEST(ResolveShape, ChecksEveryField) {
  auto shape = [](int l, int q, int kv, int d, v1::DType t = v1::DTYPE_FP16) {
    v1::ModelShape s;
    s.set_num_layers(l);
    s.set_num_q_heads(q);
    s.set_num_kv_heads(kv);
    s.set_head_dim(d);
    s.set_dtype(t);
    return s;
  };
  EXPECT_OK(ResolveShape(shape(30, 9, 3, 64)).status());
  EXPECT_EQ(ResolveShape(shape(1, 1, 1, 1, v1::DTYPE_UNSPECIFIED))->dtype(), v1::DTYPE_FP16);
  EXPECT_THAT(ResolveShape(shape(0, 9, 3, 64)), StatusIs(Code::kInvalidArgument, "num_layers"));
  EXPECT_THAT(ResolveShape(shape(2, 4, 3, 64)), StatusIs(Code::kInvalidArgument, "num_q_heads"));
  EXPECT_THAT(ResolveShape(shape(2, 0, 3, 64)), StatusIs(Code::kInvalidArgument, "num_q_heads"));
  EXPECT_THAT(ResolveShape(shape(2, 4, 0, 64)), StatusIs(Code::kInvalidArgument, "num_kv_heads"));
  EXPECT_THAT(ResolveShape(shape(2, 4, 2, 0)), StatusIs(Code::kInvalidArgument, "head_dim"));
  EXPECT_THAT(ResolveShape(shape(2, 4, 2, 513)), StatusIs(Code::kInvalidArgument, "head_dim"));
  EXPECT_OK(ResolveShape(shape(2, 4, 2, 512)).status());
  EXPECT_THAT(ResolveShape(shape(2, 4, 2, 64, v1::DTYPE_FP32)),
              StatusIs(Code::kInvalidArgument, "dtype"));
}

TEST(SessionManager, LimitsIdsAndTenants) {
  Env e;
  ServerOptions o;
  o.max_sessions = 2;
  o.default_policy = BuiltinPolicy();
  o.quotas["carol"].max_sessions = 1;
  SessionManager m(o, e.env);
  v1::CreateSessionRequest req;
  req.mutable_shape()->set_num_layers(1);
  req.mutable_shape()->set_num_q_heads(1);
  req.mutable_shape()->set_num_kv_heads(1);
  req.mutable_shape()->set_head_dim(8);
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
    SessionManager quota(q, e.env);
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

}  // namespace
}  // namespace kvtier
