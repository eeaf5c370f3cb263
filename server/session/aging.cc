#include "server/session/aging.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "server/common/check.h"
#include "server/index/chunking.h"
#include "server/quant/chunk_quant.h"

namespace kvtier {

SpanContext SpanContext::Of(const AgingContext& ctx) {
  return SpanContext{ctx.format, ctx.policy.chunk_tokens(), ctx.host, ctx.cold_bits()};
}

namespace {

// K and V rows [tokens][d] quantized into `dst` (QuantLayout{d, tokens, bits}.Bytes()); the
// statistics of the keys as dequantized, which are what attention will read.
ChunkSummary QuantizeRows(const ChunkFormat& f, const uint16_t* keys, const uint16_t* values,
                          uint32_t tokens, uint32_t bits, uint8_t* dst,
                          std::vector<uint16_t>* scratch) {
  const uint32_t d = f.head_dim;
  const QuantLayout layout{d, tokens, bits};
  QuantizeChunk(keys, values, layout, dst);
  scratch->resize(2ull * tokens * d);
  DequantizeChunk(dst, layout, scratch->data(), scratch->data() + uint64_t{tokens} * d);
  return ChunkStats::Summarize(f.kind(), scratch->data(), tokens, static_cast<int>(d));
}

}  // namespace

std::optional<SpanJob> NextSpan(const AgingContext& ctx, uint64_t tokens, std::span<Stream> heads,
                                AgingState* state) {
  if (ctx.policy.chunking() != v1::CHUNKING_SEMANTIC) return std::nullopt;
  const uint32_t aged = AgedOutChunks(ctx.policy, tokens, heads[0]);
  const std::vector<Chunk>& head0 = heads[0].chunks();
  uint32_t r = state->regrouped;
  while (r < aged && head0[r].first < ctx.policy.sink_tokens()) ++r;  // sinks stay as they are
  state->regrouped = r;
  if (r + kSemanticSpanChunks > aged) return std::nullopt;
  SpanJob job;
  job.first = r;
  for (const Stream& s : heads) {
    for (uint32_t i = 0; i < kSemanticSpanChunks; ++i) job.sources.push_back(s.chunks()[r + i]);
  }
  return job;
}

bool RegroupSpan(const SpanContext& ctx, SpanJob* job) {
  const ChunkFormat& f = ctx.format;
  const uint32_t d = f.head_dim;
  const uint32_t ct = ctx.chunk_tokens;
  const size_t heads = job->sources.size() / kSemanticSpanChunks;
  job->cold_bits = ctx.cold_bits;
  const QuantLayout cold{d, ct, ctx.cold_bits};
  const uint64_t slot_bytes = ctx.cold_bits != 0 ? cold.Bytes() : f.slot_bytes();
  std::vector<SlotRef> slots;
  if (!ctx.host.tier()->AllocateMany(ctx.host, slot_bytes, job->sources.size(), &slots).ok()) {
    return false;
  }
  const uint32_t span_rows = kSemanticSpanChunks * ct;
  // Scratch the thread keeps from one span to the next, each byte written before it is read
  // (an aging thread regroups span after span: nothing allocated or zeroed each time).
  thread_local std::vector<uint16_t> keys, values, grouped;
  thread_local std::vector<float> key_floats;
  std::vector<uint16_t> scratch;
  keys.resize(static_cast<size_t>(span_rows) * d);
  values.resize(keys.size());
  key_floats.resize(keys.size());
  if (ctx.cold_bits != 0) grouped.resize(2 * size_t{ct} * d);
  const uint64_t base = job->sources[0].first;
  for (size_t h = 0; h < heads; ++h) {
    // The span's rows in position order (its chunks are contiguous and full).
    for (uint32_t i = 0; i < kSemanticSpanChunks; ++i) {
      const Chunk& c = job->sources[h * kSemanticSpanChunks + i];
      CHECK(c.offsets.empty() && c.num_tokens == ct && c.first == base + i * ct);
      const uint16_t* rows = f.Fp16Rows(c, scratch);
      std::copy_n(rows, size_t{ct} * d, keys.begin() + static_cast<ptrdiff_t>(i) * ct * d);
      std::copy_n(rows + size_t{ct} * d, size_t{ct} * d,
                  values.begin() + static_cast<ptrdiff_t>(i) * ct * d);
    }
    HalvesToFloats(f.kind(), keys.data(), keys.size(), key_floats.data());
    const auto groups = BalancedGroups(key_floats.data(), span_rows, static_cast<int>(d), ct);
    for (uint32_t g = 0; g < kSemanticSpanChunks; ++g) {
      Chunk c;
      c.host = std::move(slots[h * kSemanticSpanChunks + g]);
      c.num_tokens = static_cast<uint16_t>(ct);
      c.first = base;
      c.sealed = true;
      uint8_t* dst = c.host->data();
      c.offsets = RowOffsets(groups[g]);
      // The group's K rows, then its V rows: in the slot itself, or (quantizing) first apart.
      uint8_t* rows = ctx.cold_bits != 0 ? reinterpret_cast<uint8_t*>(grouped.data()) : dst;
      for (uint32_t j = 0; j < ct; ++j) {
        const uint32_t row = groups[g][j];
        std::memcpy(rows + size_t{j} * f.row_bytes(), keys.data() + size_t{row} * d, f.row_bytes());
        std::memcpy(rows + size_t{ct + j} * f.row_bytes(), values.data() + size_t{row} * d,
                    f.row_bytes());
      }
      if (ctx.cold_bits != 0) {
        c.precision = ctx.cold_bits == 4 ? v1::PRECISION_INT4 : v1::PRECISION_INT8;
        job->summaries.push_back(QuantizeRows(f, grouped.data(), grouped.data() + size_t{ct} * d,
                                              ct, ctx.cold_bits, dst, &scratch));
      } else {
        job->summaries.push_back(ChunkStats::Summarize(
            f.kind(), reinterpret_cast<const uint16_t*>(dst), ct, static_cast<int>(d)));
      }
      job->regrouped.push_back(std::move(c));
    }
  }
  return true;
}

bool CommitSpan(std::span<Stream> heads, AgingState* state, SpanJob&& job, uint32_t cold_bits) {
  if (job.cold_bits != cold_bits || state->regrouped != job.first ||
      job.sources.size() != heads.size() * kSemanticSpanChunks ||
      job.regrouped.size() != job.sources.size() || job.summaries.size() != job.sources.size()) {
    return false;
  }
  for (size_t h = 0; h < heads.size(); ++h) {
    for (uint32_t i = 0; i < kSemanticSpanChunks; ++i) {
      const std::vector<Chunk>& chunks = heads[h].chunks();
      if (job.first + i >= chunks.size() ||
          chunks[job.first + i].host != job.sources[h * kSemanticSpanChunks + i].host) {
        return false;  // someone else regrouped (or changed) it meanwhile
      }
    }
  }
  for (size_t h = 0; h < heads.size(); ++h) {
    for (uint32_t g = 0; g < kSemanticSpanChunks; ++g) {
      const size_t i = h * kSemanticSpanChunks + g;
      heads[h].Replace(job.first + g, std::move(job.regrouped[i]), job.summaries[i]);
    }
  }
  state->regrouped = job.first + kSemanticSpanChunks;
  return true;
}

namespace {

// The chunks [0, n) whose rows are final: aged out, and regrouped when semantic.
uint32_t FinalRows(const AgingContext& ctx, uint32_t aged, const AgingState& state) {
  return ctx.policy.chunking() == v1::CHUNKING_SEMANTIC ? std::min(aged, state.regrouped) : aged;
}

// Semantic chunking: regroups every whole span of aged-out chunks not yet regrouped. A span
// whose slots cannot be had waits for the next call.
void Regroup(const AgingContext& ctx, uint64_t tokens, std::span<Stream> heads, AgingState* state) {
  while (std::optional<SpanJob> job = NextSpan(ctx, tokens, heads, state)) {
    if (!RegroupSpan(SpanContext::Of(ctx), &*job)) return;  // the span stays contiguous
    CommitSpan(heads, state, std::move(*job), ctx.cold_bits());
  }
}

// The peaks of at most `max_chunks` more of the `aged` chunks aged out. Peaks are needed only
// once a chunk can be ranked, that is once it leaves the window: computed once, rather than on
// every append to a growing chunk (a cold chunk got its own when it was quantized).
void PeakChunks(const AgingContext& ctx, std::span<Stream> heads, AgingState* state, uint32_t aged,
                uint32_t max_chunks) {
  const uint32_t to =
      state->peaked + std::min(max_chunks, aged > state->peaked ? aged - state->peaked : 0);
  for (uint32_t c = state->peaked; c < to; ++c) {
    for (Stream& s : heads) {
      if (!s.chunks()[c].cold()) s.ComputePeak(c, ctx.format);
    }
  }
  state->peaked = std::max(state->peaked, to);
}

// Quantizes the chunks whose rows are final and that have wholly left the recent window
// (sinks stay fp16). A chunk whose slot cannot be had, even after the chunks before it gave
// their fp16 slots back, stays fp16 and is retried next call.
void Quantize(const AgingContext& ctx, uint64_t tokens, std::span<Stream> heads,
              AgingState* state) {
  while (std::optional<QuantJob> job = NextQuant(ctx, tokens, heads, *state, UINT32_MAX)) {
    RunQuant(SpanContext::Of(ctx), &*job);
    const bool progressed = job->progressed();
    CommitQuant(heads, state, std::move(*job));
    if (!progressed) return;
  }
}

}  // namespace

std::optional<QuantJob> NextQuant(const AgingContext& ctx, uint64_t tokens,
                                  std::span<const Stream> heads, const AgingState& state,
                                  uint32_t max_chunks) {
  const uint32_t bits = ctx.cold_bits();
  if (bits == 0) return std::nullopt;
  uint32_t limit = FinalRows(ctx, AgedOutChunks(ctx.policy, tokens, heads[0]), state);
  if (state.quantized >= limit)
    return std::nullopt;  // most appends (a decode step) quantize nothing
  limit = state.quantized + std::min(max_chunks, limit - state.quantized);
  QuantJob job;
  job.first = state.quantized;
  job.end = limit;
  job.bits = bits;
  for (uint32_t c = job.first; c < limit; ++c) {
    for (uint32_t h = 0; h < heads.size(); ++h) {
      const Stream& s = heads[h];
      const Chunk& chunk = s.chunks()[c];
      if (chunk.first < ctx.policy.sink_tokens()) break;  // sinks stay fp16
      if (chunk.cold() || c < s.stats().final_chunks()) continue;
      job.items.push_back({.chunk = c,
                           .head = h,
                           .tokens = chunk.num_tokens,
                           .source = chunk.host,
                           .cold = nullptr,
                           .summary = {}});
    }
  }
  return job;
}

void RunQuant(const SpanContext& ctx, QuantJob* job) {
  const uint32_t d = ctx.format.head_dim;
  job->done = job->end;
  std::vector<uint16_t> rows;
  for (QuantJob::Item& item : job->items) {
    const QuantLayout layout{d, item.tokens, job->bits};
    auto slot = ctx.host.tier()->Allocate(ctx.host, layout.Bytes());
    if (!slot.ok()) {  // this chunk and those after it wait for the next call
      job->done = item.chunk;
      break;
    }
    const auto* k = reinterpret_cast<const uint16_t*>(item.source->data());
    item.summary = QuantizeRows(ctx.format, k, k + uint64_t{item.tokens} * d, item.tokens,
                                job->bits, (*slot)->data(), &rows);
    item.cold = *std::move(slot);
  }
}

void CommitQuant(std::span<Stream> heads, AgingState* state, QuantJob&& job) {
  const v1::Precision precision = job.bits == 4 ? v1::PRECISION_INT4 : v1::PRECISION_INT8;
  for (QuantJob::Item& item : job.items) {
    if (item.cold == nullptr) break;  // RunQuant stopped here
    Stream& s = heads[item.head];
    // Changed meanwhile (aged by another path, or gone): whoever changed it settled it.
    if (item.chunk >= s.chunks().size() || s.chunks()[item.chunk].host != item.source ||
        item.chunk < s.stats().final_chunks()) {
      continue;
    }
    Chunk cold = s.chunks()[item.chunk];
    cold.host = std::move(item.cold);  // the fp16 slot goes back (unless a lease or fork holds it)
    cold.precision = precision;
    cold.copies.reset_device();
    s.Replace(item.chunk, std::move(cold), item.summary);
  }
  if (state->quantized == job.first) state->quantized = job.done;
}

bool IndexLayerSlice(const AgingContext& ctx, uint64_t tokens, std::span<Stream> heads,
                     AgingState* state, uint32_t max_chunks, absl::Time deadline) {
  // Peaks first, at most `max_chunks` more of them too; a chunk enters the index only with
  // its peak.
  const uint32_t aged = AgedOutChunks(ctx.policy, tokens, heads[0]);
  PeakChunks(ctx, heads, state, aged, max_chunks);
  uint32_t limit = FinalRows(ctx, aged, *state);
  if (ctx.cold_bits() != 0) limit = std::min(limit, state->quantized);
  bool more = state->peaked < aged;
  limit = std::min(limit, state->peaked);
  bool added = false;  // one chunk at least, whatever the deadline
  for (Stream& s : heads) {
    const uint32_t from = s.stats().final_chunks();
    const uint32_t to = from + std::min(max_chunks, limit > from ? limit - from : 0);
    if (to == from) continue;
    if (added && absl::Now() > deadline) return true;  // this head's chunks wait
    const uint32_t got = s.Finalize(to, ctx.policy.sink_tokens(), ctx.policy.ranking(), deadline);
    added = true;
    more = more || got < limit;
  }
  return more;
}

uint32_t AgingContext::cold_bits() const {
  if (policy.lossless() || format.dtype != v1::DTYPE_FP16) return 0;
  switch (policy.cold_precision()) {
    case v1::PRECISION_INT4:
      return 4;
    case v1::PRECISION_INT8:
      return 8;
    default:
      return 0;
  }
}

uint32_t AgedOutChunks(const v1::SessionPolicy& policy, uint64_t tokens, const Stream& head0) {
  const uint64_t window = policy.recent_window();
  return tokens <= window ? 0 : head0.ChunksEndingBy(tokens - window);
}

uint32_t PeakLayer(const AgingContext& ctx, uint64_t tokens, std::span<Stream> heads,
                   AgingState* state) {
  const uint32_t aged = AgedOutChunks(ctx.policy, tokens, heads[0]);
  PeakChunks(ctx, heads, state, aged, UINT32_MAX);
  return aged;
}

void IndexLayer(const AgingContext& ctx, uint64_t tokens, std::span<Stream> heads,
                AgingState* state) {
  // The index keeps a chunk's statistics fixed, so it takes a chunk only once they are final:
  // regrouped (semantic chunking) and quantized (a chunk that should be cold but is not yet,
  // because the host tier was full, waits).
  IndexLayerSlice(ctx, tokens, heads, state, UINT32_MAX);
}

void AgeLayer(const AgingContext& ctx, uint64_t tokens, std::span<Stream> heads,
              AgingState* state) {
  Regroup(ctx, tokens, heads, state);
  Quantize(ctx, tokens, heads, state);
  IndexLayer(ctx, tokens, heads, state);
}

}  // namespace kvtier
