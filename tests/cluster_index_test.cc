#include "server/index/cluster_index.h"

#include <algorithm>
#include <cmath>
#include <random>
#include <set>

#include "gtest/gtest.h"
#include "server/index/chunk_ranker.h"
#include "server/index/chunk_stats.h"

namespace kvtier {
namespace {

constexpr int kD = 64, kT = 16, kGroup = 3;

// Chunks of 16 keys each with the session's statistics: key sums and the key farthest from
// the mean, in a ChunkStats (final, so compact: bytes times a scale) for the index, and as
// floats here. The linear scan reads the ChunkStats, as a stream's ranking does.
struct Stream {
  explicit Stream(int d = kD) : d(d), stats(d) {}
  int d;
  std::vector<float> sums, peaks;
  std::vector<uint32_t> tokens;
  ChunkStats stats;

  void Push(const std::vector<float>& keys, uint32_t n) {  // keys [n][d]
    std::vector<float> sum(d, 0.f), mean(d);
    for (uint32_t t = 0; t < n; ++t)
      for (int j = 0; j < d; ++j) sum[j] += keys[t * d + j];
    for (int j = 0; j < d; ++j) mean[j] = sum[j] / n;
    const float* peak = FarthestRow(keys.data(), n, d, mean.data());
    sums.insert(sums.end(), sum.begin(), sum.end());
    peaks.insert(peaks.end(), peak, peak + d);
    tokens.push_back(n);
    stats.Append(n, sum.data(), peak);
    stats.MarkFinal(stats.size());
  }
};

enum class Data { kGaussian, kClustered, kIdentical, kOutliers, kBeyondHalf };

std::vector<float> ChunkKeys(Data kind, std::mt19937& rng, const std::vector<float>& centers,
                             int d = kD) {
  std::normal_distribution<float> n(0, 1);
  std::vector<float> k(kT * d);
  switch (kind) {
    case Data::kGaussian:
      for (auto& x : k) x = n(rng);
      break;
    case Data::kClustered: {  // 32 directions, outlier channels every 16th, 8x
      const int c = std::uniform_int_distribution<int>(0, 31)(rng);
      for (int t = 0; t < kT; ++t) {
        for (int j = 0; j < d; ++j) {
          k[t * d + j] = (centers[c * d + j] + 0.3f * n(rng)) * (j % 16 == 0 ? 8.f : 1.f);
        }
      }
      break;
    }
    case Data::kIdentical:  // every chunk the same: ties everywhere
      for (int t = 0; t < kT; ++t)
        for (int j = 0; j < d; ++j) k[t * d + j] = 0.25f * (j % 5);
      break;
    case Data::kOutliers:  // tiny keys, and now and then one huge key
      for (auto& x : k) x = 1e-3f * n(rng);
      if (std::uniform_int_distribution<int>(0, 9)(rng) == 0) {
        for (int j = 0; j < d; ++j) k[(rng() % kT) * d + j] = 300.f * n(rng);
      }
      break;
    case Data::kBeyondHalf:  // now and then a key past the half range (a bf16 stream can hold
                             // one): its nodes' boxes do not fit the index's halves
      for (auto& x : k) x = n(rng);
      if (std::uniform_int_distribution<int>(0, 7)(rng) == 0) {
        for (int j = 0; j < d; ++j) k[(rng() % kT) * d + j] = 1e5f * n(rng);
      }
      break;
  }
  return k;
}

std::vector<float> Queries(std::mt19937& rng, float scale, int d = kD) {
  std::normal_distribution<float> n(0, scale);
  std::vector<float> q(kGroup * d);
  for (auto& x : q) x = n(rng);
  return q;
}

// Brute force: the linear scan the index must agree with.
std::vector<uint32_t> Linear(v1::Ranking ranking, const std::vector<float>& q, const Stream& s,
                             size_t k, const std::vector<bool>& skip) {
  std::vector<ChunkCandidate> cands;
  for (uint32_t c = 0; c < s.tokens.size(); ++c) {
    if (c < skip.size() && skip[c]) continue;
    cands.push_back(s.stats.candidate(c));
  }
  return SelectChunks(ranking, q, kGroup, s.d, cands, k * kT);
}

// 32 random directions for clustered keys.
std::vector<float> Centers(std::mt19937& rng, int d = kD) {
  std::normal_distribution<float> n(0, 1);
  std::vector<float> centers(32 * d);
  for (auto& x : centers) x = n(rng);
  return centers;
}

class ClusterIndexTest : public ::testing::TestWithParam<Data> {};

TEST_P(ClusterIndexTest, SearchEqualsTheLinearScanAndBoundsHold) {
  for (bool by_peak : {true, false}) {
    SCOPED_TRACE(by_peak ? "clustered by mean and peak" : "clustered by mean");
    std::mt19937 rng(static_cast<int>(GetParam()) + 1);
    const std::vector<float> centers = Centers(rng);
    Stream s;
    ClusterIndex::Options options;
    options.cluster_by_peak = by_peak;
    ClusterIndex index(kD, options);
    for (int step = 0; step < 6; ++step) {
      for (int i = 0; i < 200; ++i) {
        s.Push(ChunkKeys(GetParam(), rng, centers), kT);
        index.Add(static_cast<uint32_t>(s.tokens.size() - 1), s.stats);
      }
      ASSERT_EQ(index.CheckInvariants(s.stats), "") << "after " << s.tokens.size();
      for (int trial = 0; trial < 6; ++trial) {
        const auto q = Queries(rng, trial % 2 ? 3.f : 0.5f);
        for (v1::Ranking r : {v1::RANKING_LSE_PEAK, v1::RANKING_MEAN}) {
          EXPECT_EQ(index.CountBoundViolations(r, q, kGroup, s.stats), 0u)
              << v1::Ranking_Name(r) << " trial " << trial;
          std::vector<bool> skip(s.tokens.size(), false);
          for (size_t c = 0; c < skip.size(); c += 7) skip[c] = trial % 3 == 0;
          for (size_t k : {1, 12, 60}) {
            ClusterIndex::SearchStats stats;
            const std::vector<uint32_t> answer = Linear(r, q, s, k, skip);
            EXPECT_EQ(index.Search(r, q, kGroup, k, s.stats, skip, &stats), answer)
                << v1::Ranking_Name(r) << " k " << k << " trial " << trial << " chunks "
                << s.tokens.size();
            EXPECT_LE(stats.chunks_scored, s.tokens.size());
            // The unit level against the k-th score: a search opens every unit whose bound
            // reaches it, and the clusters of the answer all reach it.
            if (answer.size() == k) {
              const uint32_t last = answer.back();
              const ChunkCandidate c = s.stats.candidate(last);
              const float kth = r == v1::RANKING_LSE_PEAK ? LsePeakScore(q, kGroup, c, kD)
                                                          : MeanScore(q, kGroup, c, kD);
              const ClusterIndex::UnitProfile profile = index.ProfileUnits(r, q, kGroup, kth);
              EXPECT_GE(stats.units_opened, profile.units_reaching);
              std::set<uint32_t> clusters;
              for (uint32_t ch : answer) clusters.insert(index.cluster_of(ch));
              EXPECT_GE(profile.clusters_reaching, clusters.size());
              EXPECT_LE(profile.units_needed, index.num_units());
              EXPECT_GE(profile.clusters_in_needed, profile.clusters_reaching);
            }
          }
        }
      }
    }
    EXPECT_GE(index.num_clusters(), s.tokens.size() / 16);
  }
}

// Chunks of 8 to 32 tokens (boundary chunking): the greedy fill through the index, with
// candidates it does not hold scored beside it, equals SelectChunks over them all.
TEST_P(ClusterIndexTest, GreedySearchEqualsTheScanForChunksOfManySizes) {
  std::mt19937 rng(static_cast<int>(GetParam()) + 11);
  const std::vector<float> centers = Centers(rng);
  Stream s;
  ClusterIndex index(kD);
  std::vector<bool> indexed;
  for (int i = 0; i < 900; ++i) {
    const uint32_t n = 8 + rng() % 25;
    std::vector<float> keys = ChunkKeys(GetParam(), rng, centers);  // 16 rows; grow or cut
    keys.resize(size_t(n) * kD);
    for (size_t j = size_t(kT) * kD; j < keys.size(); ++j) keys[j] = keys[j % (kT * kD)];
    s.Push(keys, n);
    const bool add = rng() % 10 != 0;  // a tenth stays outside, as extras
    if (add) index.Add(static_cast<uint32_t>(s.tokens.size() - 1), s.stats);
    indexed.push_back(add);
  }
  ASSERT_EQ(index.CheckInvariants(s.stats), "");
  for (int trial = 0; trial < 8; ++trial) {
    const auto q = Queries(rng, trial % 2 ? 3.f : 0.5f);
    std::vector<bool> skip(s.tokens.size(), false);
    for (size_t c = 0; c < skip.size(); c += 5) skip[c] = trial % 3 == 0;
    std::vector<ChunkCandidate> all, extras;
    for (uint32_t c = 0; c < s.tokens.size(); ++c) {
      if (skip[c]) continue;
      const ChunkCandidate cand = s.stats.candidate(c);
      all.push_back(cand);
      if (!indexed[c]) extras.push_back(cand);
    }
    for (v1::Ranking r : {v1::RANKING_LSE_PEAK, v1::RANKING_MEAN}) {
      for (uint64_t budget : {7u, 40u, 176u, 1000u}) {
        ClusterIndex::SearchStats stats;
        EXPECT_EQ(index.SearchGreedy(r, q, kGroup, budget, s.stats, skip, extras, &stats),
                  SelectChunks(r, q, kGroup, kD, all, budget))
            << v1::Ranking_Name(r) << " budget " << budget << " trial " << trial;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Data, ClusterIndexTest,
                         ::testing::Values(Data::kGaussian, Data::kClustered, Data::kIdentical,
                                           Data::kOutliers, Data::kBeyondHalf));

TEST(ClusterIndex, PrunesMostChunksOnClusteredKeys) {
  std::mt19937 rng(7);
  const std::vector<float> centers = Centers(rng);
  Stream s;
  ClusterIndex index(kD);
  for (int i = 0; i < 4096; ++i) {
    s.Push(ChunkKeys(Data::kClustered, rng, centers), kT);
    index.Add(static_cast<uint32_t>(i), s.stats);
  }
  uint64_t scored = 0;
  const int trials = 20;
  for (int trial = 0; trial < trials; ++trial) {
    // A query close to one direction, as a decode query is to the keys it attends to.
    std::vector<float> q(kGroup * kD);
    const int c = trial % 32;
    for (int h = 0; h < kGroup; ++h) {
      for (int j = 0; j < kD; ++j) q[h * kD + j] = 2.f * centers[c * kD + j] / (j % 16 ? 1 : 8);
    }
    ClusterIndex::SearchStats stats;
    auto got = index.Search(v1::RANKING_LSE_PEAK, q, kGroup, 16, s.stats, {}, &stats);
    EXPECT_EQ(got, Linear(v1::RANKING_LSE_PEAK, q, s, 16, {}));
    scored += stats.chunks_scored;
  }
  // The scan scores all 4096 chunks every time; the index must skip most of them.
  EXPECT_LT(double(scored) / trials, 0.5 * 4096);
  std::printf("chunks scored per search: %.1f of 4096\n", double(scored) / trials);
}

// MemoryBytes counts at least what the index must hold, each node's four boxes (halves) and
// four scalars and each chunk's node, and grows with the chunks; but the units' blocks hold
// one lane per cluster (their last tile as wide as it needs), the block of units at most
// twice those used, and a node's own record adds a few hundred bytes at most.
// ChunkStats' holds its token counts, means and peaks, and no more than twice that.
// Head dims other than 64: 37 leaves a remainder below 8 in every vector loop (the scalar tails
// of the kernels the boxes' codes go through), 128 is the larger models' size.
TEST(ClusterIndex, SearchEqualsTheLinearScanAtOtherHeadDims) {
  for (int d : {37, 128}) {
    for (Data kind : {Data::kClustered, Data::kOutliers}) {
      SCOPED_TRACE(::testing::Message() << "head_dim " << d << " data " << static_cast<int>(kind));
      std::mt19937 rng(d + static_cast<int>(kind));
      const std::vector<float> centers = Centers(rng, d);
      Stream s(d);
      ClusterIndex index(d);
      for (int i = 0; i < 700; ++i) {
        s.Push(ChunkKeys(kind, rng, centers, d), kT);
        index.Add(static_cast<uint32_t>(i), s.stats);
      }
      ASSERT_EQ(index.CheckInvariants(s.stats), "");
      ASSERT_GT(index.num_units(), 4u);
      for (int trial = 0; trial < 6; ++trial) {
        const auto q = Queries(rng, trial % 2 ? 3.f : 0.5f, d);
        for (v1::Ranking r : {v1::RANKING_LSE_PEAK, v1::RANKING_MEAN}) {
          EXPECT_EQ(index.CountBoundViolations(r, q, kGroup, s.stats), 0u);
          for (size_t k : {1, 20}) {
            EXPECT_EQ(index.Search(r, q, kGroup, k, s.stats, {}, nullptr), Linear(r, q, s, k, {}))
                << v1::Ranking_Name(r) << " k " << k << " trial " << trial;
          }
        }
      }
    }
  }
}

TEST(ClusterIndex, MemoryBytesCountsWhatItHolds) {
  std::mt19937 rng(3);
  const std::vector<float> centers = Centers(rng);
  Stream s;
  ClusterIndex index(kD);
  size_t before = index.MemoryBytes();
  for (int i = 0; i < 2048; ++i) {
    s.Push(ChunkKeys(Data::kClustered, rng, centers), kT);
    index.Add(static_cast<uint32_t>(i), s.stats);
    if (i % 256 == 255) {
      const size_t now = index.MemoryBytes();
      const size_t nodes = index.num_clusters() + index.num_units();
      // A unit's boxes are halves, a cluster's a byte per side; four float scalars each.
      const size_t unit_lane = 4 * kD * sizeof(uint16_t) + 4 * sizeof(float);
      const size_t lane = 4 * kD * sizeof(uint8_t) + 4 * sizeof(float);
      const size_t lanes = index.num_clusters() * lane + index.num_units() * unit_lane;
      EXPECT_GE(now, lanes + (i + 1) * sizeof(uint32_t));
      EXPECT_EQ(index.cluster_lanes(), index.num_clusters());
      EXPECT_LE(now, 2 * lanes + nodes * 256 + 2 * (i + 1) * sizeof(uint32_t) + 16 * unit_lane);
      EXPECT_GT(now, before);
      before = now;
    }
  }
  const size_t n = s.tokens.size();
  // Every chunk final, so compact: a count and two vectors of bytes with a scale each.
  EXPECT_EQ(s.stats.compact_chunks(), n);
  const size_t per_chunk = sizeof(uint32_t) + 2 * (kD + sizeof(float));
  EXPECT_GE(s.stats.MemoryBytes(), n * per_chunk);
  EXPECT_LE(s.stats.MemoryBytes(), 2 * n * per_chunk + 4096);
}

TEST(ClusterIndex, AddingTwiceChangesNothingAndOnlyFinalChunksEnter) {
  std::mt19937 rng(1);
  Stream s;
  ClusterIndex index(kD);
  s.Push(ChunkKeys(Data::kGaussian, rng, {}), kT);
  index.Add(0, s.stats);
  index.Add(0, s.stats);
  EXPECT_EQ(index.num_chunks(), 1u);
  EXPECT_TRUE(index.contains(0));
  EXPECT_FALSE(index.contains(1));
  EXPECT_EQ(index.CheckInvariants(s.stats), "");
  EXPECT_TRUE(
      index.Search(v1::RANKING_MEAN, Queries(rng, 1), kGroup, 0, s.stats, {}, nullptr).empty());
  // A chunk whose statistics may still change never enters: its bounds would not hold.
  ChunkStats growing(kD);
  growing.Append(kT, s.sums.data(), s.peaks.data());
  EXPECT_DEATH(index.Add(0, growing), "not final");
}

}  // namespace
}  // namespace kvtier
