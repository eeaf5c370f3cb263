#include <algorithm>
#include <bit>
#include <cmath>
#include <limits>
#include <numeric>
#include <random>

#include "gtest/gtest.h"
#include "server/index/chunk_ranker.h"
#include "server/index/chunk_stats.h"
#include "server/index/chunking.h"
#include "tests/test_util.h"

namespace kvtier {
namespace {

// Brute force in double: score every chunk, sort, take greedily within the budget.
std::vector<uint32_t> Expected(const std::vector<float>& q, int group, int d,
                               const std::vector<std::vector<float>>& means,
                               const std::vector<uint32_t>& tokens, uint64_t budget) {
  std::vector<double> score(means.size());
  for (size_t c = 0; c < means.size(); ++c) {
    double best = -1e300;
    for (int h = 0; h < group; ++h) {
      double s = 0;
      for (int j = 0; j < d; ++j) s += double(q[h * d + j]) * means[c][j];
      best = std::max(best, s);
    }
    score[c] = best;
  }
  std::vector<uint32_t> order(means.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](auto a, auto b) { return score[a] > score[b]; });
  std::vector<uint32_t> out;
  uint64_t used = 0;
  for (uint32_t c : order) {
    if (used + tokens[c] > budget) continue;
    used += tokens[c];
    out.push_back(c);
  }
  return out;
}

TEST(ChunkRanker, MatchesBruteForceWithGqa) {
  std::mt19937 rng(3);
  std::normal_distribution<float> n(0, 1);
  for (int trial = 0; trial < 50; ++trial) {
    const int d = 64, group = 1 + trial % 4, chunks = 40 + trial;
    std::vector<float> q(group * d);
    for (auto& x : q) x = n(rng);
    std::vector<std::vector<float>> means(chunks, std::vector<float>(d));
    std::vector<uint32_t> tokens(chunks);
    std::vector<ChunkCandidate> cands;
    for (int c = 0; c < chunks; ++c) {
      for (auto& x : means[c]) x = n(rng);
      // Odd trials: some short chunks exercise the skip; even: all whole (the partial sort).
      tokens[c] = (trial % 2 == 1 && c % 7 == 0) ? 5 : 16;
      cands.push_back({static_cast<uint32_t>(c), tokens[c], means[c].data(), 1.f});
    }
    const uint64_t budget = 16 * (trial % 10) + 3;
    auto got = SelectByMeanScore(q, group, d, cands, budget);
    EXPECT_EQ(got, Expected(q, group, d, means, tokens, budget)) << "trial " << trial;
    uint64_t used = 0;
    for (uint32_t c : got) used += tokens[c];
    EXPECT_LE(used, budget);
  }
}

TEST(ChunkRanker, GqaTakesTheMaxOverQueryHeads) {
  const int d = 2;
  std::vector<float> q = {1, 0, 0, 1};  // head 0 likes x, head 1 likes y
  std::vector<float> a = {5, 0}, b = {0, 4}, c = {-1, -1};
  std::vector<ChunkCandidate> cands = {
      {0, 16, a.data(), 1.f}, {1, 16, b.data(), 1.f}, {2, 16, c.data(), 1.f}};
  EXPECT_EQ(SelectByMeanScore(q, 2, d, cands, 32), (std::vector<uint32_t>{0, 1}));
  EXPECT_FLOAT_EQ(MeanScore(q, 2, cands[1], d), 4.f);
  // A sum and its scale: 8 tokens summing to (0, 32) score as the mean (0, 4).
  std::vector<float> sum = {0, 32};
  EXPECT_FLOAT_EQ(MeanScore(q, 2, {3, 8, sum.data(), 1.f / 8}, d), 4.f);
}

// The estimate in double, from its definition.
double LsePeakExpected(const std::vector<float>& q, int group, int d, const float* mean,
                       const float* peak, uint32_t tokens) {
  double best = -1e300;
  for (int h = 0; h < group; ++h) {
    double a = 0, b = 0;
    for (int j = 0; j < d; ++j) {
      a += double(q[h * d + j]) * mean[j];
      b += double(q[h * d + j]) * peak[j];
    }
    a /= std::sqrt(double(d));
    b /= std::sqrt(double(d));
    best = std::max(best, std::log((tokens - 1) * std::exp(a) + std::exp(b)));
  }
  return best;
}

TEST(ChunkRanker, LsePeakMatchesItsDefinition) {
  std::mt19937 rng(5);
  std::normal_distribution<float> n(0, 1);
  for (int trial = 0; trial < 40; ++trial) {
    const int d = 64, group = 1 + trial % 3;
    const uint32_t tokens = 1 + trial % 16;
    std::vector<float> q(group * d), sum(d), peak(d), mean(d);
    for (auto& x : q) x = n(rng);
    for (int j = 0; j < d; ++j) {
      mean[j] = n(rng);
      sum[j] = mean[j] * tokens;
      peak[j] = mean[j] + 2 * n(rng);
    }
    const ChunkCandidate c{0, tokens, sum.data(), 1.f / tokens, peak.data()};
    EXPECT_NEAR(LsePeakScore(q, group, c, d),
                LsePeakExpected(q, group, d, mean.data(), peak.data(), tokens), 1e-4)
        << "trial " << trial;
  }
}

TEST(ChunkRanker, LsePeakScoresEqualsOneByOne) {
  // Blocks of every size, for groups up to many heads: each score has the bits LsePeakScore
  // gives that chunk alone (the scan scores in blocks, the index cluster by cluster).
  std::mt19937 rng(6);
  std::normal_distribution<float> n(0, 1);
  const int d = 64;
  for (int group : {1, 3, 8, 100}) {
    const int chunks = 150;
    std::vector<float> q(group * d), sums(chunks * d), peaks(chunks * d);
    for (auto& x : q) x = n(rng);
    for (auto& x : sums) x = 4 * n(rng);
    for (auto& x : peaks) x = 2 * n(rng);
    std::vector<ChunkCandidate> cands;
    for (int c = 0; c < chunks; ++c) {
      const uint32_t tokens = 1 + c % 20;
      cands.push_back({uint32_t(c), tokens, &sums[c * d], 1.f / tokens, &peaks[c * d]});
    }
    std::vector<float> all(chunks);
    LsePeakScores(q, group, cands, d, all.data());
    for (int c = 0; c < chunks; ++c) {
      ASSERT_EQ(all[c], LsePeakScore(q, group, cands[c], d)) << "group " << group << " chunk " << c;
      std::vector<float> mean(d);
      for (int j = 0; j < d; ++j) mean[j] = sums[c * d + j] / cands[c].tokens;
      ASSERT_NEAR(all[c], LsePeakExpected(q, group, d, mean.data(), &peaks[c * d], cands[c].tokens),
                  1e-4 * (1 + std::abs(all[c])))
          << "group " << group << " chunk " << c;
    }
  }
}

// `chunks` chunks of 1 to 16 tokens appended to `stats`, each with a Gaussian sum and a peak
// that sticks out of its mean.
void AppendRandomChunks(uint32_t chunks, std::mt19937& rng, ChunkStats* stats) {
  std::normal_distribution<float> n(0, 1);
  const int d = stats->head_dim();
  for (uint32_t c = 0; c < chunks; ++c) {
    const uint32_t tokens = 1 + c % 16;
    std::vector<float> sum(d), peak(d);
    for (int j = 0; j < d; ++j) {
      sum[j] = tokens * n(rng);
      peak[j] = sum[j] / tokens + 2 * n(rng);
    }
    stats->Append(tokens, sum.data(), peak.data());
  }
}

TEST(ChunkRanker, LsePeakScoresOfCompactRunsEqualOneByOne) {
  // Compact chunks' codes are gathered and scored together: with gaps in the candidates, loose
  // chunks after them or among them in any order, and blocks of every size, each score has the
  // bits the chunk alone gets, and is its score over the float mean and peak its bytes stand
  // for.
  std::mt19937 rng(16);
  std::normal_distribution<float> n(0, 1);
  const int d = 64;
  for (int group : {1, 3, 8, 100}) {
    const uint32_t chunks = 200, compact = 170;
    ChunkStats stats(d);
    AppendRandomChunks(chunks, rng, &stats);
    stats.MarkFinal(compact);
    ASSERT_EQ(stats.compact_chunks(), compact);
    std::vector<float> q(group * d);
    for (auto& x : q) x = n(rng);
    testing::OnQueryGrid(&q,
                         d);  // as RankStream passes it: the compact bytes are scored on its grid
    std::vector<ChunkCandidate> cands;
    for (uint32_t c = 0; c < chunks; ++c) {
      if (c % 7 != 3) cands.push_back(stats.candidate(c));
    }
    std::vector<float> all(cands.size());
    LsePeakScores(q, group, cands, d, all.data());
    for (size_t i = 0; i < cands.size(); ++i) {
      ASSERT_EQ(all[i], LsePeakScore(q, group, cands[i], d)) << "group " << group << " at " << i;
      std::vector<float> mean(d), peak(d);
      stats.Mean(cands[i].index, mean.data());
      stats.Peak(cands[i].index, peak.data());
      ASSERT_NEAR(all[i], LsePeakExpected(q, group, d, mean.data(), peak.data(), cands[i].tokens),
                  1e-4 * (1 + std::abs(all[i])))
          << "group " << group << " at " << i;
    }
    // The same candidates shuffled: compact and loose ones interleaved, no two side by side.
    std::vector<size_t> order(cands.size());
    std::iota(order.begin(), order.end(), size_t{0});
    std::shuffle(order.begin(), order.end(), rng);
    std::vector<ChunkCandidate> shuffled;
    for (size_t i : order) shuffled.push_back(cands[i]);
    std::vector<float> again(shuffled.size());
    LsePeakScores(q, group, shuffled, d, again.data());
    for (size_t i = 0; i < shuffled.size(); ++i) {
      ASSERT_EQ(std::bit_cast<uint32_t>(again[i]), std::bit_cast<uint32_t>(all[order[i]]))
          << "shuffled: group " << group << " at " << i;
    }
  }
}

TEST(ChunkRanker, AStreamScoredInPlaceHasEachCandidatesBits) {
  // ChunkStats::Score over a whole stream (its compact chunks read in place, in blocks; its
  // loose ones as candidates), and ScoreCompact over compact chunks picked anywhere, give
  // every chunk the bits LsePeakScore or MeanScore gives it alone, and the LSE-peak score stays
  // within float rounding of its definition. Block boundaries fall inside the compact run (1024 /
  // group chunks a block). The chunks become compact in two steps (as the aging pool marks them),
  // and a fork's copy of a prefix scores its chunks as the original does.
  std::mt19937 rng(17);
  std::normal_distribution<float> n(0, 1);
  const int d = 64;
  for (int group : {1, 3, 9}) {
    // 2100: past ChunkStats::kMaxTiledChunks, the tiles let go (and rebuilt in the fork).
    for (uint32_t compact : {0u, 1u, 400u, 700u, 2100u}) {
      const uint32_t chunks = std::max(compact, 1u) + 37;
      ChunkStats stats(d);
      AppendRandomChunks(chunks, rng, &stats);
      stats.MarkFinal(compact / 3);
      stats.MarkFinal(compact);
      ASSERT_EQ(stats.compact_chunks(), compact);
      std::vector<float> q(group * d);
      for (auto& x : q) x = n(rng);
      testing::OnQueryGrid(&q, d);  // as RankStream passes it
      std::vector<float> lse(chunks), mean(chunks);
      stats.Score(v1::RANKING_LSE_PEAK, q, group, lse.data());
      stats.Score(v1::RANKING_MEAN, q, group, mean.data());
      for (uint32_t c = 0; c < chunks; ++c) {
        const ChunkCandidate cand = stats.candidate(c);
        ASSERT_EQ(std::bit_cast<uint32_t>(lse[c]),
                  std::bit_cast<uint32_t>(LsePeakScore(q, group, cand, d)))
            << "group " << group << " compact " << compact << " chunk " << c;
        ASSERT_EQ(std::bit_cast<uint32_t>(mean[c]),
                  std::bit_cast<uint32_t>(MeanScore(q, group, cand, d)))
            << "group " << group << " compact " << compact << " chunk " << c;
        std::vector<float> m(d), p(d);
        stats.Mean(c, m.data());
        stats.Peak(c, p.data());
        ASSERT_NEAR(lse[c], LsePeakExpected(q, group, d, m.data(), p.data(), cand.tokens),
                    1e-4 * (1 + std::abs(lse[c])))
            << "group " << group << " compact " << compact << " chunk " << c;
      }
      // Compact chunks picked anywhere and in any order (a searched cluster's), gathered and
      // scored with the query's codes made once (ScoreCompact): each its own bits, for a query
      // on the grid and one off it. 400 picks cross a block (1024 / group chunks) at group 3
      // and 9.
      if (compact > 0) {
        std::vector<float> off_grid(q);
        for (auto& x : off_grid) x += 1e-3f * n(rng);
        for (const std::vector<float>* query : {&q, &off_grid}) {
          const QueryInt8Group q8(query->data(), group, d);
          for (uint32_t size : {1u, 5u, 13u, 400u}) {
            std::vector<uint32_t> pick(size);
            for (auto& c : pick) c = static_cast<uint32_t>(rng() % compact);  // repeats too
            std::vector<float> got(size), got_mean(size);
            stats.ScoreCompact(v1::RANKING_LSE_PEAK, q8, pick, got.data());
            stats.ScoreCompact(v1::RANKING_MEAN, q8, pick, got_mean.data());
            for (uint32_t i = 0; i < size; ++i) {
              const ChunkCandidate cand = stats.candidate(pick[i]);
              ASSERT_EQ(std::bit_cast<uint32_t>(got[i]),
                        std::bit_cast<uint32_t>(LsePeakScore(*query, group, cand, d)))
                  << "gathered: group " << group << " compact " << compact << " pick " << i
                  << " of " << size << (query == &q ? "" : ", off the grid");
              ASSERT_EQ(std::bit_cast<uint32_t>(got_mean[i]),
                        std::bit_cast<uint32_t>(MeanScore(*query, group, cand, d)))
                  << "gathered, mean: group " << group << " compact " << compact << " pick " << i
                  << " of " << size << (query == &q ? "" : ", off the grid");
            }
          }
        }
      }
      // Skipped chunks (every third): the loose ones keep what out held, the others their bits.
      std::vector<bool> skip(chunks);
      for (uint32_t c = 0; c < chunks; c += 3) skip[c] = true;
      std::vector<float> some(chunks, -7.f);
      stats.Score(v1::RANKING_LSE_PEAK, q, group, some.data(), &skip);
      for (uint32_t c = 0; c < chunks; ++c) {
        const float want = skip[c] && !stats.compact(c) ? -7.f : lse[c];
        ASSERT_EQ(std::bit_cast<uint32_t>(some[c]), std::bit_cast<uint32_t>(want))
            << "skip: group " << group << " compact " << compact << " chunk " << c;
      }
      const uint32_t prefix = compact / 2 + 5;  // compact chunks, then loose ones
      ChunkStats fork(d);
      fork.CopyPrefix(stats, prefix);
      std::vector<float> forked(prefix);
      fork.Score(v1::RANKING_LSE_PEAK, q, group, forked.data());
      for (uint32_t c = 0; c < prefix; ++c) {
        ASSERT_EQ(std::bit_cast<uint32_t>(forked[c]), std::bit_cast<uint32_t>(lse[c]))
            << "fork: group " << group << " compact " << compact << " chunk " << c;
      }
    }
  }
}

// The case the peak term exists for: chunk A's mass sits on one key, chunk B's keys are all
// mildly aligned with q. B has the higher mean score, A the larger true attention mass (by
// brute force over every key); the mean ranking keeps B, the peak ranking keeps A.
// FillGreedy against its definition: every candidate sorted (score down, index up), then the
// greedy fill of the budget and, beside it, of the wider one (what only that takes is the
// extra). Uniform sizes (the insertion pass for up to 64 picks, nth_element for more) and mixed
// ones, scores with many ties, picks from none to all; best first, and in any order.
TEST(ChunkRanker, FillGreedyIsTheGreedyFillOfAFullSort) {
  std::mt19937 rng(23);
  for (int trial = 0; trial < 400; ++trial) {
    const uint32_t n = 1 + rng() % 300;
    const bool uniform = trial % 3 != 0;
    std::vector<ScoredChunk> scored;
    for (uint32_t i = 0; i < n; ++i) {
      // Few distinct scores: ties are common and broken by the index (-0 ties with +0).
      const float score =
          rng() % 16 == 0 ? -0.f : static_cast<float>(static_cast<int>(rng() % 40)) - 20.f;
      scored.push_back({score, (i * 7919u) % 100003u, uniform ? 16u : 1 + uint32_t(rng() % 32)});
    }
    const uint64_t budget = rng() % (16 * n + 32);
    const uint64_t extra_budget = trial % 2 ? rng() % (8 * n + 16) : 0;
    std::vector<uint32_t> want_extra;
    const std::vector<uint32_t> want = FillGreedyBySort(scored, budget, extra_budget, &want_extra);
    std::vector<uint32_t> extra;
    EXPECT_EQ(FillGreedy(scored, budget, extra_budget, &extra), want) << "trial " << trial;
    EXPECT_EQ(extra, want_extra) << "trial " << trial;
    EXPECT_EQ(FillGreedy(scored, budget), want) << "trial " << trial;
    // In any order: the same chunks, and the same extra ones.
    auto sorted = [](std::vector<uint32_t> v) {
      std::sort(v.begin(), v.end());
      return v;
    };
    std::vector<uint32_t> any_extra;
    EXPECT_EQ(sorted(FillGreedy(scored, budget, extra_budget, &any_extra, FillOrder::kAny)),
              sorted(want))
        << "trial " << trial;
    EXPECT_EQ(sorted(any_extra), sorted(want_extra)) << "trial " << trial;
  }
}

TEST(ChunkRanker, SoftplusUpperBoundCoversLogAddExpAndStaysClose) {
  // Against log(1 + e^t) in double, and against LogAddExp as the score computes it in float,
  // with e^t off by the 1e-6 ExpInPlace allows, in the direction that hurts.
  double worst = 0;
  for (int i = 0; i <= 200000; ++i) {
    const float t = -87.f * static_cast<float>(i) / 200000.f;
    const float exp_t = std::exp(t) * (1 - 1e-6f);
    const double want = std::log1p(std::exp(static_cast<double>(t)));
    const float got = SoftplusUpperBound(t, exp_t);
    for (float hi : {-30.f, -1.f, 0.f, 2.5f, 40.f}) {
      ASSERT_GE(hi + got + 1e-5f * (1 + std::abs(hi)), LogAddExp(hi, hi + t)) << hi << " " << t;
      ASSERT_GE(double(hi) + got + 1e-5 * (1 + std::abs(hi)), hi + want) << hi << " " << t;
    }
    worst = std::max(worst, got - want);
  }
  EXPECT_LT(worst, 0.023);
}

TEST(ChunkRanker, LsePeakKeepsTheChunkWhoseMassSitsOnOneKey) {
  const int d = 4, n = 16;
  const std::vector<float> q = {8, 0, 0, 0};  // q.k / sqrt(d) = 4 k_0
  std::vector<std::vector<float>> a(n, std::vector<float>(d, 0.f)), b = a;
  a[7][0] = 3.f;                  // one key: logit 12
  for (auto& k : b) k[0] = 0.6f;  // every key: logit 2.4
  auto mass = [&](const std::vector<std::vector<float>>& keys) {
    double m = 0;
    for (const auto& k : keys) m += std::exp(q[0] * k[0] / 2.0);
    return m;
  };
  ASSERT_GT(mass(a), mass(b));
  auto stats = [&](const std::vector<std::vector<float>>& keys, std::vector<float>& sum,
                   std::vector<float>& peak) {
    sum.assign(d, 0.f);
    for (const auto& k : keys)
      for (int j = 0; j < d; ++j) sum[j] += k[j];
    float best = -1;
    for (const auto& k : keys) {
      float dist = 0;
      for (int j = 0; j < d; ++j) dist += (k[j] - sum[j] / n) * (k[j] - sum[j] / n);
      if (dist > best) best = dist, peak = k;
    }
  };
  std::vector<float> sa, pa, sb, pb;
  stats(a, sa, pa);
  stats(b, sb, pb);
  const std::vector<ChunkCandidate> cands = {{0, n, sa.data(), 1.f / n, pa.data()},
                                             {1, n, sb.data(), 1.f / n, pb.data()}};
  EXPECT_EQ(SelectChunks(v1::RANKING_MEAN, q, 1, d, cands, 16), (std::vector<uint32_t>{1}));
  EXPECT_EQ(SelectChunks(v1::RANKING_LSE_PEAK, q, 1, d, cands, 16), (std::vector<uint32_t>{0}));
}

// BalancedGroups as its comment states it, spelled out the slow way: every (row, center) pair
// sorted by (distance, row, center), then taken in that order while the row is unplaced and
// the center has room; centers seeded farthest-first and moved to their rows' means.
std::vector<std::vector<uint32_t>> ReferenceGroups(const std::vector<float>& x, uint32_t n, int d,
                                                   uint32_t size, int rounds) {
  const uint32_t k = n / size;
  auto dist = [&](const float* a, const float* b) {
    float s = 0;  // the same float sum, in the same order, as the daemon's
    for (int j = 0; j < d; ++j) s += (a[j] - b[j]) * (a[j] - b[j]);
    return s;
  };
  auto mean_of = [&](const std::vector<uint32_t>& members) {
    std::vector<float> m(d, 0.f);
    for (uint32_t r : members) {
      for (int j = 0; j < d; ++j) m[j] += x[size_t(r) * d + j];
    }
    for (float& v : m) v /= float(members.size());
    return m;
  };
  std::vector<uint32_t> all(n);
  std::iota(all.begin(), all.end(), 0u);
  std::vector<std::vector<float>> centers;
  const std::vector<float> mu = mean_of(all);
  uint32_t far = 0;
  for (uint32_t r = 0; r < n; ++r) {
    if (dist(&x[size_t(r) * d], mu.data()) > dist(&x[size_t(far) * d], mu.data())) far = r;
  }
  centers.emplace_back(x.begin() + size_t(far) * d, x.begin() + size_t(far + 1) * d);
  std::vector<float> nearest(n, std::numeric_limits<float>::infinity());
  while (centers.size() < k) {
    uint32_t best = 0;
    float best_dist = -1.f;
    for (uint32_t r = 0; r < n; ++r) {
      nearest[r] = std::min(nearest[r], dist(&x[size_t(r) * d], centers.back().data()));
      if (nearest[r] > best_dist) best_dist = nearest[r], best = r;
    }
    centers.emplace_back(x.begin() + size_t(best) * d, x.begin() + size_t(best + 1) * d);
  }
  std::vector<std::vector<uint32_t>> groups(k);
  for (int round = 0; round < rounds; ++round) {
    std::vector<std::tuple<float, uint32_t, uint32_t>> pairs;
    for (uint32_t r = 0; r < n; ++r) {
      for (uint32_t g = 0; g < k; ++g)
        pairs.emplace_back(dist(&x[size_t(r) * d], centers[g].data()), r, g);
    }
    std::sort(pairs.begin(), pairs.end());
    std::vector<uint32_t> room(k, size);
    std::vector<bool> placed(n, false);
    for (auto& grp : groups) grp.clear();
    for (auto [dd, r, g] : pairs) {
      if (placed[r] || room[g] == 0) continue;
      placed[r] = true;
      --room[g];
      groups[g].push_back(r);
    }
    for (uint32_t g = 0; g < k; ++g) {
      std::sort(groups[g].begin(), groups[g].end());
      centers[g] = mean_of(groups[g]);
    }
  }
  std::sort(groups.begin(), groups.end());
  return groups;
}

// The daemon's assignment (deferred acceptance: no sort of the pairs) is the reference's, on
// random rows and on rows of few distinct values, where many distances tie.
TEST(BalancedGroups, EqualsTheFullSortGreedyAssignment) {
  std::mt19937 rng(11);
  std::normal_distribution<float> n(0, 1);
  for (int trial = 0; trial < 60; ++trial) {
    // Shapes whose row count and width are not multiples of 4 or 8 too; 12 rounds as well as
    // the default 4 (a round that repeats the last one's assignment ends the daemon's early).
    const auto [rows, size, d] = std::vector<std::tuple<uint32_t, uint32_t, int>>{
        {128, 16, 64}, {128, 32, 16}, {96, 8, 8}, {64, 16, 4}, {60, 5, 7}}[trial % 5];
    const int rounds = trial % 2 == 0 ? 4 : 12;
    std::vector<float> x(size_t(rows) * d);
    for (auto& v : x) v = trial % 3 == 0 ? std::round(n(rng)) : n(rng);
    EXPECT_EQ(BalancedGroups(x.data(), rows, d, size, rounds),
              ReferenceGroups(x, rows, d, size, rounds))
        << "trial " << trial;
  }
}

// Semantic chunking's grouping: a partition into equal groups, deterministic, that finds
// planted clusters however their rows are interleaved.
TEST(BalancedGroups, PartitionsIntoEqualGroupsAndRecoversPlantedClusters) {
  std::mt19937 rng(3);
  std::normal_distribution<float> n(0, 1);
  for (auto [rows, size, d] : {std::tuple{128u, 16u, 64}, std::tuple{96u, 32u, 8},
                               std::tuple{7u, 7u, 4}, std::tuple{64u, 1u, 3}}) {
    std::vector<float> x(size_t(rows) * d);
    for (auto& v : x) v = n(rng);
    const auto groups = BalancedGroups(x.data(), rows, d, size);
    ASSERT_EQ(groups.size(), rows / size);
    std::vector<int> seen(rows, 0);
    for (size_t g = 0; g < groups.size(); ++g) {
      ASSERT_EQ(groups[g].size(), size);
      EXPECT_TRUE(std::is_sorted(groups[g].begin(), groups[g].end()));
      if (g > 0) {
        EXPECT_LT(groups[g - 1].front(), groups[g].front());
      }
      for (uint32_t r : groups[g]) ++seen[r];
    }
    EXPECT_EQ(std::count(seen.begin(), seen.end(), 1), int(rows));
    EXPECT_EQ(groups, BalancedGroups(x.data(), rows, d, size)) << "deterministic";
  }
  // 8 planted clusters of 16 rows, rows dealt out in a scrambled order.
  const int d = 32;
  std::vector<float> centers(8 * d), x(128 * d);
  for (auto& c : centers) c = 2 * n(rng);
  std::vector<int> cluster(128);
  for (int r = 0; r < 128; ++r) cluster[r] = (r * 5 + r / 16) % 8;
  for (int r = 0; r < 128; ++r) {
    for (int j = 0; j < d; ++j) x[r * d + j] = centers[cluster[r] * d + j] + 0.3f * n(rng);
  }
  const auto groups = BalancedGroups(x.data(), 128, d, 16);
  for (const auto& g : groups) {
    for (uint32_t r : g) EXPECT_EQ(cluster[r], cluster[g.front()]);
  }
  std::vector<std::vector<uint32_t>> contiguous(8);
  for (uint32_t r = 0; r < 128; ++r) contiguous[r / 16].push_back(r);
  EXPECT_LT(WithinGroupSquares(x.data(), d, groups),
            0.1 * WithinGroupSquares(x.data(), d, contiguous));
}

}  // namespace
}  // namespace kvtier
