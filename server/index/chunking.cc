#include "server/index/chunking.h"

#include <algorithm>
#include <limits>
#include <numeric>

#include "server/common/check.h"
#include "server/index/chunk_ranker.h"

namespace kvtier {
namespace {

float SquaredDistance(const float* a, const float* b, int d) {
  float s = 0;
  for (int j = 0; j < d; ++j) {
    const float t = a[j] - b[j];
    s += t * t;
  }
  return s;
}

std::vector<float> GroupMean(const float* rows, int d, const std::vector<uint32_t>& members) {
  std::vector<float> mean(d, 0.f);
  for (uint32_t r : members) {
    for (int j = 0; j < d; ++j) mean[j] += rows[static_cast<size_t>(r) * d + j];
  }
  for (float& m : mean) m /= static_cast<float>(members.size());
  return mean;
}

}  // namespace

std::vector<std::vector<uint32_t>> BalancedGroups(const float* rows, uint32_t n, int d,
                                                  uint32_t size, int rounds) {
  CHECK(size > 0 && n % size == 0);
  const uint32_t k = n / size;
  std::vector<std::vector<uint32_t>> groups(k);
  if (k == 1) {
    groups[0].resize(n);
    std::iota(groups[0].begin(), groups[0].end(), 0u);
    return groups;
  }
  auto row = [&](uint32_t r) { return rows + static_cast<size_t>(r) * d; };
  // Farthest-point seeding.
  std::vector<uint32_t> all(n);
  std::iota(all.begin(), all.end(), 0u);
  const std::vector<float> mean = GroupMean(rows, d, all);
  std::vector<float> centers(static_cast<size_t>(k) * d);
  const float* first = FarthestRow(rows, n, d, mean.data());
  std::copy(first, first + d, centers.begin());
  std::vector<float> nearest(n, std::numeric_limits<float>::infinity());
  for (uint32_t g = 1; g < k; ++g) {
    uint32_t best = 0;
    float best_dist = -1.f;
    for (uint32_t r = 0; r < n; ++r) {
      nearest[r] = std::min(nearest[r], SquaredDistance(row(r), &centers[(g - 1) * d], d));
      if (nearest[r] > best_dist) best_dist = nearest[r], best = r;
    }
    std::copy(row(best), row(best) + d, centers.begin() + static_cast<ptrdiff_t>(g) * d);
  }
  struct Pair {
    float dist;
    uint32_t r, g;
  };
  std::vector<Pair> pairs(static_cast<size_t>(n) * k);
  std::vector<uint32_t> group_of(n);
  for (int round = 0; round < std::max(rounds, 1); ++round) {
    for (uint32_t r = 0; r < n; ++r) {
      for (uint32_t g = 0; g < k; ++g) {
        pairs[static_cast<size_t>(r) * k + g] = {SquaredDistance(row(r), &centers[g * d], d), r, g};
      }
    }
    std::sort(pairs.begin(), pairs.end(), [](const Pair& a, const Pair& b) {
      if (a.dist != b.dist) return a.dist < b.dist;
      return a.r != b.r ? a.r < b.r : a.g < b.g;
    });
    std::vector<uint32_t> room(k, size);
    std::vector<bool> placed(n, false);
    uint32_t left = n;
    for (const Pair& p : pairs) {
      if (left == 0) break;
      if (placed[p.r] || room[p.g] == 0) continue;
      placed[p.r] = true;
      group_of[p.r] = p.g;
      --room[p.g];
      --left;
    }
    for (auto& grp : groups) grp.clear();
    for (uint32_t r = 0; r < n; ++r) groups[group_of[r]].push_back(r);
    for (uint32_t g = 0; g < k; ++g) {
      const std::vector<float> m = GroupMean(rows, d, groups[g]);
      std::copy(m.begin(), m.end(), centers.begin() + static_cast<ptrdiff_t>(g) * d);
    }
  }
  std::sort(groups.begin(), groups.end(),
            [](const auto& a, const auto& b) { return a.front() < b.front(); });
  return groups;
}

double WithinGroupSquares(const float* rows, int d,
                          const std::vector<std::vector<uint32_t>>& groups) {
  double total = 0;
  for (const auto& grp : groups) {
    const std::vector<float> m = GroupMean(rows, d, grp);
    for (uint32_t r : grp) total += SquaredDistance(rows + static_cast<size_t>(r) * d, m.data(), d);
  }
  return total;
}

}  // namespace kvtier
