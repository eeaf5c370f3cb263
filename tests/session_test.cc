// Session: append, select, leases, fork, device placement and prefetch, against brute force.
#include "server/session/session.h"

#include <malloc.h>

#include <cstdio>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_replace.h"
#include "server/session/layer_budget.h"
#include "server/session/prefetcher.h"
#include "tests/session_fixture.h"

namespace kvtier {
namespace {

using namespace ::kvtier::testing;

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
  const uint64_t gen_before = f.session->ListChunks(0, 100)->chunks(2).generation();
  // identical repeat: a no-op, nothing rewritten
  ASSERT_OK_AND_ASSIGN(uint64_t n, f.session->Append(Req(f, 0, 10, 20)));
  EXPECT_EQ(n, 40u);
  EXPECT_EQ(f.session->ListChunks(0, 100)->chunks(2).generation(), gen_before);
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

// A non-finite key or value is refused naming it (field, element, kv_head, token, channel)
// wherever it lies (rows that grow the open chunk, a new chunk, the last head), before the
// error the request would get otherwise (a gap, a rewrite with other bytes), and nothing of
// that append is stored.
TEST(Session, ANonFiniteValueIsRefusedFirstAndStoresNothing) {
  for (const int d : {8, 16, 64}) {
    Env e;
    Fixture f = Make(e, 1, 2, 2, d, 100);
    ASSERT_OK(f.session->Append(Req(f, 0, 0, 20)).status());  // a chunk and part of the next
    const uint64_t n = 40;
    for (const bool in_values : {false, true}) {
      for (const uint64_t token : {15u, 21u, 45u, 59u}) {
        for (const uint64_t start : {20u, 10u, 25u}) {  // fresh, a rewrite's overlap, a gap
          if (token < start || token >= start + n) continue;
          v1::AppendKVRequest r = Req(f, 0, start, n);
          std::string bytes = in_values ? r.values() : r.keys();
          const uint64_t head = token % 2, channel = token % d;
          const uint64_t element = (head * n + token - start) * d + channel;
          bytes[2 * element + 1] = static_cast<char>(0x7c);  // 0x7cXX: Inf or NaN
          in_values ? r.set_values(bytes) : r.set_keys(bytes);
          EXPECT_THAT(f.session->Append(r),
                      StatusIs(Code::kInvalidArgument,
                               absl::StrFormat("%s: element %d (kv_head %d, token %d, channel %d)",
                                               in_values ? "values" : "keys", element, head, token,
                                               channel)))
              << d << " " << token << " " << start;
          EXPECT_EQ(f.session->Info().num_tokens(), 20u);
        }
      }
    }
    for (int h = 0; h < 2; ++h) ExpectStreamExact(f, 0, h, 20);
    ASSERT_OK(f.session->Append(Req(f, 0, 20, 40)).status());
    for (int h = 0; h < 2; ++h) ExpectStreamExact(f, 0, h, 60);
  }
}

// No bound on a device append's host copy but the allocation's size.
constexpr uint64_t kNoLimit = ~uint64_t{0};

// Ingest from a worker's device memory (the CPU twin of GPU ingest): the bytes read through the
// stream's mapping are stored exactly as bytes sent inline; the mapping is opened once per
// stream and closed with it; every refusal names its field and stores nothing.
TEST(Session, AppendsFromWorkerDeviceMemoryAreStoredAsInline) {
  FakeWorkerDevice worker;
  Env e;
  e.env.open_device_source = worker.Opener();
  Fixture f = Make(e, 1, 2, 2, 16, 96);
  const std::string handle(kCudaIpcHandleBytes, 'h');
  std::vector<uint8_t>& buffer = worker.buffers[handle];
  auto device_req = [&](int start, int n, uint64_t at) {
    v1::AppendKVRequest r = Req(f, 0, start, n);
    buffer.resize(std::max<size_t>(buffer.size(), at + r.keys().size() + r.values().size()));
    std::memcpy(buffer.data() + at, r.keys().data(), r.keys().size());
    std::memcpy(buffer.data() + at + r.keys().size(), r.values().data(), r.values().size());
    r.clear_keys();
    r.clear_values();
    r.mutable_device()->set_cuda_ipc_handle(handle);
    r.mutable_device()->set_keys_offset(at);
    r.mutable_device()->set_values_offset(at + 2 * 2 * n * 16);
    return r;
  };
  {
    DeviceSources stream;  // one AppendKV stream's mappings
    for (int start = 0; start < 96; start += 32) {
      v1::AppendKVRequest r = device_req(start, 32, 1000 * start);
      ASSERT_OK(f.session->Undevice(&r, &stream, kNoLimit));
      EXPECT_FALSE(r.has_device());
      ASSERT_OK(f.session->Append(r).status());
    }
    EXPECT_EQ(worker.opens, 1);
    EXPECT_EQ(worker.closes, 0);
  }
  EXPECT_EQ(worker.closes, 1);  // the stream ended: nothing stays mapped for the worker
  for (int h = 0; h < 2; ++h) ExpectStreamExact(f, 0, h, 96);

  Fixture g = Make(e, 1, 2, 2, 16, 96);
  DeviceSources stream;
  v1::AppendKVRequest r = device_req(0, 16, 0);
  r.set_keys("xx");
  EXPECT_THAT(g.session->Undevice(&r, &stream, kNoLimit), StatusIs(Code::kInvalidArgument, "keys"));
  r = device_req(0, 16, 0);
  r.mutable_device()->set_cuda_ipc_handle("short");
  EXPECT_THAT(g.session->Undevice(&r, &stream, kNoLimit),
              StatusIs(Code::kInvalidArgument, "device.cuda_ipc_handle"));
  r = device_req(0, 16, 0);
  r.mutable_device()->set_cuda_ipc_handle(std::string(kCudaIpcHandleBytes, 'x'));  // no such
  EXPECT_THAT(g.session->Undevice(&r, &stream, kNoLimit),
              StatusIs(Code::kInvalidArgument, "device.cuda_ipc_handle: cudaIpcOpenMemHandle"));
  r = device_req(0, 16, 0);
  r.mutable_device()->set_values_offset(buffer.size());
  EXPECT_THAT(g.session->Undevice(&r, &stream, kNoLimit),
              StatusIs(Code::kInvalidArgument, "device.values_offset"));
  // A range past the allocation is refused before anything is allocated or read for it: the
  // daemon once made host strings of what num_tokens asked first (up to terabytes).
  const int reads = worker.reads.load();
  // The host copy is bounded as the bytes it stands for would be: 16 tokens' keys and values
  // are 2 x 1024 bytes, refused below that, before anything is read.
  r = device_req(0, 16, 0);
  EXPECT_THAT(g.session->Undevice(&r, &stream, 2047),
              StatusIs(Code::kResourceExhausted, "num_tokens: 16 tokens are 2 x 1024 bytes"));
  r = device_req(0, 16, 0);
  r.set_num_tokens(1u << 16);
  EXPECT_THAT(g.session->Undevice(&r, &stream, kNoLimit),
              StatusIs(Code::kInvalidArgument, "device.keys_offset: 4194304 bytes at 0 pass"));
  r = device_req(0, 16, 0);
  r.mutable_device()->set_keys_offset(~uint64_t{0});
  EXPECT_THAT(g.session->Undevice(&r, &stream, kNoLimit),
              StatusIs(Code::kInvalidArgument, "device.keys_offset"));
  EXPECT_EQ(worker.reads.load(), reads) << "a range past the allocation was read";
  r = device_req(0, 16, 0);
  ASSERT_OK(g.session->Undevice(&r, &stream, 2048));
  worker.fail_reads = true;
  r = device_req(0, 16, 0);
  EXPECT_THAT(g.session->Undevice(&r, &stream, kNoLimit),
              StatusIs(Code::kInternal, "device.keys_offset"));
  worker.fail_reads = false;
  Env no_gpu;
  Fixture h = Make(no_gpu, 1, 2, 2, 16, 96);
  r = device_req(0, 16, 0);
  EXPECT_THAT(h.session->Undevice(&r, &stream, kNoLimit),
              StatusIs(Code::kFailedPrecondition, "no GPU"));
  EXPECT_EQ(g.session->Info().num_tokens(), 0u);
  EXPECT_EQ(h.session->Info().num_tokens(), 0u);
}

// The bound a Select's reply is checked against before any work (ReplyBytesBound, against the
// daemon's message size) holds for every reply the Select then makes: whole chunks, refined
// rows gathered into blocks or named in their chunks (row_handles: each chunk with a chosen row
// goes whole, so up to refine_factor times the budget's rows), with and without the bytes and
// the summaries, on a dense layer and on the others.
TEST(Session, AReplyNeverPassesTheBoundItWasCheckedAgainst) {
  for (const auto& [refine, mass] : {std::pair{1u, 0.f}, {4u, 0.f}, {16u, 0.f}, {1u, 0.9f}}) {
    Env e;
    v1::SessionPolicy policy = Lossless();
    policy.set_refine_factor(refine);
    policy.set_mass_target(mass);
    policy.set_dense_layers(1);
    const int tokens = 1200;
    Fixture f = Make(e, 3, 6, 2, 64, tokens, policy, 7);
    ASSERT_OK(AppendAll(f, tokens, 300));
    for (const int layer : {0, 2}) {
      for (const uint32_t budget : {96u, 160u, 512u}) {
        for (const bool row_handles : {false, true}) {
          for (const bool data : {false, true}) {
            for (const bool summaries : {false, true}) {
              v1::SelectRequest req = SelectReq(f, layer, budget, 3 + budget);
              req.set_row_handles(row_handles);
              req.set_include_data(data);
              req.set_include_summaries(summaries);
              v1::SelectResponse resp;
              ASSERT_OK(f.session->Select(req, &resp));
              const uint64_t bound = f.session->ReplyBytesBound(req);
              EXPECT_LE(resp.ByteSizeLong(), bound)
                  << "refine_factor " << refine << " mass_target " << mass << " layer " << layer
                  << " budget " << budget << " row_handles " << row_handles << " data " << data
                  << " summaries " << summaries;
              // Nor so loose that it refuses what would fit: row handles bring at most the
              // pool's chunks, refine_factor times what gathered blocks hold, and a chunk.
              v1::SelectRequest gathered = req;
              gathered.set_row_handles(false);
              EXPECT_LE(bound, (refine + 1) * f.session->ReplyBytesBound(gathered))
                  << "refine_factor " << refine << " mass_target " << mass;
              ASSERT_OK(e.leases.Release("t", resp.lease_id()));
            }
          }
        }
      }
    }
  }
}

// A Select takes its reply's bound from a room under the lock its work runs under: a room one
// byte short refuses it before any lease, an exact one is used up, and a room that Selects
// share (a batch's) refuses the one that would pass it. With appends to a dense layer at once
// (each grows that layer's reply), every reply still fits the bound it took.
TEST(Session, ASelectTakesItsReplysBoundUnderTheLockOfItsWork) {
  Env e;
  v1::SessionPolicy policy = Lossless();
  policy.set_dense_layers(1);
  const int tokens = 2400;
  Fixture f = Make(e, 2, 4, 2, 64, tokens, policy, 3);
  ASSERT_OK(AppendAll(f, 600, 200));
  v1::SelectRequest req = SelectReq(f, 0, 128, 11);
  req.set_include_data(true);
  const uint64_t bound = f.session->ReplyBytesBound(req);
  v1::SelectResponse resp;
  ReplyRoom short_room{bound, bound - 1};
  EXPECT_THAT(f.session->Select(req, &resp, &short_room),
              StatusIs(Code::kResourceExhausted,
                       absl::StrFormat("Select: a reply of up to %d bytes would pass "
                                       "max_message_size %d (%d bytes of it left",
                                       bound, bound, bound - 1)));
  EXPECT_EQ(short_room.left, bound - 1);
  EXPECT_EQ(f.session->live_leases(), 0u);
  ReplyRoom shared{2 * bound, 2 * bound - 1};
  ASSERT_OK(f.session->Select(req, &resp, &shared));
  EXPECT_EQ(shared.left, bound - 1);
  EXPECT_LE(resp.ByteSizeLong(), bound);
  EXPECT_THAT(f.session->Select(req, &resp, &shared), StatusIs(Code::kResourceExhausted));
  EXPECT_EQ(f.session->live_leases(), 1u);

  std::atomic<bool> done{false};
  std::thread appender([&] {
    for (int s = 600; s < tokens; s += 8) {
      EXPECT_OK(f.session->Append(Req(f, 0, s, 8)).status());
    }
    done = true;
  });
  int selects = 0;
  while (!done.load() || selects == 0) {
    ReplyRoom room{~uint64_t{0}, ~uint64_t{0}};
    ASSERT_OK(f.session->Select(req, &resp, &room));
    EXPECT_LE(resp.ByteSizeLong(), room.limit - room.left) << "select " << selects;
    ASSERT_OK(e.leases.Release("t", resp.lease_id()));
    ++selects;
  }
  appender.join();
}

// A tenant's lease limit holds for Selects at once too: each passes the early look (before its
// work) while none has its lease yet, and the limit is taken again, atomically, as the lease is
// made, so exactly the limit's number get one and the others are RESOURCE_EXHAUSTED.
TEST(Session, SelectsAtOnceNeverPassTheTenantsLeaseLimit) {
  Env e;
  e.env.max_leases_per_tenant = 2;
  Fixture f = Make(e, 2, 4, 2, 64, 600);
  ASSERT_OK(AppendAll(f, 600, 200));
  constexpr int kThreads = 8;
  std::atomic<int> ready{0}, granted{0}, refused{0}, other{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      v1::SelectRequest req = SelectReq(f, t % 2, 256, 5 + t);
      ready.fetch_add(1);
      while (ready.load() < kThreads) {
      }
      v1::SelectResponse resp;
      const absl::Status s = f.session->Select(req, &resp);
      if (s.ok()) {
        granted.fetch_add(1);
      } else if (s.code() == Code::kResourceExhausted &&
                 absl::StrContains(s.message(), "max_leases_per_tenant 2")) {
        refused.fetch_add(1);
      } else {
        other.fetch_add(1);
      }
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(granted.load(), 2);
  EXPECT_EQ(refused.load(), kThreads - 2);
  EXPECT_EQ(other.load(), 0);
  EXPECT_EQ(e.leases.Tenant("t")->live(), 2u);
  EXPECT_EQ(f.session->live_leases(), 2u);
}

TEST(Session, FullHostTierStoresNothingAndKeepsWhatWasThere) {
  // 2 kv heads, d 16: a slot is 16*16*4 = 1 KiB; room for 6 slots and the session's metadata.
  const uint64_t meta = MetadataOfTwin([](Env& twin) {
    Fixture f = Make(twin, 1, 2, 2, 16, 100);
    EXPECT_OK(f.session->Append(Req(f, 0, 0, 40)).status());
    return twin.host.Stats().metadata_bytes;
  });
  Env e(6 * 1024 + meta);
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

TEST(Session, ASelectIntoAReusedResponseAnswersAsIntoAFreshOne) {
  // A decode loop passes the same response every step: each answer is that step's alone.
  Env e;
  Fixture f = Make(e, 3, 4, 2, 32, 200);
  ASSERT_OK(AppendAll(f, 200, 64));
  v1::SelectResponse reused;
  for (uint32_t layer : {2u, 0u, 1u, 2u}) {
    ASSERT_OK(f.session->Select(SelectReq(f, layer, 96), &reused));
    v1::SelectResponse fresh;
    ASSERT_OK(f.session->Select(SelectReq(f, layer, 96), &fresh));
    ASSERT_EQ(reused.heads_size(), 2) << layer;
    for (int h = 0; h < 2; ++h) {
      Gathered a = Gather(reused.heads(h).blocks()), b = Gather(fresh.heads(h).blocks());
      EXPECT_EQ(a.pos, b.pos) << layer;
      EXPECT_EQ(a.k, b.k) << layer;
    }
    EXPECT_NE(reused.lease_id(), fresh.lease_id());
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

// Token-level refinement: the pool is what the chunk ranking returns for the sinks' and the
// window's chunks and refine_factor times the rows the sink and window rows leave of the
// budget; the rows are those sink and window rows and the exact best of the pool's other rows
// (brute force in double from the appended keys) by each score, the rows before the window in
// its first chunk among them; the handles name them, and the chunks wholly kept come whole.
TEST(Session, RefinedSelectReturnsTheExactBestRowsOfTheChunkPool) {
  for (v1::RefineScore score : {v1::REFINE_SCORE_MAX, v1::REFINE_SCORE_MEAN_MASS}) {
    Env e;
    v1::SessionPolicy policy = Lossless();
    policy.set_refine_factor(4);
    policy.set_refine_score(score);
    const int tokens = 900;
    Fixture f = Make(e, 3, 6, 2, 64, tokens, policy, 31);
    ASSERT_OK(AppendAll(f, tokens, 300));
    const uint32_t budget = 160;
    const uint64_t kept_tokens = 16 + (tokens - 832);  // chunk 0, and chunks 52..56 (window)
    const int window_start = tokens - 64;              // 836: chunk 52's rows 0..3 are not
    const uint64_t rows_left = budget - (16 + 64);     // the budget counts the kept rows
    for (auto [seed, row_handles] : {std::pair{4u, true}, {5u, true}, {4u, false}}) {
      SCOPED_TRACE(row_handles ? "row handles" : "gathered blocks");
      v1::SelectResponse resp;
      v1::SelectRequest req = SelectReq(f, 2, budget, seed);
      req.set_row_handles(row_handles);
      ASSERT_OK(f.session->Select(req, &resp));
      std::vector<float> q;
      Query(f, seed, &q);
      const int group = f.qh / f.kvh;
      for (int h = 0; h < f.kvh; ++h) {
        const std::set<uint32_t> pool =
            ExpectedChunks(f, 2, h, tokens, uint32_t(kept_tokens + 4 * rows_left), seed);
        // Every row of the pool beyond the kept chunks, scored here.
        std::vector<std::pair<double, int64_t>> scored;  // (-score, position)
        std::vector<std::vector<double>> logits;
        std::vector<int64_t> rows;
        for (uint32_t c : pool) {
          for (int64_t t = c * 16; t < std::min(c * 16 + 16, uint32_t(window_start)); ++t) {
            if (t < 16) continue;  // a sink
            std::vector<double> s(group, 0.0);
            for (int g = 0; g < group; ++g) {
              for (int j = 0; j < f.d; ++j) {
                s[g] += double(q[(size_t(h) * group + g) * f.d + j]) *
                        HalfToFloat(f.k[2][(size_t(h) * f.total + t) * f.d + j]);
              }
              s[g] /= std::sqrt(double(f.d));
            }
            logits.push_back(s);
            rows.push_back(t);
          }
        }
        for (size_t i = 0; i < rows.size(); ++i) {
          double v = 0;
          if (score == v1::REFINE_SCORE_MAX) {
            v = *std::max_element(logits[i].begin(), logits[i].end());
          } else {
            for (int g = 0; g < group; ++g) {
              double z = 0;
              for (const auto& l : logits) z += std::exp(l[g]);
              v += std::exp(logits[i][g]) / z;
            }
          }
          scored.push_back({-v, rows[i]});
        }
        std::sort(scored.begin(), scored.end());
        std::set<int64_t> want;
        for (int t = 0; t < 16; ++t) want.insert(t);
        for (int t = window_start; t < tokens; ++t) want.insert(t);
        for (size_t i = 0; i < rows_left; ++i) want.insert(scored[i].second);
        std::set<int64_t> got;
        for (const v1::BlockHandle& b : resp.heads(h).blocks()) {
          if (b.gathered()) {  // rows of several pool chunks, copied into a block of their own
            EXPECT_FALSE(row_handles);
            EXPECT_EQ(b.chunk_id(), 0u);
            EXPECT_EQ(b.rows_size(), 0);
            EXPECT_EQ(b.positions_size(), int(b.num_tokens()));
            EXPECT_EQ(b.length(), 2u * b.num_tokens() * f.d * 2);
            std::string k, v;
            for (int r = 0; r < b.positions_size(); ++r) {
              if (r > 0) {
                EXPECT_LT(b.positions(r - 1), b.positions(r));
              }
              EXPECT_TRUE(pool.count(uint32_t(b.positions(r) / 16)));
              k += AsBytes(HeadRows(f.k[2], f, h, int(b.positions(r)), 1));
              v += AsBytes(HeadRows(f.v[2], f, h, int(b.positions(r)), 1));
              got.insert(b.positions(r));
            }
            EXPECT_EQ(b.keys(), k);
            EXPECT_EQ(b.values(), v);
            continue;
          }
          const uint32_t c = DecodeChunkId(b.chunk_id()).index;
          EXPECT_TRUE(pool.count(c)) << "chunk " << c << " is not in the pool";
          if (!row_handles) {
            EXPECT_EQ(b.rows_size(), 0) << "every handle's rows are all selected";
          }
          EXPECT_EQ(b.positions_size(), int(b.num_tokens()));  // positions cover every row
          if (c == 0 || c > 52) {
            EXPECT_EQ(b.rows_size(), 0) << "a kept chunk comes whole";
          }
          for (int r = 0; r < b.rows_size(); ++r) {
            EXPECT_LT(b.rows(r), b.num_tokens());
            if (r > 0) {
              EXPECT_LT(b.rows(r - 1), b.rows(r));
            }
          }
          if (b.rows_size() == 0) {
            for (int64_t p : b.positions()) got.insert(p);
          } else {
            for (uint32_t r : b.rows()) got.insert(b.positions(int(r)));
          }
        }
        EXPECT_EQ(got.size(), budget);
        EXPECT_EQ(got, want) << v1::RefineScore_Name(score) << " seed " << seed << " head " << h;
      }
      ASSERT_OK(e.leases.Release("t", resp.lease_id()));
    }
  }
}

// A mass target: within the budget, the fewest rows (with the sinks and window) that hold
// that share of the estimated mass; a larger target holds a superset, and a target of 1 the
// whole budget.
TEST(Session, AMassTargetReturnsTheFewestRowsHoldingIt) {
  Env e;
  const int tokens = 900;
  auto positions = [&](float target) {
    v1::SessionPolicy policy = Lossless();
    policy.set_refine_factor(4);
    policy.set_mass_target(target);
    Fixture f = Make(e, 3, 6, 2, 64, tokens, policy, 31);
    EXPECT_OK(AppendAll(f, tokens, 300));
    v1::SelectResponse resp;
    v1::SelectRequest req = SelectReq(f, 2, 160, 4);
    req.set_row_handles(true);
    EXPECT_OK(f.session->Select(req, &resp));
    std::set<int64_t> got;
    for (const v1::BlockHandle& b : resp.heads(0).blocks()) {
      const uint32_t c = DecodeChunkId(b.chunk_id()).index;
      if (c == 0 || c > 52) {
        EXPECT_EQ(b.rows_size(), 0) << "a kept chunk comes whole";
      }
      if (b.rows_size() == 0) {
        for (int64_t p : b.positions()) got.insert(p);
      } else {
        for (uint32_t r : b.rows()) got.insert(b.positions(int(r)));
      }
    }
    EXPECT_OK(e.leases.Release("t", resp.lease_id()));
    return got;
  };
  const std::set<int64_t> half = positions(0.5f), most = positions(0.9f), all = positions(1.f);
  EXPECT_EQ(all.size(), 160u);
  EXPECT_LE(half.size(), most.size());
  EXPECT_TRUE(std::includes(most.begin(), most.end(), half.begin(), half.end()));
  EXPECT_TRUE(std::includes(all.begin(), all.end(), most.begin(), most.end()));
  for (int t = 0; t < 16; ++t) EXPECT_TRUE(half.count(t)) << "sink " << t;
  for (int t = tokens - 64; t < tokens; ++t) EXPECT_TRUE(half.count(t)) << "window " << t;
}

// Chunks larger than the window: under refinement the budget counts the sink and window rows,
// not their chunks, so a budget below those chunks' tokens still serves, with every sink and
// window row and the rest of the budget from the other rows; without refinement the same
// budget is INVALID_ARGUMENT naming budget_tokens and the tokens the kept chunks hold.
TEST(Session, UnderRefinementTheBudgetCountsSinkAndWindowRowsNotChunks) {
  Env e;
  const int tokens = 900;
  v1::SessionPolicy policy = Lossless();
  policy.set_chunk_tokens(32);
  policy.set_recent_window(16);
  policy.set_refine_factor(4);
  Fixture f = Make(e, 3, 6, 2, 64, tokens, policy, 31);
  ASSERT_OK(AppendAll(f, tokens, 300));
  // Kept chunks: 0 (rows 0..31), 27 (864..895) and 28 (896..899): 68 tokens, 32 of them kept rows.
  const uint32_t budget = 48;
  v1::SelectResponse resp;
  v1::SelectRequest req = SelectReq(f, 2, budget, 4);
  req.set_row_handles(true);
  ASSERT_OK(f.session->Select(req, &resp));
  for (int h = 0; h < f.kvh; ++h) {
    std::set<int64_t> got;
    for (const v1::BlockHandle& b : resp.heads(h).blocks()) {
      if (b.rows_size() == 0) {
        for (int64_t p : b.positions()) got.insert(p);
      } else {
        for (uint32_t r : b.rows()) got.insert(b.positions(int(r)));
      }
    }
    EXPECT_EQ(got.size(), budget) << "head " << h;
    for (int t = 0; t < 16; ++t) EXPECT_TRUE(got.count(t)) << "sink " << t;
    for (int t = tokens - 16; t < tokens; ++t) EXPECT_TRUE(got.count(t)) << "window " << t;
  }
  ASSERT_OK(e.leases.Release("t", resp.lease_id()));

  v1::SessionPolicy whole = policy;
  whole.set_refine_factor(1);
  Fixture g = Make(e, 3, 6, 2, 64, tokens, whole, 31);
  ASSERT_OK(AppendAll(g, tokens, 300));
  v1::SelectResponse none;
  EXPECT_THAT(g.session->Select(SelectReq(g, 2, budget, 4), &none),
              StatusIs(Code::kInvalidArgument, "budget_tokens: 48 is below the 68 tokens"));
}

// LAYER_BUDGET_BY_NEED: a layer's need is the attention mass its rows miss (brute force in
// double over every row, the pool being all of the context here: the rows by the group's mean
// mass over the pool, then their mass and the kept rows' over all rows); its rows beyond the
// sinks and window follow 0.25 + 0.75 * need / mean need of the equal share, so a peaked
// layer gives rows to a flat one and the two together keep the budget's total.
TEST(Session, LayerBudgetsFollowTheMeasuredNeed) {
  Env e;
  const int tokens = 900;
  v1::SessionPolicy policy = Lossless();
  policy.set_refine_factor(16);  // a pool of all the context: 84 + 16 * 80 >= 900
  policy.set_refine_score(v1::REFINE_SCORE_MEAN_MASS);
  policy.set_layer_budget(v1::LAYER_BUDGET_BY_NEED);
  Fixture f = Make(e, 4, 6, 2, 64, tokens, policy, 31);
  ASSERT_OK(AppendAll(f, tokens, 300));
  const uint32_t budget = 160;
  const uint64_t kept = 16 + 64, rows_left = budget - kept;  // the sink and window rows
  const int group = f.qh / f.kvh;
  // Layer 2 attends sharply (a large query), layer 3 flatly (a small one).
  const std::map<int, float> scale = {{2, 4.f}, {3, 0.25f}};
  auto request = [&](int layer) {
    std::vector<float> q;
    Query(f, 4, &q);
    for (float& x : q) x *= scale.at(layer);
    v1::SelectRequest req = SelectReq(f, layer, budget, 4);
    req.set_query(std::string(reinterpret_cast<const char*>(q.data()), q.size() * 4));
    req.set_row_handles(true);
    return std::pair{req, q};
  };
  auto need = [&](int layer, const std::vector<float>& q) {
    double sum = 0;
    for (int h = 0; h < f.kvh; ++h) {
      std::vector<std::vector<double>> s(tokens, std::vector<double>(group, 0.0));
      for (int t = 0; t < tokens; ++t) {
        for (int g = 0; g < group; ++g) {
          for (int j = 0; j < f.d; ++j) {
            s[t][g] += double(q[(size_t(h) * group + g) * f.d + j]) *
                       HalfToFloat(f.k[layer][(size_t(h) * f.total + t) * f.d + j]);
          }
          s[t][g] /= std::sqrt(double(f.d));
        }
      }
      auto kept_row = [&](int t) { return t < 16 || t >= tokens - 64; };
      // Softmax over `all` rows or the pool's alone, summed over the group.
      auto mass = [&](int t, bool all) {
        double m = 0;
        for (int g = 0; g < group; ++g) {
          double z = 0;
          for (int u = 0; u < tokens; ++u) {
            if (all || !kept_row(u)) z += std::exp(s[u][g]);
          }
          m += std::exp(s[t][g]) / z;
        }
        return m;
      };
      std::vector<std::pair<double, int>> pool;  // (-score, row)
      double held = 0;
      for (int t = 0; t < tokens; ++t) {
        if (kept_row(t)) {
          held += mass(t, true) / group;
        } else {
          pool.push_back({-mass(t, false), t});
        }
      }
      std::sort(pool.begin(), pool.end());
      for (size_t i = 0; i < rows_left; ++i) held += mass(pool[i].second, true) / group;
      sum += 1.0 - held;
    }
    return sum / f.kvh;
  };
  auto rows = [&](const v1::SelectResponse& resp, int h) {
    size_t n = 0;
    for (const v1::BlockHandle& b : resp.heads(h).blocks()) {
      n += b.rows_size() ? size_t(b.rows_size()) : size_t(b.num_tokens());
    }
    return n;
  };
  // First Selects: no layer measured yet, so each gets the equal share, and is measured.
  std::map<int, double> want_need;
  for (int layer : {2, 3}) {
    auto [req, q] = request(layer);
    v1::SelectResponse resp;
    ASSERT_OK(f.session->Select(req, &resp));
    for (int h = 0; h < f.kvh; ++h) EXPECT_EQ(rows(resp, h), budget) << "layer " << layer;
    ASSERT_OK(e.leases.Release("t", resp.lease_id()));
    want_need[layer] = need(layer, q);
    EXPECT_NEAR(f.session->Layers()->at(layer).budget_need(), want_need[layer], 1e-4)
        << "layer " << layer;
  }
  ASSERT_LT(want_need[2], want_need[3]);
  const std::vector<v1::LayerStats> stats = *f.session->Layers();
  const double mean = (stats[2].budget_need() + stats[3].budget_need()) / 2;
  EXPECT_EQ(stats[0].budget_share(), 1.f);  // dense layers take no part
  EXPECT_EQ(stats[0].budget_need(), -1.f);
  for (int layer : {2, 3}) {
    EXPECT_NEAR(stats[layer].budget_share(), 0.25 + 0.75 * stats[layer].budget_need() / mean, 1e-6);
  }
  EXPECT_NEAR(stats[2].budget_share() + stats[3].budget_share(), 2.0, 1e-6);
  // Now the flat layer gets more rows than the budget and the sharp one fewer, as the shares
  // say (each Select measures its layer again: the shares as they stand before it).
  for (int layer : {2, 3}) {
    const std::vector<v1::LayerStats> now = *f.session->Layers();
    // The share as the daemon computes it, in double from the needs it reports.
    const double share = 0.25 + 0.75 * double(now[layer].budget_need()) /
                                    ((double(now[2].budget_need()) + now[3].budget_need()) / 2);
    EXPECT_NEAR(now[layer].budget_share(), share, 1e-6);
    auto [req, q] = request(layer);
    v1::SelectResponse resp;
    ASSERT_OK(f.session->Select(req, &resp));
    const size_t want = kept + size_t(std::llround(share * double(rows_left)));
    for (int h = 0; h < f.kvh; ++h) EXPECT_EQ(rows(resp, h), want) << "layer " << layer;
    if (layer == 2) {
      EXPECT_LT(want, budget);
    }
    if (layer == 3) {
      EXPECT_GT(want, budget);
    }
    ASSERT_OK(e.leases.Release("t", resp.lease_id()));
  }
}

// The share arithmetic alone: the average need weighted 0.2 for the newest Select, the equal
// quarter, unmeasured and dense layers at 1, and the cap at 4x with what it leaves going to
// the other layers by their need.
TEST(LayerNeeds, SharesAverageOneAndFollowTheNeed) {
  LayerNeeds n(6);
  EXPECT_EQ(n.need(3), -1.f);
  EXPECT_EQ(n.Share(3, 2), 1.0);
  n.Record(2, 0.1f);
  n.Record(3, 0.5f);
  n.Record(3, 0.0f);  // 0.8 * 0.5 + 0.2 * 0
  EXPECT_FLOAT_EQ(n.need(3), 0.4f);
  EXPECT_NEAR(n.Share(2, 2), 0.25 + 0.75 * 0.1 / 0.25, 1e-6);
  EXPECT_NEAR(n.Share(3, 2), 0.25 + 0.75 * 0.4 / 0.25, 1e-6);
  EXPECT_EQ(n.Share(4, 2), 1.0);  // not measured yet
  EXPECT_EQ(n.Share(1, 2), 1.0);  // dense
  n.Record(4, 0.f);
  n.Record(5, 0.f);  // mean 0.125
  EXPECT_NEAR(n.Share(3, 2), 0.25 + 0.75 * 0.4 / 0.125, 1e-6);
  EXPECT_NEAR(n.Share(2, 2), 0.25 + 0.75 * 0.1 / 0.125, 1e-6);
  EXPECT_NEAR(n.Share(5, 2), 0.25, 1e-6);
  LayerNeeds none(4);
  none.Record(2, 0.f);
  none.Record(3, 0.f);
  EXPECT_EQ(none.Share(2, 2), 1.0);  // no layer misses anything: the equal share
  // One layer missing 1, nine 0.01: at s = 1 it would take 7.1x; capped at 4, the 6 it leaves
  // for the nine go by their (equal) need: 2/3 each, and the shares still sum to 10.
  LayerNeeds many(12);
  for (uint32_t l = 2; l < 12; ++l) many.Record(l, l == 2 ? 1.f : 0.01f);
  EXPECT_EQ(many.Share(2, 2), LayerNeeds::kMaxShare);
  double sum = 0;
  for (uint32_t l = 2; l < 12; ++l) sum += many.Share(l, 2);
  EXPECT_NEAR(sum, 10.0, 1e-6);
  EXPECT_NEAR(many.Share(7, 2), 6.0 / 9, 1e-6);
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
  const v1::LayerStats before = f.session->Layers()->at(2);
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
  const v1::LayerStats after = f.session->Layers()->at(2);
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
    // An indexed chunk's mean key is kept compact: each adds up to 16 times half its step, the
    // largest magnitude of its mean over 254.
    std::vector<double> slack_k(32, 1e-3);
    for (uint32_t c = 0; c < 40; ++c) {
      if (chosen.count(c)) continue;
      std::vector<double> chunk_k(32, 0.0);
      for (uint32_t t = c * 16; t < c * 16 + 16; ++t) {
        for (int j = 0; j < 32; ++j) {
          chunk_k[j] += HalfToFloat(f.k[2][(size_t(h) * 640 + t) * 32 + j]);
          want_v[j] += HalfToFloat(f.v[2][(size_t(h) * 640 + t) * 32 + j]);
        }
      }
      double top = 0;  // 16 times the largest magnitude of the chunk's mean
      for (int j = 0; j < 32; ++j) top = std::max(top, std::fabs(chunk_k[j]));
      for (int j = 0; j < 32; ++j) {
        want_k[j] += chunk_k[j];
        slack_k[j] += top / 254 + 1e-4;
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
      EXPECT_NEAR(got_k[j], want_k[j], slack_k[j] + 1e-3 * std::abs(want_k[j])) << "channel " << j;
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
  // Another tenant's lease is answered as a lease that does not exist, in the same words.
  const absl::Status foreign = e.leases.Release("other-tenant", resp.lease_id());
  EXPECT_THAT(foreign, StatusIs(Code::kNotFound, "is not a live lease of this tenant"));
  const absl::Status unknown = e.leases.Release("other-tenant", "no-such-lease");
  EXPECT_EQ(foreign.code(), unknown.code());
  EXPECT_EQ(absl::StrReplaceAll(foreign.message(), {{resp.lease_id(), "ID"}}),
            absl::StrReplaceAll(unknown.message(), {{"no-such-lease", "ID"}}));
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

// A lease taken under a worker id ends with the worker, at once, and only its own leases do;
// ids that are not attached, or are another tenant's, get nothing pinned.
TEST(Session, LeasesOfADetachedWorkerEndAtOnce) {
  Env e;
  Fixture f = Make(e, 3, 2, 1, 16, 500);
  ASSERT_OK(AppendAll(f, 500, 500));
  const std::string w = e.leases.Attach("t"), other = e.leases.Attach("u");
  EXPECT_NE(w, other);
  EXPECT_EQ(e.leases.workers(), 2u);
  auto r = SelectReq(f, 2, 128);
  r.set_lease_ms(5000);
  r.set_worker_id(w);
  v1::SelectResponse a, b, plain;
  ASSERT_OK(f.session->Select(r, &a));
  ASSERT_OK(f.session->Select(r, &b));
  auto unattached = SelectReq(f, 2, 128);
  unattached.set_lease_ms(5000);
  ASSERT_OK(f.session->Select(unattached, &plain));
  EXPECT_EQ(f.session->Info().active_leases(), 3u);

  r.set_worker_id(other);
  // Another tenant's worker is answered as one that does not exist, in the same words.
  const absl::Status foreign = f.session->Select(r, &a);
  r.set_worker_id("w-999-0000000000000000");
  const absl::Status unknown = f.session->Select(r, &a);
  EXPECT_THAT(unknown, StatusIs(Code::kNotFound, "is not one of this tenant's attached workers"));
  EXPECT_EQ(foreign.code(), unknown.code());
  EXPECT_EQ(absl::StrReplaceAll(foreign.message(), {{other, "ID"}}),
            absl::StrReplaceAll(unknown.message(), {{"w-999-0000000000000000", "ID"}}));
  EXPECT_EQ(f.session->Info().active_leases(), 3u);

  EXPECT_EQ(e.leases.Detach(w), 2);
  EXPECT_EQ(e.leases.Detach(w), 0);  // idempotent
  EXPECT_EQ(f.session->Info().active_leases(), 1u);
  EXPECT_THAT(e.leases.Release("t", b.lease_id()), StatusIs(Code::kNotFound));
  EXPECT_EQ(e.host.Stats().pinned_bytes, 8u * 1024);  // the unattached lease's 8 slots
  r.set_worker_id(w);
  EXPECT_THAT(f.session->Select(r, &a), StatusIs(Code::kNotFound, "attached workers"));
  // A lease granted to a worker that detached meanwhile is refused and pins nothing.
  std::vector<SlotRef> slots;
  EXPECT_THAT(e.leases.Create("t", "s", slots, 1000, w), StatusIs(Code::kNotFound));
  ASSERT_OK(e.leases.Release("t", plain.lease_id()));
  EXPECT_EQ(e.host.Stats().pinned_bytes, 0u);
  EXPECT_EQ(e.leases.Detach(other), 0);
  EXPECT_EQ(e.leases.workers(), 0u);
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
  auto now = f.session->ListChunks(0, 10)->chunks(2);
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

// Gathered blocks' slots are kept by the session from one Select for the next: a slot whose
// lease ended is written again under a new generation (the tier's slot count stays put over a
// decode loop), a leased one never is, and the session's Close lets the rest go.
TEST(Session, GatheredBlocksReuseTheSlotsOfEndedLeasesOnly) {
  Env e;
  v1::SessionPolicy policy = Lossless();
  policy.set_refine_factor(4);
  const int tokens = 900;
  Fixture f = Make(e, 4, 6, 2, 64, tokens, policy, 31);  // layers 0 and 1 are dense
  ASSERT_OK(AppendAll(f, tokens, 300));
  const uint64_t stored = e.host.Stats().num_slots;
  struct Place {
    uint64_t segment, offset, generation;
    std::string bytes;
  };
  auto gathered = [&](const v1::SelectResponse& r) {
    std::vector<Place> out;
    for (const v1::HeadSelection& h : r.heads()) {
      for (const v1::BlockHandle& b : h.blocks()) {
        if (b.gathered()) {
          out.push_back({b.segment_id(), b.offset(), b.generation(), b.keys() + b.values()});
        }
      }
    }
    return out;
  };
  auto select = [&](uint32_t layer, uint32_t seed) {
    v1::SelectRequest req = SelectReq(f, layer, 160, seed);
    req.set_include_data(true);
    v1::SelectResponse resp;
    EXPECT_OK(f.session->Select(req, &resp));
    return resp;
  };
  auto mapped = [&](const Place& p) {
    for (const auto& seg : e.host.Segments()) {
      if (seg.segment_id != p.segment) continue;
      absl::StatusOr<ShmSegment> m = ShmSegment::OpenReadOnly(seg.shm_name);
      EXPECT_OK(m.status());
      return std::string(reinterpret_cast<const char*>(m->data() + p.offset), p.bytes.size());
    }
    return std::string("no such segment");
  };
  const v1::SelectResponse first = select(2, 4);
  const std::vector<Place> a = gathered(first);
  ASSERT_FALSE(a.empty());
  const uint64_t with_one = e.host.Stats().num_slots;
  EXPECT_EQ(with_one, stored + a.size());
  // While the first lease holds its blocks, another Select's blocks lie elsewhere and the
  // first's bytes stay as they were.
  const v1::SelectResponse second = select(3, 5);
  const std::vector<Place> b = gathered(second);
  ASSERT_FALSE(b.empty());
  for (const Place& x : a) {
    for (const Place& y : b) EXPECT_FALSE(x.segment == y.segment && x.offset == y.offset);
    EXPECT_EQ(mapped(x), x.bytes);
  }
  ASSERT_OK(e.leases.Release("t", first.lease_id()));
  ASSERT_OK(e.leases.Release("t", second.lease_id()));
  // The ended leases' slots stay the session's, for the next Select.
  EXPECT_EQ(e.host.Stats().num_slots, stored + a.size() + b.size());
  // A decode loop: Select, Release, again and again. The blocks come from the same slots, each
  // time under a new generation, and hold each answer's own rows.
  std::set<std::pair<uint64_t, uint64_t>> places;
  for (const Place& x : a) places.insert({x.segment, x.offset});
  for (const Place& x : b) places.insert({x.segment, x.offset});
  std::map<std::pair<uint64_t, uint64_t>, uint64_t> last_generation;
  for (int step = 0; step < 20; ++step) {
    const v1::SelectResponse r = select(2 + step % 2, 6 + step);
    for (const Place& x : gathered(r)) {
      EXPECT_TRUE(places.count({x.segment, x.offset})) << "step " << step;
      EXPECT_EQ(mapped(x), x.bytes);  // the answer's rows are in the slot it names
      uint64_t& g = last_generation[{x.segment, x.offset}];
      EXPECT_NE(x.generation, g);
      g = x.generation;
    }
    EXPECT_LE(e.host.Stats().num_slots, stored + a.size() + b.size());
    ASSERT_OK(e.leases.Release("t", r.lease_id()));
    EXPECT_GE(e.host.Stats().num_slots, stored + gathered(r).size());  // kept, not freed
  }
  f.session->Close();
  EXPECT_EQ(e.host.Stats().num_slots, 0u);
}

TEST(Session, UnsharedPartialChunkGrowsInPlaceWithANewGeneration) {
  Env e;
  Fixture f = Make(e, 1, 2, 1, 16, 100);
  ASSERT_OK(f.session->Append(Req(f, 0, 0, 20)).status());
  auto before = f.session->ListChunks(0, 10)->chunks(1);
  ASSERT_OK(f.session->Append(Req(f, 0, 20, 3)).status());
  auto after = f.session->ListChunks(0, 10)->chunks(1);
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
  EXPECT_EQ(e.device_copies.counters().promotions, 3u);
  ASSERT_OK(f.session->Select(r, &second));  // cached: no new promotion
  EXPECT_EQ(e.device_copies.counters().promotions, 3u);
  // A fourth chunk does not fit: refused, and nothing half-promoted stays.
  ASSERT_OK(f.session->Append(Req(f, 0, 48, 16)).status());
  EXPECT_THAT(f.session->Select(r, &refused), StatusIs(Code::kResourceExhausted, "device"));
  EXPECT_EQ(refused.heads_size(), 0);
  EXPECT_EQ(e.device.Stats().used_bytes, 3u * 1024);
  ASSERT_OK_AND_ASSIGN(uint64_t freed, f.session->Evict(v1::TIER_DEVICE));
  EXPECT_EQ(freed, 3u * 1024);
  EXPECT_EQ(e.device_copies.counters().drops, 3u);
  EXPECT_EQ(e.device.Stats().used_bytes, 3u * 1024);  // the leases still hold the copies
  ASSERT_OK(e.leases.Release("t", first.lease_id()));
  ASSERT_OK(e.leases.Release("t", second.lease_id()));
  EXPECT_EQ(e.device.Stats().used_bytes, 0u);
  EXPECT_THAT(f.session->Evict(v1::TIER_HOST), StatusIs(Code::kFailedPrecondition, "remote"));
  EXPECT_THAT(f.session->Evict(v1::TIER_REMOTE), StatusIs(Code::kInvalidArgument, "tier"));
}

// The same on device memory (the GPU path's CPU twin): promoted copies and gathered rows are
// written to the device through copies and read back inline through copies, exact; a copy
// that fails fails the Select.
TEST(Session, DevicePlacementOnDeviceMemoryCopiesTheExactBytes) {
  auto state = std::make_shared<FakeDeviceState>();
  Env e(64 << 20, 16 << 20, {}, state);
  // Whole fp16 chunks (promotion), refined rows gathered into device blocks, and whole chunks
  // of which the old ones are int4 (moved as stored, dequantized on "the device").
  for (const auto& [refined, int4] : {std::pair{false, false}, {true, false}, {false, true}}) {
    v1::SessionPolicy p = int4 ? WholeContiguousChunks() : Lossless();
    if (refined) p.set_refine_factor(4);
    Fixture f = Make(e, 3, 2, 1, 16, 512, p);  // layer 2: past the dense layers
    ASSERT_OK(AppendAll(f, 512, 512));
    auto r = SelectReq(f, 2, refined ? 160 : 512);
    r.set_placement(v1::TIER_DEVICE);
    v1::SelectResponse resp;
    const int writes = state->writes;
    ASSERT_OK(f.session->Select(r, &resp));
    EXPECT_GT(state->writes, writes);
    ASSERT_GT(resp.heads(0).blocks_size(), 0);
    bool gathered = false;
    for (const auto& b : resp.heads(0).blocks()) {
      EXPECT_EQ(b.tier(), v1::TIER_DEVICE);
      gathered = gathered || b.gathered();
    }
    EXPECT_EQ(gathered, refined);
    // The host placement of the same request: the same rows, the same bytes.
    v1::SelectResponse on_host;
    r.set_placement(v1::TIER_HOST);
    ASSERT_OK(f.session->Select(r, &on_host));
    Gathered dev = Gather(resp.heads(0).blocks()), host = Gather(on_host.heads(0).blocks());
    EXPECT_EQ(dev.pos, host.pos) << (refined ? "refined" : "whole chunks");
    EXPECT_EQ(dev.k, host.k);
    EXPECT_EQ(dev.v, host.v);
    if (!refined && !int4) {
      EXPECT_EQ(dev.k, HeadRows(f.k[2], f, 0, 0, 512));
      EXPECT_EQ(dev.v, HeadRows(f.v[2], f, 0, 0, 512));
    }
    int cold = 0;
    for (const auto& b : resp.heads(0).blocks()) {
      cold += b.stored_precision() == v1::PRECISION_INT4 ? 1 : 0;
    }
    EXPECT_EQ(cold > 0, int4);
    ASSERT_OK(e.leases.Release("t", resp.lease_id()));
    ASSERT_OK(e.leases.Release("t", on_host.lease_id()));
    if (refined) {
      // The whole chunks' device copies are cached now; the gathered blocks are filled anew
      // (in one batch), and a failed fill fails the Select, naming a chunk the rows came from.
      state->fail_copies = true;
      r.set_placement(v1::TIER_DEVICE);
      v1::SelectResponse failed;
      EXPECT_THAT(f.session->Select(r, &failed), StatusIs(Code::kInternal, "promoting chunk"));
      EXPECT_EQ(failed.heads_size(), 0);
      EXPECT_EQ(f.session->live_leases(), 0u);
      state->fail_copies = false;
    }
    ASSERT_OK(f.session->Evict(v1::TIER_DEVICE).status());
  }
  Fixture f = Make(e, 1, 2, 1, 16, 64);
  ASSERT_OK(f.session->Append(Req(f, 0, 0, 64)).status());
  auto r = SelectReq(f, 0, 64);
  r.set_placement(v1::TIER_DEVICE);
  state->fail_copies = true;
  v1::SelectResponse failed;
  EXPECT_THAT(f.session->Select(r, &failed), StatusIs(Code::kInternal, "promoting chunk"));
  EXPECT_EQ(failed.heads_size(), 0);
  EXPECT_EQ(f.session->live_leases(), 0u);
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

// A Select's guess is what a 25% larger budget would add, and its prefetch promotes that: a
// Select with that budget then finds every chunk cached, and the prefetch itself reads nothing
// and counts no Select work. A guess leaves out what is cached already.
TEST(Prefetch, PromotesWhatALargerBudgetWouldAdd) {
  for (auto placement : {v1::TIER_DEVICE, v1::TIER_HOST}) {
    Env e;
    Fixture f = Make(e, 3, 4, 2, 64, 1200, Cold(), 5);
    ASSERT_OK(AppendAll(f, 1200, 300));
    PromotionCache& cache = placement == v1::TIER_DEVICE ? e.device_copies : e.host_copies;
    auto req = SelectReq(f, 2, 256, 7);
    req.set_placement(placement);
    v1::SelectResponse first;
    PrefetchGuess guess;
    ASSERT_OK(f.session->Select(req, &first, nullptr, &guess, 25));
    const uint64_t made_first = cache.counters().misses;
    const auto stats_before = f.session->Layers()->at(2);
    ASSERT_OK_AND_ASSIGN(uint64_t prefetched, f.session->Prefetch(guess));
    EXPECT_GT(prefetched, 0u);
    EXPECT_EQ(cache.counters().prefetched, prefetched);
    EXPECT_EQ(cache.counters().hits, 0u) << "a prefetch is not a read";
    EXPECT_EQ(f.session->Layers()->at(2).select_candidates(), stats_before.select_candidates());
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
        const bool copied =
            placement == v1::TIER_DEVICE || b.stored_precision() == v1::PRECISION_INT4;
        needs_copy += copied && !small.count(b.chunk_id());
      }
    }
    EXPECT_EQ(prefetched, needs_copy);
    EXPECT_TRUE(std::includes(large.begin(), large.end(), small.begin(), small.end()));
    // The guess is exactly the larger choice less the smaller one.
    std::set<uint64_t> guessed;
    for (uint32_t h = 0; h < guess.chunks.size(); ++h) {
      for (uint32_t c : guess.chunks[h]) guessed.insert(EncodeChunkId({2, h, c}));
    }
    std::set<uint64_t> added;
    std::set_difference(large.begin(), large.end(), small.begin(), small.end(),
                        std::inserter(added, added.begin()));
    EXPECT_EQ(guessed, added) << v1::Tier_Name(placement);
    ASSERT_OK(e.leases.Release("t", first.lease_id()));
    ASSERT_OK(e.leases.Release("t", second.lease_id()));
    // The same Select again: every chunk its guess named is cached now, so it names none (and
    // wakes no prefetcher); once the device copies are dropped, it names them again.
    v1::SelectResponse again;
    PrefetchGuess next;
    ASSERT_OK(f.session->Select(req, &again, nullptr, &next, 25));
    ASSERT_OK(e.leases.Release("t", again.lease_id()));
    EXPECT_TRUE(next.empty()) << v1::Tier_Name(placement);
    if (placement == v1::TIER_DEVICE) {
      ASSERT_OK(f.session->Evict(v1::TIER_DEVICE).status());
      ASSERT_OK(f.session->Select(req, &again, nullptr, &next, 25));
      ASSERT_OK(e.leases.Release("t", again.lease_id()));
      std::set<uint64_t> renamed;
      for (uint32_t h = 0; h < next.chunks.size(); ++h) {
        for (uint32_t c : next.chunks[h]) renamed.insert(EncodeChunkId({2, h, c}));
      }
      EXPECT_EQ(renamed, added);
    }
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
  PrefetchGuess guess;
  for (uint32_t seed = 0; seed < 4; ++seed) {
    req.set_query(Query(f, seed));
    v1::SelectResponse resp;
    ASSERT_OK(session->Select(req, &resp, nullptr, &guess, 25));
    ASSERT_OK(e.leases.Release("t", resp.lease_id()));
    ASSERT_FALSE(guess.empty());
    prefetcher.Enqueue(session, guess);
  }
  prefetcher.WaitIdle();
  auto c = prefetcher.counters();
  EXPECT_EQ(c.tasks, 4u);
  EXPECT_EQ(c.failed, 0u);
  EXPECT_EQ(c.copies, e.device_copies.counters().prefetched);
  EXPECT_GT(c.copies, 0u);
  session->Close();
  prefetcher.Enqueue(session, guess);
  prefetcher.WaitIdle();
  EXPECT_EQ(prefetcher.counters().failed, 1u);  // NOT_FOUND, quietly
}

// A session's metadata (chunk records, statistics, index, its streams) is charged to the host
// tier and its tenant: the charge follows the heap the session really holds, as the allocator
// counts it, and is given back whole when the session closes.
TEST(Metadata, TheChargeFollowsTheHeapTheSessionHolds) {
  if (mallinfo2().uordblks == 0) GTEST_SKIP() << "the allocator keeps no counts (a sanitizer's)";
  for (const bool cold : {false, true}) {
    Env e;
    v1::SessionPolicy policy = cold ? v1::SessionPolicy() : Lossless();
    Fixture f = Make(e, 4, 8, 4, 64, 2048, policy);
    f.session.reset();
    ASSERT_EQ(e.host.Stats().metadata_bytes, 0u);
    std::vector<v1::AppendKVRequest> reqs;  // built first: their bytes are the test's
    for (int s = 0; s < 2048; s += 128) {
      for (int l = 0; l < 4; ++l) reqs.push_back(Req(f, l, s, 128));
    }
    const size_t heap0 = mallinfo2().uordblks;
    v1::ModelShape shape;
    shape.set_num_layers(4);
    shape.set_num_q_heads(8);
    shape.set_num_kv_heads(4);
    shape.set_head_dim(64);
    f.session = std::make_unique<Session>("s", "t", *ResolveShape(shape),
                                          *ResolvePolicy(policy, BuiltinPolicy(), "policy"),
                                          std::map<std::string, std::string>{}, e.env);
    for (const auto& r : reqs) ASSERT_OK(f.session->Append(r).status());
    const double heap = double(mallinfo2().uordblks - heap0);
    const double charged = double(e.host.Stats().metadata_bytes);
    EXPECT_EQ(charged, double(f.session->metadata_bytes()));
    std::printf("cold=%d heap %.0f charged %.0f ratio %.3f\n", cold, heap, charged, charged / heap);
    EXPECT_GE(charged, 0.8 * heap);
    EXPECT_LE(charged, 1.25 * heap);
    f.session->Close();
    EXPECT_EQ(e.host.Stats().metadata_bytes, 0u);
    EXPECT_EQ(e.host.TenantUsed("t"), 0u);
  }
}

}  // namespace
}  // namespace kvtier
