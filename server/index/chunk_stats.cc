#include "server/index/chunk_stats.h"

#include <algorithm>

#include "server/common/check.h"
#include "server/common/fp16.h"

namespace kvtier {

uint16_t ChunkStats::Narrow(float x) const {
  if (kind_ == HalfKind::kBf16) return FloatToBf16(x);
  return FloatToHalf(std::clamp(x, -65504.f, 65504.f));  // a mean of halves lies within
}

void ChunkStats::Mean(uint32_t c, float* out) const {
  if (c < compact_) {
    const uint16_t* h = &means_h_[static_cast<size_t>(c) * d_];
    for (int j = 0; j < d_; ++j) out[j] = Widen(h[j]);
    return;
  }
  const float inv = 1.f / static_cast<float>(tokens_[c]);
  const float* s = &sums_[Loose(c)];
  for (int j = 0; j < d_; ++j) out[j] = s[j] * inv;
}

void ChunkStats::Peak(uint32_t c, float* out) const {
  if (c < compact_) {
    const uint16_t* h = &peaks_h_[static_cast<size_t>(c) * d_];
    for (int j = 0; j < d_; ++j) out[j] = Widen(h[j]);
    return;
  }
  std::copy_n(&peaks_[Loose(c)], d_, out);
}

const float* ChunkStats::key_sum(uint32_t c) const {
  CHECK(c >= compact_ && c < size()) << "chunk " << c << " is compact or absent";
  return &sums_[Loose(c)];
}

const float* ChunkStats::peak(uint32_t c) const {
  CHECK(c >= compact_ && c < size()) << "chunk " << c << " is compact or absent";
  return &peaks_[Loose(c)];
}

ChunkCandidate ChunkStats::candidate(uint32_t c) const {
  if (c < compact_) {
    const size_t at = static_cast<size_t>(c) * d_;
    return {c, tokens_[c], nullptr, 1.f, nullptr, &means_h_[at], &peaks_h_[at], kind_};
  }
  return {c, tokens_[c], key_sum(c), 1.f / static_cast<float>(tokens_[c]), peak(c)};
}

const void* ChunkStats::mean_data(uint32_t c) const {
  return c < compact_ ? static_cast<const void*>(&means_h_[static_cast<size_t>(c) * d_])
                      : static_cast<const void*>(&sums_[Loose(c)]);
}

const void* ChunkStats::peak_data(uint32_t c) const {
  return c < compact_ ? static_cast<const void*>(&peaks_h_[static_cast<size_t>(c) * d_])
                      : static_cast<const void*>(&peaks_[Loose(c)]);
}

size_t ChunkStats::vector_bytes(uint32_t c) const {
  return static_cast<size_t>(d_) * (c < compact_ ? sizeof(uint16_t) : sizeof(float));
}

void ChunkStats::Grow(uint32_t c) {
  CHECK(c <= size()) << "chunk " << c << " of " << size();
  CHECK(c >= final_ && c >= compact_) << "chunk " << c << " has final statistics";
  if (c < size()) return;
  tokens_.push_back(0);
  sums_.resize(sums_.size() + d_, 0.f);
  peaks_.resize(peaks_.size() + d_, 0.f);
}

void ChunkStats::AddRows(uint32_t c, HalfKind kind, const uint16_t* rows, uint32_t n) {
  Grow(c);
  tokens_[c] += n;
  kvtier::AddRows(kind, rows, static_cast<int>(n), d_, &sums_[Loose(c)]);
}

void ChunkStats::Recompute(uint32_t c, HalfKind kind, const uint16_t* rows, uint32_t n) {
  Grow(c);
  tokens_[c] = 0;
  std::fill_n(&sums_[Loose(c)], d_, 0.f);
  AddRows(c, kind, rows, n);
  ComputePeak(c, kind, rows);
}

void ChunkStats::ComputePeak(uint32_t c, HalfKind kind, const uint16_t* rows) {
  CHECK(c < size() && c >= final_ && c >= compact_) << "chunk " << c;
  const uint32_t n = tokens_[c];
  const size_t d = static_cast<size_t>(d_);
  std::vector<float> floats(n * d, 0.f), mean(d);
  for (uint32_t r = 0; r < n; ++r) {  // the halves as floats, row by row
    kvtier::AddRows(kind, rows + r * d, 1, d_, &floats[r * d]);
  }
  Mean(c, mean.data());
  const float* peak = FarthestRow(floats.data(), n, d_, mean.data());
  std::copy(peak, peak + d, peaks_.begin() + static_cast<ptrdiff_t>(Loose(c)));
}

void ChunkStats::Append(uint32_t tokens, const float* key_sum, const float* peak) {
  const uint32_t c = size();
  Grow(c);
  tokens_[c] = tokens;
  std::copy_n(key_sum, d_, &sums_[Loose(c)]);
  std::copy_n(peak, d_, &peaks_[Loose(c)]);
}

void ChunkStats::MarkFinal(uint32_t n) {
  CHECK(n <= size() && n >= final_) << "final " << n << " of " << size() << ", was " << final_;
  final_ = n;
  if (n <= compact_) return;
  // Chunks [compact_, n) leave the float arrays for the compact ones.
  const size_t moved = static_cast<size_t>(n - compact_) * d_;
  std::vector<float> mean(d_);
  for (uint32_t c = compact_; c < n; ++c) {
    Mean(c, mean.data());
    const float* p = &peaks_[Loose(c)];
    for (int j = 0; j < d_; ++j) {
      means_h_.push_back(Narrow(mean[j]));
      peaks_h_.push_back(Narrow(p[j]));
    }
  }
  sums_.erase(sums_.begin(), sums_.begin() + static_cast<ptrdiff_t>(moved));
  peaks_.erase(peaks_.begin(), peaks_.begin() + static_cast<ptrdiff_t>(moved));
  compact_ = n;
}

void ChunkStats::CopyPrefix(const ChunkStats& from, uint32_t n) {
  CHECK(n <= from.size() && from.d_ == d_) << n << " of " << from.size();
  const uint32_t compact = std::min(n, from.compact_);
  const auto halves = static_cast<ptrdiff_t>(compact) * d_;
  const auto floats = static_cast<ptrdiff_t>(n - compact) * d_;
  kind_ = from.kind_;
  tokens_.assign(from.tokens_.begin(), from.tokens_.begin() + n);
  means_h_.assign(from.means_h_.begin(), from.means_h_.begin() + halves);
  peaks_h_.assign(from.peaks_h_.begin(), from.peaks_h_.begin() + halves);
  sums_.assign(from.sums_.begin(), from.sums_.begin() + floats);
  peaks_.assign(from.peaks_.begin(), from.peaks_.begin() + floats);
  compact_ = compact;
  final_ = 0;
}

}  // namespace kvtier
