// Token-level refinement: the best rows of a pool of candidate chunks by an exact score on
// their keys, so that a budget buys rows rather than whole chunks (most rows of a chosen
// chunk carry little of the attention mass). Two scores (SessionPolicy.refine_score), for a
// KV head's query heads q_h and a row's key k, s_h = q_h . k / sqrt(head_dim):
//   REFINE_SCORE_MAX        max_h s_h;
//   REFINE_SCORE_MEAN_MASS  mean_h of e^(s_h) / sum over the pool's rows of e^(s_h): the
//                           group's mean attention mass with the pool standing for the context.
#ifndef KVTIER_SERVER_INDEX_TOKEN_REFINE_H_
#define KVTIER_SERVER_INDEX_TOKEN_REFINE_H_

#include <cstdint>
#include <span>
#include <vector>

#include "kvtier/v1/kvtier.pb.h"
#include "server/common/vec.h"

namespace kvtier {

// One candidate chunk, or a run of its rows: its index in the stream and its keys, 2-byte rows
// of head_dim (`kind`: fp16 or bf16) as attention reads them (dequantized for a cold chunk).
// The candidates are its rows [first_row, first_row + rows).
struct RefineChunk {
  uint32_t chunk;
  const uint16_t* keys;  // the chunk's row 0: [first_row + rows][head_dim]
  uint32_t rows;
  uint32_t first_row = 0;
};

// A chosen row: chunks[i].chunk's row `row`.
struct RefinedRow {
  uint32_t chunk;
  uint32_t row;
  bool operator==(const RefinedRow&) const = default;
};

// The k best rows of `chunks` by `score` for queries [group][head_dim], ordered by (chunk,
// row); ties go to the earlier (chunk, row) in the order `chunks` lists them. Every row when
// the pool holds k rows or fewer.
//
// With `mass_target` in (0, 1] (a budget that follows the mass), the rows are ranked by their
// mass instead, the group's mean softmax weight over the rows of `fixed` (returned anyway:
// the sinks and the window) and the pool together, and taken best first until they and
// `fixed` hold mass_target of it, at most k: the smallest such set.
//
// With `missed` (a layer's need, for LAYER_BUDGET_BY_NEED), *missed is the share of the
// group's mean softmax mass over `fixed` and the pool that the rows returned and `fixed` do
// not hold: what this budget leaves out, the pool standing for the context.
std::vector<RefinedRow> RefineRows(v1::RefineScore score, HalfKind kind,
                                   std::span<const float> queries, int group, int head_dim,
                                   std::span<const RefineChunk> chunks, size_t k,
                                   std::span<const RefineChunk> fixed = {}, float mass_target = 0.f,
                                   float* missed = nullptr);

}  // namespace kvtier

#endif  // KVTIER_SERVER_INDEX_TOKEN_REFINE_H_
