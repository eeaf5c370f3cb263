#include "server/session/promotion.h"

#include <utility>

#include "server/common/status_macros.h"
#include "server/transfer/device_fill.h"

namespace kvtier {
namespace {

// What it costs to remake an evicted copy, for the cost-aware eviction policy: a copy at
// about 10 GB/s; dequantizing int4 or int8 first, about 4 times that (quant_bench).
double RemakeCostUs(uint64_t bytes, bool cold) {
  return static_cast<double>(bytes) * 1e-4 * (cold ? 4 : 1);
}

}  // namespace

absl::StatusOr<std::vector<std::vector<SlotRef>>> Readable(
    const PromotionTarget& target, std::span<Stream> heads,
    const std::vector<std::vector<uint32_t>>& chosen, bool prefetch, size_t* promoted) {
  PromotionCache* cache = target.cache;
  const bool to_device = target.to_device;
  // Holding every slot found keeps the cache from evicting it while room is made.
  std::vector<std::vector<SlotRef>> out(chosen.size());
  std::vector<std::pair<uint32_t, size_t>> todo;  // (kv_head, position in chosen[h])
  for (uint32_t h = 0; h < chosen.size(); ++h) {
    for (size_t i = 0; i < chosen[h].size(); ++i) {
      const Chunk& ch = heads[h].chunks()[chosen[h][i]];
      // A prefetch only looks: it is not a read of the copies already there.
      const CopyRef& copy = to_device ? ch.device : ch.promoted;
      SlotRef slot = !to_device && !ch.cold() ? ch.host
                     : prefetch               ? cache->Peek(copy)
                                              : cache->Read(copy);
      if (!slot) todo.emplace_back(h, i);
      out[h].push_back(std::move(slot));
    }
  }
  ASSIGN_OR_RETURN(std::vector<SlotRef> slots,
                   cache->Allocate(target.tenant, target.format.slot_bytes(), todo.size()));
  // Device slots are filled in one batch (FillDevice: int4 moved as int4, dequantized there),
  // then every copy enters the cache; host slots are written here.
  std::vector<DeviceFill> fills;
  for (size_t j = 0; j < todo.size(); ++j) {
    const auto [h, i] = todo[j];
    const uint32_t c = chosen[h][i];
    const Chunk& ch = heads[h].chunks()[c];
    if (!slots[j]->on_device()) {
      target.format.WriteFp16(ch, slots[j]->data());
      continue;
    }
    std::optional<QuantLayout> quantized;
    if (ch.cold()) quantized = target.format.ColdLayout(ch);
    fills.push_back({.dst = slots[j]->device_memory(),
                     .offset = slots[j]->offset(),
                     .src = ch.host->data(),
                     .src_bytes = target.format.StoredBytes(ch),
                     .quantized = quantized,
                     .chunk_id = EncodeChunkId({target.layer, h, c})});
  }
  RETURN_IF_ERROR(FillDevice(fills));
  for (size_t j = 0; j < todo.size(); ++j) {
    const auto [h, i] = todo[j];
    const uint32_t c = chosen[h][i];
    const Chunk& ch = heads[h].chunks()[c];
    const double cost = RemakeCostUs(2 * ch.num_tokens * target.format.row_bytes(), ch.cold());
    (to_device ? heads[h].device(c) : heads[h].promoted(c)) =
        cache->Insert(slots[j], target.tenant, cost, prefetch);
    out[h][i] = std::move(slots[j]);
  }
  if (promoted) *promoted = todo.size();
  return out;
}

}  // namespace kvtier
