// Aging: quantization of cold chunks and semantic regrouping, through a session and on a layer's
// streams directly.
#include "server/session/aging.h"

#include <algorithm>
#include <cstring>
#include <optional>

#include "server/quant/chunk_quant.h"
#include "tests/session_fixture.h"

namespace kvtier {
namespace {

using namespace ::kvtier::testing;

TEST(ColdChunks, LeavingTheWindowQuantizesAndSelectReadsFp16WithinTheBound) {
  for (auto [precision, levels] :
       {std::pair{v1::PRECISION_INT4, 15.f}, {v1::PRECISION_INT8, 255.f}}) {
    Env e;
    Fixture f = Make(e, 3, 4, 2, 64, 300, Cold(precision));
    ASSERT_OK(AppendAll(f, 300, 37));
    // Chunks wholly before token 300 - 64 = 236 (chunks 0..13) are cold, except the sink chunk.
    auto chunks = *f.session->ListChunks(2, 1000);
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
        // Keys per channel over the chunk, values per token over groups of kValueGroup channels.
        // The step is at most the group's range, widened by the zero's step (its zero is a
        // byte: (largest - smallest minimum of the chunk's groups) / 255 below its minimum), over
        // levels, times the scale byte's rounding up (at most 1 + 1/32) (quant_layout.h).
        const uint32_t n = b.num_tokens();
        const int g = int(kValueGroup);
        const int G = (64 + g - 1) / g;  // value groups per token
        std::vector<float> kmin(64, 1e9f), kmax(64, -1e9f), vmin(n * G, 1e9f), vmax(n * G, -1e9f);
        for (uint32_t t = 0; t < n; ++t) {
          for (int j = 0; j < 64; ++j) {
            kmin[j] = std::min(kmin[j], HalfToFloat(want_k[t * 64 + j]));
            kmax[j] = std::max(kmax[j], HalfToFloat(want_k[t * 64 + j]));
            const int gj = int(t) * G + j / g;
            vmin[gj] = std::min(vmin[gj], HalfToFloat(want_v[t * 64 + j]));
            vmax[gj] = std::max(vmax[gj], HalfToFloat(want_v[t * 64 + j]));
          }
        }
        auto zero_step = [](const std::vector<float>& mins) {
          const auto [lo, hi] = std::minmax_element(mins.begin(), mins.end());
          return (*hi - *lo) / 255.f;
        };
        const float kstep = zero_step(kmin), vstep = zero_step(vmin);
        for (uint32_t t = 0; t < n; ++t) {
          for (int j = 0; j < 64; ++j) {
            const int gj = int(t) * G + j / g;
            const float kx = HalfToFloat(want_k[t * 64 + j]), ky = HalfToFloat(k[t * 64 + j]);
            const float vx = HalfToFloat(want_v[t * 64 + j]), vy = HalfToFloat(v[t * 64 + j]);
            EXPECT_LE(std::fabs(kx - ky),
                      (kmax[j] - kmin[j] + kstep) / levels * 0.5f * 1.032f + HalfUlpAt(ky) + 1e-3f);
            EXPECT_LE(std::fabs(vx - vy), (vmax[gj] - vmin[gj] + vstep) / levels * 0.5f * 1.032f +
                                              HalfUlpAt(vy) + 1e-3f);
          }
        }
      }
    }
    // The dequantized copies are cached: a second Select promotes nothing new.
    const uint64_t promotions = e.host_copies.counters().promotions;
    EXPECT_EQ(promotions, 2u * 13);  // layer 2: 2 heads x 13 cold chunks, dequantized once
    v1::SelectResponse again;
    ASSERT_OK(f.session->Select(SelectReq(f, 2, 1000), &again));
    EXPECT_EQ(e.host_copies.counters().promotions, promotions);
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
  EXPECT_THAT(f.session->Append(r), StatusIs(Code::kInvalidArgument,
                                             "keys: element 133 (kv_head 1, token 0, channel 5)"));
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
  ASSERT_TRUE(f.session->ListChunks(0, 100)->chunks(3).precision() == v1::PRECISION_INT4);
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

// What Info says a session holds (kept per stream and per cache as chunks change) equals a walk
// of its chunks (ListChunks: each chunk's slot and copies, read one by one), through appends
// that grow chunks in place and in a copy (a lease holds the partial one), aging to int4 and
// semantic regrouping, promotions to host and device copies, evictions from a full device
// tier, Evict, a policy change and a fork.
TEST(ColdChunks, InfoCountsWhatAWalkOfTheChunksFinds) {
  for (const bool semantic : {false, true}) {
    SCOPED_TRACE(semantic ? "semantic chunks" : "contiguous chunks");
    Env e(64 << 20, 34 * 2048);  // room for 34 device copies of 16 rows of head_dim 32
    v1::SessionPolicy policy = Cold(v1::PRECISION_INT4);
    if (semantic) policy.set_chunking(v1::CHUNKING_SEMANTIC);
    Fixture f = Make(e, 3, 4, 2, 32, 700, policy);  // layers 0 and 1 dense, 2 selective
    auto walk_equals_info = [&](Session& s, const char* when) {
      SCOPED_TRACE(when);
      uint64_t host = 0, device = 0;
      std::map<std::string, uint64_t> by_precision;
      const v1::ListChunksResponse all = *s.ListChunks(std::nullopt, 1 << 30);
      for (const v1::ChunkInfo& c : all.chunks()) {
        host += c.host_bytes();
        device += c.device_bytes();
        ++by_precision[v1::Precision_Name(c.precision())];
      }
      const v1::SessionInfo info = s.Info();
      EXPECT_EQ(info.bytes_by_tier().at("TIER_HOST"), host);
      EXPECT_EQ(info.bytes_by_tier().at("TIER_DEVICE"), device);
      const std::map<std::string, uint64_t> counted(info.chunks_by_precision().begin(),
                                                    info.chunks_by_precision().end());
      EXPECT_EQ(counted, by_precision);
    };
    walk_equals_info(*f.session, "empty");
    ASSERT_OK(AppendAll(f, 300, 37));
    walk_equals_info(*f.session, "appended and aged");
    // A fork before any copy is made: its copies are its own (a fork reads the copies its
    // parent had made of the chunks they share, and those count to the parent).
    ASSERT_OK_AND_ASSIGN(std::unique_ptr<Session> child, f.session->Fork("c", 250));
    walk_equals_info(*child, "a fork");
    // A lease on the partial last chunk: the next append grows it in a copy.
    v1::SelectResponse held;
    ASSERT_OK(f.session->Select(SelectReq(f, 0, 1000), &held));
    for (int l = 0; l < 3; ++l) ASSERT_OK(f.session->Append(Req(f, l, 300, 5)).status());
    walk_equals_info(*f.session, "grown beside a lease, host copies made");
    auto on_device = SelectReq(f, 2, 200);  // 13 chunks a head
    on_device.set_placement(v1::TIER_DEVICE);
    for (uint32_t seed = 1; seed <= 6; ++seed) {  // other queries: the device tier fills, evicts
      on_device.set_query(Query(f, seed));
      v1::SelectResponse resp;
      const absl::Status s = f.session->Select(on_device, &resp);
      ASSERT_TRUE(s.ok() || absl::IsResourceExhausted(s)) << s;
      if (s.ok()) {
        ASSERT_OK(e.leases.Release("t", resp.lease_id()));
      }
    }
    EXPECT_GT(e.device_copies.counters().evictions, 0u);
    walk_equals_info(*f.session, "device copies, some evicted");
    ASSERT_OK(f.session->Evict(v1::TIER_DEVICE).status());
    walk_equals_info(*f.session, "device copies evicted");
    v1::SessionPolicy wider = policy;
    wider.set_recent_window(128);
    ASSERT_OK(f.session->SetPolicy(wider).status());
    ASSERT_OK(AppendAll(f, 700, 101));
    walk_equals_info(*f.session, "a wider window, more appended");
    v1::SelectResponse more;
    ASSERT_OK(child->Select(SelectReq(f, 0, 1000), &more));
    walk_equals_info(*child, "the fork's own copies");
    ASSERT_OK(e.leases.Release("t", held.lease_id()));
    ASSERT_OK(e.leases.Release("t", more.lease_id()));
    child.reset();
    walk_equals_info(*f.session, "its fork closed");
  }
}

// A full host tier makes room by evicting dequantized copies nobody is reading (the host
// promotion cache); the copies this very Select chose again are held and never evicted.
TEST(ColdChunks, MakingRoomForCopiesKeepsTheChosenOnes) {
  // Two layers (layer 0 dense) of one stream, 400 tokens, d 64: chunk 0 (sink) and 21..24
  // (window) fp16, 1..20 int4.
  const uint64_t warm = 2 * 5 * 4096, cold = 2 * 20 * QuantLayout{64, 16, 4}.Bytes();
  v1::SessionPolicy policy = Cold();
  policy.set_dense_layers(1);
  // Keys constant per chunk (exact under int4): channel 0 = chunk index, channel 1 = 100 for
  // chunks 3, 4, 5. A query along channel 0 ranks 20, 19, ...; along (1, 1), 5, 4, 3, 20, 19.
  auto make = [&](Env& env) {
    Fixture f = Make(env, 2, 1, 1, 64, 400, policy);
    for (int t = 0; t < 400; ++t) {
      for (int j = 0; j < 64; ++j) {
        const int c = t / 16;
        f.k[1][t * 64 + j] = FloatToHalf(j == 0 ? c : (j == 1 && c >= 3 && c <= 5 ? 100.f : 0.f));
      }
    }
    return f;
  };
  const uint64_t meta = MetadataOfTwin([&](Env& twin) {
    Fixture f = make(twin);
    EXPECT_OK(AppendAll(f, 400, 16));
    return twin.host.Stats().metadata_bytes;
  });
  Env e(warm + cold + meta + 6 * 4096);  // room for six dequantized copies
  Fixture f = make(e);
  ASSERT_OK(AppendAll(f, 400, 16));  // 16 at a time: quantizing as it goes stays in capacity
  ASSERT_EQ(e.host.Stats().used_bytes, warm + cold);
  ASSERT_EQ(e.host.Stats().metadata_bytes, meta);
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
  EXPECT_EQ(e.device_copies.counters().drops, 0u);
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
  EXPECT_EQ(f.session->Layers()->at(2).indexed_chunks(), 2u * 3 * 8);
  const auto listed = *f.session->ListChunks(2, 100);
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
    EXPECT_EQ(view.session->Layers()->at(2).indexed_chunks(), 2u * 3 * 8) << "fork at " << at;
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
  EXPECT_EQ(f.session->Layers()->at(2).indexed_chunks(), aged_out / 8 * 8);
  const auto chunks = ExpectRowsAtTheirPositions(f, 2, 0, tokens);
  ExpectLongContextSelections(f, tokens, chunks, 2);
  const v1::LayerStats st = f.session->Layers()->at(2);
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

// A layer's streams aged directly: two KV heads of head_dim 64, 16-token chunks.
struct LayerEnv {
  explicit LayerEnv(uint64_t host_capacity = 1 << 20)
      : host(TierOpts(v1::TIER_HOST, host_capacity)) {
    policy = *ResolvePolicy(WholeContiguousChunks(), BuiltinPolicy(), "policy");  // int4
    for (int h = 0; h < 2; ++h) heads.emplace_back(64);
  }
  AgingContext ctx() { return AgingContext{policy, f, account}; }
  // Tokens [from, to) of each head (random halves, kept in k[h] and v[h]).
  void Append(uint64_t from, uint64_t to) {
    for (int h = 0; h < 2; ++h) {
      k[h].resize(to * 64);
      v[h].resize(to * 64);
      const std::vector<uint16_t> nk = RandomHalfs((to - from) * 64, rng);
      const std::vector<uint16_t> nv = RandomHalfs((to - from) * 64, rng);
      std::copy(nk.begin(), nk.end(), k[h].begin() + from * 64);
      std::copy(nv.begin(), nv.end(), v[h].begin() + from * 64);
      const AppendPlan plan =
          PlanAppend(heads[h], from, to, [](uint32_t rows, uint64_t) { return rows >= 16; });
      heads[h].Write(plan, reinterpret_cast<const uint8_t*>(nk.data()),
                     reinterpret_cast<const uint8_t*>(nv.data()), from, f,
                     [&] { return *host.Allocate(account, f.slot_bytes()); });
    }
    tokens = to;
  }
  void Age() { AgeLayer(ctx(), tokens, heads, &state); }

  Tier host;
  v1::SessionPolicy policy;
  ChunkFormat f{.head_dim = 64, .dtype = v1::DTYPE_FP16, .capacity = 16};
  const std::string tenant = "t";
  const TierAccount account = host.Account(tenant);
  std::vector<Stream> heads;
  AgingState state;
  uint64_t tokens = 0;
  std::mt19937 rng{11};
  std::vector<uint16_t> k[2], v[2];
};

std::vector<v1::Precision> Precisions(const Stream& s) {
  std::vector<v1::Precision> out;
  for (const Chunk& c : s.chunks()) out.push_back(c.precision);
  return out;
}

TEST(AgeLayer, QuantizesWhatLeftTheWindowIndexesItAndWaitsForRoom) {
  // Room for the 32 fp16 slots and one more, which the test holds: the tier is full.
  LayerEnv e(33 * 4096);
  e.Append(0, 256);  // 16 chunks; the window holds the last 64 tokens, 12 chunks aged out
  absl::StatusOr<SlotRef> held = e.host.Allocate("other", 4096);
  ASSERT_TRUE(held.ok()) << held.status();
  e.Age();
  // Chunk 1 (the first past the sink) cannot get its int4 slot: it waits, and so does the
  // index, which takes a chunk only once its statistics are final.
  EXPECT_EQ(e.state.quantized, 1u);
  EXPECT_EQ(e.state.peaked, 12u);  // every aged-out chunk has its peak meanwhile
  for (const Stream& s : e.heads) {
    EXPECT_EQ(Precisions(s), std::vector<v1::Precision>(16, v1::PRECISION_FP16));
    EXPECT_EQ(s.stats().final_chunks(), 1u);
    EXPECT_EQ(s.index(), nullptr);  // chunk 0 is a sink
  }
  // With room again (each quantized chunk gives its fp16 slot back), the next call resumes.
  held->reset();
  e.Age();
  EXPECT_EQ(e.state.quantized, 12u);
  for (const Stream& s : e.heads) {
    std::vector<v1::Precision> want(16, v1::PRECISION_INT4);
    want[0] = v1::PRECISION_FP16;
    for (int c = 12; c < 16; ++c) want[c] = v1::PRECISION_FP16;  // still in the window
    EXPECT_EQ(Precisions(s), want);
    EXPECT_EQ(s.stats().final_chunks(), 12u);
    ASSERT_NE(s.index(), nullptr);
    EXPECT_EQ(s.index()->num_chunks(), 11u);
    EXPECT_EQ(s.index()->CheckInvariants(s.stats()), "");
    // A cold chunk's statistics are those of its dequantized keys, what attention reads.
    std::vector<uint16_t> rows(2 * 16 * 64);
    const Chunk& cold = s.chunks()[5];
    DequantizeChunk(cold.host->data(), e.f.ColdLayout(cold), rows.data(), rows.data() + 16 * 64);
    std::vector<float> mean(64);
    s.stats().Mean(5, mean.data());  // final, so compact: within half a step of 1/127 of its top
    std::vector<double> want_mean(64, 0.0);
    double top = 0;
    for (int j = 0; j < 64; ++j) {
      for (int r = 0; r < 16; ++r) want_mean[j] += HalfToFloat(rows[r * 64 + j]) / 16.0;
      top = std::max(top, std::fabs(want_mean[j]));
    }
    for (int j = 0; j < 64; ++j) EXPECT_NEAR(mean[j], want_mean[j], 1e-5 + top / 254) << j;
  }
}

TEST(AgeLayer, AChunkAlreadyIndexedIsNeverQuantizedLater) {
  LayerEnv e;
  e.policy.set_cold_precision(v1::PRECISION_FP16);
  e.Append(0, 256);
  e.Age();
  EXPECT_EQ(e.heads[0].index()->num_chunks(), 11u);  // indexed as fp16
  // The policy turns to int4 (SetPolicy may do that): the chunks that age out from now on
  // are quantized; those in the index keep the statistics its bounds were built on.
  e.policy.set_cold_precision(v1::PRECISION_INT4);
  e.Append(256, 288);
  e.Age();
  for (const Stream& s : e.heads) {
    std::vector<v1::Precision> want(18, v1::PRECISION_FP16);
    want[12] = want[13] = v1::PRECISION_INT4;
    EXPECT_EQ(Precisions(s), want);
    EXPECT_EQ(s.index()->num_chunks(), 13u);
    EXPECT_EQ(s.index()->CheckInvariants(s.stats()), "");
  }
}

// The pool regroups a span without the session's lock (NextSpan, RegroupSpan, CommitSpan): a
// span that was regrouped meanwhile (a fork or a wait_aged append ages it inline) is not
// committed a second time, and its fresh slots go back; an unchanged one commits as AgeLayer
// would have regrouped it.
TEST(AgeLayer, ASpanRegroupedMeanwhileIsNotCommittedTwice) {
  for (bool meanwhile : {false, true}) {
    LayerEnv e(4 << 20), twin(4 << 20);
    e.policy.set_chunking(v1::CHUNKING_SEMANTIC);
    twin.policy.set_chunking(v1::CHUNKING_SEMANTIC);
    e.Append(0, 16 + 128 + 64);  // one whole span past the sink, then the window
    twin.Append(0, 16 + 128 + 64);
    std::optional<SpanJob> job = NextSpan(e.ctx(), e.tokens, e.heads, &e.state);
    ASSERT_TRUE(job.has_value());
    EXPECT_EQ(job->first, 1u);
    ASSERT_TRUE(RegroupSpan(SpanContext::Of(e.ctx()), &*job));
    if (meanwhile) e.Age();  // the span is regrouped (and quantized, indexed) meanwhile
    const uint64_t used = e.host.Stats().used_bytes;
    EXPECT_EQ(CommitSpan(e.heads, &e.state, std::move(*job), e.ctx().cold_bits()), !meanwhile);
    job.reset();
    if (meanwhile) {
      EXPECT_LT(e.host.Stats().used_bytes, used) << "the job's slots went back";
    }
    e.Age();
    twin.Age();
    EXPECT_EQ(e.state.regrouped, twin.state.regrouped);
    for (int h = 0; h < 2; ++h) {
      ASSERT_EQ(e.heads[h].chunks().size(), twin.heads[h].chunks().size());
      for (size_t c = 0; c < e.heads[h].chunks().size(); ++c) {
        const Chunk& a = e.heads[h].chunks()[c];
        const Chunk& b = twin.heads[h].chunks()[c];
        EXPECT_EQ(a.offsets, b.offsets) << h << ":" << c;
        EXPECT_EQ(a.precision, b.precision);
        EXPECT_EQ(std::memcmp(a.host->data(), b.host->data(), a.host->bytes()), 0);
      }
    }
  }
}

// Under a policy that quantizes, RegroupSpan quantizes each regrouped chunk at once: the same
// bytes and statistics as regrouping in fp16 and then quantizing that chunk (the two steps it
// took before), in slots of the cold size; a commit under another precision (a policy
// changed meanwhile) is refused; after the commit, aging leaves those chunks as they are.
TEST(AgeLayer, ARegroupedSpanIsQuantizedAsItsFp16ChunksWouldBe) {
  LayerEnv e(4 << 20), fp16(4 << 20);
  for (LayerEnv* x : {&e, &fp16}) {
    x->policy.set_chunking(v1::CHUNKING_SEMANTIC);
    x->Append(0, 16 + 128 + 64);  // one whole span past the sink, then the window
  }
  std::optional<SpanJob> job = NextSpan(e.ctx(), e.tokens, e.heads, &e.state);
  std::optional<SpanJob> plain = NextSpan(fp16.ctx(), fp16.tokens, fp16.heads, &fp16.state);
  ASSERT_TRUE(job.has_value() && plain.has_value());
  SpanContext cold = SpanContext::Of(e.ctx());
  ASSERT_EQ(cold.cold_bits, 4u);
  SpanContext warm = SpanContext::Of(fp16.ctx());
  warm.cold_bits = 0;
  ASSERT_TRUE(RegroupSpan(cold, &*job));
  ASSERT_TRUE(RegroupSpan(warm, &*plain));
  ASSERT_EQ(job->regrouped.size(), 2u * kSemanticSpanChunks);
  ASSERT_EQ(plain->regrouped.size(), job->regrouped.size());
  const QuantLayout layout{64, 16, 4};
  for (size_t i = 0; i < job->regrouped.size(); ++i) {
    const Chunk& a = job->regrouped[i];
    const Chunk& b = plain->regrouped[i];
    EXPECT_EQ(a.precision, v1::PRECISION_INT4);
    EXPECT_EQ(b.precision, v1::PRECISION_FP16);
    EXPECT_EQ(a.offsets, b.offsets) << i;
    ASSERT_EQ(a.host->bytes(), layout.Bytes());
    const auto* k = reinterpret_cast<const uint16_t*>(b.host->data());
    std::vector<uint8_t> want(layout.Bytes());
    QuantizeChunk(k, k + 16 * 64, layout, want.data());
    EXPECT_EQ(std::memcmp(a.host->data(), want.data(), want.size()), 0) << i;
    std::vector<uint16_t> rows(2 * 16 * 64);
    DequantizeChunk(want.data(), layout, rows.data(), rows.data() + 16 * 64);
    const ChunkSummary s = ChunkStats::Summarize(HalfKind::kFp16, rows.data(), 16, 64);
    EXPECT_EQ(job->summaries[i].tokens, s.tokens);
    EXPECT_EQ(job->summaries[i].key_sum, s.key_sum) << i;
    EXPECT_EQ(job->summaries[i].peak, s.peak) << i;
  }
  std::vector<std::vector<uint8_t>> committed;
  for (const Chunk& c : job->regrouped) {
    committed.emplace_back(c.host->data(), c.host->data() + c.host->bytes());
  }
  // A job quantized under another policy's precision is refused, the span left as it was.
  SpanJob other = *job;
  EXPECT_FALSE(CommitSpan(e.heads, &e.state, std::move(other), 0));
  EXPECT_EQ(e.heads[0].chunks()[1].precision, v1::PRECISION_FP16);
  EXPECT_TRUE(e.heads[0].chunks()[1].offsets.empty()) << "still contiguous";
  EXPECT_EQ(e.state.regrouped, 1u);
  ASSERT_TRUE(CommitSpan(e.heads, &e.state, std::move(*job), 4));
  e.Age();
  for (int h = 0; h < 2; ++h) {
    for (uint32_t i = 0; i < kSemanticSpanChunks; ++i) {
      const Chunk& c = e.heads[h].chunks()[1 + i];
      EXPECT_EQ(c.precision, v1::PRECISION_INT4);
      const std::vector<uint8_t>& want = committed[h * kSemanticSpanChunks + i];
      ASSERT_EQ(c.host->bytes(), want.size());
      EXPECT_EQ(std::memcmp(c.host->data(), want.data(), want.size()), 0) << h << ":" << i;
    }
  }
}

// The pool quantizes without the session's lock too (NextQuant, RunQuant, CommitQuant), a few
// chunks at a time: a job whose chunks were aged meanwhile commits nothing and gives its slots
// back; jobs of two chunks end exactly where AgeLayer does, byte for byte.
TEST(AgeLayer, QuantJobsEqualAgeLayerAndSkipChunksAgedMeanwhile) {
  for (bool meanwhile : {false, true}) {
    LayerEnv e, twin;
    e.Append(0, 256);
    twin.Append(0, 256);
    if (meanwhile) {
      std::optional<QuantJob> job = NextQuant(e.ctx(), e.tokens, e.heads, e.state, 3);
      ASSERT_TRUE(job.has_value());
      EXPECT_EQ(job->first, 0u);
      EXPECT_EQ(job->end, 3u);
      EXPECT_EQ(job->items.size(), 4u);  // chunks 1 and 2 of two heads (chunk 0 is a sink)
      RunQuant(SpanContext::Of(e.ctx()), &*job);
      EXPECT_TRUE(job->progressed());
      e.Age();  // quantized (and indexed) meanwhile
      const uint64_t used = e.host.Stats().used_bytes;
      const std::vector<v1::Precision> before = Precisions(e.heads[0]);
      CommitQuant(e.heads, &e.state, std::move(*job));
      job.reset();
      EXPECT_LT(e.host.Stats().used_bytes, used) << "the job's slots went back";
      EXPECT_EQ(Precisions(e.heads[0]), before);
      EXPECT_EQ(e.state.quantized, 12u);
    } else {
      while (std::optional<QuantJob> job = NextQuant(e.ctx(), e.tokens, e.heads, e.state, 2)) {
        EXPECT_LE(job->end - job->first, 2u);
        RunQuant(SpanContext::Of(e.ctx()), &*job);
        CommitQuant(e.heads, &e.state, std::move(*job));
      }
      EXPECT_EQ(e.state.quantized, 12u);
      e.Age();  // the index
    }
    twin.Age();
    for (int h = 0; h < 2; ++h) {
      ASSERT_EQ(e.heads[h].chunks().size(), twin.heads[h].chunks().size());
      EXPECT_EQ(Precisions(e.heads[h]), Precisions(twin.heads[h]));
      for (size_t c = 0; c < e.heads[h].chunks().size(); ++c) {
        const Chunk& a = e.heads[h].chunks()[c];
        const Chunk& b = twin.heads[h].chunks()[c];
        ASSERT_EQ(e.f.StoredBytes(a), twin.f.StoredBytes(b));
        EXPECT_EQ(std::memcmp(a.host->data(), b.host->data(), e.f.StoredBytes(a)), 0) << h << c;
      }
      EXPECT_EQ(e.heads[h].index()->num_chunks(), twin.heads[h].index()->num_chunks());
    }
  }
}

// A layer of two heads holding 256 fp16 tokens (12 chunks aged out, the first a sink) for an
// index made a slice at a time, and its twin, indexed at once.
struct SlicedLayer {
  SlicedLayer() {
    for (LayerEnv* l : {&e, &twin}) {
      l->policy.set_cold_precision(v1::PRECISION_FP16);
      l->Append(0, 256);
    }
  }
  // Once the slices are done: IndexLayer's index, whose search is the linear scan's.
  void ExpectTheTwinsIndex() {
    IndexLayer(twin.ctx(), twin.tokens, twin.heads, &twin.state);
    for (int h = 0; h < 2; ++h) {
      EXPECT_EQ(e.heads[h].stats().final_chunks(), 12u);
      EXPECT_EQ(e.heads[h].index()->num_chunks(), twin.heads[h].index()->num_chunks());
      EXPECT_EQ(e.heads[h].index()->num_clusters(), twin.heads[h].index()->num_clusters());
      EXPECT_EQ(e.heads[h].index()->CheckInvariants(e.heads[h].stats()), "");
    }
  }
  LayerEnv e, twin;
};

// The index a slice at a time: at most that many chunks of each head per call, and in the
// end the same index as IndexLayer's.
TEST(AgeLayer, IndexSlicesTakeAtMostTheirChunks) {
  SlicedLayer layer;
  LayerEnv& e = layer.e;
  int calls = 0;
  uint32_t final_before = e.heads[0].stats().final_chunks();
  for (;;) {
    const bool more = IndexLayerSlice(e.ctx(), e.tokens, e.heads, &e.state, 3);
    ++calls;
    for (const Stream& s : e.heads) EXPECT_LE(s.stats().final_chunks() - final_before, 3u);
    EXPECT_LE(e.state.peaked, 3u * calls);  // the peaks a slice at a time too
    EXPECT_GE(e.state.peaked, e.heads[0].stats().final_chunks());  // none indexed before its peak
    final_before = e.heads[0].stats().final_chunks();
    if (!more) break;
    ASSERT_LT(calls, 10);
  }
  EXPECT_EQ(calls, 4);  // 12 aged-out chunks, 3 a call
  layer.ExpectTheTwinsIndex();
}

// A slice whose deadline has passed indexes one chunk, of the first head with any left, and
// leaves none final outside the index: one call per chunk of each head, then the same index as
// IndexLayer's.
TEST(AgeLayer, AnIndexSlicePastItsDeadlineTakesOneChunk) {
  SlicedLayer layer;
  LayerEnv& e = layer.e;
  int calls = 0;
  uint64_t final_total = 0;
  for (;;) {
    const bool more =
        IndexLayerSlice(e.ctx(), e.tokens, e.heads, &e.state, 3, absl::InfinitePast());
    ++calls;
    uint64_t now = 0;
    for (const Stream& s : e.heads) {
      now += s.stats().final_chunks();
      // Every final chunk but the sink (chunk 0) is in the index.
      EXPECT_EQ(s.index() ? s.index()->num_chunks() : 0u,
                s.stats().final_chunks() > 0 ? s.stats().final_chunks() - 1 : 0u);
    }
    EXPECT_EQ(now, final_total + 1) << "call " << calls;
    final_total = now;
    if (!more) break;
    ASSERT_LT(calls, 40);
  }
  EXPECT_EQ(calls, 24);  // 12 aged-out chunks of each of two heads
  layer.ExpectTheTwinsIndex();
}

}  // namespace
}  // namespace kvtier
