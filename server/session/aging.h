// Aging: what happens to a layer's chunks once they leave the recent window, in order:
//   regroup   semantic chunking: each whole span of kSemanticSpanChunks aged-out chunks is
//             regrouped, per KV head, by balanced k-means into as many chunks of nearby keys,
//             each row keeping its position (Chunk::offsets);
//   quantize  cold chunks become int4 or int8 (sinks stay fp16), their statistics recomputed
//             from the dequantized keys, which are what attention reads (a regrouped span's
//             chunks as they are regrouped);
//   peaks     each aged-out chunk's peak key (a cold or regrouped one got it above);
//   index     chunks whose statistics are final (aged out, regrouped when semantic, quantized
//             when the policy quantizes) enter their stream's cluster index.
// A step that cannot get its slots (a full host tier) leaves the chunks as they are and
// resumes on the next call; Select stays exact meanwhile, since chunks not yet indexed are
// scored beside the index. A chunk already in the index is never quantized later (a policy
// changed to int4 afterwards applies to the chunks that age out from then on).
//
// Aging reads only its AgingContext, the layer's token count, its streams and its AgingState,
// so a caller can run it wherever it holds those: the aging pool (aging_pool.h), one layer at a
// time, regrouping spans and quantizing chunks without the session's lock (NextSpan,
// RegroupSpan, CommitSpan; NextQuant, RunQuant, CommitQuant below) and indexing under it a
// slice at a time (IndexLayerSlice), or the append path itself (no pool; wait_aged). An
// append that leaves the work to the pool computes nothing; a Select that comes first
// computes the peaks of the chunks aged out since (PeakLayer), so that it ranks them exactly
// beside the index meanwhile. Chunk
// boundaries are the same in every KV head of a layer, so one state serves them.
#ifndef KVTIER_SERVER_SESSION_AGING_H_
#define KVTIER_SERVER_SESSION_AGING_H_

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "kvtier/v1/kvtier.pb.h"
#include "server/session/stream.h"
#include "server/tier/tier.h"

namespace kvtier {

// Semantic chunking regroups spans of this many aged-out chunks.
inline constexpr uint32_t kSemanticSpanChunks = 8;

// How far one layer's aging has come. (Its index's progress is each stream's
// stats().final_chunks().)
struct AgingState {
  uint32_t regrouped = 0;  // semantic: chunks [0, n) are sinks or regrouped spans
  uint32_t quantized = 0;  // chunks [0, n) have been examined for quantization
  uint32_t peaked = 0;     // chunks [0, n) have their peaks
};

// What aging reads of its session, fixed for one call.
struct AgingContext {
  const v1::SessionPolicy& policy;
  ChunkFormat format;
  const TierAccount& host;  // slots for quantized and regrouped chunks
  // Bits of cold chunks under `policy`: 4, 8, or 0 (keep fp16).
  uint32_t cold_bits() const;
};

// Every step, for a layer holding `tokens` tokens whose streams are `heads`.
void AgeLayer(const AgingContext& ctx, uint64_t tokens, std::span<Stream> heads, AgingState* state);
// Only the peaks of the chunks aged out (what Select needs to rank them); returns how many
// chunks have aged out.
uint32_t PeakLayer(const AgingContext& ctx, uint64_t tokens, std::span<Stream> heads,
                   AgingState* state);
// Only peaks and the index: after a fork or a policy change, which store no new rows.
void IndexLayer(const AgingContext& ctx, uint64_t tokens, std::span<Stream> heads,
                AgingState* state);

// Regrouping one span in three steps, so that an aging pool does the work (RegroupSpan)
// without the session's lock: NextSpan and CommitSpan run under it. AgeLayer runs the three
// in a row.
struct SpanContext {  // what RegroupSpan reads, copied: the session may change meanwhile
  ChunkFormat format;
  uint32_t chunk_tokens = 0;
  TierAccount host;
  uint32_t cold_bits = 0;  // AgingContext::cold_bits()
  static SpanContext Of(const AgingContext& ctx);
};
struct SpanJob {
  uint32_t first = 0;  // the span's first chunk
  // The span's chunks as they were, [kv_head * kSemanticSpanChunks + i] (their slots held),
  // and what RegroupSpan made of them, in the same order, with their statistics (computed
  // there, without the lock).
  std::vector<Chunk> sources, regrouped;
  std::vector<ChunkSummary> summaries;
  uint32_t cold_bits = 0;  // RegroupSpan: the chunks were quantized to these bits (0: fp16)
};
// The next whole span of aged-out chunks not yet regrouped (semantic chunking), or nullopt.
std::optional<SpanJob> NextSpan(const AgingContext& ctx, uint64_t tokens, std::span<Stream> heads,
                                AgingState* state);
// Regroups the span into fresh slots; false when they cannot be had (the span waits). Under a
// policy that quantizes (cold_bits), each regrouped chunk is quantized at once, as the next
// step would quantize it (a regrouped span has left the window): its fp16 rows are never
// stored.
bool RegroupSpan(const SpanContext& ctx, SpanJob* job);
// Puts the regrouped chunks in place of the span's, unless the span changed since NextSpan or
// the job's chunks are not of the precision the policy now gives (`cold_bits`: a policy changed
// meanwhile); then false, and the job's slots go back.
bool CommitSpan(std::span<Stream> heads, AgingState* state, SpanJob&& job, uint32_t cold_bits);

// Quantizing in the same three steps: NextQuant (under the lock) names up to `max_chunks`
// chunks of every head and holds their slots, RunQuant (without it) quantizes each into a fresh
// slot and dequantizes it back (the rows attention will read), CommitQuant (under it) puts
// each in place of its chunk unless the chunk changed meanwhile. Quantize runs them in a row.
struct QuantJob {
  uint32_t first = 0, end = 0;  // chunks [first, end) of every head
  uint32_t bits = 0;
  uint32_t done = 0;  // after RunQuant: chunks [first, done) were quantized; < end: no slots
  struct Item {
    uint32_t chunk = 0, head = 0, tokens = 0;
    SlotRef source;        // the chunk's fp16 slot, held: its bytes stay as they are
    SlotRef cold;          // RunQuant: the quantized bytes
    ChunkSummary summary;  // RunQuant: the statistics of its keys as dequantized
  };
  std::vector<Item> items;  // chunk-major, then head
  // After RunQuant: whether any chunk got its slot (each commit gives fp16 slots back, so a
  // job on a full tier that made some progress may make more when tried again).
  bool progressed() const { return done > first || (!items.empty() && items[0].cold != nullptr); }
};
std::optional<QuantJob> NextQuant(const AgingContext& ctx, uint64_t tokens,
                                  std::span<const Stream> heads, const AgingState& state,
                                  uint32_t max_chunks);
void RunQuant(const SpanContext& ctx, QuantJob* job);
void CommitQuant(std::span<Stream> heads, AgingState* state, QuantJob&& job);

// IndexLayer a slice at a time: at most `max_chunks` more chunks get their peaks and at most
// `max_chunks` more of each head enter the index, and none more once `deadline` has passed
// (after at least one); returns whether any peak or chunk that could be made or enter is still
// left out.
bool IndexLayerSlice(const AgingContext& ctx, uint64_t tokens, std::span<Stream> heads,
                     AgingState* state, uint32_t max_chunks,
                     absl::Time deadline = absl::InfiniteFuture());

// The chunks [0, n) of a layer holding `tokens` that lie wholly before its recent window.
uint32_t AgedOutChunks(const v1::SessionPolicy& policy, uint64_t tokens, const Stream& head0);

}  // namespace kvtier

#endif  // KVTIER_SERVER_SESSION_AGING_H_
