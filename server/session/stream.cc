#include "server/session/stream.h"

#include <algorithm>
#include <cstring>

#include "server/common/check.h"
#include "server/quant/chunk_quant.h"

namespace kvtier {

uint64_t EncodeChunkId(const ChunkAddress& a) {
  return (static_cast<uint64_t>(a.layer) << 40) | (static_cast<uint64_t>(a.kv_head) << 28) |
         a.index;
}

ChunkAddress DecodeChunkId(uint64_t id) {
  return {static_cast<uint32_t>(id >> 40), static_cast<uint32_t>((id >> 28) & 0xfff),
          static_cast<uint32_t>(id & (kMaxChunksPerStream - 1))};
}

ChunkFormat FormatOf(const v1::ModelShape& shape, const v1::SessionPolicy& policy) {
  return ChunkFormat{
      .head_dim = shape.head_dim(),
      .dtype = shape.dtype(),
      .capacity = policy.chunk_tokens() * (policy.chunking() == v1::CHUNKING_BOUNDARY ? 2u : 1u)};
}

void ChunkFormat::WriteFp16(const Chunk& c, uint8_t* dst) const {
  if (!c.cold()) {
    std::memcpy(dst, c.host->data(), 2 * c.num_tokens * row_bytes());
    return;
  }
  auto* k = reinterpret_cast<uint16_t*>(dst);
  DequantizeChunk(c.host->data(), ColdLayout(c), k, k + uint64_t{c.num_tokens} * head_dim);
}

const uint16_t* ChunkFormat::Fp16Rows(const Chunk& c, std::vector<uint16_t>& scratch) const {
  if (!c.cold()) return reinterpret_cast<const uint16_t*>(c.host->data());
  scratch.resize(2ull * c.num_tokens * head_dim);
  WriteFp16(c, reinterpret_cast<uint8_t*>(scratch.data()));
  return scratch.data();
}

RowOffsets::RowOffsets(std::span<const uint32_t> offsets) {
  if (offsets.empty()) return;
  CHECK_LT(offsets.size(), 256u);
  const uint32_t width = offsets.back() < 256 ? 1 : 2;
  data_ = std::make_unique_for_overwrite<uint8_t[]>(Bytes(offsets.size(), width));
  data_[0] = static_cast<uint8_t>(width);
  data_[1] = static_cast<uint8_t>(offsets.size());
  for (size_t r = 0; r < offsets.size(); ++r) {
    CHECK_LT(offsets[r], 65536u);
    CHECK(r == 0 || offsets[r] > offsets[r - 1]) << "row offsets must ascend";
    if (width == 1) {
      data_[2 + r] = static_cast<uint8_t>(offsets[r]);
    } else {
      data_[2 + 2 * r] = static_cast<uint8_t>(offsets[r]);
      data_[3 + 2 * r] = static_cast<uint8_t>(offsets[r] >> 8);
    }
  }
}

RowOffsets& RowOffsets::operator=(const RowOffsets& o) {
  if (this == &o) return *this;
  data_.reset();
  if (!o.empty()) {
    const size_t n = o.AllocatedBytes();
    data_ = std::make_unique_for_overwrite<uint8_t[]>(n);
    std::memcpy(data_.get(), o.data_.get(), n);
  }
  return *this;
}

bool RowOffsets::operator==(const RowOffsets& o) const {
  if (size() != o.size()) return false;
  for (uint32_t r = 0; r < size(); ++r) {
    if ((*this)[r] != o[r]) return false;
  }
  return true;
}

int64_t RowOffsets::Find(uint32_t o) const {
  uint32_t lo = 0, hi = size();  // the first row whose offset is at least o
  while (lo < hi) {
    const uint32_t mid = (lo + hi) / 2;
    if ((*this)[mid] < o) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  return lo < size() && (*this)[lo] == o ? int64_t{lo} : -1;
}

std::pair<uint32_t, uint32_t> Stream::Locate(uint64_t t) const {
  // The last chunk starting at or before t; within a regrouped span (chunks sharing `first`)
  // the one whose offsets hold t.
  auto it = std::upper_bound(chunks_.begin(), chunks_.end(), t,
                             [](uint64_t t, const Chunk& c) { return t < c.first; });
  CHECK(it != chunks_.begin());
  for (auto c = it - 1;; --c) {
    if (c->offsets.empty()) {
      return {static_cast<uint32_t>(c - chunks_.begin()), static_cast<uint32_t>(t - c->first)};
    }
    const int64_t r =
        t - c->first < 65536 ? c->offsets.Find(static_cast<uint32_t>(t - c->first)) : -1;
    if (r >= 0) return {static_cast<uint32_t>(c - chunks_.begin()), static_cast<uint32_t>(r)};
    CHECK(c != chunks_.begin());
  }
}

uint32_t Stream::ChunksEndingBy(uint64_t position) const {
  // Every chunk before the last one that starts by `position` ends by it; that one too when
  // its last row does (it is then sealed: a later chunk holds the rows from `position`).
  auto it = std::upper_bound(chunks_.begin(), chunks_.end(), position,
                             [](uint64_t t, const Chunk& c) { return t < c.first; });
  if (it == chunks_.begin()) return 0;
  const auto n = static_cast<uint32_t>(it - chunks_.begin());
  return (it - 1)->end() <= position ? n : n - 1;
}

std::vector<bool> Stream::Kept(uint64_t sink_end, uint64_t window_start, uint64_t* tokens,
                               uint64_t* rows) const {
  std::vector<bool> kept(chunks_.size(), false);
  *tokens = 0;
  if (rows != nullptr) *rows = 0;
  auto keep = [&](uint32_t c) {
    const Chunk& ch = chunks_[c];
    if (kept[c] || !(ch.position(0) < sink_end || ch.end() > window_start)) return;
    kept[c] = true;
    *tokens += ch.num_tokens;
    for (uint32_t r = 0; rows != nullptr && r < ch.num_tokens; ++r) {
      *rows += IsKeptPosition(ch.position(r), sink_end, window_start) ? 1 : 0;
    }
  };
  // Only the two ends are looked at, not every chunk: a chunk's rows lie in [first, the next
  // greater first), so past the first chunk whose `first` reaches sink_end none holds a sink,
  // and before the last span starting below window_start none reaches the window.
  const uint32_t n = static_cast<uint32_t>(chunks_.size());
  for (uint32_t c = 0; c < n && chunks_[c].first < sink_end; ++c) keep(c);
  uint32_t c = n;
  while (c > 0 && chunks_[c - 1].first >= window_start) keep(--c);
  if (c > 0) {  // the span (or chunk) that starts below window_start: its ends decide
    const uint64_t span = chunks_[c - 1].first;
    while (c > 0 && chunks_[c - 1].first == span) keep(--c);
  }
  return kept;
}

std::optional<uint64_t> Stream::FirstMismatch(uint64_t start, uint64_t count, const uint8_t* keys,
                                              const uint8_t* values, const ChunkFormat& f) const {
  const uint64_t rb = f.row_bytes();
  for (uint64_t t = start; t < start + count; ++t) {
    const auto [index, row] = Locate(t);
    const Chunk& c = chunks_[index];
    const uint8_t* base = c.host->data();
    const uint64_t in = (t - start) * rb;
    const bool same = c.cold()
                          ? MatchesQuantizedRow(base, f.ColdLayout(c), row,
                                                reinterpret_cast<const uint16_t*>(keys + in),
                                                reinterpret_cast<const uint16_t*>(values + in))
                          : std::memcmp(base + row * rb, keys + in, rb) == 0 &&
                                std::memcmp(base + (c.num_tokens + row) * rb, values + in, rb) == 0;
    if (!same) return t;
  }
  return std::nullopt;
}

namespace {

uint16_t* Halves(uint8_t* p) { return reinterpret_cast<uint16_t*>(p); }
const uint16_t* Halves(const uint8_t* p) { return reinterpret_cast<const uint16_t*>(p); }

}  // namespace

uint32_t Stream::Push(Chunk chunk) {
  Count(chunk);
  chunks_.push_back(std::move(chunk));
  return static_cast<uint32_t>(chunks_.size() - 1);
}

void Stream::Write(const AppendPlan& plan, const uint8_t* keys, const uint8_t* values,
                   uint64_t position, const ChunkFormat& f, const std::function<SlotRef()>& slot) {
  LandedRows rows;
  CHECK(Land(plan, keys, values, position, f, slot, &rows)) << "a row is not finite";
  Take(plan, std::move(rows), f, slot);
}

bool Stream::Land(const AppendPlan& plan, const uint8_t* keys, const uint8_t* values,
                  uint64_t position, const ChunkFormat& f, const std::function<SlotRef()>& slot,
                  LandedRows* out) const {
  const uint64_t rb = f.row_bytes();
  const int d = static_cast<int>(f.head_dim);
  out->chunks.reserve(plan.new_chunks());
  out->sums.assign(plan.new_chunks() * static_cast<size_t>(d), 0.f);
  float* sums = out->sums.data();
  for (size_t seg = 0; seg < plan.segments.size(); ++seg) {
    const uint32_t k = plan.segments[seg].rows;
    if (seg == 0 && plan.grow) {
      out->grow.resize(2 * k * rb);
      if (!CopyFinite(f.kind(), Halves(out->grow.data()), Halves(keys), k * rb / 2) ||
          !CopyFinite(f.kind(), Halves(out->grow.data() + k * rb), Halves(values), k * rb / 2)) {
        return false;
      }
    } else {
      Chunk c;
      c.host = slot();
      if (!CopyFiniteRows(f.kind(), Halves(c.host->data()), Halves(keys), k, d, sums,
                          /*stream=*/true) ||
          !CopyFinite(f.kind(), Halves(c.host->data() + k * rb), Halves(values), k * rb / 2,
                      /*stream=*/true)) {
        FenceStreamedStores();
        return false;
      }
      sums += d;
      c.num_tokens = static_cast<uint16_t>(k);  // at most the capacity
      c.first = position;
      c.sealed = plan.segments[seg].sealed;
      out->chunks.push_back(std::move(c));
    }
    keys += k * rb;
    values += k * rb;
    position += k;
  }
  FenceStreamedStores();  // the slots' rows before the stream (and other threads) see them
  return true;
}

void Stream::Take(const AppendPlan& plan, LandedRows&& rows, const ChunkFormat& f,
                  const std::function<SlotRef()>& slot) {
  const uint64_t rb = f.row_bytes();
  if (plan.grow) {
    const uint32_t k = plan.segments[0].rows;
    const uint8_t* keys = rows.grow.data();
    const uint8_t* values = keys + k * rb;
    Chunk& c = chunks_.back();
    const uint32_t m = c.num_tokens;
    const uint32_t grown = m + k;
    if (c.host.use_count() > 1) {
      // Someone else holds the partial chunk (a lease, a fork): grow a copy instead.
      SlotRef copy = slot();
      std::memcpy(copy->data(), c.host->data(), m * rb);                        // old K
      std::memcpy(copy->data() + grown * rb, c.host->data() + m * rb, m * rb);  // old V
      Uncount(c);
      c.host = std::move(copy);
      Count(c);
    } else {
      // No lease holds this slot: move V down to make room for the new key rows. A worker may
      // still read it through a handle of an ended lease, so the slot takes its new generation
      // first: a copy that overlaps the move fails its Recheck.
      c.host->Renew();
      std::memmove(c.host->data() + grown * rb, c.host->data() + m * rb, m * rb);
    }
    std::memcpy(c.host->data() + m * rb, keys, k * rb);
    std::memcpy(c.host->data() + (grown + m) * rb, values, k * rb);
    stats_.AddRows(static_cast<uint32_t>(chunks_.size() - 1), f.kind(),
                   reinterpret_cast<const uint16_t*>(keys), k);
    c.num_tokens = static_cast<uint16_t>(grown);
    c.sealed = plan.segments[0].sealed;
    c.copies.reset_device();  // the device copy is stale
  }
  const float* sums = rows.sums.data();
  for (Chunk& c : rows.chunks) {
    const uint32_t n = c.num_tokens;
    stats_.AddSummed(Push(std::move(c)), sums, n);
    sums += stats_.head_dim();
  }
}

void Stream::Replace(uint32_t c, Chunk chunk, const ChunkSummary& summary) {
  Uncount(chunks_[c]);
  Count(chunk);
  chunks_[c] = std::move(chunk);  // the old slot goes back (unless a lease or fork holds it)
  stats_.Set(c, summary);
}

void Stream::ComputePeak(uint32_t c, const ChunkFormat& f) {
  std::vector<uint16_t> scratch;
  stats_.ComputePeak(c, f.kind(), f.Fp16Rows(chunks_[c], scratch));
}

uint32_t Stream::Finalize(uint32_t n, uint64_t sink_tokens, v1::Ranking ranking,
                          absl::Time deadline) {
  const uint32_t from = stats_.final_chunks();
  if (n <= from) return from;
  // Without a deadline, every chunk's statistics at once; with one, a chunk at a time, each
  // final before it enters the index (only final chunks may), so that the chunks past a stop
  // stay out of both.
  const bool bounded = deadline != absl::InfiniteFuture();
  if (!bounded) stats_.MarkFinal(n);
  uint32_t c = from;
  while (c < n) {
    if (bounded) stats_.MarkFinal(c + 1);
    if (chunks_[c].first >= sink_tokens) {  // sinks are always returned
      if (!index_) {
        // Clustered for the ranking the session has now; a later change of ranking leaves the
        // answers exact, only the search's work tuned for the other.
        ClusterIndex::Options options;
        options.cluster_by_peak = ranking == v1::RANKING_LSE_PEAK;
        index_ = std::make_unique<ClusterIndex>(stats_.head_dim(), options);
      }
      index_->Add(c, stats_);
    }
    ++c;
    if (bounded && absl::Now() > deadline) break;
  }
  if (index_) index_bytes_ = index_->MemoryBytes();
  return c;
}

void Stream::ForkFrom(const Stream& src, uint32_t keep, uint64_t from, uint64_t to, uint32_t piece,
                      uint32_t seal_rows, const ChunkFormat& f,
                      const std::function<SlotRef()>& slot) {
  const uint64_t rb = f.row_bytes();
  chunks_.assign(src.chunks_.begin(), src.chunks_.begin() + keep);
  offset_bytes_ = 0;
  slot_bytes_ = 0;
  by_precision_ = {};
  for (const Chunk& c : chunks_) Count(c);
  stats_.CopyPrefix(src.stats_, keep);
  std::vector<uint16_t> scratch;
  for (uint64_t p = from; p < to;) {
    const auto rows = static_cast<uint32_t>(std::min<uint64_t>(piece, to - p));
    Chunk c;
    c.host = slot();
    c.first = p;
    c.num_tokens = static_cast<uint16_t>(rows);
    c.sealed = seal_rows != 0 && rows == seal_rows;
    uint32_t read = ~0u;  // the chunk whose fp16 rows `fp16` holds
    const uint8_t* fp16 = nullptr;
    for (uint32_t r = 0; r < rows; ++r, ++p) {
      const auto [index, row] = src.Locate(p);
      const Chunk& at = src.chunks_[index];
      if (index != read) {
        fp16 = reinterpret_cast<const uint8_t*>(f.Fp16Rows(at, scratch));
        read = index;
      }
      std::memcpy(c.host->data() + r * rb, fp16 + row * rb, rb);
      std::memcpy(c.host->data() + (rows + r) * rb, fp16 + (at.num_tokens + row) * rb, rb);
    }
    const uint32_t i = Push(std::move(c));
    stats_.AddRows(i, f.kind(), Halves(chunks_[i].host->data()), chunks_[i].num_tokens);
  }
}

void Stream::Restore(Chunk chunk, const ChunkFormat& f) {
  const uint32_t c = Push(std::move(chunk));
  std::vector<uint16_t> scratch;
  stats_.Recompute(c, f.kind(), f.Fp16Rows(chunks_[c], scratch), chunks_[c].num_tokens);
}

AppendPlan PlanAppend(const Stream& head0, uint64_t from, uint64_t to,
                      const std::function<bool(uint32_t rows, uint64_t i)>& seals) {
  AppendPlan plan;
  const std::vector<Chunk>& chunks = head0.chunks();
  plan.grow = !chunks.empty() && !chunks.back().sealed;
  uint32_t rows = plan.grow ? chunks.back().num_tokens : 0;
  bool open = plan.grow;
  if (plan.grow) plan.segments.emplace_back();
  for (uint64_t i = from; i < to; ++i) {
    if (!open) {
      plan.segments.emplace_back();
      rows = 0;
      open = true;
    }
    ++rows;
    ++plan.segments.back().rows;
    if (seals(rows, i)) {
      plan.segments.back().sealed = true;
      open = false;
    }
  }
  return plan;
}

}  // namespace kvtier
