#include "server/index/chunk_ranker.h"

#include <algorithm>
#include <numeric>
#include <random>

#include "gtest/gtest.h"

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

}  // namespace
}  // namespace kvtier
