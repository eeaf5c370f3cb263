#include "server/index/chunk_ranker.h"

#include <xmmintrin.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <optional>
#include <vector>

#include "server/common/check.h"
#include "server/common/vec.h"

namespace kvtier {

const float* FarthestRow(const float* rows, uint32_t n, int d, const float* mean) {
  std::vector<float> diff(d);
  const float* best_row = rows;
  float best = -1.f;
  for (uint32_t r = 0; r < n; ++r) {
    const float* row = rows + static_cast<size_t>(r) * d;
    for (int j = 0; j < d; ++j) diff[j] = row[j] - mean[j];
    const float dist = Dot(diff.data(), diff.data(), d);
    if (dist > best) best = dist, best_row = row;
  }
  return best_row;
}

float MeanScore(std::span<const float> queries, int group, const ChunkCandidate& c, int head_dim) {
  float best = -std::numeric_limits<float>::infinity();
  for (int h = 0; h < group; ++h) {
    best = std::max(best, MeanDot(queries.data() + static_cast<size_t>(h) * head_dim, c, head_dim));
  }
  return best;
}

namespace {

// log(n - 1) for chunk sizes n, -inf for n <= 1: the same values std::log gives, computed once
// for n below kLogRestTable (LogRestTable), in a call each above.
constexpr uint32_t kLogRestTable = 1024;
const float* LogRestTable() {
  static const std::vector<float> table = [] {
    std::vector<float> t(kLogRestTable);
    for (uint32_t i = 0; i < t.size(); ++i) {
      t[i] = i > 1 ? std::log(static_cast<float>(i - 1)) : -std::numeric_limits<float>::infinity();
    }
    return t;
  }();
  return table.data();
}
// With the table fetched once by the caller (a loop over many chunks).
inline float LogRest(const float* table, uint32_t n) {
  return n < kLogRestTable ? table[n] : std::log(static_cast<float>(n - 1));
}
float LogRest(uint32_t n) { return LogRest(LogRestTable(), n); }

}  // namespace

float LogAddExp(float hi, float lo) {
  float e = lo - hi;
  ExpInPlace(&e, 1);
  float u = 1.f + e;
  LogInPlace(&u, 1);
  return hi + u;
}

namespace {

// The steps of LogAddExp for a block of `n` candidates' `group` heads laid out [block][head]
// (hi = max(a, b), t = min(a, b) - hi): e^t, log(1 + e^t), hi + that, all at once, and each
// candidate's max over its heads into out[i].
void FinishLsePeak(const float* hi, float* t, int n, int group, float* out) {
  Log1pExpInPlace(t, n * group);
  for (int i = 0; i < n; ++i) {
    float best = -std::numeric_limits<float>::infinity();
    for (int h = 0; h < group; ++h) best = std::max(best, hi[i * group + h] + t[i * group + h]);
    out[i] = best;
  }
}

// One candidate's a (mean term) and b (peak term) of every head into hi and t, from its dot
// products mean_dot[group] and peak_dot[group] and their scales.
inline void LsePeakTerms(const float* mean_dot, const float* peak_dot, float mean_scale,
                         float peak_scale, uint32_t tokens, int group, float inv_sqrt_d, float* hi,
                         float* t) {
  const float log_rest = LogRest(tokens);
  for (int h = 0; h < group; ++h) {
    const float a = mean_dot[h] * mean_scale * inv_sqrt_d + log_rest;
    const float b = peak_dot[h] * peak_scale * inv_sqrt_d;
    hi[h] = std::max(a, b);
    t[h] = std::min(a, b) - hi[h];
  }
}

// LsePeakTerms for one head of n candidates at once, four at a time (SSE, which every x86-64
// has; the same IEEE operations, so the same bits): a = mean_dot * mean_scale * inv_sqrt_d +
// log_rest, b = peak_dot * peak_scale * inv_sqrt_d, hi = max(a, b), t = min(a, b) - hi.
// _mm_max_ps(b, a) is std::max(a, b) (a unless a < b), _mm_min_ps(b, a) std::min(a, b).
void LsePeakTermsOfHead(const float* mean_dot, const float* peak_dot, const float* mean_scale,
                        const float* peak_scale, const float* log_rest, uint32_t n,
                        float inv_sqrt_d, float* hi, float* t) {
  const __m128 s = _mm_set1_ps(inv_sqrt_d);
  uint32_t i = 0;
  for (; i + 4 <= n; i += 4) {
    const __m128 a = _mm_add_ps(
        _mm_mul_ps(_mm_mul_ps(_mm_loadu_ps(mean_dot + i), _mm_loadu_ps(mean_scale + i)), s),
        _mm_loadu_ps(log_rest + i));
    const __m128 b =
        _mm_mul_ps(_mm_mul_ps(_mm_loadu_ps(peak_dot + i), _mm_loadu_ps(peak_scale + i)), s);
    const __m128 top = _mm_max_ps(b, a);
    _mm_storeu_ps(hi + i, top);
    _mm_storeu_ps(t + i, _mm_sub_ps(_mm_min_ps(b, a), top));
  }
  for (; i < n; ++i) {
    const float a = mean_dot[i] * mean_scale[i] * inv_sqrt_d + log_rest[i];
    const float b = peak_dot[i] * peak_scale[i] * inv_sqrt_d;
    hi[i] = std::max(a, b);
    t[i] = std::min(a, b) - hi[i];
  }
}

// FinishLsePeak's last step for values head by head ([head][n]): out[i] = the largest of
// hi + t over the heads, taken in head order as std::max takes it (_mm_max_ps(v, best) is
// std::max(best, v)).
void BestOfHeads(const float* hi, const float* t, uint32_t n, int group, float* out) {
  uint32_t i = 0;
  for (; i + 4 <= n; i += 4) {
    __m128 best = _mm_set1_ps(-std::numeric_limits<float>::infinity());
    for (int h = 0; h < group; ++h) {
      const size_t at = static_cast<size_t>(h) * n + i;
      best = _mm_max_ps(_mm_add_ps(_mm_loadu_ps(hi + at), _mm_loadu_ps(t + at)), best);
    }
    _mm_storeu_ps(out + i, best);
  }
  for (; i < n; ++i) {
    float best = -std::numeric_limits<float>::infinity();
    for (int h = 0; h < group; ++h) {
      const size_t at = static_cast<size_t>(h) * n + i;
      best = std::max(best, hi[at] + t[at]);
    }
    out[i] = best;
  }
}

// Blocks of candidates: the scratch arrays hold kScratch (candidate, head) pairs.
constexpr int kScratch = 1024;

}  // namespace

void LsePeakScores(std::span<const float> queries, int group,
                   std::span<const ChunkCandidate> candidates, int head_dim, float* out) {
  const float inv_sqrt_d = 1.f / std::sqrt(static_cast<float>(head_dim));
  CHECK(group >= 1 && group <= kScratch);  // the session allows 256 query heads per KV head
  const int block = kScratch / group;
  float hi[kScratch], t[kScratch];
  float dots[2 * kScratch];  // a block's candidates' [mean, peak][head] dot products
  int row[kScratch];  // where candidate i's lie in dots (in units of 2 * group); -1: loose, so far
  // A block's compact chunks' codes gathered side by side, mean then peak each (most lie so in
  // their stream already; a searched cluster's or a search's picks do not): one call of the rows
  // kernel for all of them, four rows a pass, MeanDot's and PeakDot's values bit for bit. The
  // query's codes are made once, at the first compact chunk (loose chunks, the window's, take
  // the floats).
  const size_t pair = 2 * static_cast<size_t>(head_dim);
  std::vector<int8_t> gathered;
  std::optional<QueryInt8Group> q8;
  for (size_t first = 0; first < candidates.size(); first += block) {
    const int n = static_cast<int>(std::min<size_t>(block, candidates.size() - first));
    const ChunkCandidate* c = &candidates[first];
    int compact = 0;
    for (int i = 0; i < n; ++i) {
      row[i] = -1;
      if (c[i].mean_q == nullptr || c[i].peak_q != c[i].mean_q + head_dim) continue;
      if (gathered.empty()) gathered.resize(static_cast<size_t>(block) * pair);
      std::memcpy(&gathered[static_cast<size_t>(compact) * pair], c[i].mean_q, pair);
      row[i] = compact++;
    }
    if (compact > 0) {
      if (!q8) q8.emplace(queries.data(), group, head_dim);
      DotInt8GroupRowsStrided(*q8, gathered.data(), 2 * compact, head_dim, dots, group, 1);
    }
    int loose = compact;  // the loose ones' dots after the compact ones'
    for (int i = 0; i < n; ++i) {
      const bool packed = row[i] >= 0;
      if (!packed) {
        row[i] = loose++;
        float* d = dots + static_cast<size_t>(2 * row[i]) * group;
        for (int h = 0; h < group; ++h) {
          const float* q = queries.data() + static_cast<size_t>(h) * head_dim;
          d[h] = MeanDot(q, c[i], head_dim);
          d[group + h] = PeakDot(q, c[i], head_dim);
        }
      }
      const float* mean_dot = dots + static_cast<size_t>(2 * row[i]) * group;
      LsePeakTerms(mean_dot, mean_dot + group, packed ? c[i].mean_scale : 1.f,
                   packed ? c[i].peak_scale : 1.f, c[i].tokens, group, inv_sqrt_d, hi + i * group,
                   t + i * group);
    }
    FinishLsePeak(hi, t, n, group, out + first);
  }
}

void LsePeakScoresCompact(std::span<const float> queries, int group, const int8_t* codes,
                          const uint8_t* tiles, const float* scales, const uint32_t* tokens,
                          uint32_t n, int head_dim, float* out) {
  CHECK(group >= 1 && group <= kScratch);
  const QueryInt8Group q8(queries.data(), group, head_dim);  // the codes, once for every block
  LsePeakScoresCompact(q8, codes, tiles, scales, tokens, n, out);
}

void LsePeakScoresCompact(const QueryInt8Group& q8, const int8_t* codes, const uint8_t* tiles,
                          const float* scales, const uint32_t* tokens, uint32_t n, float* out) {
  const int group = q8.group(), head_dim = q8.n();
  const float inv_sqrt_d = 1.f / std::sqrt(static_cast<float>(head_dim));
  CHECK(group >= 1 && group <= kScratch);
  uint32_t block = kScratch / group;
  // A block's values head by head ([head][chunk]), so that every step below is a loop over the
  // block's chunks, several at a time: the mean's and the peak's dot products, the terms a and
  // b (LsePeakTerms), hi and t, then FinishLsePeak's exponentials and logarithms and the best
  // head. Each value is the same operations on the same operands as LsePeakTerms and
  // FinishLsePeak, so the same bits.
  float mean[kScratch], peak[kScratch], hi[kScratch], t[kScratch];
  float mean_scale[kScratch], peak_scale[kScratch], log_rest[kScratch];
  // The tiles where the VNNI kernel reads them, in blocks of whole tiles; else the rows.
  const bool tiled = tiles != nullptr && q8.kernel() == Int8Kernel::kVnni && block >= kInt8TileRows;
  if (tiled) block -= block % kInt8TileRows;
  const float* log_rest_table = LogRestTable();
  for (uint32_t first = 0; first < n; first += block) {
    const uint32_t b = std::min(block, n - first);
    const int8_t* c = codes + static_cast<size_t>(first) * 2 * head_dim;
    const int stride = 2 * head_dim, column = static_cast<int>(b);
    if (tiled) {
      DotInt8GroupTiles(q8, tiles, 2, 0, first, b, mean, column);
      DotInt8GroupTiles(q8, tiles, 2, 1, first, b, peak, column);
    } else {
      DotInt8GroupRowsStrided(q8, c, column, stride, mean, 1, column);
      DotInt8GroupRowsStrided(q8, c + head_dim, column, stride, peak, 1, column);
    }
    for (uint32_t i = 0; i < b; ++i) {
      mean_scale[i] = scales[2 * (first + i)];
      peak_scale[i] = scales[2 * (first + i) + 1];
      log_rest[i] = LogRest(log_rest_table, tokens[first + i]);
    }
    for (int h = 0; h < group; ++h) {
      LsePeakTermsOfHead(mean + h * b, peak + h * b, mean_scale, peak_scale, log_rest, b,
                         inv_sqrt_d, hi + h * b, t + h * b);
    }
    Log1pExpInPlace(t, group * column);
    BestOfHeads(hi, t, b, group, out + first);
  }
}

void MeanScoresCompact(const QueryInt8Group& q8, const int8_t* codes, int stride,
                       const float* mean_scales, int scale_stride, uint32_t n, float* out) {
  const int group = q8.group();
  CHECK(group >= 1 && group <= kScratch);
  const uint32_t block = kScratch / group;
  float dots[kScratch];  // a block's [chunk][head]
  for (uint32_t first = 0; first < n; first += block) {
    const uint32_t b = std::min(block, n - first);
    DotInt8GroupRowsStrided(q8, codes + static_cast<size_t>(first) * stride, static_cast<int>(b),
                            stride, dots, group, 1);
    // MeanScore: the largest over the heads, in order, of MeanDot (DotInt8 times the scale).
    for (uint32_t i = 0; i < b; ++i) {
      const float scale = mean_scales[static_cast<size_t>(first + i) * scale_stride];
      float best = -std::numeric_limits<float>::infinity();
      for (int h = 0; h < group; ++h) best = std::max(best, dots[i * group + h] * scale);
      out[first + i] = best;
    }
  }
}

float LsePeakScore(std::span<const float> queries, int group, const ChunkCandidate& c,
                   int head_dim) {
  float score;
  LsePeakScores(queries, group, std::span<const ChunkCandidate>(&c, 1), head_dim, &score);
  return score;
}

void ScoreCandidates(v1::Ranking ranking, std::span<const float> queries, int group, int head_dim,
                     std::span<const ChunkCandidate> candidates, float* out) {
  if (ranking == v1::RANKING_LSE_PEAK) {
    LsePeakScores(queries, group, candidates, head_dim, out);
  } else {
    for (size_t i = 0; i < candidates.size(); ++i) {
      out[i] = MeanScore(queries, group, candidates[i], head_dim);
    }
  }
}

namespace {

// A candidate as one integer that orders as FillGreedy's `better` does (the larger key first):
// the score's bits made to order as their values (negatives flipped; -0 made +0 first, as the
// scores' == holds them equal), then the index reversed (the lower index first on a tie).
uint64_t RankKey(const ScoredChunk& c) {
  const uint32_t bits = std::bit_cast<uint32_t>(c.score + 0.f);
  const uint32_t ordered = (bits & 0x80000000u) ? ~bits : bits | 0x80000000u;
  return uint64_t{ordered} << 32 | (0xffffffffu - c.index);
}
uint32_t RankKeyIndex(uint64_t key) { return 0xffffffffu - static_cast<uint32_t>(key); }

}  // namespace

std::vector<uint32_t> FillGreedy(std::vector<ScoredChunk> scored, uint64_t budget,
                                 uint64_t extra_budget, std::vector<uint32_t>* extra,
                                 FillOrder order) {
  const uint64_t wide = budget + (extra != nullptr ? extra_budget : 0);
  // A strict total order (chunk indices differ), so every partial order below picks and ranks
  // what a full sort would.
  auto better = [](const ScoredChunk& a, const ScoredChunk& b) {
    if (a.score != b.score) return a.score > b.score;
    return a.index < b.index;
  };
  // When every candidate has the same size (the usual case: whole chunks between the sinks
  // and the window), the greedy answer is exactly the best budget/size: select those (linear),
  // then sort only them.
  const bool uniform = std::all_of(scored.begin(), scored.end(), [&](const ScoredChunk& c) {
    return c.tokens == scored.front().tokens;
  });
  size_t sorted = scored.size();
  if (uniform && !scored.empty() && scored.front().tokens > 0) {
    sorted = std::min<size_t>(scored.size(), wide / scored.front().tokens);
    if (sorted > 0 && sorted <= kInsertionPicks) {
      // Few picks (a Select's budget over many chunks): the best so far kept in order at the
      // front, each other candidate against the worst of them (it loses, mostly, in that one
      // comparison) and placed by insertion when it wins.
      std::sort(scored.begin(), scored.begin() + sorted, better);
      float worst = scored[sorted - 1].score;  // the worst pick's score, kept in a register
      for (size_t i = sorted; i < scored.size(); ++i) {
        if (scored[i].score < worst || !better(scored[i], scored[sorted - 1])) continue;
        const ScoredChunk c = scored[i];
        size_t at = sorted - 1;
        for (; at > 0 && better(c, scored[at - 1]); --at) scored[at] = scored[at - 1];
        scored[at] = c;
        worst = scored[sorted - 1].score;
      }
    } else {
      if (order == FillOrder::kAny) {
        // The fill of equal chunks takes the best budget / size, and the wider one the next
        // ones up to `sorted`: two partitions find both sets, in no order, with no sort, over
        // one 64-bit key a candidate whose order is `better`'s.
        const size_t take = std::min<size_t>(sorted, budget / scored.front().tokens);
        std::vector<uint64_t> keys(scored.size());
        for (size_t i = 0; i < scored.size(); ++i) keys[i] = RankKey(scored[i]);
        if (sorted < keys.size()) {
          std::nth_element(keys.begin(), keys.begin() + sorted, keys.end(), std::greater<>());
        }
        if (take < sorted) {
          std::nth_element(keys.begin(), keys.begin() + take, keys.begin() + sorted,
                           std::greater<>());
        }
        std::vector<uint32_t> out(take);
        for (size_t i = 0; i < take; ++i) out[i] = RankKeyIndex(keys[i]);
        if (extra != nullptr) {
          extra->reserve(extra->size() + sorted - take);
          for (size_t i = take; i < sorted; ++i) extra->push_back(RankKeyIndex(keys[i]));
        }
        return out;
      }
      if (sorted < scored.size()) {
        std::nth_element(scored.begin(), scored.begin() + sorted, scored.end(), better);
      }
      std::sort(scored.begin(), scored.begin() + sorted, better);
    }
  } else {
    std::sort(scored.begin(), scored.end(), better);
  }
  // The greedy fill of `budget`, and beside it (for the guess) that of the wider budget: each
  // takes a chunk by its own tokens used so far; what only the wider one takes is the extra.
  std::vector<uint32_t> out;
  out.reserve(sorted);  // at most: one allocation, not one per doubling
  if (extra != nullptr) extra->reserve(sorted);
  uint64_t used = 0, used_wide = 0;
  for (size_t i = 0; i < sorted; ++i) {
    const ScoredChunk& c = scored[i];
    const bool in_wide = extra != nullptr && used_wide + c.tokens <= wide;
    if (in_wide) used_wide += c.tokens;
    if (used + c.tokens <= budget) {
      used += c.tokens;
      out.push_back(c.index);
    } else if (in_wide) {
      extra->push_back(c.index);
    }
  }
  return out;
}

std::vector<uint32_t> FillGreedyBySort(std::vector<ScoredChunk> scored, uint64_t budget,
                                       uint64_t extra_budget, std::vector<uint32_t>* extra) {
  std::sort(scored.begin(), scored.end(), [](const ScoredChunk& a, const ScoredChunk& b) {
    return a.score != b.score ? a.score > b.score : a.index < b.index;
  });
  std::vector<uint32_t> out;
  extra->clear();
  uint64_t used = 0, used_wide = 0;
  for (const ScoredChunk& c : scored) {
    const bool in_wide = used_wide + c.tokens <= budget + extra_budget;
    if (in_wide) used_wide += c.tokens;
    if (used + c.tokens <= budget) {
      used += c.tokens;
      out.push_back(c.index);
    } else if (in_wide) {
      extra->push_back(c.index);
    }
  }
  return out;
}

std::vector<uint32_t> SelectChunks(v1::Ranking ranking, std::span<const float> queries, int group,
                                   int head_dim, std::span<const ChunkCandidate> candidates,
                                   uint64_t budget, uint64_t extra_budget,
                                   std::vector<uint32_t>* extra) {
  std::vector<float> scores(candidates.size());
  ScoreCandidates(ranking, queries, group, head_dim, candidates, scores.data());
  std::vector<ScoredChunk> scored;
  scored.reserve(candidates.size());
  for (size_t i = 0; i < candidates.size(); ++i) {
    scored.push_back({scores[i], candidates[i].index, candidates[i].tokens});
  }
  return FillGreedy(std::move(scored), budget, extra_budget, extra);
}

}  // namespace kvtier
