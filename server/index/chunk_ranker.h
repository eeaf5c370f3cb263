// Ranking of a stream's chunks for one decode query: the interim rule until the cluster
// index lands. A chunk scores by its mean score, max over the KV head's query heads of
// q . mu, mu the mean of its keys; ARCHITECTURE.md reports that the mean score came closest
// to the chunk oracle on clustered keys. The scan is linear in the number of chunks.
#ifndef KVTIER_SERVER_INDEX_CHUNK_RANKER_H_
#define KVTIER_SERVER_INDEX_CHUNK_RANKER_H_

#include <cstdint>
#include <span>
#include <vector>

namespace kvtier {

struct ChunkCandidate {
  uint32_t index;         // the chunk's index in its stream
  uint32_t tokens;        // tokens it would add to the selection
  const float* key_sum;   // [head_dim] sum of the chunk's keys (any positive multiple of the mean)
  float scale;            // > 0: mean = scale * key_sum (1 / tokens for a sum)
};

// max over h of queries[h] . (scale * key_sum), queries [group][head_dim].
float MeanScore(std::span<const float> queries, int group, const ChunkCandidate& c,
                int head_dim);

// The chunk indices, best score first, whose tokens fit in `budget` together: greedy by
// score, skipping a chunk that no longer fits. Ties go to the lower index, so the answer is
// deterministic.
std::vector<uint32_t> SelectByMeanScore(std::span<const float> queries, int group, int head_dim,
                                        std::span<const ChunkCandidate> candidates,
                                        uint64_t budget);

}  // namespace kvtier

#endif  // KVTIER_SERVER_INDEX_CHUNK_RANKER_H_
