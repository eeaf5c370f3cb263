// ChunkStats against sums and peaks computed here in double, and RankStream against the
// linear scan (SelectChunks) over exactly the candidates it should see: neither returned
// anyway (`must`) nor excluded (`skip`), on each of its paths (scan, the index's top-k, the
// index's greedy fill, and the index with candidates it does not hold).
#include "server/index/stream_ranker.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <deque>
#include <functional>
#include <iterator>
#include <limits>
#include <memory>
#include <random>

#include "gtest/gtest.h"
#include "server/common/fp16.h"
#include "server/index/chunk_stats.h"

namespace kvtier {
namespace {

constexpr int kD = 32, kGroup = 2;

std::vector<uint16_t> Rows(uint32_t n, std::mt19937& rng, float center) {
  std::normal_distribution<float> g(center, 1.f);
  std::vector<uint16_t> rows(size_t(n) * kD);
  for (auto& h : rows) h = FloatToHalf(g(rng));
  return rows;
}

TEST(ChunkStats, SumsAndPeaksMatchDoubleArithmetic) {
  std::mt19937 rng(3);
  ChunkStats s(kD);
  const std::vector<uint16_t> a = Rows(5, rng, 0.f), b = Rows(11, rng, 2.f);
  s.AddRows(0, HalfKind::kFp16, a.data(), 5);   // a chunk appended, 5 rows
  s.AddRows(0, HalfKind::kFp16, b.data(), 11);  // grown by 11
  s.AddRows(1, HalfKind::kFp16, b.data(), 11);  // a second chunk
  ASSERT_EQ(s.size(), 2u);
  EXPECT_EQ(s.tokens(0), 16u);
  EXPECT_EQ(s.tokens(1), 11u);
  std::vector<uint16_t> all = a;
  all.insert(all.end(), b.begin(), b.end());
  s.ComputePeak(0, HalfKind::kFp16, all.data());
  std::vector<double> mean(kD, 0.0);
  for (uint32_t r = 0; r < 16; ++r) {
    for (int j = 0; j < kD; ++j) mean[j] += HalfToFloat(all[r * kD + j]);
  }
  for (int j = 0; j < kD; ++j) {
    EXPECT_NEAR(s.key_sum(0)[j], mean[j], 1e-4) << j;
    mean[j] /= 16;
  }
  uint32_t far = 0;
  double most = -1;
  for (uint32_t r = 0; r < 16; ++r) {
    double dist = 0;
    for (int j = 0; j < kD; ++j) dist += std::pow(HalfToFloat(all[r * kD + j]) - mean[j], 2);
    if (dist > most) most = dist, far = r;
  }
  for (int j = 0; j < kD; ++j) EXPECT_EQ(s.peak(0)[j], HalfToFloat(all[far * kD + j])) << j;
  // Recompute from other rows replaces both; the candidate points at them.
  s.Recompute(1, HalfKind::kFp16, a.data(), 5);
  EXPECT_EQ(s.tokens(1), 5u);
  const ChunkCandidate c = s.candidate(1);
  EXPECT_EQ(c.index, 1u);
  EXPECT_EQ(c.tokens, 5u);
  EXPECT_EQ(c.key_sum, s.key_sum(1));
  EXPECT_EQ(c.peak, s.peak(1));
  EXPECT_FLOAT_EQ(c.scale, 0.2f);
  for (int j = 0; j < kD; ++j) {
    double sum = 0;
    for (uint32_t r = 0; r < 5; ++r) sum += HalfToFloat(a[r * kD + j]);
    EXPECT_NEAR(s.key_sum(1)[j], sum, 1e-4) << j;
  }
}

TEST(ChunkStats, FinalChunksNeverChangeAndCopiesStartUnfinal) {
  std::mt19937 rng(4);
  ChunkStats s(kD);
  const std::vector<uint16_t> a = Rows(16, rng, 0.f);
  s.AddRows(0, HalfKind::kFp16, a.data(), 16);
  s.AddRows(1, HalfKind::kFp16, a.data(), 16);
  s.MarkFinal(1);
  EXPECT_EQ(s.final_chunks(), 1u);
  s.AddRows(1, HalfKind::kFp16, a.data(), 1);  // not final: it may grow
  EXPECT_EQ(s.tokens(1), 17u);
  EXPECT_DEATH(s.AddRows(0, HalfKind::kFp16, a.data(), 1), "final");
  EXPECT_DEATH(s.Recompute(0, HalfKind::kFp16, a.data(), 16), "final");
  EXPECT_DEATH(s.MarkFinal(0), "final");  // the mark never goes back
  ChunkStats copy(kD);
  copy.CopyPrefix(s, 2);
  EXPECT_EQ(copy.size(), 2u);
  EXPECT_EQ(copy.final_chunks(), 0u);
  EXPECT_EQ(copy.tokens(1), 17u);
  // The final chunk stays compact in the copy; the other keeps its float sum.
  EXPECT_EQ(copy.compact_chunks(), 1u);
  std::vector<float> m0(kD), m1(kD);
  s.Mean(0, m0.data());
  copy.Mean(0, m1.data());
  EXPECT_EQ(m0, m1);
  EXPECT_TRUE(std::equal(copy.key_sum(1), copy.key_sum(1) + kD, s.key_sum(1)));
  EXPECT_DEATH(copy.AddRows(0, HalfKind::kFp16, a.data(), 1), "final");
}

// Summarize (the aging pool computes it without the stream's lock), stored by Set: the float
// sum of the rows, and as the peak the row farthest from their mean, each against a brute
// force in double.
TEST(ChunkStats, ASummaryIsTheRowsSumAndFarthestRow) {
  std::mt19937 rng(9);
  for (HalfKind kind : {HalfKind::kFp16, HalfKind::kBf16}) {
    for (uint32_t n : {1u, 7u, 16u, 32u}) {
      std::normal_distribution<float> g(0.5f, 2.f);
      std::vector<uint16_t> rows(size_t(n) * kD);
      for (auto& h : rows) h = kind == HalfKind::kFp16 ? FloatToHalf(g(rng)) : FloatToBf16(g(rng));
      auto at = [&](uint32_t r, int j) {
        return double(kind == HalfKind::kFp16 ? HalfToFloat(rows[r * kD + j])
                                              : Bf16ToFloat(rows[r * kD + j]));
      };
      ChunkStats s(kD);
      s.Set(0, ChunkStats::Summarize(kind, rows.data(), n, kD));
      EXPECT_EQ(s.tokens(0), n);
      std::vector<double> sum(kD, 0.0);
      for (uint32_t r = 0; r < n; ++r) {
        for (int j = 0; j < kD; ++j) sum[j] += at(r, j);
      }
      for (int j = 0; j < kD; ++j) EXPECT_NEAR(s.key_sum(0)[j], sum[j], 1e-3) << n << " " << j;
      uint32_t far = 0;
      double far_dist = -1;
      for (uint32_t r = 0; r < n; ++r) {
        double dist = 0;
        for (int j = 0; j < kD; ++j) dist += std::pow(at(r, j) - sum[j] / n, 2);
        if (dist > far_dist) far_dist = dist, far = r;
      }
      for (int j = 0; j < kD; ++j) EXPECT_EQ(double(s.peak(0)[j]), at(far, j)) << n << " " << j;
    }
  }
}

// Chunks marked final a few at a time, as the aging pool marks them, while more are appended:
// every chunk's statistics (compact or loose) and a copy's are those of the same chunks marked
// final all at once.
TEST(ChunkStats, MarkingFinalAFewAtATimeEqualsAllAtOnce) {
  std::mt19937 rng(8);
  ChunkStats stepwise(kD), once(kD);
  std::vector<std::vector<uint16_t>> rows;
  for (uint32_t c = 0; c < 60; ++c) {
    rows.push_back(Rows(16, rng, float(c % 5)));
    for (ChunkStats* s : {&stepwise, &once}) s->Recompute(c, HalfKind::kFp16, rows[c].data(), 16);
    if (c % 3 == 2) stepwise.MarkFinal(stepwise.final_chunks() + (c % 2 == 0 ? 1 : 2));
  }
  once.MarkFinal(stepwise.final_chunks());
  ASSERT_GT(stepwise.final_chunks(), 20u);
  ASSERT_EQ(stepwise.compact_chunks(), once.compact_chunks());
  auto expect_same = [&](const ChunkStats& a, const ChunkStats& b, uint32_t n) {
    std::vector<float> ma(kD), mb(kD), pa(kD), pb(kD);
    for (uint32_t c = 0; c < n; ++c) {
      a.Mean(c, ma.data());
      b.Mean(c, mb.data());
      a.Peak(c, pa.data());
      b.Peak(c, pb.data());
      EXPECT_EQ(ma, mb) << "chunk " << c;
      EXPECT_EQ(pa, pb) << "chunk " << c;
      EXPECT_EQ(a.tokens(c), b.tokens(c));
    }
  };
  expect_same(stepwise, once, 60);
  stepwise.AddRows(59, HalfKind::kFp16, rows[0].data(), 3);  // a loose chunk still grows
  once.AddRows(59, HalfKind::kFp16, rows[0].data(), 3);
  expect_same(stepwise, once, 60);
  ChunkStats a(kD), b(kD);
  a.CopyPrefix(stepwise, 50);
  b.CopyPrefix(once, 50);
  expect_same(a, b, 50);
}

// LooseFloats against a deque of vectors under random pushes, writes and pops: every chunk's
// floats where they were written (none moved or overwritten by another chunk's), the blocks
// held at most those the chunks held touch, and GrowthBytes what pushes then take.
TEST(LooseFloats, HoldsEachChunksFloatsThroughPushesAndPops) {
  constexpr int kWidth = 5;  // not a divisor of anything
  std::mt19937 rng(11);
  LooseFloats loose(kWidth), copy(kWidth);
  std::deque<std::vector<float>> model;
  float next = 1.f;
  size_t most = 0;  // the most blocks the chunks held have touched
  for (int step = 0; step < 4000; ++step) {
    const uint32_t op = rng() % 10;
    if (op < 6) {
      const size_t more = 1 + rng() % 3, bytes = loose.MemoryBytes();
      const size_t growth = loose.GrowthBytes(more);  // what the pushes will take, exactly
      for (size_t i = 0; i < more; ++i) {
        loose.PushZero();
        model.emplace_back(kWidth, 0.f);
        if (op < 4) {  // written after the push, as Recompute and AddSummed write
          for (int j = 0; j < kWidth; ++j) model.back()[j] = loose.at(model.size() - 1)[j] = next++;
        }
      }
      ASSERT_EQ(loose.MemoryBytes(), bytes + growth) << more << " pushed at step " << step;
    } else if (op < 9 && !model.empty()) {
      const size_t n = rng() % (std::min<size_t>(model.size(), 20) + 1);
      loose.PopFront(n);
      model.erase(model.begin(), model.begin() + static_cast<ptrdiff_t>(n));
    } else {
      const size_t n = model.empty() ? 0 : rng() % (model.size() + 1);
      copy.AssignPrefix(loose, n);
      ASSERT_EQ(copy.size(), n);
      for (size_t i = 0; i < n; ++i) {
        ASSERT_EQ(std::vector<float>(copy.at(i), copy.at(i) + kWidth), model[i]) << i;
      }
    }
    ASSERT_EQ(loose.size(), model.size());
    for (size_t i = 0; i < model.size(); ++i) {
      ASSERT_EQ(std::vector<float>(loose.at(i), loose.at(i) + kWidth), model[i])
          << "chunk " << i << " at step " << step;
    }
    // The blocks the chunks touch, and the pointers' array (at most twice the most blocks, and
    // 4 at least).
    const size_t blocks =
        (model.size() + 2 * LooseFloats::kBlockChunks - 2) / LooseFloats::kBlockChunks;
    most = std::max(most, blocks);
    ASSERT_LE(loose.MemoryBytes(), blocks * LooseFloats::kBlockChunks * kWidth * sizeof(float) +
                                       std::max<size_t>(2 * most, 4) * sizeof(void*))
        << model.size() << " chunks";
  }
  loose.PopFront(loose.size());
  EXPECT_EQ(loose.MemoryBytes(), 0u);
}

// A final chunk is held compact: its mean and its peak each as bytes times one scale, the
// largest magnitude over 127, every value within half a step of the float it was (the mean
// from the float sum, the peak the row itself); the candidate then points at the bytes, and
// scores as the float one did to that rounding.
TEST(ChunkStats, FinalChunksAreBytesWithinHalfAStep) {
  for (HalfKind kind : {HalfKind::kFp16, HalfKind::kBf16}) {
    std::mt19937 rng(5);
    std::normal_distribution<float> g(1.f, 3.f);
    std::vector<uint16_t> rows(size_t(16) * kD);
    for (auto& h : rows) h = kind == HalfKind::kFp16 ? FloatToHalf(g(rng)) : FloatToBf16(g(rng));
    rows[3 * kD + 7] = kind == HalfKind::kFp16 ? FloatToHalf(-40.f) : FloatToBf16(-40.f);
    auto widen = [&](uint16_t h) {
      return kind == HalfKind::kFp16 ? HalfToFloat(h) : Bf16ToFloat(h);
    };
    ChunkStats s(kD);
    s.Recompute(0, kind, rows.data(), 16);
    s.Recompute(1, kind, rows.data(), 16);
    const ChunkCandidate loose = s.candidate(0);
    const std::vector<float> peak(s.peak(0), s.peak(0) + kD);
    const auto q = std::vector<float>(kGroup * kD, 0.5f);
    const float loose_score = LsePeakScore(q, kGroup, loose, kD);
    s.MarkFinal(1);
    EXPECT_EQ(s.compact_chunks(), 1u);
    const ChunkCandidate c = s.candidate(0);
    ASSERT_NE(c.mean_q, nullptr);
    ASSERT_NE(c.peak_q, nullptr);
    EXPECT_EQ(c.key_sum, nullptr);
    EXPECT_EQ(c.tokens, 16u);
    std::vector<double> want_mean(kD, 0.0);
    for (int j = 0; j < kD; ++j) {
      for (int r = 0; r < 16; ++r) want_mean[j] += widen(rows[r * kD + j]);
      want_mean[j] /= 16;
    }
    double mean_top = 0, peak_top = 0;
    for (int j = 0; j < kD; ++j) {
      mean_top = std::max(mean_top, std::fabs(want_mean[j]));
      peak_top = std::max(peak_top, double(std::fabs(peak[j])));
    }
    EXPECT_NEAR(c.mean_scale, mean_top / 127, 1e-5 * mean_top);
    EXPECT_FLOAT_EQ(c.peak_scale, float(peak_top / 127));
    EXPECT_EQ(peak_top, 40.0);  // the farthest row holds the outlier
    std::vector<float> mean(kD), got_peak(kD);
    s.Mean(0, mean.data());
    s.Peak(0, got_peak.data());
    for (int j = 0; j < kD; ++j) {
      EXPECT_LE(std::fabs(mean[j] - want_mean[j]), 0.5 * mean_top / 127 + 1e-5 * mean_top) << j;
      EXPECT_LE(std::fabs(got_peak[j] - peak[j]), 0.5 * peak_top / 127 + 1e-6 * peak_top) << j;
      EXPECT_EQ(float(c.mean_q[j]) * c.mean_scale, mean[j]);
      EXPECT_EQ(float(c.peak_q[j]) * c.peak_scale, got_peak[j]);
    }
    // Each dot product moves by at most |q|_1 times half a step.
    const double q1 = 0.5 * kD, slack = q1 * 0.5 * (mean_top + peak_top) / 127 / std::sqrt(kD);
    EXPECT_NEAR(LsePeakScore(q, kGroup, c, kD), loose_score, slack + 1e-3);
    EXPECT_DEATH(s.key_sum(0), "compact");
    EXPECT_NE(s.candidate(1).key_sum, nullptr);  // not final: floats still
  }
}

// Statistics past the float range or not numbers (a damaged record's rows) still narrow to
// defined bytes: infinity as the largest float, NaN as 0.
TEST(ChunkStats, NonFiniteStatisticsNarrowToDefinedBytes) {
  ChunkStats s(kD);
  std::vector<float> sum(kD, 1.f), peak(kD, 2.f);
  sum[3] = std::numeric_limits<float>::quiet_NaN();
  peak[5] = std::numeric_limits<float>::infinity();
  s.Append(1, sum.data(), peak.data());
  s.MarkFinal(1);
  const ChunkCandidate c = s.candidate(0);
  EXPECT_EQ(c.mean_q[3], 0);
  EXPECT_EQ(c.mean_q[0], 127);
  EXPECT_FLOAT_EQ(c.mean_scale, 1.f / 127);
  EXPECT_EQ(c.peak_q[5], 127);
  EXPECT_EQ(c.peak_q[0], 0);  // 2 against the largest float
  EXPECT_FLOAT_EQ(c.peak_scale, std::numeric_limits<float>::max() / 127);
}

// An all-zero chunk is compact with a zero scale, and scores as its floats do.
TEST(ChunkStats, ZeroChunkIsCompactZeros) {
  ChunkStats s(kD);
  std::vector<uint16_t> rows(size_t(4) * kD, FloatToHalf(0.f));
  s.Recompute(0, HalfKind::kFp16, rows.data(), 4);
  s.MarkFinal(1);
  const ChunkCandidate c = s.candidate(0);
  EXPECT_EQ(c.mean_scale, 0.f);
  EXPECT_EQ(c.peak_scale, 0.f);
  const auto q = std::vector<float>(kGroup * kD, 1.f);
  EXPECT_FLOAT_EQ(LsePeakScore(q, kGroup, c, kD), std::log(4.f));
}

// A stream's statistics, random: chunks of `size(c)` tokens around 24 directions.
ChunkStats RandomStats(uint32_t chunks, std::mt19937& rng,
                       const std::function<uint32_t(uint32_t)>& size) {
  std::normal_distribution<float> g(0, 1);
  std::vector<float> dirs(24 * kD);
  for (auto& x : dirs) x = g(rng);
  ChunkStats s(kD);
  std::vector<float> sum(kD), peak(kD);
  for (uint32_t c = 0; c < chunks; ++c) {
    const uint32_t n = size(c);
    const int dir = int(rng() % 24);
    for (int j = 0; j < kD; ++j) {
      sum[j] = float(n) * (dirs[dir * kD + j] + 0.3f * g(rng));
      peak[j] = dirs[dir * kD + j] + g(rng);
    }
    s.Append(n, sum.data(), peak.data());
  }
  s.MarkFinal(chunks);
  return s;
}

std::vector<float> Query(std::mt19937& rng) {
  std::normal_distribution<float> g(0, 1.5f);
  std::vector<float> q(kGroup * kD);
  for (auto& x : q) x = g(rng);
  return q;
}

// The expectation: `must`, then the scan over the other chunks not skipped, within what is
// left of the budget; ascending.
std::vector<uint32_t> Expected(v1::Ranking ranking, const ChunkStats& s,
                               const std::vector<float>& q, uint64_t budget,
                               const std::vector<bool>& must, const std::vector<bool>& skip) {
  std::vector<ChunkCandidate> cands;
  std::vector<uint32_t> out;
  for (uint32_t c = 0; c < s.size(); ++c) {
    if (must[c]) {
      out.push_back(c);
      budget -= s.tokens(c);
    } else if (!skip[c]) {
      cands.push_back(s.candidate(c));
    }
  }
  for (uint32_t c : SelectChunks(ranking, q, kGroup, kD, cands, budget)) out.push_back(c);
  std::sort(out.begin(), out.end());
  return out;
}

struct Case {
  const char* name;
  uint32_t chunks;
  bool uniform;  // every chunk 16 tokens, else 8 to 32
  int indexed;   // 0: no index; 1: every chunk; 2: nine in ten (the rest scored beside it)
};

class RankStreamTest : public ::testing::TestWithParam<Case> {};

TEST_P(RankStreamTest, EqualsTheScanOverTheCandidates) {
  const Case p = GetParam();
  std::mt19937 rng(p.chunks + p.indexed);
  const ChunkStats s = RandomStats(
      p.chunks, rng, [&](uint32_t) { return p.uniform ? 16u : 8u + uint32_t(rng() % 25); });
  std::unique_ptr<ClusterIndex> index;
  if (p.indexed > 0) {
    index = std::make_unique<ClusterIndex>(kD);
    for (uint32_t c = 0; c < s.size(); ++c) {
      if (p.indexed == 1 || c % 10 != 3) index->Add(c, s);
    }
  }
  for (int trial = 0; trial < 6; ++trial) {
    const std::vector<float> q = Query(rng);
    std::vector<bool> must(s.size(), false), skip(s.size(), false);
    uint64_t must_tokens = 0;
    for (uint32_t c = 0; c < s.size(); ++c) {
      // Sinks and a recent window, as a session keeps them; some skipped when asked.
      must[c] = c < 2 || c + 4 >= s.size();
      must_tokens += must[c] ? s.tokens(c) : 0;
      skip[c] = !must[c] && trial % 2 == 1 && c % 7 == 0;
    }
    for (v1::Ranking ranking : {v1::RANKING_LSE_PEAK, v1::RANKING_MEAN}) {
      for (uint64_t extra : {0u, 64u, 512u}) {
        RankQuery query{.ranking = ranking,
                        .queries = q,
                        .group = kGroup,
                        .budget = must_tokens + extra,
                        .must = &must,
                        .skip = trial % 2 == 1 ? &skip : nullptr,
                        .chunk_tokens = 16};
        const RankResult r = RankStream(s, index.get(), query);
        const std::vector<bool> none(s.size(), false);
        EXPECT_EQ(r.chunks,
                  Expected(ranking, s, q, must_tokens + extra, must, trial % 2 == 1 ? skip : none))
            << p.name << " trial " << trial << " extra " << extra;
        uint64_t candidates = 0;
        for (uint32_t c = 0; c < s.size(); ++c) {
          candidates += !must[c] && !(trial % 2 == 1 && skip[c]);
        }
        EXPECT_EQ(r.candidates, candidates);
        EXPECT_LE(r.scored, r.candidates);
        // The scan scores every candidate; the index's top-k search prunes. The index is
        // searched only with many candidates and few of them to find (512 tokens: 32 of 2600
        // chunks, too many).
        const bool searched = p.indexed > 0 && IndexPays(r.candidates, extra / 16);
        if (!searched) {
          EXPECT_EQ(r.scored, r.candidates) << p.name << " extra " << extra;
        } else if (p.uniform && p.indexed == 1) {
          EXPECT_LT(r.scored, r.candidates) << p.name;
        }
        if (p.indexed > 0 && p.chunks == 2600) {
          EXPECT_EQ(searched, extra < 512) << p.name;
        }
        // A prefetch's guess beside it: the same chunks, and as extra what the larger budget
        // chooses beyond them (none where the index's greedy fill serves).
        RankQuery deeper = query;
        deeper.extra_budget = 100;
        const RankResult g = RankStream(s, index.get(), deeper);
        EXPECT_EQ(g.chunks, r.chunks) << p.name << " trial " << trial << " extra " << extra;
        std::vector<uint32_t> added;
        const bool greedy_index =
            p.indexed > 0 && !p.uniform && IndexPays(r.candidates, (extra + 100) / 16);
        if (!greedy_index) {
          const std::vector<uint32_t> wider = Expected(ranking, s, q, must_tokens + extra + 100,
                                                       must, trial % 2 == 1 ? skip : none);
          std::set_difference(wider.begin(), wider.end(), r.chunks.begin(), r.chunks.end(),
                              std::back_inserter(added));
          if (p.uniform) {
            EXPECT_EQ(added.size(), 100u / 16) << p.name;
          }
        }
        EXPECT_EQ(g.extra, added) << p.name << " trial " << trial << " extra " << extra;
      }
    }
  }
}

// Chunks of equal statistics score alike: the lower index wins each tie, in the scan's picks
// and in its guess alike (FillGreedy's order), and the rest are what a larger budget adds.
TEST(RankStreamTies, TheLowerIndexWins) {
  std::mt19937 rng(11);
  std::normal_distribution<float> g(0, 1);
  std::vector<float> a(kD), b(kD), peak(kD);
  for (int j = 0; j < kD; ++j) a[j] = 16 * g(rng), b[j] = 16 * g(rng), peak[j] = g(rng);
  ChunkStats s(kD);
  constexpr uint32_t kChunks = 120;
  for (uint32_t c = 0; c < kChunks; ++c) s.Append(16, (c % 3 == 1 ? b : a).data(), peak.data());
  s.MarkFinal(kChunks);
  std::vector<bool> must(kChunks, false);
  must[0] = must[kChunks - 1] = true;
  const std::vector<float> q = Query(rng);
  for (uint64_t picks : {1u, 5u, 40u, 64u, 70u}) {
    RankQuery query{.ranking = v1::RANKING_LSE_PEAK,
                    .queries = q,
                    .group = kGroup,
                    .budget = 32 + 16 * picks,
                    .must = &must,
                    .chunk_tokens = 16,
                    .extra_budget = 16 * 7};
    const RankResult r = RankStream(s, nullptr, query);
    const std::vector<bool> none(kChunks, false);
    EXPECT_EQ(r.chunks, Expected(v1::RANKING_LSE_PEAK, s, q, query.budget, must, none)) << picks;
    std::vector<uint32_t> wider = Expected(v1::RANKING_LSE_PEAK, s, q, query.budget + 16 * 7, must,
                                           none),
                          added;
    std::set_difference(wider.begin(), wider.end(), r.chunks.begin(), r.chunks.end(),
                        std::back_inserter(added));
    EXPECT_EQ(r.extra, added) << picks;
    EXPECT_EQ(added.size(), 7u) << picks;
  }
}

INSTANTIATE_TEST_SUITE_P(Paths, RankStreamTest,
                         ::testing::Values(Case{"scan, no index", 300, true, 0},
                                           Case{"scan, few candidates", 300, true, 1},
                                           Case{"index top-k", 2600, true, 1},
                                           Case{"index top-k with extras", 2600, true, 2},
                                           Case{"index greedy fill", 2600, false, 1},
                                           Case{"index greedy fill with extras", 2600, false, 2},
                                           Case{"scan, chunks of many sizes", 300, false, 1}),
                         [](const ::testing::TestParamInfo<Case>& info) {
                           std::string n = info.param.name;
                           std::replace_if(
                               n.begin(), n.end(), [](char c) { return !std::isalnum(c); }, '_');
                           return n;
                         });

}  // namespace
}  // namespace kvtier
