// One stream: the keys and values of one (session, layer, KV head). A stream owns its chunks,
// their statistics (ChunkStats) and its cluster index, and keeps the three in step: a chunk's
// rows change only through the methods below, which update its statistics with it.
//
// Chunks are ordered by `first`, their first position (a regrouped span's chunks share the
// span's first position). Each chunk's K and V lie in one slot of the host tier:
//
//   offset 0            n*d*2            2*n*d*2        slot end (capacity*d*4)
//   +-------------------+----------------+---------------+
//   | K [n][d]          | V [n][d]       | unused        |
//   +-------------------+----------------+---------------+
//
// for a chunk of n tokens, head_dim d and the session's 2-byte dtype; a cold chunk holds its
// QuantLayout instead. V starts right after the chunk's n key rows, so a partial chunk is
// still one contiguous K-then-V run. Growing a partial chunk moves its V rows; that happens in
// place only when nobody else holds the slot (no lease, no fork), and then the slot takes a
// new generation. Otherwise the chunk is copied to a fresh slot (copy on write).
//
// Not thread-safe: the session's lock serializes every call.
#ifndef KVTIER_SERVER_SESSION_STREAM_H_
#define KVTIER_SERVER_SESSION_STREAM_H_

#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <utility>
#include <vector>

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "kernels/quant_layout.h"
#include "kvtier/v1/kvtier.pb.h"
#include "server/common/vec.h"
#include "server/index/chunk_stats.h"
#include "server/index/cluster_index.h"
#include "server/tier/promotion_cache.h"
#include "server/tier/tier.h"

namespace kvtier {

// A chunk's fp16 copies in the promotion caches: `promoted`, a cold chunk dequantized on the
// host tier, and `device`, a copy on the device tier (dropped when the chunk changes); each
// null when there is none. Most old chunks never have one, so the pair lives out of line,
// made at the first copy: 8 bytes in every chunk record instead of two shared pointers' 32
// (quant_bench counts the record). Copying a chunk (a fork's) shares its copies.
class ChunkCopies {
 public:
  ChunkCopies() = default;
  ChunkCopies(const ChunkCopies& o) { *this = o; }
  ChunkCopies& operator=(const ChunkCopies& o) {
    pair_ = o.pair_ ? std::make_unique<Pair>(*o.pair_) : nullptr;
    return *this;
  }
  ChunkCopies(ChunkCopies&&) noexcept = default;
  ChunkCopies& operator=(ChunkCopies&&) noexcept = default;

  const CopyRef& promoted() const { return pair_ ? pair_->promoted : Null(); }
  const CopyRef& device() const { return pair_ ? pair_->device : Null(); }
  // The copy to set: makes the pair when the chunk has none.
  CopyRef& mutable_promoted() { return Made().promoted; }
  CopyRef& mutable_device() { return Made().device; }
  void reset_device() {
    if (pair_) pair_->device.reset();
  }

 private:
  struct Pair {
    CopyRef promoted, device;
  };
  Pair& Made() {
    if (!pair_) pair_ = std::make_unique<Pair>();
    return *pair_;
  }
  static const CopyRef& Null() {
    static const CopyRef kNull;
    return kNull;
  }
  std::unique_ptr<Pair> pair_;
};

// chunk_id = layer << 40 | kv_head << 28 | index: ReadChunks decodes it without a map.
struct ChunkAddress {
  uint32_t layer;
  uint32_t kv_head;
  uint32_t index;
};
inline constexpr uint32_t kMaxChunksPerStream = 1u << 28;
uint64_t EncodeChunkId(const ChunkAddress& a);
ChunkAddress DecodeChunkId(uint64_t id);

// Whether position p is a sink (below sink_end) or in the recent window (from window_start).
inline bool IsKeptPosition(uint64_t p, uint64_t sink_end, uint64_t window_start) {
  return p < sink_end || p >= window_start;
}

// A regrouped chunk's row offsets from its span's first position, ascending: one byte each
// while every offset is below 256 (a semantic span of chunks of up to 32 tokens), else two, in
// one allocation headed by that width and the count (a chunk holds at most 255 rows). Every
// old chunk of a semantic session has one, so its bytes count against the stored format
// (bench/quant_bench.cc): 48 bytes of heap at 32 rows, where a vector of uint16 took 24 in the
// chunk and 80 of heap.
class RowOffsets {
 public:
  RowOffsets() = default;
  explicit RowOffsets(std::span<const uint32_t> offsets);
  RowOffsets(const RowOffsets& o) { *this = o; }
  RowOffsets& operator=(const RowOffsets& o);
  RowOffsets(RowOffsets&&) noexcept = default;
  RowOffsets& operator=(RowOffsets&&) noexcept = default;

  bool empty() const { return data_ == nullptr; }
  uint32_t size() const { return data_ ? data_[1] : 0; }
  uint32_t operator[](uint32_t r) const {
    return data_[0] == 1 ? data_[2 + r] : data_[2 + 2 * r] | uint32_t{data_[3 + 2 * r]} << 8;
  }
  // The row whose offset is o, or -1.
  int64_t Find(uint32_t o) const;
  // The bytes its allocation asks for: 0 when empty.
  size_t AllocatedBytes() const { return data_ ? Bytes(size(), data_[0]) : 0; }
  // What `count` offsets below `end` ask for.
  static size_t AllocatedBytes(uint32_t count, uint32_t end) {
    return Bytes(count, end <= 256 ? 1 : 2);
  }
  bool operator==(const RowOffsets& o) const;

 private:
  static size_t Bytes(uint32_t count, uint32_t width) { return 2 + size_t{count} * width; }
  std::unique_ptr<uint8_t[]> data_;
};

struct Chunk {
  uint16_t num_tokens = 0;  // at most 2 * kMaxChunkTokens
  bool sealed = false;      // takes no more rows
  // How `host` holds the chunk: fp16/bf16 (the ChunkLayout) or int4/int8 (QuantLayout).
  v1::Precision precision = v1::PRECISION_FP16;
  uint64_t first = 0;  // position of row 0; of the span for a regrouped chunk
  // A regrouped chunk's row positions, first + offsets[r], ascending; empty: contiguous
  RowOffsets offsets;
  SlotRef host;        // the stored bytes
  ChunkCopies copies;  // its fp16 copies in the promotion caches, if any
  bool cold() const { return IsCold(precision); }
  static bool IsCold(v1::Precision p) { return p == v1::PRECISION_INT4 || p == v1::PRECISION_INT8; }
  uint64_t position(uint32_t r) const { return first + (offsets.empty() ? r : offsets[r]); }
  uint64_t end() const { return position(num_tokens - 1) + 1; }  // past the last row
};
// One per chunk of every stream: its bytes count against the stored format (quant_bench).
static_assert(sizeof(Chunk) == 48);

// How a session's chunks are laid out: the same for every stream of it.
struct ChunkFormat {
  uint32_t head_dim = 0;
  v1::DType dtype = v1::DTYPE_FP16;
  uint32_t capacity = 0;  // the most rows a chunk holds (2 * chunk_tokens for boundary chunking)

  HalfKind kind() const { return dtype == v1::DTYPE_BF16 ? HalfKind::kBf16 : HalfKind::kFp16; }
  // The precision of a chunk that is not cold: the session's dtype.
  v1::Precision warm() const {
    return dtype == v1::DTYPE_BF16 ? v1::PRECISION_BF16 : v1::PRECISION_FP16;
  }
  v1::Precision precision(const Chunk& c) const { return precision(c.precision); }
  // Of a chunk whose precision field says `p`.
  v1::Precision precision(v1::Precision p) const { return Chunk::IsCold(p) ? p : warm(); }
  uint64_t row_bytes() const { return uint64_t{head_dim} * 2; }
  uint64_t slot_bytes() const { return row_bytes() * capacity * 2; }
  // The layout of a cold chunk's bytes.
  QuantLayout ColdLayout(const Chunk& c) const {
    return QuantLayout{head_dim, c.num_tokens, c.precision == v1::PRECISION_INT4 ? 4u : 8u};
  }
  // The bytes a chunk's host slot holds: K then V rows, or the quantized layout of a cold one.
  uint64_t StoredBytes(const Chunk& c) const {
    return c.cold() ? ColdLayout(c).Bytes() : 2 * c.num_tokens * row_bytes();
  }
  // Writes a chunk's K then V as 2-byte rows (ChunkLayout) at `dst`, dequantizing a cold one.
  void WriteFp16(const Chunk& c, uint8_t* dst) const;
  // The K and V of a chunk as 2-byte rows, dequantizing a cold one into `scratch`.
  const uint16_t* Fp16Rows(const Chunk& c, std::vector<uint16_t>& scratch) const;
};
ChunkFormat FormatOf(const v1::ModelShape& shape, const v1::SessionPolicy& policy);

// How one append's new tokens fall into chunks, the same for every KV head of a layer: the
// first segment grows the stream's open last chunk when `grow`, each other one is a new chunk.
struct AppendPlan {
  struct Segment {
    uint32_t rows = 0;
    bool sealed = false;
  };
  bool grow = false;
  std::vector<Segment> segments;
  uint64_t new_chunks() const { return segments.size() - (grow ? 1 : 0); }
};

// The heap a chunk's host slot takes beside its shared memory: the Slot and its shared_ptr's
// counts in one block (make_shared: a vtable pointer and two counts before the object), as
// glibc's malloc rounds it (8 bytes of header, then to 16, at least 32).
inline constexpr uint64_t kSlotHeapBytes = (16 + sizeof(Slot) + 8 + 15) / 16 * 16;
static_assert(sizeof(Slot) == 56 && kSlotHeapBytes == 80);

// One KV head's rows of an append, copied where they will be stored before the stream changes
// (Stream::Land, then Stream::Take).
struct LandedRows {
  std::vector<Chunk> chunks;  // the new chunks, each with its rows in a fresh slot
  std::vector<float> sums;    // [chunks][head_dim]: each new chunk's key rows summed
  std::vector<uint8_t> grow;  // the rows that grow the open last chunk: keys, then values
};

class Stream {
 public:
  explicit Stream(uint32_t head_dim) : stats_(static_cast<int>(head_dim)) {}
  Stream(Stream&&) = default;
  Stream& operator=(Stream&&) = default;

  const std::vector<Chunk>& chunks() const { return chunks_; }
  // Kept as the chunks change, so that a session's Info sums its streams, not their chunks:
  // the bytes of the chunks' host slots, and how many chunks hold each precision (by the value
  // of Chunk::precision).
  uint64_t slot_bytes() const { return slot_bytes_; }
  const std::array<uint32_t, v1::Precision_ARRAYSIZE>& chunks_by_precision() const {
    return by_precision_;
  }
  const ChunkStats& stats() const { return stats_; }
  const ClusterIndex* index() const { return index_.get(); }
  // A chunk's cached copies (promoted, device) are the one part of it that callers set.
  ChunkCopies& copies(uint32_t c) { return chunks_[c].copies; }

  // The chunk and row that hold position `t` (stored).
  std::pair<uint32_t, uint32_t> Locate(uint64_t t) const;
  // How many chunks, from the first, lie wholly before `position` (each of them sealed).
  uint32_t ChunksEndingBy(uint64_t position) const;
  // The chunks with a row among the sinks (< sink_end) or in the recent window (>= window_start,
  // judged by a chunk's first and last rows); `tokens` receives their tokens, and `rows`, when
  // not null, how many of their rows are sinks or in the window.
  std::vector<bool> Kept(uint64_t sink_end, uint64_t window_start, uint64_t* tokens,
                         uint64_t* rows = nullptr) const;
  // The first position in [start, start + count) whose stored rows differ from keys[i] and
  // values[i] (rows of head_dim halves, i = position - start), or nullopt. A cold chunk keeps
  // no exact bytes: a row matches when its codes could have come from it.
  std::optional<uint64_t> FirstMismatch(uint64_t start, uint64_t count, const uint8_t* keys,
                                        const uint8_t* values, const ChunkFormat& f) const;

  // Writes one append's rows (keys and values [tokens][head_dim], for the plan's segments)
  // from `position` on: grows the open last chunk (in a copy when its slot is shared) and adds
  // new chunks. `slot()` hands over a fresh slot for each new chunk and for a copy. Land
  // (the rows finite: a CHECK), then Take.
  void Write(const AppendPlan& plan, const uint8_t* keys, const uint8_t* values, uint64_t position,
             const ChunkFormat& f, const std::function<SlotRef()>& slot);
  // Write's first half, which changes nothing in the stream: copies the rows where they will
  // be stored, each new chunk's into a fresh slot from `slot()` (past the cache: the rows are
  // next read when they age or a worker reads them) with its keys' sum, the ones that grow
  // the open last chunk into out->grow. Every value is checked finite as it is copied, so that
  // what is checked is what is stored even when `keys` and `values` are memory another
  // process may write meanwhile; false at the first that is not (the slots taken go back with
  // *out).
  bool Land(const AppendPlan& plan, const uint8_t* keys, const uint8_t* values, uint64_t position,
            const ChunkFormat& f, const std::function<SlotRef()>& slot, LandedRows* out) const;
  // Write's second half: grows the open last chunk by rows.grow (in a copy from `slot()` when
  // its slot is shared) and adds rows.chunks, their statistics from the sums Land made.
  void Take(const AppendPlan& plan, LandedRows&& rows, const ChunkFormat& f,
            const std::function<SlotRef()>& slot);
  // Whether the plan would copy this stream's open last chunk (someone else holds its slot).
  bool CopiesOnGrow(const AppendPlan& plan) const {
    return plan.grow && chunks_.back().host.use_count() > 1;
  }

  // Chunk c becomes `chunk`, the same rows in another form (quantized; regrouped), whose keys
  // as attention reads them `summary` describes (ChunkStats::Summarize of them).
  void Replace(uint32_t c, Chunk chunk, const ChunkSummary& summary);
  // Chunk c's peak, from its keys as attention reads them.
  void ComputePeak(uint32_t c, const ChunkFormat& f);
  // Chunks [0, n) have final statistics: each that is not a sink (first < sink_tokens) enters
  // the index, which is made on first use, clustered for `ranking`. Smaller n: a no-op. Past
  // `deadline` it stops after the chunk in hand (at least one), so that a caller under a lock
  // holds it for a bounded while; returns the chunks final now (n, or fewer when it stopped).
  uint32_t Finalize(uint32_t n, uint64_t sink_tokens, v1::Ranking ranking,
                    absl::Time deadline = absl::InfiniteFuture());

  // A fork's stream: the first `keep` chunks of `src` shared (their statistics copied, not yet
  // final here), then the rows of positions [from, to) copied, in position order, into new
  // chunks of at most `piece` rows, each sealed when it holds `seal_rows` (0: never).
  void ForkFrom(const Stream& src, uint32_t keep, uint64_t from, uint64_t to, uint32_t piece,
                uint32_t seal_rows, const ChunkFormat& f, const std::function<SlotRef()>& slot);

  // Appends a chunk restored from a record; its statistics are computed from its rows.
  void Restore(Chunk chunk, const ChunkFormat& f);

  // The heap bytes this stream's metadata holds beyond the object itself (chunk records and
  // their slots' heap, row offsets, statistics and index, as their arrays' capacities); O(1):
  // what a session charges its tenant for metadata, with sizeof(Stream).
  uint64_t HeapBytes() const {
    return chunks_.capacity() * sizeof(Chunk) + chunks_.size() * kSlotHeapBytes + offset_bytes_ +
           (stats_.MemoryBytes() - sizeof(stats_)) + index_bytes_;
  }

 private:
  // A chunk joins or leaves the stream's counts (its offsets' bytes, its slot's, its precision).
  void Count(const Chunk& c) {
    offset_bytes_ += c.offsets.AllocatedBytes();
    slot_bytes_ += c.host->bytes();
    ++by_precision_[c.precision];
  }
  void Uncount(const Chunk& c) {
    offset_bytes_ -= c.offsets.AllocatedBytes();
    slot_bytes_ -= c.host->bytes();
    --by_precision_[c.precision];
  }

  // Appends `chunk` (its row offsets counted); returns its index. The caller adds its
  // statistics.
  uint32_t Push(Chunk chunk);

  std::vector<Chunk> chunks_;
  ChunkStats stats_;
  std::unique_ptr<ClusterIndex> index_;  // null until the first chunk is final
  uint64_t offset_bytes_ = 0;            // the chunks' offsets arrays
  uint64_t slot_bytes_ = 0;              // the chunks' host slots
  std::array<uint32_t, v1::Precision_ARRAYSIZE> by_precision_{};
  uint64_t index_bytes_ = 0;  // index_->MemoryBytes(), taken when the index changes
};

// The plan for the append's tokens [from, to) after what `head0` (any stream of the layer)
// holds. `seals(rows, i)`: whether a chunk of `rows` rows whose last row is token i ends.
AppendPlan PlanAppend(const Stream& head0, uint64_t from, uint64_t to,
                      const std::function<bool(uint32_t rows, uint64_t i)>& seals);

}  // namespace kvtier

#endif  // KVTIER_SERVER_SESSION_STREAM_H_
