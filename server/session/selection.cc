#include "server/session/selection.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "server/common/status_macros.h"
#include "server/common/vec.h"
#include "server/index/token_refine.h"
#include "server/transfer/device_fill.h"

namespace kvtier {

absl::Status RefineLayer(const PromotionTarget& host, std::span<Stream> heads,
                         v1::RefineScore score, float mass_target, std::span<const float> queries,
                         int group, LayerChoice* choice, float* need) {
  ASSIGN_OR_RETURN(std::vector<std::vector<SlotRef>> slots,
                   Readable(host, heads, choice->chunks, /*prefetch=*/false));
  const size_t d = host.format.head_dim;
  const size_t kvh = heads.size();
  choice->rows.assign(kvh, {});
  choice->host_slots.assign(kvh, {});
  float need_sum = 0.f;
  for (size_t h = 0; h < kvh; ++h) {
    const std::vector<uint32_t>& chunks = choice->chunks[h];
    const std::vector<bool>& kept = choice->kept[h];
    std::vector<RefineChunk> pool, fixed;
    pool.reserve(chunks.size());
    for (size_t i = 0; i < chunks.size(); ++i) {
      const Chunk& c = heads[h].chunks()[chunks[i]];
      const auto* keys = reinterpret_cast<const uint16_t*>(slots[h][i]->data());
      if (!kept[chunks[i]]) {
        pool.push_back({chunks[i], keys, c.num_tokens});
        continue;
      }
      // A kept chunk's sink and window rows are fixed; its other rows are candidates.
      for (uint32_t r = 0; r < c.num_tokens;) {
        const bool fixed_row = choice->KeptRow(c, r);
        uint32_t end = r + 1;
        while (end < c.num_tokens && choice->KeptRow(c, end) == fixed_row) ++end;
        (fixed_row ? fixed : pool).push_back({chunks[i], keys, end - r, r});
        r = end;
      }
    }
    float head_need = 0.f;
    const std::vector<RefinedRow> best =
        RefineRows(score, host.format.kind(), queries.subspan(h * group * d, group * d), group,
                   static_cast<int>(d), pool, choice->rows_left[h], fixed, mass_target,
                   need != nullptr ? &head_need : nullptr);
    need_sum += head_need;
    // Each chunk with its kept and chosen rows (none: left out; all: whole), in chunk order.
    std::vector<uint32_t> out;
    ChunkRows rows;
    std::vector<SlotRef> out_slots;
    out.reserve(chunks.size());
    rows.ends.reserve(chunks.size());
    size_t fixed_rows = 0;
    for (const RefineChunk& run : fixed) fixed_rows += run.rows;
    rows.rows.reserve(best.size() + fixed_rows);
    out_slots.reserve(chunks.size());
    size_t next = 0;
    for (size_t i = 0; i < chunks.size(); ++i) {
      const uint32_t c = chunks[i];
      // A pool chunk none of whose rows was picked is left out without a look at its rows.
      if (!kept[c] && (next >= best.size() || best[next].chunk != c)) continue;
      const Chunk& chunk = heads[h].chunks()[c];
      const size_t begin = rows.rows.size();
      if (!kept[c]) {
        // Its picked rows alone: best's run for this chunk, already in row order.
        for (; next < best.size() && best[next].chunk == c; ++next) {
          rows.rows.push_back(best[next].row);
        }
      } else {
        for (uint32_t r = 0; r < chunk.num_tokens; ++r) {
          const bool picked = next < best.size() && best[next].chunk == c && best[next].row == r;
          next += picked ? 1 : 0;
          if (picked || choice->KeptRow(chunk, r)) rows.rows.push_back(r);
        }
      }
      if (rows.rows.size() == begin) continue;
      if (rows.rows.size() - begin == chunk.num_tokens) rows.rows.resize(begin);  // whole
      rows.EndChunk();
      out.push_back(c);
      out_slots.push_back(std::move(slots[h][i]));
    }
    choice->chunks[h] = std::move(out);
    choice->rows[h] = std::move(rows);
    choice->host_slots[h] = std::move(out_slots);
  }
  if (need != nullptr) *need = kvh ? need_sum / static_cast<float>(kvh) : 0.f;
  return absl::OkStatus();
}

absl::StatusOr<std::vector<SlotRef>> GatherPool::Take(PromotionCache* cache,
                                                      const TierAccount& account, uint64_t bytes,
                                                      size_t n) {
  std::vector<SlotRef> out;
  out.reserve(n);
  // Idle: only the pool holds it (slots are handed out under the session's lock, so the count
  // never rises meanwhile; a lease ending meanwhile is seen next time).
  size_t kept = 0;
  for (SlotRef& s : slots_) {
    const bool idle = s.use_count() == 1 && !s->pinned();
    if (idle && (out.size() >= n || s->bytes() != bytes)) continue;  // back to the tier
    if (idle) {
      s->Renew();  // rewritten in place: a worker's old handle to it no longer reads
      out.push_back(s);
    }
    slots_[kept++] = std::move(s);
  }
  slots_.resize(kept);
  if (out.size() < n) {
    ASSIGN_OR_RETURN(std::vector<SlotRef> fresh, cache->Allocate(account, bytes, n - out.size()));
    for (SlotRef& s : fresh) {
      slots_.push_back(s);
      out.push_back(std::move(s));
    }
  }
  return out;
}

absl::StatusOr<std::vector<std::vector<GatheredBlock>>> GatherRows(const PromotionTarget& target,
                                                                   std::span<Stream> heads,
                                                                   LayerChoice* choice,
                                                                   GatherPool* pool) {
  const ChunkFormat& f = target.format;
  const uint64_t rb = f.row_bytes();
  struct Row {
    int64_t position;
    const uint8_t* k;
    const uint8_t* v;
    uint32_t chunk;  // the stream's chunk it comes from
  };
  // Per head, the rows to gather, in position order; the slots they need, all at once.
  std::vector<std::vector<Row>> rows(heads.size());
  size_t blocks = 0;
  for (size_t h = 0; h < heads.size(); ++h) {
    rows[h].reserve(choice->rows[h].rows.size());
    for (size_t i = 0; i < choice->chunks[h].size(); ++i) {
      const Chunk& c = heads[h].chunks()[choice->chunks[h][i]];
      const uint8_t* fp16 = choice->host_slots[h][i]->data();
      for (uint32_t r : choice->rows[h].of(i)) {
        const uint8_t* v = fp16 + (c.num_tokens + r) * rb;
        // The value rows, which refinement did not read, are asked for now: they arrive while
        // the rows are sorted and the slots taken, before the copies below.
        PrefetchBytes(v, rb);
        rows[h].push_back(
            {static_cast<int64_t>(c.position(r)), fp16 + r * rb, v, choice->chunks[h][i]});
      }
    }
    std::sort(rows[h].begin(), rows[h].end(),
              [](const Row& a, const Row& b) { return a.position < b.position; });
    blocks += (rows[h].size() + f.capacity - 1) / f.capacity;
  }
  ASSIGN_OR_RETURN(std::vector<SlotRef> slots,
                   pool->Take(target.cache, target.account, f.slot_bytes(), blocks));
  std::vector<std::vector<GatheredBlock>> out(heads.size());
  for (size_t h = 0; h < heads.size(); ++h) {
    out[h].reserve((rows[h].size() + f.capacity - 1) / f.capacity);
  }
  // Into each slot where it is mapped here; device slots (the slots are all of one tier) are
  // made here and filled in one batch, as promotion fills them (FillDevice).
  const bool device = !slots.empty() && slots[0]->on_device();
  size_t device_bytes = 0;
  for (const std::vector<Row>& r : rows) device_bytes += device ? 2 * r.size() * rb : 0;
  std::vector<uint8_t> made(device_bytes);  // never grows: the fills point into it
  std::vector<DeviceFill> fills;
  size_t next = 0, made_at = 0;
  for (size_t h = 0; h < heads.size(); ++h) {
    for (size_t at = 0; at < rows[h].size(); at += f.capacity) {
      const size_t n = std::min<size_t>(f.capacity, rows[h].size() - at);
      GatheredBlock& b = out[h].emplace_back();
      b.slot = std::move(slots[next++]);
      uint8_t* dst = device ? made.data() + made_at : b.slot->data();
      b.positions.reserve(n);
      for (size_t j = 0; j < n; ++j) {
        const Row& row = rows[h][at + j];
        std::memcpy(dst + j * rb, row.k, rb);
        std::memcpy(dst + (n + j) * rb, row.v, rb);
        b.positions.push_back(row.position);
      }
      if (device) {
        fills.push_back({.dst = b.slot->device_memory(),
                         .offset = b.slot->offset(),
                         .src = dst,
                         .src_bytes = 2 * n * rb,
                         .quantized = std::nullopt,
                         .chunk_id = EncodeChunkId(
                             {target.layer, static_cast<uint32_t>(h), rows[h][at].chunk})});
        made_at += 2 * n * rb;
      }
    }
    // What was gathered leaves the chunk handles.
    std::vector<uint32_t> chunks;
    ChunkRows kept_rows;  // each whole
    std::vector<SlotRef> kept_slots;
    chunks.reserve(choice->chunks[h].size());
    kept_rows.ends.reserve(choice->chunks[h].size());
    kept_slots.reserve(choice->chunks[h].size());
    for (size_t i = 0; i < choice->chunks[h].size(); ++i) {
      if (!choice->rows[h].of(i).empty()) continue;
      chunks.push_back(choice->chunks[h][i]);
      kept_rows.EndChunk();
      kept_slots.push_back(std::move(choice->host_slots[h][i]));
    }
    choice->chunks[h] = std::move(chunks);
    choice->rows[h] = std::move(kept_rows);
    choice->host_slots[h] = std::move(kept_slots);
  }
  RETURN_IF_ERROR(FillDevice(fills));
  return out;
}

}  // namespace kvtier
