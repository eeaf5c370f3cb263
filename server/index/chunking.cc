#include "server/index/chunking.h"

#include <algorithm>
#include <bit>
#include <cstring>
#include <functional>
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

// Four floats, added and multiplied lane by lane (GCC's vector extension: SSE on the baseline
// target, which has no fused multiply-add, so each lane rounds exactly as the scalar loop).
typedef float Lanes4 __attribute__((vector_size(16)));

// SquaredDistance of `row` to each of the k centers held transposed in `t` ([d][k8], k8 the
// next multiple of 8), into out[0, k): eight centers at once, each lane the same sums in the
// same order as SquaredDistance, so the same bits.
void Distances(const float* row, const float* t, uint32_t k8, int d, float* out) {
  for (uint32_t g = 0; g < k8; g += 8) {
    Lanes4 lo = {0, 0, 0, 0}, hi = {0, 0, 0, 0};  // two chains, in registers
    for (int j = 0; j < d; ++j) {
      Lanes4 c0, c1;
      const float* at = t + static_cast<size_t>(j) * k8 + g;
      std::memcpy(&c0, at, sizeof c0);
      std::memcpy(&c1, at + 4, sizeof c1);
      const Lanes4 d0 = row[j] - c0, d1 = row[j] - c1;
      lo += d0 * d0;
      hi += d1 * d1;
    }
    std::memcpy(out + g, &lo, sizeof lo);
    std::memcpy(out + g + 4, &hi, sizeof hi);
  }
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
  // A (row, center) pair as one number whose order is (distance, row, center): a distance is
  // a sum of squares, never negative, so its bits order as it does.
  auto key = [k](float dist, uint32_t r, uint32_t g) {
    return uint64_t{std::bit_cast<uint32_t>(dist)} << 32 | (uint64_t{r} * k + g);
  };
  std::vector<uint64_t> pairs(static_cast<size_t>(n) * k);  // row-major: each row's k pairs
  std::vector<uint32_t> next(n);                            // each row's next pair to offer
  std::vector<uint64_t> heap;
  heap.reserve(n);
  std::vector<uint32_t> group_of(n);
  const uint32_t k8 = (k + 7) / 8 * 8;
  std::vector<float> transposed(static_cast<size_t>(d) * k8, 0.f), dist(k8);
  for (int round = 0; round < std::max(rounds, 1); ++round) {
    for (uint32_t g = 0; g < k; ++g) {
      for (int j = 0; j < d; ++j) transposed[static_cast<size_t>(j) * k8 + g] = centers[g * d + j];
    }
    // Assigning the closest pairs first while the center has room, as if every pair were
    // sorted, visits only each unplaced row's closest pair not yet refused: rows' sorted
    // pairs merged through a heap give the same assignment for a fraction of the sorting.
    heap.clear();
    for (uint32_t r = 0; r < n; ++r) {
      uint64_t* mine = &pairs[static_cast<size_t>(r) * k];
      Distances(row(r), transposed.data(), k8, d, dist.data());
      for (uint32_t g = 0; g < k; ++g) mine[g] = key(dist[g], r, g);
      std::sort(mine, mine + k);
      next[r] = 1;
      heap.push_back(mine[0]);
    }
    std::make_heap(heap.begin(), heap.end(), std::greater<>());
    std::vector<uint32_t> room(k, size);
    for (uint32_t left = n; left > 0;) {
      std::pop_heap(heap.begin(), heap.end(), std::greater<>());
      const uint32_t pair = static_cast<uint32_t>(heap.back());
      const uint32_t r = pair / k, g = pair % k;
      if (room[g] > 0) {  // placed; its other pairs are never offered
        group_of[r] = g;
        --room[g];
        --left;
        heap.pop_back();
      } else {  // that center is full: the row offers its next closest (some center has room)
        heap.back() = pairs[static_cast<size_t>(r) * k + next[r]++];
        std::push_heap(heap.begin(), heap.end(), std::greater<>());
      }
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
