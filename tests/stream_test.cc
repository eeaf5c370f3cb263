// Streams: how appended rows fall into chunks (contiguous and boundary chunking), copy on
// write, lookups, and the statistics and index a stream keeps in step with its chunks.
#include "server/session/stream.h"

#include "server/common/fp16.h"
#include "tests/session_fixture.h"

namespace kvtier {
namespace {

using namespace ::kvtier::testing;

// Row offsets in one byte each below 256 and in two from there, found by binary search, copied
// deeply, and counted as the bytes they ask for.
TEST(RowOffsets, OneByteEachBelow256AndTwoFromThere) {
  EXPECT_TRUE(RowOffsets().empty());
  EXPECT_EQ(RowOffsets().AllocatedBytes(), 0u);
  for (uint32_t step : {7u, 300u}) {
    std::vector<uint32_t> rows;
    for (uint32_t r = 0; r < 32; ++r) rows.push_back(3 + r * step);
    const RowOffsets o(rows);
    ASSERT_EQ(o.size(), 32u);
    const size_t width = rows.back() < 256 ? 1 : 2;
    EXPECT_EQ(o.AllocatedBytes(), 2 + 32 * width) << step;
    EXPECT_EQ(o.AllocatedBytes(), RowOffsets::AllocatedBytes(32, rows.back() + 1));
    for (uint32_t r = 0; r < 32; ++r) {
      EXPECT_EQ(o[r], rows[r]);
      EXPECT_EQ(o.Find(rows[r]), r);
      EXPECT_EQ(o.Find(rows[r] + 1), -1);  // between two rows, or past the last
    }
    EXPECT_EQ(o.Find(0), -1);
    RowOffsets copy(o);
    EXPECT_EQ(copy, o);
    rows[5] += 1;
    EXPECT_NE(RowOffsets(rows), o);
    copy = RowOffsets();
    EXPECT_TRUE(copy.empty());
    EXPECT_EQ(o.size(), 32u);  // the copy owned its own bytes
  }
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
  const v1::LayerStats st = f.session->Layers()->at(2);
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

// A stream on its own, rows of head_dim 8 in slots of 16.
struct StreamEnv {
  Tier host{TierOpts(v1::TIER_HOST, 1 << 20)};
  ChunkFormat f{.head_dim = 8, .dtype = v1::DTYPE_FP16, .capacity = 16};
  std::mt19937 rng{5};
  std::vector<uint16_t> k = RandomHalfs(64 * 8, rng), v = RandomHalfs(64 * 8, rng);
  std::function<SlotRef()> slot = [this] { return *host.Allocate("t", f.slot_bytes()); };
  // Rows [from, to) of k and v appended to `s`.
  void Append(Stream& s, uint64_t from, uint64_t to) {
    const AppendPlan plan =
        PlanAppend(s, from, to, [](uint32_t rows, uint64_t) { return rows >= 16; });
    s.Write(plan, reinterpret_cast<const uint8_t*>(&k[from * 8]),
            reinterpret_cast<const uint8_t*>(&v[from * 8]), from, f, slot);
  }
  // The sum of key rows [from, to), in double.
  std::vector<double> KeySum(uint64_t from, uint64_t to) const {
    std::vector<double> sum(8, 0.0);
    for (uint64_t t = from; t < to; ++t) {
      for (int j = 0; j < 8; ++j) sum[j] += HalfToFloat(k[t * 8 + j]);
    }
    return sum;
  }
};

// Every chunk's statistics describe its rows: its token count and the mean of its keys (to the
// rounding of a compact mean once the chunk is final).
void ExpectStatsFollowRows(const StreamEnv& e, const Stream& s) {
  ASSERT_EQ(s.stats().size(), s.chunks().size());
  std::vector<float> mean(8);
  for (uint32_t c = 0; c < s.chunks().size(); ++c) {
    const Chunk& ch = s.chunks()[c];
    EXPECT_EQ(s.stats().tokens(c), ch.num_tokens) << c;
    const std::vector<double> want = e.KeySum(ch.first, ch.first + ch.num_tokens);
    s.stats().Mean(c, mean.data());
    double top = 0;  // a compact mean is within half a step, 1/254 of its largest magnitude
    for (int j = 0; j < 8; ++j) top = std::max(top, std::fabs(want[j] / ch.num_tokens));
    for (int j = 0; j < 8; ++j) {
      const double m = want[j] / ch.num_tokens;
      EXPECT_NEAR(mean[j], m, 1e-4 + (s.stats().compact(c) ? top / 254 : 0.0)) << c;
    }
  }
}

TEST(Stream, WritesGrowAndCopyOnWriteKeepRowsStatsAndLookupsInStep) {
  StreamEnv e;
  Stream s(8);
  e.Append(s, 0, 20);  // one full chunk, sealed, and 4 rows of an open one
  ASSERT_EQ(s.chunks().size(), 2u);
  EXPECT_TRUE(s.chunks()[0].sealed);
  EXPECT_FALSE(s.chunks()[1].sealed);
  EXPECT_EQ(s.chunks()[1].first, 16u);
  ExpectStatsFollowRows(e, s);
  EXPECT_EQ(s.Locate(17), (std::pair<uint32_t, uint32_t>{1, 1}));
  const auto* k = reinterpret_cast<const uint8_t*>(e.k.data());
  const auto* v = reinterpret_cast<const uint8_t*>(e.v.data());
  EXPECT_EQ(s.FirstMismatch(0, 20, k, v, e.f), std::nullopt);
  std::vector<uint16_t> other = e.v;
  other[13 * 8 + 2] ^= 1;
  EXPECT_EQ(s.FirstMismatch(0, 20, k, reinterpret_cast<const uint8_t*>(other.data()), e.f), 13u);

  // Nobody else holds the open chunk: it grows in place, under a new generation.
  const Slot* before = s.chunks()[1].host.get();
  const uint64_t generation = before->generation();
  const AppendPlan grow = PlanAppend(s, 20, 25, [](uint32_t rows, uint64_t) { return rows >= 16; });
  EXPECT_TRUE(grow.grow);
  EXPECT_FALSE(s.CopiesOnGrow(grow));
  e.Append(s, 20, 25);
  EXPECT_EQ(s.chunks()[1].host.get(), before);
  EXPECT_NE(s.chunks()[1].host->generation(), generation);
  ExpectStatsFollowRows(e, s);

  // A lease (here: this reference) holds it: the next rows go into a copy, and the held slot
  // keeps the 9 rows it had, K then V.
  const SlotRef held = s.chunks()[1].host;
  EXPECT_TRUE(s.CopiesOnGrow(PlanAppend(s, 25, 28, [](uint32_t r, uint64_t) { return r >= 16; })));
  e.Append(s, 25, 28);
  EXPECT_NE(s.chunks()[1].host, held);
  EXPECT_EQ(std::memcmp(held->data(), &e.k[16 * 8], 9 * 16), 0);
  EXPECT_EQ(std::memcmp(held->data() + 9 * 16, &e.v[16 * 8], 9 * 16), 0);
  EXPECT_EQ(s.FirstMismatch(0, 28, k, v, e.f), std::nullopt);
  ExpectStatsFollowRows(e, s);

  EXPECT_EQ(s.ChunksEndingBy(15), 0u);
  EXPECT_EQ(s.ChunksEndingBy(16), 1u);
  EXPECT_EQ(s.ChunksEndingBy(27), 1u);
  EXPECT_EQ(s.ChunksEndingBy(28), 2u);
  uint64_t tokens = 0;
  EXPECT_EQ(s.Kept(4, 30, &tokens), (std::vector<bool>{true, false}));  // a sink row
  EXPECT_EQ(tokens, 16u);
  EXPECT_EQ(s.Kept(0, 20, &tokens), (std::vector<bool>{false, true}));  // in the window
  EXPECT_EQ(tokens, 12u);
}

// Land copies rows where they will be stored and checks them there; a non-finite value (in
// the rows that grow the open chunk, or in a new chunk's) leaves the stream exactly as it was,
// and Take then appends what Land made, as Write does.
TEST(Stream, LandChecksWhatItCopiedAndChangesNothingUntilTake) {
  StreamEnv e;
  Stream s(8);
  e.Append(s, 0, 20);  // a full chunk and 4 rows of an open one
  const auto* k = reinterpret_cast<const uint8_t*>(e.k.data());
  const auto* v = reinterpret_cast<const uint8_t*>(e.v.data());
  const AppendPlan plan = PlanAppend(s, 20, 52, [](uint32_t rows, uint64_t) { return rows >= 16; });
  ASSERT_TRUE(plan.grow);
  ASSERT_EQ(plan.new_chunks(), 2u);  // 12 rows grow the open chunk, then 20 rows: 16 and 4
  const std::vector<uint8_t> open_before(s.chunks()[1].host->data(),
                                         s.chunks()[1].host->data() + e.f.slot_bytes());
  for (const uint64_t bad_row : {21, 33}) {  // in the grow rows; in the first new chunk
    for (const bool in_values : {false, true}) {
      std::vector<uint16_t> kk = e.k, vv = e.v;
      (in_values ? vv : kk)[bad_row * 8 + 3] = 0x7e00;  // fp16 NaN
      LandedRows rows;
      EXPECT_FALSE(s.Land(plan, reinterpret_cast<const uint8_t*>(&kk[20 * 8]),
                          reinterpret_cast<const uint8_t*>(&vv[20 * 8]), 20, e.f, e.slot, &rows));
      ASSERT_EQ(s.chunks().size(), 2u);
      EXPECT_EQ(s.chunks()[1].num_tokens, 4u);
      EXPECT_EQ(std::memcmp(s.chunks()[1].host->data(), open_before.data(), open_before.size()), 0);
      EXPECT_EQ(s.stats().size(), 2u);
      ExpectStatsFollowRows(e, s);
    }
  }
  LandedRows rows;
  ASSERT_TRUE(s.Land(plan, k + 20 * 16, v + 20 * 16, 20, e.f, e.slot, &rows));
  EXPECT_EQ(rows.chunks.size(), 2u);
  EXPECT_EQ(rows.grow.size(), 2u * 12 * 16);
  EXPECT_EQ(s.chunks().size(), 2u);
  s.Take(plan, std::move(rows), e.f, e.slot);
  ASSERT_EQ(s.chunks().size(), 4u);
  EXPECT_EQ(s.chunks()[1].num_tokens, 16u);
  EXPECT_EQ(s.chunks()[3].first, 48u);
  EXPECT_EQ(s.FirstMismatch(0, 52, k, v, e.f), std::nullopt);
  ExpectStatsFollowRows(e, s);
}

// Kept looks only at the stream's two ends; it must find what a look at every chunk finds,
// over contiguous chunks, a regrouped span (chunks sharing their span's first position, rows
// interleaved) and a partial last chunk, for every sink end and window start.
TEST(Stream, KeptEqualsALookAtEveryChunk) {
  StreamEnv e;
  Stream s(8);
  auto add = [&](uint64_t first, std::vector<uint32_t> offsets, uint32_t n) {
    Chunk c;
    c.host = e.slot();
    c.first = first;
    c.num_tokens = static_cast<uint16_t>(n);
    c.offsets = RowOffsets(offsets);
    c.sealed = true;
    std::memcpy(c.host->data(), &e.k[0], n * 16);
    std::memcpy(c.host->data() + n * 16, &e.v[0], n * 16);
    s.Restore(std::move(c), e.f);
  };
  add(0, {}, 16);  // contiguous [0, 16)
  // A span [16, 64) regrouped into three chunks of 16 rows, taken every third row.
  for (uint32_t g = 0; g < 3; ++g) {
    std::vector<uint32_t> rows;
    for (uint32_t r = g; r < 48; r += 3) rows.push_back(r);
    add(16, rows, 16);
  }
  add(64, {}, 16);
  add(80, {}, 5);  // partial
  for (uint64_t sink_end = 0; sink_end <= 90; ++sink_end) {
    for (uint64_t window_start = 0; window_start <= 90; ++window_start) {
      std::vector<bool> want(s.chunks().size(), false);
      uint64_t want_tokens = 0, want_rows = 0;
      for (uint32_t c = 0; c < s.chunks().size(); ++c) {
        const Chunk& ch = s.chunks()[c];
        for (uint32_t r = 0; r < ch.num_tokens; ++r) {
          const bool kept_row = IsKeptPosition(ch.position(r), sink_end, window_start);
          want_rows += kept_row ? 1 : 0;
          want[c] = want[c] || ch.position(r) < sink_end || ch.position(r) >= window_start;
        }
        want_tokens += want[c] ? ch.num_tokens : 0;
      }
      uint64_t tokens = 0, rows = 0;
      ASSERT_EQ(s.Kept(sink_end, window_start, &tokens, &rows), want)
          << "sink_end " << sink_end << " window_start " << window_start;
      ASSERT_EQ(tokens, want_tokens);
      ASSERT_EQ(rows, want_rows);
    }
  }
}

TEST(Stream, OnlyFinalChunksBeyondTheSinksEnterTheIndex) {
  StreamEnv e;
  Stream s(8);
  e.Append(s, 0, 64);
  s.Finalize(3, /*sink_tokens=*/16, v1::RANKING_LSE_PEAK);
  ASSERT_NE(s.index(), nullptr);
  EXPECT_EQ(s.stats().final_chunks(), 3u);
  EXPECT_FALSE(s.index()->contains(0));  // a sink
  EXPECT_TRUE(s.index()->contains(1));
  EXPECT_TRUE(s.index()->contains(2));
  EXPECT_FALSE(s.index()->contains(3));
  s.Finalize(2, 16, v1::RANKING_LSE_PEAK);  // fewer: nothing changes
  EXPECT_EQ(s.stats().final_chunks(), 3u);
  s.Finalize(4, 16, v1::RANKING_LSE_PEAK);
  EXPECT_TRUE(s.index()->contains(3));
  EXPECT_EQ(s.index()->num_chunks(), 3u);
  EXPECT_EQ(s.index()->CheckInvariants(s.stats()), "");
  // A final chunk's rows never change: its bounds in the index would no longer hold.
  Chunk same = s.chunks()[1];
  std::vector<uint16_t> rows(2 * 16 * 8);
  EXPECT_DEATH(s.Replace(1, same, ChunkStats::Summarize(HalfKind::kFp16, rows.data(), 16, 8)),
               "final");
}

TEST(Stream, ForkSharesThePrefixAndCopiesTheRestIntoNewChunks) {
  StreamEnv e;
  Stream src(8);
  e.Append(src, 0, 48);
  src.Finalize(3, 0, v1::RANKING_LSE_PEAK);
  Stream child(8);
  child.ForkFrom(src, /*keep=*/2, /*from=*/32, /*to=*/40, /*piece=*/16, /*seal_rows=*/16, e.f,
                 e.slot);
  ASSERT_EQ(child.chunks().size(), 3u);
  EXPECT_EQ(child.chunks()[0].host, src.chunks()[0].host);  // shared, not copied
  EXPECT_EQ(child.chunks()[1].host, src.chunks()[1].host);
  const Chunk& copied = child.chunks()[2];
  EXPECT_NE(copied.host, src.chunks()[2].host);
  EXPECT_EQ(copied.first, 32u);
  EXPECT_EQ(copied.num_tokens, 8u);
  EXPECT_FALSE(copied.sealed);  // 8 rows of 16
  EXPECT_EQ(std::memcmp(copied.host->data(), &e.k[32 * 8], 8 * 16), 0);
  EXPECT_EQ(std::memcmp(copied.host->data() + 8 * 16, &e.v[32 * 8], 8 * 16), 0);
  // The shared chunks' statistics come along, not yet final here: the child's own index
  // takes them in.
  EXPECT_EQ(child.stats().final_chunks(), 0u);
  EXPECT_EQ(child.index(), nullptr);
  for (uint32_t c = 0; c < 2; ++c) {
    std::vector<float> a(8), b(8);
    child.stats().Mean(c, a.data());
    src.stats().Mean(c, b.data());
    EXPECT_EQ(a, b) << c;
  }
  ExpectStatsFollowRows(e, child);
}

}  // namespace
}  // namespace kvtier
