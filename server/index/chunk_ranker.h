// Ranking of a stream's chunks for one decode query: the scores, and the linear scan a
// session runs below kIndexMinCandidates (the cluster index computes the same scores). Two
// scores, chosen per session (SessionPolicy.ranking), both the max over the KV head's query
// heads:
//   RANKING_MEAN      q . mu, mu the mean of the chunk's keys;
//   RANKING_LSE_PEAK  log((n - 1) e^(q.mu / sqrt d) + e^(q.k_peak / sqrt d)), k_peak the key
//                     farthest from mu: the chunk's attention mass (log of sum of e^(q.k/sqrt d))
//                     estimated as n - 1 keys at the mean plus the one key that sticks out.
// Measured on SmolLM2's own tensors (bench/ranking/compare.py, docs/QUALITY.md): the mean
// score loses chunks whose mass sits on one key (a delimiter, a name); the peak term keeps them.
#ifndef KVTIER_SERVER_INDEX_CHUNK_RANKER_H_
#define KVTIER_SERVER_INDEX_CHUNK_RANKER_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <span>
#include <vector>

#include "kvtier/v1/kvtier.pb.h"
#include "server/common/vec.h"

namespace kvtier {

// A chunk's statistics as floats (key_sum, scale, peak), or compact as signed bytes times a
// float scale each (mean_q, peak_q: ChunkStats' final chunks), which the scores then read
// instead.
struct ChunkCandidate {
  uint32_t index;        // the chunk's index in its stream
  uint32_t tokens;       // tokens it would add to the selection
  const float* key_sum;  // [head_dim] sum of the chunk's keys (any positive multiple of the mean)
  float scale;           // > 0: mean = scale * key_sum (1 / tokens for a sum)
  const float* peak = nullptr;     // [head_dim] the key farthest from the mean (LSE_PEAK only)
  const int8_t* mean_q = nullptr;  // [head_dim] the mean key = mean_q * mean_scale, compact
  const int8_t* peak_q = nullptr;  // [head_dim] the peak = peak_q * peak_scale, compact
  float mean_scale = 0, peak_scale = 0;
};

// q . mean and q . peak of a candidate, from whichever form it has.
inline float MeanDot(const float* q, const ChunkCandidate& c, int head_dim) {
  return c.mean_q != nullptr ? DotInt8(q, c.mean_q, head_dim) * c.mean_scale
                             : Dot(q, c.key_sum, head_dim) * c.scale;
}
inline float PeakDot(const float* q, const ChunkCandidate& c, int head_dim) {
  return c.peak_q != nullptr ? DotInt8(q, c.peak_q, head_dim) * c.peak_scale
                             : Dot(q, c.peak, head_dim);
}

// log(e^hi + e^lo) for hi >= lo (lo may be -inf) for one pair, by the steps LsePeakScores
// takes for every (chunk, head) at once: hi + log(1 + e^(lo - hi)) through ExpInPlace and
// LogInPlace, whose results do not depend on how many values go together, so both give the
// same bits (the index's bound is tested against it). log(1 + e) rather than log1p: its extra
// precision (under 2^-24 of 1 + e) is far below the rounding of hi + that term.
float LogAddExp(float hi, float lo);

// An upper bound on log(1 + e^t) for t <= 0, given exp_t = e^t (to within 1e-6), with no
// log, for the index's bounds on the LSE-peak score: log(1 + u) <= u, and log(1 + e^t) =
// log 2 + t/2 + log cosh(t/2) <= log 2 + t/2 + t^2/8. The smaller of the two is within 0.023
// of the true value for every t <= 0 (the first is the smaller below about -1.5). Plain
// arithmetic, so that a loop over many t vectorizes.
inline float SoftplusUpperBound(float t, float exp_t) {
  return std::min(exp_t, 0.6931472f + t * (0.5f + t * 0.125f));
}

// The row of rows [n][d] farthest from `mean` (squared Euclidean; the first of equals): a
// chunk's peak key for RANKING_LSE_PEAK.
const float* FarthestRow(const float* rows, uint32_t n, int d, const float* mean);

// max over h of queries[h] . (scale * key_sum), queries [group][head_dim].
float MeanScore(std::span<const float> queries, int group, const ChunkCandidate& c, int head_dim);

// max over h of log((tokens - 1) e^(a_h) + e^(b_h)), a_h = queries[h] . mean / sqrt(d),
// b_h = queries[h] . peak / sqrt(d). A one-token chunk scores b.
float LsePeakScore(std::span<const float> queries, int group, const ChunkCandidate& c,
                   int head_dim);
// LsePeakScore of every candidate into out[i], the same bits, with the exponentials and
// logarithms of many candidates and heads eight at a time.
void LsePeakScores(std::span<const float> queries, int group,
                   std::span<const ChunkCandidate> candidates, int head_dim, float* out);

// Each candidate's score by `ranking` (LsePeakScore or MeanScore) into out[i].
void ScoreCandidates(v1::Ranking ranking, std::span<const float> queries, int group, int head_dim,
                     std::span<const ChunkCandidate> candidates, float* out);

// LsePeakScores of n compact chunks as ChunkStats holds them side by side, read in place:
// codes [n][2][head_dim] signed bytes (mean, then peak), scales [n][2] (mean's, then peak's),
// tokens [n]; and, where not null, the same codes in tiles (PutInt8TileRow, parts 2: mean,
// then peak), which the VNNI kernel reads instead. The same bits as LsePeakScores of their
// candidates, without building them.
void LsePeakScoresCompact(std::span<const float> queries, int group, const int8_t* codes,
                          const uint8_t* tiles, const float* scales, const uint32_t* tokens,
                          uint32_t n, int head_dim, float* out);
// The same with the query group's codes made by the caller (QueryInt8Group of the same queries,
// group and head_dim), as a search that scores many runs of chunks makes them once.
void LsePeakScoresCompact(const QueryInt8Group& q8, const int8_t* codes, const uint8_t* tiles,
                          const float* scales, const uint32_t* tokens, uint32_t n, float* out);

// MeanScore of n compact chunks read in place: chunk i's mean codes at codes + i * stride
// (head_dim signed bytes) and its mean's scale at mean_scales[i * scale_stride], scored with
// the query group's codes q8 made once (MeanScore makes them again for every chunk and head):
// the same bits.
void MeanScoresCompact(const QueryInt8Group& q8, const int8_t* codes, int stride,
                       const float* mean_scales, int scale_stride, uint32_t n, float* out);

// A candidate's score, index and tokens: what the greedy fill reads.
struct ScoredChunk {
  float score;
  uint32_t index;  // the chunk's, which breaks ties
  uint32_t tokens;
};

// The order FillGreedy returns its picks (and the extra ones) in: best first, as the fill
// takes them, or any (the same chunks, for a caller that marks them in a set: where every
// candidate has the same size, two partitions find them without sorting any).
enum class FillOrder { kBestFirst, kAny };

// Up to this many picks of equal chunks, FillGreedy (and RankStream's scan) keeps the best in
// order by insertion rather than by nth_element and a sort.
inline constexpr size_t kInsertionPicks = 64;

// The greedy fill of SelectChunks over candidates already scored (any order).
std::vector<uint32_t> FillGreedy(std::vector<ScoredChunk> scored, uint64_t budget,
                                 uint64_t extra_budget = 0, std::vector<uint32_t>* extra = nullptr,
                                 FillOrder order = FillOrder::kBestFirst);
// FillGreedy's definition, which it must equal (for tests and benches): every candidate sorted
// (score down, index up), then the greedy fill of `budget` and, beside it, of budget +
// extra_budget (what only that one takes, in order, into *extra).
std::vector<uint32_t> FillGreedyBySort(std::vector<ScoredChunk> scored, uint64_t budget,
                                       uint64_t extra_budget, std::vector<uint32_t>* extra);

// The chunk indices, best score first, whose tokens fit in `budget` together: greedy by
// score, skipping a chunk that no longer fits. Ties go to the lower index, so the answer is
// deterministic. With `extra`, also the chunks the same fill with `budget + extra_budget`
// takes that this one does not, best first, from the same scores (a prefetch's guess).
std::vector<uint32_t> SelectChunks(v1::Ranking ranking, std::span<const float> queries, int group,
                                   int head_dim, std::span<const ChunkCandidate> candidates,
                                   uint64_t budget, uint64_t extra_budget = 0,
                                   std::vector<uint32_t>* extra = nullptr);

inline std::vector<uint32_t> SelectByMeanScore(std::span<const float> queries, int group,
                                               int head_dim,
                                               std::span<const ChunkCandidate> candidates,
                                               uint64_t budget) {
  return SelectChunks(v1::RANKING_MEAN, queries, group, head_dim, candidates, budget);
}

}  // namespace kvtier

#endif  // KVTIER_SERVER_INDEX_CHUNK_RANKER_H_
