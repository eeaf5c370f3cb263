#include "server/index/chunk_stats.h"

#include <algorithm>

#include "server/common/check.h"

namespace kvtier {

void ChunkStats::Grow(uint32_t c) {
  CHECK(c <= size()) << "chunk " << c << " of " << size();
  CHECK(c >= final_) << "chunk " << c << " has final statistics";
  if (c < size()) return;
  tokens_.push_back(0);
  sums_.resize(sums_.size() + d_, 0.f);
  peaks_.resize(peaks_.size() + d_, 0.f);
}

void ChunkStats::AddRows(uint32_t c, HalfKind kind, const uint16_t* rows, uint32_t n) {
  Grow(c);
  tokens_[c] += n;
  kvtier::AddRows(kind, rows, static_cast<int>(n), d_, &sums_[static_cast<size_t>(c) * d_]);
}

void ChunkStats::Recompute(uint32_t c, HalfKind kind, const uint16_t* rows, uint32_t n) {
  Grow(c);
  tokens_[c] = 0;
  std::fill_n(&sums_[static_cast<size_t>(c) * d_], d_, 0.f);
  AddRows(c, kind, rows, n);
  ComputePeak(c, kind, rows);
}

void ChunkStats::ComputePeak(uint32_t c, HalfKind kind, const uint16_t* rows) {
  CHECK(c < size() && c >= final_) << "chunk " << c;
  const uint32_t n = tokens_[c];
  const size_t d = static_cast<size_t>(d_);
  const float inv = 1.f / static_cast<float>(n);
  std::vector<float> floats(n * d, 0.f), mean(d);
  for (uint32_t r = 0; r < n; ++r) {  // the halves as floats, row by row
    kvtier::AddRows(kind, rows + r * d, 1, d_, &floats[r * d]);
  }
  for (size_t j = 0; j < d; ++j) mean[j] = sums_[c * d + j] * inv;
  const float* peak = FarthestRow(floats.data(), n, d_, mean.data());
  std::copy(peak, peak + d, peaks_.begin() + static_cast<ptrdiff_t>(c * d));
}

void ChunkStats::Append(uint32_t tokens, const float* key_sum, const float* peak) {
  const uint32_t c = size();
  Grow(c);
  tokens_[c] = tokens;
  std::copy_n(key_sum, d_, &sums_[static_cast<size_t>(c) * d_]);
  std::copy_n(peak, d_, &peaks_[static_cast<size_t>(c) * d_]);
}

void ChunkStats::MarkFinal(uint32_t n) {
  CHECK(n <= size() && n >= final_) << "final " << n << " of " << size() << ", was " << final_;
  final_ = n;
}

void ChunkStats::CopyPrefix(const ChunkStats& from, uint32_t n) {
  CHECK(n <= from.size() && from.d_ == d_) << n << " of " << from.size();
  const auto floats = static_cast<ptrdiff_t>(n) * d_;
  tokens_.assign(from.tokens_.begin(), from.tokens_.begin() + n);
  sums_.assign(from.sums_.begin(), from.sums_.begin() + floats);
  peaks_.assign(from.peaks_.begin(), from.peaks_.begin() + floats);
  final_ = 0;
}

}  // namespace kvtier
