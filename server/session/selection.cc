#include "server/session/selection.h"

#include <utility>

#include "server/common/status_macros.h"
#include "server/index/token_refine.h"

namespace kvtier {

absl::Status RefineLayer(const PromotionTarget& host, std::span<Stream> heads,
                         v1::RefineScore score, float mass_target, std::span<const float> queries,
                         int group, LayerChoice* choice) {
  ASSIGN_OR_RETURN(std::vector<std::vector<SlotRef>> slots,
                   Readable(host, heads, choice->chunks, /*prefetch=*/false));
  const size_t d = host.format.head_dim;
  const size_t kvh = heads.size();
  choice->rows.assign(kvh, {});
  choice->host_slots.assign(kvh, {});
  for (size_t h = 0; h < kvh; ++h) {
    const std::vector<uint32_t>& chunks = choice->chunks[h];
    const std::vector<bool>& kept = choice->kept[h];
    std::vector<RefineChunk> pool, fixed;
    for (size_t i = 0; i < chunks.size(); ++i) {
      (kept[chunks[i]] ? fixed : pool)
          .push_back({chunks[i], reinterpret_cast<const uint16_t*>(slots[h][i]->data()),
                      heads[h].chunks()[chunks[i]].num_tokens});
    }
    const std::vector<RefinedRow> best =
        RefineRows(score, host.format.kind(), queries.subspan(h * group * d, group * d), group,
                   static_cast<int>(d), pool, choice->rows_left[h], fixed, mass_target);
    // The kept chunks whole, the pool's chunks with their chosen rows, in chunk order.
    std::vector<uint32_t> out;
    std::vector<std::vector<uint32_t>> rows;
    std::vector<SlotRef> out_slots;
    size_t next = 0;
    for (size_t i = 0; i < chunks.size(); ++i) {
      const uint32_t c = chunks[i];
      std::vector<uint32_t> chosen;
      while (next < best.size() && best[next].chunk == c) chosen.push_back(best[next++].row);
      if (!kept[c] && chosen.empty()) continue;
      if (kept[c] || chosen.size() == heads[h].chunks()[c].num_tokens) chosen.clear();
      out.push_back(c);
      rows.push_back(std::move(chosen));
      out_slots.push_back(std::move(slots[h][i]));
    }
    choice->chunks[h] = std::move(out);
    choice->rows[h] = std::move(rows);
    choice->host_slots[h] = std::move(out_slots);
  }
  return absl::OkStatus();
}

}  // namespace kvtier
