#include "server/index/chunk_stats.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "absl/container/inlined_vector.h"
#include "server/common/check.h"
#include "server/common/fp16.h"

namespace kvtier {

namespace {

// Whether chunks of this width are kept in tiles on this machine (its VNNI kernel reads them).
bool Tileable(int head_dim) { return head_dim % 32 == 0 && BestInt8Kernel() == Int8Kernel::kVnni; }

}  // namespace

void LooseFloats::PushZero() {
  const size_t j = first_ + size_;
  if (j / kBlockChunks == blocks_.size()) {
    if (blocks_.size() == blocks_.capacity()) blocks_.reserve(NextRoom(blocks_.capacity()));
    blocks_.push_back(std::make_unique_for_overwrite<float[]>(kBlockChunks * d_));
  }
  ++size_;
  std::fill_n(Row(size_ - 1), d_, 0.f);
}

void LooseFloats::PopFront(size_t n) {
  CHECK(n <= size_) << n << " of " << size_;
  first_ += n;
  size_ -= n;
  const size_t gone = size_ == 0 ? blocks_.size() : first_ / kBlockChunks;
  blocks_.erase(blocks_.begin(), blocks_.begin() + static_cast<ptrdiff_t>(gone));
  first_ = size_ == 0 ? 0 : first_ - gone * kBlockChunks;
  if (blocks_.empty()) blocks_.shrink_to_fit();  // a stream aged to its end holds nothing
}

void LooseFloats::AssignPrefix(const LooseFloats& from, size_t n) {
  CHECK(n <= from.size_ && from.d_ == d_) << n << " of " << from.size_;
  PopFront(size_);
  for (size_t i = 0; i < n; ++i) {
    PushZero();
    std::copy_n(from.at(i), d_, at(i));
  }
}

ChunkStats::ChunkStats(int head_dim) : d_(head_dim), sums_(head_dim), peaks_(head_dim) {}

bool ChunkStats::tiled() const { return compact_ <= kMaxTiledChunks && Tileable(d_); }

size_t ChunkStats::CompactChunkBytes(int head_dim) {
  const size_t d = static_cast<size_t>(head_dim);
  return 2 * (d + sizeof(float)) + (Tileable(head_dim) ? 2 * d : 0);
}

void ChunkStats::Narrow(const float* x) {
  // A bf16 sum may overflow to infinity: it is held as the largest float. A NaN (rows that
  // validation let through from a damaged record) is held as 0, never cast.
  const size_t at = codes_.size();
  codes_.resize(at + static_cast<size_t>(d_));
  scales_.push_back(SymmetricInt8Codes(x, d_, &codes_[at]));
}

void ChunkStats::Widen(uint32_t c, int part, float* out) const {
  Int8Times(&codes_[Code(c, part)], d_, scales_[ScaleAt(c, part)], out);
}

void ChunkStats::Mean(uint32_t c, float* out) const {
  if (c < compact_) return Widen(c, 0, out);
  const float inv = 1.f / static_cast<float>(tokens_[c]);
  const float* s = sums_.at(Loose(c));
  for (int j = 0; j < d_; ++j) out[j] = s[j] * inv;
}

void ChunkStats::Peak(uint32_t c, float* out) const {
  if (c < compact_) return Widen(c, 1, out);
  std::copy_n(peaks_.at(Loose(c)), d_, out);
}

const float* ChunkStats::key_sum(uint32_t c) const {
  CHECK(c >= compact_ && c < size()) << "chunk " << c << " is compact or absent";
  return sums_.at(Loose(c));
}

const float* ChunkStats::peak(uint32_t c) const {
  CHECK(c >= compact_ && c < size()) << "chunk " << c << " is compact or absent";
  return peaks_.at(Loose(c));
}

const void* ChunkStats::mean_data(uint32_t c) const {
  return c < compact_ ? static_cast<const void*>(&codes_[Code(c, 0)])
                      : static_cast<const void*>(sums_.at(Loose(c)));
}

const void* ChunkStats::peak_data(uint32_t c) const {
  return c < compact_ ? static_cast<const void*>(&codes_[Code(c, 1)])
                      : static_cast<const void*>(peaks_.at(Loose(c)));
}

size_t ChunkStats::vector_bytes(uint32_t c) const {
  return static_cast<size_t>(d_) * (c < compact_ ? sizeof(int8_t) : sizeof(float));
}

void ChunkStats::Grow(uint32_t c) {
  CHECK(c <= size()) << "chunk " << c << " of " << size();
  CHECK(c >= final_ && c >= compact_) << "chunk " << c << " has final statistics";
  if (c < size()) return;
  tokens_.push_back(0);
  sums_.PushZero();
  peaks_.PushZero();
}

void ChunkStats::AddRows(uint32_t c, HalfKind kind, const uint16_t* rows, uint32_t n) {
  Grow(c);
  tokens_[c] += n;
  kvtier::AddRows(kind, rows, static_cast<int>(n), d_, sums_.at(Loose(c)));
}

void ChunkStats::AddSummed(uint32_t c, const float* sum, uint32_t n) {
  Grow(c);
  tokens_[c] += n;
  float* to = sums_.at(Loose(c));
  AddInto(to, sum, static_cast<size_t>(d_), to);  // eight at a time (the scalar loop's bits)
}

void ChunkStats::Recompute(uint32_t c, HalfKind kind, const uint16_t* rows, uint32_t n) {
  Set(c, Summarize(kind, rows, n, d_));
}

namespace {

// The row of n key rows farthest from `mean`, into peak (d floats).
void PeakOf(HalfKind kind, const uint16_t* rows, uint32_t n, int d, const float* mean,
            float* peak) {
  const size_t dd = static_cast<size_t>(d);
  std::vector<float> floats(n * dd);
  HalvesToFloats(kind, rows, floats.size(), floats.data());
  const float* far = FarthestRow(floats.data(), n, d, mean);
  std::copy(far, far + dd, peak);
}

}  // namespace

void ChunkStats::ComputePeak(uint32_t c, HalfKind kind, const uint16_t* rows) {
  CHECK(c < size() && c >= final_ && c >= compact_) << "chunk " << c;
  std::vector<float> mean(d_);
  Mean(c, mean.data());
  PeakOf(kind, rows, tokens_[c], d_, mean.data(), peaks_.at(Loose(c)));
}

ChunkSummary ChunkStats::Summarize(HalfKind kind, const uint16_t* rows, uint32_t n, int d) {
  ChunkSummary s{n, std::vector<float>(d, 0.f), std::vector<float>(d)};
  kvtier::AddRows(kind, rows, static_cast<int>(n), d, s.key_sum.data());
  std::vector<float> mean(d);
  const float inv = 1.f / static_cast<float>(n);  // as Mean reads a loose chunk's
  for (int j = 0; j < d; ++j) mean[j] = s.key_sum[j] * inv;
  PeakOf(kind, rows, n, d, mean.data(), s.peak.data());
  return s;
}

void ChunkStats::Set(uint32_t c, const ChunkSummary& s) {
  CHECK(s.key_sum.size() == static_cast<size_t>(d_) && s.peak.size() == s.key_sum.size());
  Grow(c);
  tokens_[c] = s.tokens;
  std::copy_n(s.key_sum.data(), d_, sums_.at(Loose(c)));
  std::copy_n(s.peak.data(), d_, peaks_.at(Loose(c)));
}

void ChunkStats::Append(uint32_t tokens, const float* key_sum, const float* peak) {
  const uint32_t c = size();
  Grow(c);
  tokens_[c] = tokens;
  std::copy_n(key_sum, d_, sums_.at(Loose(c)));
  std::copy_n(peak, d_, peaks_.at(Loose(c)));
}

void ChunkStats::MarkFinal(uint32_t n) {
  CHECK(n <= size() && n >= final_) << "final " << n << " of " << size() << ", was " << final_;
  final_ = n;
  if (n <= compact_) return;
  // Chunks [compact_, n) leave the float arrays for the compact ones.
  const size_t moved = n - compact_;
  std::vector<float> mean(d_);
  for (uint32_t c = compact_; c < n; ++c) {
    Mean(c, mean.data());
    Narrow(mean.data());
    Narrow(peaks_.at(Loose(c)));
  }
  sums_.PopFront(moved);
  peaks_.PopFront(moved);
  const uint32_t was = compact_;
  compact_ = n;
  if (!tiled() && !tiles_.empty()) {  // past a scan's reach: the index reads the rows
    std::vector<uint8_t>().swap(tiles_);
  }
  Tile(was);
}

void ChunkStats::Tile(uint32_t from) {
  if (!tiled()) return;
  tiles_.resize(Int8TileBytes(compact_, 2, d_));
  for (uint32_t c = from; c < compact_; ++c) {
    for (int part = 0; part < 2; ++part) {
      PutInt8TileRow(&codes_[Code(c, part)], c, 2, part, d_, tiles_.data());
    }
  }
}

void ChunkStats::CopyPrefix(const ChunkStats& from, uint32_t n) {
  CHECK(n <= from.size() && from.d_ == d_) << n << " of " << from.size();
  const uint32_t compact = std::min(n, from.compact_);
  const auto codes = static_cast<ptrdiff_t>(compact) * 2 * d_;
  tokens_.assign(from.tokens_.begin(), from.tokens_.begin() + n);
  codes_.assign(from.codes_.begin(), from.codes_.begin() + codes);
  scales_.assign(from.scales_.begin(), from.scales_.begin() + 2 * static_cast<ptrdiff_t>(compact));
  sums_.AssignPrefix(from.sums_, n - compact);
  peaks_.AssignPrefix(from.peaks_, n - compact);
  compact_ = compact;
  final_ = 0;
  // From the codes: `from` may have let its tiles go past kMaxTiledChunks.
  tiles_.clear();
  Tile(0);
}

void ChunkStats::ScoreCompact(v1::Ranking ranking, const QueryInt8Group& q8,
                              std::span<const uint32_t> chunks, float* out) const {
  CHECK(q8.n() == d_) << q8.n() << " against head_dim " << d_;
  const bool lse = ranking == v1::RANKING_LSE_PEAK;
  // Rows of whole passes of four (the rows past n zero, their scores dropped): a cluster's few
  // chunks would leave up to three rows of each kind to the scalar loop.
  const size_t n = chunks.size(), padded = (n + 3) / 4 * 4;
  const size_t parts = lse ? 2 : 1, row = parts * static_cast<size_t>(d_);
  // A cluster's chunks (13 at most by default) fit the inline room.
  absl::InlinedVector<int8_t, 16 * 2 * 128> codes(padded * row, 0);
  absl::InlinedVector<float, 32> scales(parts * padded, 0.f);
  absl::InlinedVector<uint32_t, 16> tokens(padded, 1);
  for (size_t i = 0; i < n; ++i) {
    const uint32_t c = chunks[i];
    CHECK(c < compact_) << "chunk " << c << " is not compact (" << compact_ << " are)";
    std::memcpy(&codes[i * row], &codes_[Code(c, 0)], row);
    for (size_t part = 0; part < parts; ++part) {
      scales[parts * i + part] = scales_[ScaleAt(c, static_cast<int>(part))];
    }
    tokens[i] = tokens_[c];
  }
  absl::InlinedVector<float, 16> scores(padded);
  if (lse) {
    LsePeakScoresCompact(q8, codes.data(), nullptr, scales.data(), tokens.data(),
                         static_cast<uint32_t>(padded), scores.data());
  } else {
    MeanScoresCompact(q8, codes.data(), d_, scales.data(), 1, static_cast<uint32_t>(padded),
                      scores.data());
  }
  std::copy_n(scores.begin(), n, out);
}

void ChunkStats::Score(v1::Ranking ranking, std::span<const float> queries, int group, float* out,
                       const std::vector<bool>* skip) const {
  const uint32_t n = size();
  uint32_t from = 0;
  if (ranking == v1::RANKING_LSE_PEAK && compact_ > 0) {
    LsePeakScoresCompact(queries, group, codes_.data(), tiled() ? tiles_.data() : nullptr,
                         scales_.data(), tokens_.data(), compact_, d_, out);
    from = compact_;
  } else if (ranking == v1::RANKING_MEAN && compact_ > 0) {
    // The means in place (every other vector of the codes), the query's codes made once.
    const QueryInt8Group q8(queries.data(), group, d_);
    MeanScoresCompact(q8, codes_.data(), 2 * d_, scales_.data(), 2, compact_, out);
    from = compact_;
  }
  std::vector<ChunkCandidate> rest;
  rest.reserve(n - from);
  for (uint32_t c = from; c < n; ++c) {
    if (skip == nullptr || !(*skip)[c]) rest.push_back(candidate(c));
  }
  if (rest.empty()) return;
  if (rest.size() == n - from) {
    ScoreCandidates(ranking, queries, group, d_, rest, out + from);
    return;
  }
  std::vector<float> scores(rest.size());
  ScoreCandidates(ranking, queries, group, d_, rest, scores.data());
  for (size_t i = 0; i < rest.size(); ++i) out[rest[i].index] = scores[i];
}

}  // namespace kvtier
