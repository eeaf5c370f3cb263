// The one place a stream's chunks are chosen for a query: the chunks that must be returned,
// then the best of the others by the ranking score within what is left of the budget. Whether
// the cluster index's search or a linear scan finds them is decided here (IndexPays);
// either way the answer is the scan's (SelectChunks over the same candidates), so the choice
// changes only the work.
#ifndef KVTIER_SERVER_INDEX_STREAM_RANKER_H_
#define KVTIER_SERVER_INDEX_STREAM_RANKER_H_

#include <cstdint>
#include <span>
#include <vector>

#include "kvtier/v1/kvtier.pb.h"
#include "server/index/chunk_stats.h"
#include "server/index/cluster_index.h"

namespace kvtier {

// Below this many candidate chunks a linear scan beats the index's best-first search.
// Measured with kvtier-bench select (16-token chunks, head_dim 64, budget 256; three runs,
// in us): the scan against the index took 51-58 against 90-116 at 512 chunks (8K tokens),
// 74-111 against 102-126 at 1024, and 196-222 against 104-120 at 2048; the index with
// semantic chunks took 168-195 at 2048. (Before the scan scored its candidates' exponentials
// and logarithms eight at a time, the index won from 1024 contiguous chunks.)
inline constexpr uint64_t kIndexMinCandidates = 2048;
// Nor does the search pay when it must find more than one chunk in this many: each chunk found
// opens more of the index, and past that share the scan is faster whatever the context.
// Measured with kvtier-bench select (contiguous and semantic 16-token chunks), index against
// scan, in us: 32 picks of 2048 chunks (32K tokens, budget 1024 a head) 177-195 against 84,
// 128 picks of them (budget 2048) 206-241 against 94; 64 picks of 8192 chunks (128K tokens)
// 115 contiguous but 1072 semantic against 467, and 128 picks of them 930-1245 against 482.
// In the daemon, a decode step's 28 selective layers under the default policy (rows refined
// from an 8x pool: about 110 chunks picked a head) took 50-52 ms with the index at 40K tokens
// against 20-21 ms with the scan, 75 against 38 ms at 64K, 147 against 64 ms at 128K. With
// 16 picks (budget 256, whole chunks) the index takes 32 us at 2048 chunks against the scan's
// 81, and 52 at 8192 against 463.
inline constexpr uint64_t kIndexCandidatesPerPick = 128;
// Whether RankStream searches the index to find `picks` chunks among `candidates`.
inline bool IndexPays(uint64_t candidates, uint64_t picks) {
  return candidates >= kIndexMinCandidates && candidates >= kIndexCandidatesPerPick * picks;
}

struct RankQuery {
  v1::Ranking ranking = v1::RANKING_LSE_PEAK;
  std::span<const float> queries;  // [group][head_dim]: the query heads of one KV head
  int group = 1;
  // Tokens for every chunk returned, `must` included. REQUIRES: at least must's tokens.
  uint64_t budget = 0;
  // [chunks]: returned whatever their score (a stream's sinks and recent window).
  const std::vector<bool>* must = nullptr;
  // [chunks] or null: never returned, and not counted as candidates.
  const std::vector<bool>* skip = nullptr;
  // The size of a whole chunk: when every candidate has it, the index's top-k search serves
  // (budget / chunk_tokens chunks); chunks of several sizes take its greedy fill.
  uint32_t chunk_tokens = 16;
  // > 0: RankResult::extra holds what `extra_budget` more tokens would add (a prefetch's
  // guess), found by the same scan or search (the index's top-k, searched that much deeper).
  uint64_t extra_budget = 0;
};

struct RankResult {
  std::vector<uint32_t> chunks;  // ascending: `must` and the chosen candidates
  // Ascending: the candidates a budget larger by extra_budget would add. Empty without
  // extra_budget, and where the index's greedy fill serves (chunks of several sizes, many
  // candidates), which would need a second search.
  std::vector<uint32_t> extra;
  uint64_t candidates = 0;  // chunks neither in `must` nor in `skip`
  uint64_t scored = 0;      // candidates whose score or a bound over them was computed
};

// The chunks of `stats` that `query` returns. `index`, when not null, holds some of the chunks
// (with final statistics); the candidates it does not hold are scored beside its search.
RankResult RankStream(const ChunkStats& stats, const ClusterIndex* index, const RankQuery& query);

}  // namespace kvtier

#endif  // KVTIER_SERVER_INDEX_STREAM_RANKER_H_
