#include "server/index/stream_ranker.h"

#include <algorithm>

#include "absl/container/inlined_vector.h"
#include "server/common/check.h"
#include "server/common/vec.h"

namespace kvtier {

namespace {

// The best `k` chunks by score (FillGreedy's order: score down, index up) among those not
// `excluded`, best first: the first k candidates sorted, then each other one against the
// worst kept, placed by insertion when it wins.
std::vector<uint32_t> TopCandidates(const float* scores, uint32_t n,
                                    const std::vector<bool>& excluded, size_t k) {
  std::vector<uint32_t> top;
  if (k == 0) return top;
  top.reserve(k);
  auto better = [scores](uint32_t a, uint32_t b) {
    return scores[a] != scores[b] ? scores[a] > scores[b] : a < b;
  };
  uint32_t c = 0;
  for (; c < n && top.size() < k; ++c) {
    if (!excluded[c]) top.push_back(c);
  }
  std::sort(top.begin(), top.end(), better);
  float worst = scores[top.back()];
  for (; c < n; ++c) {
    // Later chunks lose ties (a higher index): only a strictly better score enters.
    if (!(scores[c] > worst) || excluded[c]) continue;
    size_t at = k - 1;
    for (; at > 0 && better(c, top[at - 1]); --at) top[at] = top[at - 1];
    top[at] = c;
    worst = scores[top.back()];
  }
  return top;
}

}  // namespace

RankResult RankStream(const ChunkStats& stats, const ClusterIndex* index, const RankQuery& q) {
  const std::vector<bool>& must = *q.must;
  const uint32_t n = stats.size();
  CHECK(must.size() == n && (q.skip == nullptr || q.skip->size() == n));
  const int d = stats.head_dim();
  // Every candidate is ranked against the query on the 8-bit grid (RoundQueryToInt8, head by
  // head): the compact statistics' integer dot products take it so, and the float statistics
  // of chunks not yet aged, and the index's bounds, then see the same query.
  absl::InlinedVector<float, 1024> rounded(q.queries.begin(),
                                           q.queries.begin() + static_cast<size_t>(q.group) * d);
  for (int h = 0; h < q.group; ++h)
    RoundQueryToInt8(rounded.data() + static_cast<size_t>(h) * d, d);
  const std::span<const float> queries(rounded.data(), rounded.size());
  RankResult out;
  // The index skips what is returned anyway and what may not be.
  std::vector<bool> excluded_storage;
  const std::vector<bool>* excluded = &must;
  if (q.skip != nullptr) {
    excluded_storage = must;
    for (uint32_t c = 0; c < n; ++c) excluded_storage[c] = must[c] || (*q.skip)[c];
    excluded = &excluded_storage;
  }
  // Counted in locals (a member of `out` would be stored back on every chunk).
  uint64_t must_tokens = 0;
  uint32_t candidates = 0;
  bool uniform = true;
  absl::InlinedVector<uint32_t, 64> musts;  // ascending
  for (uint32_t c = 0; c < n; ++c) {
    const uint32_t tokens = stats.tokens(c);
    if (must[c]) {
      must_tokens += tokens;
      musts.push_back(c);
    }
    if ((*excluded)[c]) continue;
    ++candidates;
    uniform &= tokens == q.chunk_tokens;
  }
  out.candidates = candidates;
  CHECK(must_tokens <= q.budget) << must_tokens << " tokens must be returned, budget " << q.budget;
  const uint64_t budget = q.budget - must_tokens;
  // Candidates the index does not hold, scored beside its search.
  auto not_indexed = [&] {
    std::vector<ChunkCandidate> extras;
    for (uint32_t c = 0; c < n; ++c) {
      if (!(*excluded)[c] && !index->contains(c)) extras.push_back(stats.candidate(c));
    }
    return extras;
  };

  std::vector<uint32_t> found, extra;
  const uint64_t picks = (budget + q.extra_budget) / std::max<uint64_t>(1, q.chunk_tokens);
  const bool search = index != nullptr && IndexPays(out.candidates, picks);
  if (search && !uniform) {
    // Chunks of several sizes (boundary chunking): the index's greedy fill, the extras scored
    // beside it. The answer is the scan's.
    ClusterIndex::SearchStats st;
    found = index->SearchGreedy(q.ranking, queries, q.group, budget, stats, *excluded,
                                not_indexed(), &st);
    out.scored = st.chunks_scored;
  } else if (!search) {
    // Nothing indexed yet, or too few chunks (or too many to find) for pruning to pay for its
    // bounds: scan. The answer is the same. Every compact chunk is scored in place (the few
    // returned anyway too), the others only where they are candidates, and the candidates'
    // scores filled from.
    out.scored = out.candidates;
    absl::InlinedVector<float, 1024> scores(n);
    stats.Score(q.ranking, queries, q.group, scores.data(), excluded);
    const uint64_t size = q.chunk_tokens;
    const uint64_t wide = budget + q.extra_budget;
    if (uniform && size > 0 && std::min<uint64_t>(candidates, wide / size) <= kInsertionPicks) {
      // Chunks of one size and few to find (a decode step's Select): the best wide / size in
      // FillGreedy's order, kept best first by insertion straight from the scores.
      found =
          TopCandidates(scores.data(), n, *excluded, std::min<uint64_t>(candidates, wide / size));
      const size_t take = std::min<size_t>(found.size(), budget / size);
      if (q.extra_budget > 0)
        extra.assign(found.begin() + static_cast<ptrdiff_t>(take), found.end());
      found.resize(take);
    } else {
      std::vector<ScoredChunk> scored;
      scored.reserve(out.candidates);
      for (uint32_t c = 0; c < n; ++c) {
        if (!(*excluded)[c]) scored.push_back({scores[c], c, stats.tokens(c)});
      }
      // In any order: `take` below marks them, and the extra ones are sorted.
      found = FillGreedy(std::move(scored), budget, q.extra_budget,
                         q.extra_budget > 0 ? &extra : nullptr, FillOrder::kAny);
    }
  } else {
    // Whole chunks: the best budget / chunk_tokens. The index's answer is exact for its
    // chunks; the few it does not hold yet (a policy change, a chunk waiting for room to be
    // quantized) are scored here and merged by the same order.
    // The top k is the deeper search's first k (best first, a strict order); the rest are
    // what the extra budget adds.
    ClusterIndex::SearchStats st;
    std::vector<ChunkCandidate> extras = not_indexed();
    const size_t k = budget / q.chunk_tokens;
    found = index->Search(q.ranking, queries, q.group, (budget + q.extra_budget) / q.chunk_tokens,
                          stats, *excluded, &st);
    out.scored = st.chunks_scored + extras.size();
    if (!extras.empty()) {
      for (uint32_t c : found) extras.push_back(stats.candidate(c));
      std::sort(extras.begin(), extras.end(),
                [](const ChunkCandidate& a, const ChunkCandidate& b) { return a.index < b.index; });
      found = SelectChunks(q.ranking, queries, q.group, d, extras, budget, q.extra_budget,
                           q.extra_budget > 0 ? &extra : nullptr);
    } else if (found.size() > k) {
      extra.assign(found.begin() + static_cast<ptrdiff_t>(k), found.end());
      found.resize(k);
    }
  }
  // `must` and the chosen, ascending (the chosen are neither in `must` nor repeated).
  std::sort(found.begin(), found.end());
  out.chunks.resize(musts.size() + found.size());
  std::merge(musts.begin(), musts.end(), found.begin(), found.end(), out.chunks.begin());
  std::sort(extra.begin(), extra.end());
  out.extra = std::move(extra);
  return out;
}

}  // namespace kvtier
