// What a stream's ranking knows of its chunks: per chunk its token count, the sum of its keys
// and its peak key (the key farthest from the mean), computed on the rows attention reads (the
// dequantized keys of a cold chunk), and how many of the chunks have final statistics.
//
//   tokens  uint32 [chunks]
//   sums    float  [chunks][head_dim]   sum of the chunk's keys (mean = sum / tokens)
//   peaks   float  [chunks][head_dim]   zeros until the chunk's peak is computed
//
// The arrays are contiguous, chunk by chunk, so that a scan reads them in order. Statistics are
// final for the chunks [0, final_chunks()): they no longer change, and only those may enter a
// cluster index (whose bounds assume fixed statistics). Changing a final chunk is a broken
// invariant (CHECK).
//
// Not thread-safe: its stream's owner serializes access.
#ifndef KVTIER_SERVER_INDEX_CHUNK_STATS_H_
#define KVTIER_SERVER_INDEX_CHUNK_STATS_H_

#include <cstddef>
#include <cstdint>
#include <vector>

#include "server/common/vec.h"
#include "server/index/chunk_ranker.h"

namespace kvtier {

class ChunkStats {
 public:
  explicit ChunkStats(int head_dim) : d_(head_dim) {}

  int head_dim() const { return d_; }
  uint32_t size() const { return static_cast<uint32_t>(tokens_.size()); }
  uint32_t tokens(uint32_t c) const { return tokens_[c]; }
  const float* key_sum(uint32_t c) const { return &sums_[static_cast<size_t>(c) * d_]; }
  const float* peak(uint32_t c) const { return &peaks_[static_cast<size_t>(c) * d_]; }
  // The chunk as the ranking scores it (ChunkCandidate points into these arrays).
  ChunkCandidate candidate(uint32_t c) const {
    return {c, tokens_[c], key_sum(c), 1.f / static_cast<float>(tokens_[c]), peak(c)};
  }

  // Adds n key rows ([n][head_dim] halves of `kind`) to chunk c's sum and token count; c ==
  // size() appends a chunk first. The peak is left as it is.
  void AddRows(uint32_t c, HalfKind kind, const uint16_t* rows, uint32_t n);
  // Chunk c's statistics anew from all its n rows: the sum, then the peak.
  void Recompute(uint32_t c, HalfKind kind, const uint16_t* rows, uint32_t n);
  // Chunk c's peak from its n rows, which its sum already covers.
  void ComputePeak(uint32_t c, HalfKind kind, const uint16_t* rows);
  // Room for n chunks without reallocating (a caller that knows how many will come).
  void Reserve(uint32_t n) {
    tokens_.reserve(n);
    sums_.reserve(static_cast<size_t>(n) * d_);
    peaks_.reserve(static_cast<size_t>(n) * d_);
  }
  // Appends a chunk of `tokens` tokens whose statistics were computed elsewhere (from float
  // keys, say): key_sum and peak are head_dim floats each.
  void Append(uint32_t tokens, const float* key_sum, const float* peak);

  // The heap bytes its arrays hold (their capacities), and the object itself.
  size_t MemoryBytes() const {
    return sizeof(*this) + tokens_.capacity() * sizeof(uint32_t) +
           (sums_.capacity() + peaks_.capacity()) * sizeof(float);
  }

  uint32_t final_chunks() const { return final_; }
  // Chunks [0, n) have final statistics. REQUIRES: n <= size(); n never decreases.
  void MarkFinal(uint32_t n);

  // The first n chunks of `from` (a fork's shared chunks), none of them final yet here: the
  // copy's owner marks them final as its own index takes them in.
  void CopyPrefix(const ChunkStats& from, uint32_t n);

 private:
  void Grow(uint32_t c);

  int d_;
  std::vector<uint32_t> tokens_;
  std::vector<float> sums_;
  std::vector<float> peaks_;
  uint32_t final_ = 0;
};

}  // namespace kvtier

#endif  // KVTIER_SERVER_INDEX_CHUNK_STATS_H_
