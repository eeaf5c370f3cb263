// How tokens become chunks, beyond contiguous runs (SessionPolicy.chunking).
//
// Boundary chunking (CHUNKING_BOUNDARY) cuts consecutive tokens after a delimiter token id,
// so that a chunk holds a phrase or a sentence: EndsChunk is the rule.
//
// Semantic chunking (CHUNKING_SEMANTIC): once a span of contiguous chunks has left the recent
// window, its rows are regrouped, per KV head, into chunks of nearby keys. Tight chunks make
// both the ranking score (a chunk's mean and peak stand for rows that resemble them) and the
// index's bounds (small radii) sharper. Groups keep the span's chunk size, so the chunk count,
// the slot sizes and the index's top-k search are those of contiguous chunking; each row
// carries its position.
#ifndef KVTIER_SERVER_INDEX_CHUNKING_H_
#define KVTIER_SERVER_INDEX_CHUNKING_H_

#include <cstdint>
#include <vector>

namespace kvtier {

// Whether a boundary chunk of `rows` rows ends after its last token: at 2 * chunk_tokens
// always; with token ids (`id_given`), after a delimiter once it holds chunk_tokens / 2;
// without, at chunk_tokens (contiguous cuts).
inline bool EndsChunk(uint32_t rows, uint32_t chunk_tokens, bool id_given, bool is_delimiter) {
  if (rows >= 2 * chunk_tokens) return true;
  if (!id_given) return rows >= chunk_tokens;
  return is_delimiter && rows >= (chunk_tokens > 1 ? chunk_tokens / 2 : 1);
}

// Balanced k-means (squared Euclidean) of rows [n][d] into n / size groups of exactly `size`
// rows; n is a multiple of size. Centers start at the row farthest from the mean, then each
// next one at the row farthest from the centers so far; each round assigns the closest
// (row, center) pairs first while the center has room, then moves each center to its rows'
// mean, for `rounds` rounds or until a round repeats the last one's assignment (every later
// one would too). Deterministic. Each group's rows ascend, and groups are ordered by their
// first row.
std::vector<std::vector<uint32_t>> BalancedGroups(const float* rows, uint32_t n, int d,
                                                  uint32_t size, int rounds = 4);

// The sum over groups of squared distances from each row to its group's mean.
double WithinGroupSquares(const float* rows, int d,
                          const std::vector<std::vector<uint32_t>>& groups);

}  // namespace kvtier

#endif  // KVTIER_SERVER_INDEX_CHUNKING_H_
