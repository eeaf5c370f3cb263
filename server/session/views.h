// What the daemon shows of a session's chunks: block handles (Select, ReadChunks), cluster
// summaries of what a selection left out, and chunk metadata (ListChunks). These read a
// stream; they never change it. Session::Info, ListChunks and Layers are defined in views.cc
// beside them.
#ifndef KVTIER_SERVER_SESSION_VIEWS_H_
#define KVTIER_SERVER_SESSION_VIEWS_H_

#include <cstdint>
#include <span>
#include <vector>

#include "kvtier/v1/kvtier.pb.h"
#include "server/session/stream.h"
#include "server/tier/promotion_cache.h"

namespace kvtier {

// A handle for chunk `c` read at `slot` (null: inline only, segment_id 0), with `fp16` (its K
// then V rows; null: read out of `slot`, a device slot's) inline when `include_data`; `rows`
// (empty: all) are the rows selected of it. The device's error when that read fails.
absl::Status FillHandle(const Chunk& c, const ChunkFormat& f, const Slot* slot, const uint8_t* fp16,
                        uint64_t chunk_id, bool include_data, std::span<const uint32_t> rows,
                        v1::BlockHandle* h);

// A handle for rows gathered into `slot` (K [n][d] then V [n][d], n = positions.size()) for
// (layer, kv_head): chunk_id 0, `gathered`, the bytes inline when `include_data` (read out of a
// device slot).
absl::Status FillGatheredHandle(const Slot* slot, std::span<const int64_t> positions,
                                const ChunkFormat& f, uint32_t layer, uint32_t kv_head,
                                bool include_data, v1::BlockHandle* h);

// One summary per cluster of the stream's index over the chunks not in `chosen` (ascending);
// a left-out chunk the index does not hold is its own group. Groups come in the order of their
// first chunk.
void AddSummaries(const Stream& s, const ChunkFormat& f, const std::vector<uint32_t>& chosen,
                  v1::HeadSelection* out);

// ListChunks' entry for chunk `index` of stream (layer, kv_head).
void FillChunkInfo(const Chunk& c, const ChunkFormat& f, ChunkAddress at,
                   const PromotionCache& host_copies, const PromotionCache& device_copies,
                   v1::ChunkInfo* info);

}  // namespace kvtier

#endif  // KVTIER_SERVER_SESSION_VIEWS_H_
