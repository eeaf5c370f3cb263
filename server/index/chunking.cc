#include "server/index/chunking.h"

#include <xmmintrin.h>

#include <algorithm>
#include <bit>
#include <cstring>
#include <limits>
#include <numeric>

#include "server/common/check.h"
#include "server/common/vec.h"
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

// Four floats added lane by lane (GCC's vector extension on SSE: each lane rounds as a scalar
// addition does).
typedef float Lanes4 __attribute__((vector_size(16)));

// Columns [j, j + 4 Q) of the sum of `members`' rows, added in their order from 0, in
// registers (Q of four columns each).
template <int Q>
void SumColumns(const float* rows, int d, const std::vector<uint32_t>& members, int j, float* sum) {
  Lanes4 a0 = {}, a1 = {}, a2 = {}, a3 = {};
  for (uint32_t r : members) {
    const float* x = rows + static_cast<size_t>(r) * d + j;
    Lanes4 t;
    std::memcpy(&t, x, sizeof t);
    a0 += t;
    if constexpr (Q > 1) {
      std::memcpy(&t, x + 4, sizeof t);
      a1 += t;
    }
    if constexpr (Q > 2) {
      std::memcpy(&t, x + 8, sizeof t);
      a2 += t;
    }
    if constexpr (Q > 3) {
      std::memcpy(&t, x + 12, sizeof t);
      a3 += t;
    }
  }
  const Lanes4 all[4] = {a0, a1, a2, a3};
  std::memcpy(sum + j, all, sizeof(Lanes4) * Q);
}

// The sum of `members`' rows, added in their order from 0, into `sum`.
void SumInto(const float* rows, int d, const std::vector<uint32_t>& members, float* sum) {
  int j = 0;
  for (; j + 16 <= d; j += 16) SumColumns<4>(rows, d, members, j, sum);
  for (; j + 4 <= d; j += 4) SumColumns<1>(rows, d, members, j, sum);
  for (; j < d; ++j) {
    float s = 0;
    for (uint32_t r : members) s += rows[static_cast<size_t>(r) * d + j];
    sum[j] = s;
  }
}

// The mean of `members`' rows: their sum in order, then one division per column.
void MeanInto(const float* rows, int d, const std::vector<uint32_t>& members, float* mean) {
  SumInto(rows, d, members, mean);
  const float count = static_cast<float>(members.size());
  int j = 0;
  for (; j + 4 <= d; j += 4) {  // four divisions at once (each lane rounds as one alone)
    Lanes4 m;
    std::memcpy(&m, mean + j, sizeof m);
    m /= count;
    std::memcpy(mean + j, &m, sizeof m);
  }
  for (; j < d; ++j) mean[j] /= count;
}

// cols[j * stride + r] = rows[r * d + j]: rows [n][d] transposed, in 4 x 4 blocks where both
// counts allow it.
void Transpose(const float* rows, uint32_t n, int d, float* cols, size_t stride) {
  uint32_t r0 = 0;
  if (d % 4 == 0) {
    for (; r0 + 4 <= n; r0 += 4) {
      for (int j = 0; j < d; j += 4) {
        __m128 a = _mm_loadu_ps(rows + static_cast<size_t>(r0) * d + j);
        __m128 b = _mm_loadu_ps(rows + static_cast<size_t>(r0 + 1) * d + j);
        __m128 c = _mm_loadu_ps(rows + static_cast<size_t>(r0 + 2) * d + j);
        __m128 e = _mm_loadu_ps(rows + static_cast<size_t>(r0 + 3) * d + j);
        _MM_TRANSPOSE4_PS(a, b, c, e);
        _mm_storeu_ps(cols + static_cast<size_t>(j) * stride + r0, a);
        _mm_storeu_ps(cols + static_cast<size_t>(j + 1) * stride + r0, b);
        _mm_storeu_ps(cols + static_cast<size_t>(j + 2) * stride + r0, c);
        _mm_storeu_ps(cols + static_cast<size_t>(j + 3) * stride + r0, e);
      }
    }
  }
  for (uint32_t r = r0; r < n; ++r) {
    for (int j = 0; j < d; ++j) cols[static_cast<size_t>(j) * stride + r] = rows[size_t{r} * d + j];
  }
}

typedef int32_t Ints4 __attribute__((vector_size(16)));

// least[r] = the least of dist[g * stride + r] over centers g in [0, k), at[r] = that g, ties
// to the lower one: four rows at a time, each lane comparing as the plain loop does (a NaN
// never replaces, nor is replaced by less than itself).
void Closest(const float* dist, uint32_t n, uint32_t k, size_t stride, float* least, uint32_t* at) {
  uint32_t r = 0;
  for (; r + 4 <= n; r += 4) {
    Lanes4 best;
    std::memcpy(&best, dist + r, sizeof best);
    Ints4 where = {0, 0, 0, 0};
    for (uint32_t g = 1; g < k; ++g) {
      Lanes4 v;
      std::memcpy(&v, dist + g * stride + r, sizeof v);
      const Ints4 closer = v < best;
      best = closer ? v : best;
      where = closer ? Ints4{int32_t(g), int32_t(g), int32_t(g), int32_t(g)} : where;
    }
    std::memcpy(least + r, &best, sizeof best);
    for (int i = 0; i < 4; ++i) at[r + i] = static_cast<uint32_t>(where[i]);
  }
  for (; r < n; ++r) {
    float best = dist[r];
    uint32_t where = 0;
    for (uint32_t g = 1; g < k; ++g) {
      const float v = dist[g * stride + r];
      if (v < best) best = v, where = g;
    }
    least[r] = best;
    at[r] = where;
  }
}

std::vector<float> GroupMean(const float* rows, int d, const std::vector<uint32_t>& members) {
  std::vector<float> mean(d);
  MeanInto(rows, d, members, mean.data());
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
  // The rows transposed ([d][n8], n8 the next multiple of 8), so that one center's distance
  // to every row is one pass (SquaredDistances: the bits of SquaredDistance, row by row).
  const uint32_t n8 = (n + 7) / 8 * 8;
  // Scratch kept by the thread from one call to the next (an aging thread regroups span after
  // span): neither allocated nor zeroed each time. Only the padding rows [n, n8) need zeros.
  thread_local std::vector<float> cols, dist;
  cols.resize(static_cast<size_t>(d) * n8);
  Transpose(rows, n, d, cols.data(), n8);
  for (int j = 0; j < d && n < n8; ++j) {
    std::fill_n(cols.begin() + static_cast<ptrdiff_t>(j) * n8 + n, n8 - n, 0.f);
  }
  const int stride = static_cast<int>(n8);
  // Farthest-point seeding.
  std::vector<uint32_t> all(n);
  std::iota(all.begin(), all.end(), 0u);
  const std::vector<float> mean = GroupMean(rows, d, all);
  std::vector<float> centers(static_cast<size_t>(k) * d);
  dist.resize(static_cast<size_t>(k) * n8);  // [center][row], each written before it is read
  SquaredDistances(cols.data(), stride, static_cast<int>(n), d, mean.data(), dist.data());
  const uint32_t first = static_cast<uint32_t>(std::max_element(dist.begin(), dist.begin() + n) -
                                               dist.begin());  // the first farthest
  std::copy(row(first), row(first) + d, centers.begin());
  // Each seed's distances are kept where the first round reads its center's: that round
  // computes only the last seed's.
  std::vector<float> nearest(n, std::numeric_limits<float>::infinity());
  for (uint32_t g = 1; g < k; ++g) {
    const float* to_last = &dist[(g - 1) * n8];
    SquaredDistances(cols.data(), stride, static_cast<int>(n), d, &centers[(g - 1) * d],
                     &dist[(g - 1) * n8]);
    uint32_t best = 0;
    float best_dist = -1.f;
    for (uint32_t r = 0; r < n; ++r) {
      nearest[r] = std::min(nearest[r], to_last[r]);
      if (nearest[r] > best_dist) best_dist = nearest[r], best = r;
    }
    std::copy(row(best), row(best) + d, centers.begin() + static_cast<ptrdiff_t>(g) * d);
  }
  // A (row, center) pair as one number whose order is (distance, row, center): a distance is
  // a sum of squares, never negative, so its bits order as it does.
  // Its low half is r << bits | g, which orders as (r, g).
  const int bits = std::bit_width(k - 1);
  CHECK(std::bit_width(n - 1) + bits <= 32) << n << " rows in " << k << " groups";
  const uint32_t g_mask = (1u << bits) - 1;
  auto key = [bits](float dist, uint32_t r, uint32_t g) {
    return uint64_t{std::bit_cast<uint32_t>(dist)} << 32 | (uint64_t{r} << bits | g);
  };
  std::vector<float> least(n);  // each row's closest center's distance, and that center
  std::vector<uint32_t> least_g(n), held_count(k);
  std::vector<uint64_t> held(size_t{k} * size);  // the pairs each center holds
  std::vector<uint32_t> group_of(n), last_group_of;
  const int last_round = std::max(rounds, 1) - 1;
  for (int round = 0; round <= last_round; ++round) {
    for (uint32_t g = round == 0 ? k - 1 : 0; g < k; ++g) {
      SquaredDistances(cols.data(), stride, static_cast<int>(n), d, &centers[g * d], &dist[g * n8]);
    }
    // Assigning the closest pairs first while the center has room, as if every pair were
    // sorted, is the one stable assignment of rows to centers whose preferences are that
    // order of pairs (the smallest pair is in every stable assignment, and so on), which
    // deferred acceptance finds without the sort: each row offers its closest pair not yet
    // refused (ties to the lower center); a center holds the smallest offers it has had, up
    // to its size, and turns away the largest. Each row offers each center at most once.
    Closest(dist.data(), n, k, n8, least.data(), least_g.data());
    std::fill(held_count.begin(), held_count.end(), 0u);
    for (uint32_t first = 0; first < n; ++first) {
      uint64_t pair = key(least[first], first, least_g[first]);
      for (;;) {
        const uint32_t g = pair & g_mask;
        uint64_t* h = &held[size_t{g} * size];  // a max-heap of the center's pairs
        if (held_count[g] < size) {
          h[held_count[g]++] = pair;
          std::push_heap(h, h + held_count[g]);
          break;
        }
        if (pair < h[0]) {  // held; the center's largest pair is turned away instead
          std::pop_heap(h, h + size);
          std::swap(pair, h[size - 1]);
          std::push_heap(h, h + size);
        }
        // `pair` was turned away: its row offers the smallest of its pairs above it (pairs
        // are distinct, and some center has room).
        const uint32_t r = static_cast<uint32_t>(pair) >> bits;
        uint64_t offer = std::numeric_limits<uint64_t>::max();
        for (uint32_t c = 0; c < k; ++c) {
          const uint64_t mine = key(dist[c * n8 + r], r, c);
          if (mine > pair) offer = std::min(offer, mine);
        }
        CHECK(offer != std::numeric_limits<uint64_t>::max()) << "row " << r << " refused by all";
        pair = offer;
      }
    }
    for (uint32_t g = 0; g < k; ++g) {
      for (uint32_t i = 0; i < size; ++i) {
        group_of[static_cast<uint32_t>(held[size_t{g} * size + i]) >> bits] = g;
      }
    }
    // An assignment equal to the last round's moves no center: every later round repeats it.
    if (round > 0 && group_of == last_group_of) break;
    last_group_of = group_of;
    for (auto& grp : groups) grp.clear();
    for (uint32_t r = 0; r < n; ++r) groups[group_of[r]].push_back(r);
    // Each center moves to its rows' mean (for a next round, if any).
    if (round == last_round) break;
    for (uint32_t g = 0; g < k; ++g) MeanInto(rows, d, groups[g], &centers[g * d]);
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
