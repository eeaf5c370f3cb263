#include "server/index/chunk_ranker.h"

#include <algorithm>
#include <limits>

namespace kvtier {

float MeanScore(std::span<const float> queries, int group, const float* mean, int head_dim) {
  float best = -std::numeric_limits<float>::infinity();
  for (int h = 0; h < group; ++h) {
    const float* q = queries.data() + static_cast<size_t>(h) * head_dim;
    float s = 0.f;
    for (int j = 0; j < head_dim; ++j) s += q[j] * mean[j];
    best = std::max(best, s);
  }
  return best;
}

std::vector<uint32_t> SelectByMeanScore(std::span<const float> queries, int group, int head_dim,
                                        std::span<const ChunkCandidate> candidates,
                                        uint64_t budget) {
  struct Scored {
    float score;
    uint32_t pos;
  };
  std::vector<Scored> scored;
  scored.reserve(candidates.size());
  for (uint32_t i = 0; i < candidates.size(); ++i) {
    scored.push_back({MeanScore(queries, group, candidates[i].mean, head_dim), i});
  }
  std::sort(scored.begin(), scored.end(), [&](const Scored& a, const Scored& b) {
    if (a.score != b.score) return a.score > b.score;
    return candidates[a.pos].index < candidates[b.pos].index;
  });
  std::vector<uint32_t> out;
  uint64_t used = 0;
  for (const Scored& s : scored) {
    const ChunkCandidate& c = candidates[s.pos];
    if (used + c.tokens > budget) continue;
    used += c.tokens;
    out.push_back(c.index);
  }
  return out;
}

}  // namespace kvtier
