// What one query chose of a layer's streams, and its token-level refinement.
//
// Choosing happens in two steps when SessionPolicy.refine_factor is above 1 (or a
// mass_target is set, which refines within the chunks the budget chose). The chunk
// ranking (RankStream) picks, beyond the chunks holding the sinks and the recent window
// (`kept`), a pool of whole chunks holding refine_factor times the rows the budget has left;
// RefineLayer then scores every row of that pool exactly (RefineRows, on the keys as
// attention reads them: fp16, dequantized for a cold chunk) and keeps the best rows the
// budget allows. Under refinement the budget counts the sink and window rows themselves, not
// their whole chunks: a kept chunk's other rows are candidates like the pool's, so a chunk
// larger than the window costs the budget nothing beyond what it returns. A chunk with no
// chosen or kept row is dropped; the others carry their rows (all of them: whole).
#ifndef KVTIER_SERVER_SESSION_SELECTION_H_
#define KVTIER_SERVER_SESSION_SELECTION_H_

#include <cstdint>
#include <span>
#include <vector>

#include "absl/status/status.h"
#include "kvtier/v1/kvtier.pb.h"
#include "server/session/promotion.h"
#include "server/session/stream.h"

namespace kvtier {

// The rows chosen of each of a KV head's chunks, side by side in one array (a refined Select
// chooses rows of some hundred chunks: one array each cost as many allocations).
struct ChunkRows {
  std::vector<uint32_t> rows;
  std::vector<uint32_t> ends;  // chunk i's rows are rows[ends[i - 1], ends[i]) (from 0 for i 0)

  size_t size() const { return ends.size(); }
  std::span<const uint32_t> of(size_t i) const {
    const uint32_t begin = i == 0 ? 0 : ends[i - 1];
    return {rows.data() + begin, ends[i] - begin};
  }
  // Ends the next chunk's rows: those added since the last (none: the whole chunk).
  void EndChunk() { ends.push_back(static_cast<uint32_t>(rows.size())); }
};

struct LayerChoice {
  bool everything = false;  // every chunk, whole (a dense layer, or a context within budget)
  std::vector<std::vector<uint32_t>> chunks;  // [kv_head]: chunk indices, ascending
  // [kv_head]: of(i), the rows chosen of chunks[h][i], ascending; empty: the whole chunk.
  // Empty altogether when nothing was refined.
  std::vector<ChunkRows> rows;
  std::vector<std::vector<bool>> kept;  // [kv_head][chunk]: a sink or recent-window chunk
  // Positions below sink_end are sinks; from window_start on, the recent window.
  uint64_t sink_end = 0;
  uint64_t window_start = 0;
  // [kv_head]: the budget beyond the kept chunks (under refinement: beyond the kept rows)
  std::vector<uint64_t> rows_left;
  // After RefineLayer: [kv_head][i] the host slot chunks[h][i] was scored from (fp16).
  std::vector<std::vector<SlotRef>> host_slots;
  // [kv_head]: the chunks a larger budget would add (Choose's extra_budget), ascending.
  std::vector<std::vector<uint32_t>> extra;

  // Whether row r of a kept chunk is a sink or in the recent window.
  bool KeptRow(const Chunk& c, uint32_t r) const {
    return IsKeptPosition(c.position(r), sink_end, window_start);
  }
};

// Refines `choice` (chosen with a pool of refine_factor times rows_left) to rows_left rows per
// KV head, scoring `queries` ([kv_heads * group][head_dim]) by `score`. The pool's fp16 keys
// come from `host` (a cold chunk's dequantized copy is made there if it has none): all or
// nothing, RESOURCE_EXHAUSTED when the host tier cannot hold them.
// With `mass_target` above 0, each KV head keeps the fewest rows that, with its kept chunks,
// hold that share of the estimated mass (RefineRows), within rows_left. With `need`, *need is
// the layer's need: the estimated mass its rows miss (RefineRows), its KV heads averaged.
absl::Status RefineLayer(const PromotionTarget& host, std::span<Stream> heads,
                         v1::RefineScore score, float mass_target, std::span<const float> queries,
                         int group, LayerChoice* choice, float* need = nullptr);

// Rows of one stream's chunks gathered into a block of their own: fp16 K [n][d] then V [n][d]
// in `slot`, rows in position order.
struct GatheredBlock {
  SlotRef slot;
  std::vector<int64_t> positions;
};

// A session's slots for gathered blocks on one tier, kept from one Select for the next: a
// slot whose lease ended (nothing but the pool holds it) is written again, under a new
// generation, instead of going back to the tier and another coming from it, so that a decode
// loop's Selects neither allocate nor free (a shard's lock and the tier's atomic counts). The
// pool keeps idle at most as many slots as the last Select took; the rest go back to the tier.
// Guarded by its session's lock.
class GatherPool {
 public:
  // `n` slots of `bytes` for the account: this pool's idle ones first (renewed), the rest from
  // `cache`'s tier (Allocate: RESOURCE_EXHAUSTED, all or nothing). Idle slots past `n`, and
  // any of another size, go back to the tier.
  absl::StatusOr<std::vector<SlotRef>> Take(PromotionCache* cache, const TierAccount& account,
                                            uint64_t bytes, size_t n);
  // Lets every slot go (a lease still holding one keeps it until released).
  void Clear() { slots_.clear(); }
  void swap(GatherPool& other) { slots_.swap(other.slots_); }

 private:
  std::vector<SlotRef> slots_;
};

// Moves each KV head's partly chosen chunks (those with a row list) out of `choice` and into
// compact blocks of at most the chunk capacity's rows, on `target`'s tier (slots from `pool`),
// copied from the host slots the refinement read. Returns the blocks per KV head.
// RESOURCE_EXHAUSTED (with the tier's reason) when the tier cannot hold them: all or nothing.
absl::StatusOr<std::vector<std::vector<GatheredBlock>>> GatherRows(const PromotionTarget& target,
                                                                   std::span<Stream> heads,
                                                                   LayerChoice* choice,
                                                                   GatherPool* pool);

}  // namespace kvtier

#endif  // KVTIER_SERVER_SESSION_SELECTION_H_
