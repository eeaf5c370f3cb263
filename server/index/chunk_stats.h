// What a stream's ranking knows of its chunks: per chunk its token count, its mean key and its
// peak key (the key farthest from the mean), computed on the rows attention reads (the
// dequantized keys of a cold chunk), and how many of the chunks have final statistics.
//
// Two forms, chunk by chunk in order. A chunk whose statistics are final is held compact: its
// mean and its peak each as head_dim signed bytes times one float scale (the vector's largest
// magnitude over 127, each byte rounded to nearest: within half a step, 1/254 of that
// magnitude, of the float), a quarter of the bytes of floats. The chunks after those (the
// recent window, and chunks aging has not finished) keep a float sum and peak, which appends
// grow:
//
//   tokens    uint32 [chunks]
//   codes     int8   [compact][2][head_dim]   the compact chunks [0, compact_chunks()): mean,
//                                             then peak, side by side (one read scores both)
//   scales    float  [compact][2]             mean's, then peak's
//   tiles     uint8  the compact chunks' codes again, in tiles (PutInt8TileRow, parts 2: mean,
//                    then peak), where this machine's VNNI kernel scores them (Score): kept
//                    only there, for head_dim a multiple of 32, and up to kMaxTiledChunks
//                    compact chunks (2 * head_dim bytes a chunk, a whole-chunk scan's reach)
//   sums      float  [chunks - compact][head_dim]   sum of the chunk's keys (mean = sum / tokens)
//   peaks     float  [chunks - compact][head_dim]   zeros until the chunk's peak is computed
//
// (The float arrays are LooseFloats: blocks of chunks, so that an append's chunks never move
// the floats already held, however long the backlog the aging pool has not reached, and the
// chunks that became compact leave by whole blocks at the front.)
//
// The ranking reads either form through ChunkCandidate; the cluster index bounds the compact
// values, so its searches stay exact against the scan over the same statistics. Statistics
// are final for the chunks [0, final_chunks()): they no longer change, and only those may
// enter a cluster index (whose bounds assume fixed statistics). Changing a final or compact
// chunk is a broken invariant (CHECK). A fork's copy keeps the compact chunks it copies
// compact, none of them final yet.
//
// Not thread-safe: its stream's owner serializes access.
#ifndef KVTIER_SERVER_INDEX_CHUNK_STATS_H_
#define KVTIER_SERVER_INDEX_CHUNK_STATS_H_

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "server/common/vec.h"
#include "server/index/chunk_ranker.h"

namespace kvtier {

// One chunk's float statistics, computed from its rows apart from any ChunkStats (so that the
// aging pool computes them without its stream's lock): what Recompute stores.
struct ChunkSummary {
  uint32_t tokens = 0;
  std::vector<float> key_sum, peak;
};

// head_dim floats per chunk for a run of chunks, the first ones leaving first: held in blocks
// of kBlockChunks chunks, so that adding a chunk never moves (or copies, or touches the fresh
// pages of) the floats held, as a vector's growth would, and one chunk's floats are contiguous.
// Nothing is allocated until the first chunk.
class LooseFloats {
 public:
  static constexpr size_t kBlockChunks = 8;  // 2 KiB at head_dim 64: few chunks held idle
  explicit LooseFloats(int d) : d_(static_cast<size_t>(d)) {}
  size_t size() const { return size_; }
  // Chunk i's d floats (i from the first chunk held). REQUIRES: i < size().
  float* at(size_t i) { return Row(i); }
  const float* at(size_t i) const { return Row(i); }
  // One more chunk, its floats 0.
  void PushZero();
  // The first n chunks leave. REQUIRES: n <= size().
  void PopFront(size_t n);
  // The first n chunks of `from`, replacing what is here.
  void AssignPrefix(const LooseFloats& from, size_t n);
  // The blocks, and the array of their pointers.
  size_t MemoryBytes() const {
    return blocks_.size() * BlockBytes() + blocks_.capacity() * sizeof(blocks_[0]);
  }
  // What `more` chunks pushed would add to MemoryBytes(): the blocks they would begin, and
  // the pointers' array grown as PushZero grows it.
  size_t GrowthBytes(size_t more) const {
    const size_t blocks = (first_ + size_ + more + kBlockChunks - 1) / kBlockChunks;
    const size_t had = blocks_.capacity();
    size_t room = had;
    while (room < blocks) room = NextRoom(room);
    return (blocks - std::min(blocks, blocks_.size())) * BlockBytes() +
           (room - had) * sizeof(blocks_[0]);
  }

 private:
  static size_t NextRoom(size_t room) { return std::max<size_t>(2 * room, 4); }
  size_t BlockBytes() const { return kBlockChunks * d_ * sizeof(float); }
  float* Row(size_t i) const {
    const size_t j = first_ + i;
    return blocks_[j / kBlockChunks].get() + (j % kBlockChunks) * d_;
  }

  size_t d_;
  std::vector<std::unique_ptr<float[]>> blocks_;  // a few dozen at most in a long backlog
  size_t first_ = 0;                              // chunks of the first block already gone
  size_t size_ = 0;
};

class ChunkStats {
 public:
  explicit ChunkStats(int head_dim);

  // Tiles are kept while the compact chunks are at most this many: a whole-chunk Select scans
  // up to kIndexMinCandidates (stream_ranker.h) and searches the index past it, whose reads
  // want the rows. A stream past it lets its tiles go for good.
  static constexpr uint32_t kMaxTiledChunks = 2048;
  // The bytes a compact chunk's statistics hold here: its mean and peak codes and their scales,
  // and their tiles where this machine keeps them (counting them for every chunk: an estimate
  // made before the stream's length is known errs high, not low).
  static size_t CompactChunkBytes(int head_dim);

  int head_dim() const { return d_; }
  uint32_t size() const { return static_cast<uint32_t>(tokens_.size()); }
  uint32_t tokens(uint32_t c) const { return tokens_[c]; }
  // Chunk c's mean key and peak as head_dim floats into out (the compact bytes times scale).
  void Mean(uint32_t c, float* out) const;
  void Peak(uint32_t c, float* out) const;
  // The float sum and peak of a chunk that is not compact.
  const float* key_sum(uint32_t c) const;
  const float* peak(uint32_t c) const;
  // The chunk as the ranking scores it (ChunkCandidate points into these arrays). Inline: a
  // scan builds one per chunk.
  ChunkCandidate candidate(uint32_t c) const {
    if (c < compact_) {
      return {c,
              tokens_[c],
              nullptr,
              1.f,
              nullptr,
              &codes_[Code(c, 0)],
              &codes_[Code(c, 1)],
              scales_[ScaleAt(c, 0)],
              scales_[ScaleAt(c, 1)]};
    }
    return {c, tokens_[c], key_sum(c), 1.f / static_cast<float>(tokens_[c]), peak(c)};
  }
  // Every chunk's score by `ranking` into out[c], c < size(): the bits ScoreCandidates gives
  // over candidate(c) of each, with the compact chunks read in place (a scan's whole stream).
  // Where `skip` is given (size() flags), a chunk that is not compact and is skipped (the
  // recent window, returned anyway) is not scored: its out[c] is left as it was.
  void Score(v1::Ranking ranking, std::span<const float> queries, int group, float* out,
             const std::vector<bool>* skip = nullptr) const;
  // The scores by `ranking` of the compact chunks `chunks` (anywhere in the stream, in any
  // order) into out[i]: Score's bits, their codes gathered side by side (four rows a pass of
  // the vector kernel) and scored with the query group's codes as the caller made them
  // (QueryInt8Group of its queries: a search scores cluster after cluster with one).
  // REQUIRES: every chunk compact, q8.n() == head_dim().
  void ScoreCompact(v1::Ranking ranking, const QueryInt8Group& q8, std::span<const uint32_t> chunks,
                    float* out) const;
  // Where the bytes scoring chunk c reads begin (its mean or sum, then its peak: side by side
  // when it is compact), and how many each.
  const void* mean_data(uint32_t c) const;
  const void* peak_data(uint32_t c) const;
  size_t vector_bytes(uint32_t c) const;
  bool compact(uint32_t c) const { return c < compact_; }

  // Adds n key rows ([n][head_dim] halves of `kind`) to chunk c's sum and token count; c ==
  // size() appends a chunk first. The peak is left as it is.
  void AddRows(uint32_t c, HalfKind kind, const uint16_t* rows, uint32_t n);
  // The same for n rows whose float sum (head_dim floats, as AddRows adds them from zero) the
  // caller made as it copied them (CopyFiniteRows).
  void AddSummed(uint32_t c, const float* sum, uint32_t n);
  // Chunk c's statistics anew from all its n rows: Set of their Summarize.
  void Recompute(uint32_t c, HalfKind kind, const uint16_t* rows, uint32_t n);
  // The statistics of n key rows of head_dim d: their float sum, and the row farthest from
  // their mean (sum * (1 / n), as Mean reads it) as the peak.
  static ChunkSummary Summarize(HalfKind kind, const uint16_t* rows, uint32_t n, int d);
  // Chunk c's statistics become `s`.
  void Set(uint32_t c, const ChunkSummary& s);
  // Chunk c's peak from its n rows, which its sum already covers.
  void ComputePeak(uint32_t c, HalfKind kind, const uint16_t* rows);
  // Appends a chunk of `tokens` tokens whose statistics were computed elsewhere (from float
  // keys, say): key_sum and peak are head_dim floats each.
  void Append(uint32_t tokens, const float* key_sum, const float* peak);

  uint32_t final_chunks() const { return final_; }
  uint32_t compact_chunks() const { return compact_; }
  // Chunks [0, n) have final statistics, and are made compact. REQUIRES: n <= size(); n never
  // decreases.
  void MarkFinal(uint32_t n);

  // The first n chunks of `from` (a fork's shared chunks), none of them final yet here: the
  // copy's owner marks them final as its own index takes them in.
  void CopyPrefix(const ChunkStats& from, uint32_t n);

  // What `more` chunks appended would add to MemoryBytes() in float statistics (the blocks
  // they would begin), before any is made compact.
  size_t LooseGrowthBytes(uint32_t more) const {
    return sums_.GrowthBytes(more) + peaks_.GrowthBytes(more);
  }
  // The heap bytes its arrays hold (their capacities), and the object itself.
  size_t MemoryBytes() const {
    return sizeof(*this) + tokens_.capacity() * sizeof(uint32_t) + codes_.capacity() +
           tiles_.capacity() + scales_.capacity() * sizeof(float) + sums_.MemoryBytes() +
           peaks_.MemoryBytes();
  }

 private:
  void Grow(uint32_t c);
  size_t Loose(uint32_t c) const { return c - compact_; }
  // Where compact chunk c's vector `part` (0 mean, 1 peak) begins in codes_, its scale's index.
  size_t Code(uint32_t c, int part) const { return (static_cast<size_t>(c) * 2 + part) * d_; }
  size_t ScaleAt(uint32_t c, int part) const { return static_cast<size_t>(c) * 2 + part; }
  // Appends x (d_ floats) to codes_ and scales_ as bytes and their scale.
  void Narrow(const float* x);
  void Widen(uint32_t c, int part, float* out) const;
  // Whether tiles_ holds the compact chunks (this machine's kernel reads them, and they are at
  // most kMaxTiledChunks: compact_ never goes down, so once past it, for good).
  bool tiled() const;
  // The tiles of compact chunks [from, compact_) from their codes, tiles_ sized for compact_.
  void Tile(uint32_t from);

  int d_;
  std::vector<uint32_t> tokens_;
  std::vector<int8_t> codes_;
  std::vector<uint8_t> tiles_;
  std::vector<float> scales_;
  LooseFloats sums_;   // chunks [compact_, size())
  LooseFloats peaks_;  // the same chunks'
  uint32_t compact_ = 0;
  uint32_t final_ = 0;
};

}  // namespace kvtier

#endif  // KVTIER_SERVER_INDEX_CHUNK_STATS_H_
