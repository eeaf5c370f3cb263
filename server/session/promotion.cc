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
  // The copies to look up, and where each goes: read all at once (one hold of the cache's
  // lock per Select, not one per chunk). A prefetch only looks: it is not a read of the copies
  // already there.
  std::vector<const CopyRef*> copies;
  std::vector<std::pair<uint32_t, size_t>> at;  // (kv_head, position in chosen[h])
  size_t most = 0;
  for (const std::vector<uint32_t>& c : chosen) most += c.size();
  for (uint32_t h = 0; h < chosen.size(); ++h) {
    out[h].resize(chosen[h].size());
    for (size_t i = 0; i < chosen[h].size(); ++i) {
      const Chunk& ch = heads[h].chunks()[chosen[h][i]];
      if (!to_device && !ch.cold()) {
        out[h][i] = ch.host;
        continue;
      }
      if (copies.empty()) {  // sized once, when some chunk needs a copy at all
        copies.reserve(most);
        at.reserve(most);
      }
      copies.push_back(to_device ? &ch.copies.device() : &ch.copies.promoted());
      at.emplace_back(h, i);
    }
  }
  // Every chunk readable where it lies (warm, for the host): the cache's lock is not taken.
  if (copies.empty()) {
    if (promoted) *promoted = 0;
    return out;
  }
  std::vector<SlotRef> found(copies.size());
  cache->ReadAll(copies, /*record=*/!prefetch, found.data());
  std::vector<std::pair<uint32_t, size_t>> todo;  // (kv_head, position in chosen[h])
  for (size_t j = 0; j < copies.size(); ++j) {
    const auto [h, i] = at[j];
    if (!found[j]) todo.emplace_back(h, i);
    out[h][i] = std::move(found[j]);
  }
  ASSIGN_OR_RETURN(std::vector<SlotRef> slots,
                   cache->Allocate(target.account, target.format.slot_bytes(), todo.size()));
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
  // One layer's copies share a stripe of the cache: a Select reads them under one lock.
  const uint64_t group = reinterpret_cast<uintptr_t>(heads.data());
  for (size_t j = 0; j < todo.size(); ++j) {
    const auto [h, i] = todo[j];
    const uint32_t c = chosen[h][i];
    const Chunk& ch = heads[h].chunks()[c];
    const double cost = RemakeCostUs(2 * ch.num_tokens * target.format.row_bytes(), ch.cold());
    (to_device ? heads[h].copies(c).mutable_device() : heads[h].copies(c).mutable_promoted()) =
        cache->Insert(slots[j], target.account.tenant(), cost, prefetch, group, target.copy_bytes);
    out[h][i] = std::move(slots[j]);
  }
  if (promoted) *promoted = todo.size();
  return out;
}

}  // namespace kvtier
