#include "server/common/mutex.h"
#include "server/session/session.h"

#include <algorithm>
#include <map>
#include <cmath>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "server/common/check.h"
#include "server/common/fp16.h"
#include "server/common/vec.h"
#include "server/common/status_macros.h"
#include "server/config/policy.h"
#include "server/index/chunk_ranker.h"
#include "server/index/chunking.h"
#include "server/quant/quant.h"

namespace kvtier {
namespace {

constexpr uint32_t kMaxLayers = 1u << 12;
constexpr uint32_t kMaxKvHeads = 1u << 12;
constexpr uint32_t kMaxChunksPerStream = 1u << 28;

// The bytes of a cached copy, 0 when there is none.
uint64_t CopyBytes(const PromotionCache* cache, const CopyRef& copy) {
  const SlotRef slot = cache->Peek(copy);
  return slot ? slot->bytes() : 0;
}

absl::Status Invalid(absl::string_view field, absl::string_view why) {
  return absl::InvalidArgumentError(absl::StrCat(field, ": ", why));
}

}  // namespace

uint64_t EncodeChunkId(const ChunkAddress& a) {
  return (static_cast<uint64_t>(a.layer) << 40) | (static_cast<uint64_t>(a.kv_head) << 28) |
         a.index;
}

ChunkAddress DecodeChunkId(uint64_t id) {
  return {static_cast<uint32_t>(id >> 40), static_cast<uint32_t>((id >> 28) & 0xfff),
          static_cast<uint32_t>(id & (kMaxChunksPerStream - 1))};
}

absl::StatusOr<v1::ModelShape> ResolveShape(const v1::ModelShape& in) {
  v1::ModelShape s = in;
  if (s.num_layers() == 0 || s.num_layers() > kMaxLayers) {
    return Invalid("shape.num_layers", absl::StrFormat("%d is outside [1, %d]", s.num_layers(),
                                                       kMaxLayers));
  }
  if (s.num_kv_heads() == 0 || s.num_kv_heads() > kMaxKvHeads) {
    return Invalid("shape.num_kv_heads", absl::StrFormat("%d is outside [1, %d]",
                                                         s.num_kv_heads(), kMaxKvHeads));
  }
  if (s.num_q_heads() == 0 || s.num_q_heads() % s.num_kv_heads() != 0) {
    return Invalid("shape.num_q_heads",
                   absl::StrFormat("%d is not a positive multiple of num_kv_heads %d",
                                   s.num_q_heads(), s.num_kv_heads()));
  }
  if (s.num_q_heads() / s.num_kv_heads() > 256) {
    return Invalid("shape.num_q_heads", "more than 256 query heads per KV head");
  }
  if (s.head_dim() == 0 || s.head_dim() > kMaxHeadDim) {
    return Invalid("shape.head_dim",
                   absl::StrFormat("%d is outside [1, %d]", s.head_dim(), kMaxHeadDim));
  }
  switch (s.dtype()) {
    case v1::DTYPE_UNSPECIFIED:
      s.set_dtype(v1::DTYPE_FP16);
      break;
    case v1::DTYPE_FP16:
    case v1::DTYPE_BF16:
      break;
    default:
      return Invalid("shape.dtype", absl::StrCat(v1::DType_Name(s.dtype()),
                                                 " is not stored; send DTYPE_FP16 or DTYPE_BF16"));
  }
  return s;
}

Session::Session(std::string id, std::string tenant, v1::ModelShape shape,
                 v1::SessionPolicy policy, std::map<std::string, std::string> labels,
                 const SessionEnv& env)
    : id_(std::move(id)),
      tenant_(std::move(tenant)),
      shape_(std::move(shape)),
      labels_(std::move(labels)),
      env_(env),
      created_ms_(env.clock->NowMs()),
      policy_(std::move(policy)),
      last_access_ms_(created_ms_),
      layer_tokens_(shape_.num_layers(), 0),
      streams_(static_cast<size_t>(shape_.num_layers()) * shape_.num_kv_heads()),
      cold_upto_(shape_.num_layers(), 0),
      indexed_upto_(shape_.num_layers(), 0),
      peaked_upto_(shape_.num_layers(), 0),
      regrouped_upto_(shape_.num_layers(), 0),
      select_candidates_(shape_.num_layers(), 0),
      select_scored_(shape_.num_layers(), 0) {}

Session::Session(const Session& parent, std::string new_id)
    : Session(std::move(new_id), parent.tenant_, parent.shape_,
              [&] {
                MutexLock lock(&parent.mu_);
                return parent.policy_;
              }(),
              parent.labels_, parent.env_) {}

absl::Status Session::CheckOpen() const {
  if (demoted_) {
    return absl::UnavailableError(absl::StrCat(
        "session_id: \"", id_, "\" moved to the remote tier while this call waited; retry "
        "(the next call restores it)"));
  }
  if (closed_) return absl::NotFoundError(absl::StrCat("session_id: \"", id_, "\" is closed"));
  return absl::OkStatus();
}

uint64_t Session::MinTokens() const {
  return *std::min_element(layer_tokens_.begin(), layer_tokens_.end());
}

void Session::AddToSums(Stream& s, size_t index, const uint8_t* k_rows, uint32_t rows) const {
  const size_t d = shape_.head_dim();
  if (s.key_sums.size() < (index + 1) * d) s.key_sums.resize((index + 1) * d, 0.f);
  AddRows(half_kind(), reinterpret_cast<const uint16_t*>(k_rows), static_cast<int>(rows),
          static_cast<int>(d), &s.key_sums[index * d]);
}

void Session::UpdatePeak(Stream& s, size_t index, const uint8_t* k_rows, uint32_t n) const {
  const size_t d = shape_.head_dim();
  if (s.peaks.size() < (index + 1) * d) s.peaks.resize((index + 1) * d, 0.f);
  const float inv = 1.f / static_cast<float>(n);
  std::vector<float> rows(n * d, 0.f), mean(d);
  for (uint32_t r = 0; r < n; ++r) {  // the session's halves as floats, row by row
    AddRows(half_kind(), reinterpret_cast<const uint16_t*>(k_rows) + r * d, 1,
            static_cast<int>(d), &rows[r * d]);
  }
  for (size_t j = 0; j < d; ++j) mean[j] = s.key_sums[index * d + j] * inv;
  const float* peak = FarthestRow(rows.data(), n, static_cast<int>(d), mean.data());
  std::copy(peak, peak + d, s.peaks.begin() + static_cast<ptrdiff_t>(index * d));
}

absl::Status Session::CompareStored(uint32_t layer, uint64_t start, uint64_t count,
                                    const v1::AppendKVRequest& req) {
  const uint64_t rb = row_bytes();
  const uint64_t n = req.num_tokens();
  for (uint32_t h = 0; h < shape_.num_kv_heads(); ++h) {
    const Stream& s = stream(layer, h);
    for (uint64_t t = start; t < start + count; ++t) {
      const auto [index, row] = Locate(s, t);
      const Chunk& c = s.chunks[index];
      const uint8_t* base = c.host->data();
      const uint64_t in = (h * n + (t - start)) * rb;
      const bool same =
          c.cold()
              // The exact bytes are gone: accept what the stored codes could have come from.
              ? MatchesQuantizedRow(base, ColdLayout(c), static_cast<uint32_t>(row),
                                    reinterpret_cast<const uint16_t*>(req.keys().data() + in),
                                    reinterpret_cast<const uint16_t*>(req.values().data() + in))
              : std::memcmp(base + row * rb, req.keys().data() + in, rb) == 0 &&
                    std::memcmp(base + (c.num_tokens + row) * rb, req.values().data() + in, rb) ==
                        0;
      if (!same) {
        return absl::FailedPreconditionError(absl::StrFormat(
            "start_token: token %d of layer %d (kv_head %d) is stored with other bytes; "
            "a stored token is not rewritten",
            t, layer, h));
      }
    }
  }
  return absl::OkStatus();
}

std::pair<uint32_t, uint32_t> Session::Locate(const Stream& s, uint64_t t) const {
  // The last chunk starting at or before t; within a regrouped span (chunks sharing `first`)
  // the one whose offsets hold t.
  auto it = std::upper_bound(s.chunks.begin(), s.chunks.end(), t,
                             [](uint64_t t, const Chunk& c) { return t < c.first; });
  CHECK(it != s.chunks.begin());
  for (auto c = it - 1;; --c) {
    if (c->offsets.empty()) {
      return {static_cast<uint32_t>(c - s.chunks.begin()), static_cast<uint32_t>(t - c->first)};
    }
    const auto o = std::lower_bound(c->offsets.begin(), c->offsets.end(), t - c->first);
    if (o != c->offsets.end() && *o == t - c->first) {
      return {static_cast<uint32_t>(c - s.chunks.begin()),
              static_cast<uint32_t>(o - c->offsets.begin())};
    }
    CHECK(c != s.chunks.begin());
  }
}

bool Session::Seals(uint32_t rows, const int32_t* id) const {
  if (policy_.chunking() != v1::CHUNKING_BOUNDARY) return rows >= policy_.chunk_tokens();
  const auto& delim = policy_.delimiter_token_ids();
  return EndsChunk(rows, policy_.chunk_tokens(), id != nullptr,
                   id != nullptr && std::find(delim.begin(), delim.end(), *id) != delim.end());
}

absl::StatusOr<uint64_t> Session::Append(const v1::AppendKVRequest& req) {
  const uint32_t kvh = shape_.num_kv_heads();
  const uint64_t rb = row_bytes();
  if (req.layer() >= shape_.num_layers()) {
    return Invalid("layer", absl::StrFormat("%d is outside [0, %d)", req.layer(),
                                            shape_.num_layers()));
  }
  const uint64_t n = req.num_tokens();
  if (n == 0) return Invalid("num_tokens", "0; an append carries at least one token");
  const uint64_t want = kvh * n * rb;
  if (req.keys().size() != want) {
    return Invalid("keys", absl::StrFormat("%d bytes; [num_kv_heads %d][num_tokens %d][head_dim "
                                           "%d] of 2-byte values is %d bytes",
                                           req.keys().size(), kvh, n, shape_.head_dim(), want));
  }
  if (req.values().size() != want) {
    return Invalid("values", absl::StrFormat("%d bytes; expected %d", req.values().size(), want));
  }
  if (req.token_ids_size() != 0 && static_cast<uint64_t>(req.token_ids_size()) != n) {
    return Invalid("token_ids", absl::StrFormat("%d ids for %d tokens", req.token_ids_size(), n));
  }
  for (const auto& [field, bytes] : {std::pair{"keys", &req.keys()}, {"values", &req.values()}}) {
    const auto* h = reinterpret_cast<const uint16_t*>(bytes->data());
    int64_t bad = -1;
    if (shape_.dtype() == v1::DTYPE_BF16) {
      for (uint64_t i = 0; i < bytes->size() / 2 && bad < 0; ++i) {
        if ((h[i] & 0x7f80u) == 0x7f80u) bad = static_cast<int64_t>(i);
      }
    } else {
      bad = FindNonFinite(h, bytes->size() / 2);
    }
    if (bad >= 0) {
      const uint64_t d = shape_.head_dim();
      return Invalid(field, absl::StrFormat("element %d (kv_head %d, token %d, channel %d) is "
                                            "Inf or NaN",
                                            bad, bad / (n * d), req.start_token() + bad / d % n,
                                            bad % d));
    }
  }
  MutexLock lock(&mu_);
  RETURN_IF_ERROR(CheckOpen());
  last_access_ms_ = env_.clock->NowMs();
  const uint32_t layer = req.layer();
  const uint64_t stored = layer_tokens_[layer];
  const uint64_t start = req.start_token();
  if (start > stored) {
    return absl::OutOfRangeError(absl::StrFormat(
        "start_token: %d leaves a gap; layer %d holds tokens [0, %d)", start, layer, stored));
  }
  const uint64_t overlap = std::min(stored, start + n) - start;
  RETURN_IF_ERROR(CompareStored(layer, start, overlap, req));
  const uint64_t add = n - overlap;
  if (add == 0) return MinTokens();

  // How the new tokens fall into chunks, the same for every KV head: the first segment grows
  // the stream's last chunk when that one is open, each other segment is a new chunk.
  struct Segment {
    uint32_t rows = 0;
    bool sealed = false;
  };
  const Stream& head0 = stream(layer, 0);
  const bool grow = !head0.chunks.empty() && !head0.chunks.back().sealed;
  const uint32_t partial_rows = grow ? head0.chunks.back().num_tokens : 0;
  std::vector<Segment> segments;
  {
    const int32_t* ids = req.token_ids_size() != 0 ? req.token_ids().data() : nullptr;
    uint32_t rows = partial_rows;
    bool open = grow;
    if (grow) segments.emplace_back();
    for (uint64_t i = overlap; i < n; ++i) {
      if (!open) {
        segments.emplace_back();
        rows = 0;
        open = true;
      }
      ++rows;
      ++segments.back().rows;
      if (Seals(rows, ids ? ids + i : nullptr)) {
        segments.back().sealed = true;
        open = false;
      }
    }
  }
  const uint64_t fresh_per_head = segments.size() - (grow ? 1 : 0);
  if (head0.chunks.size() + fresh_per_head > kMaxChunksPerStream) {
    return Invalid("start_token", "the stream would exceed 2^28 chunks");
  }

  // Allocate every slot first, so a full tier leaves the session exactly as it was.
  std::vector<SlotRef> fresh;
  std::vector<bool> cow(kvh, false);
  for (uint32_t h = 0; h < kvh; ++h) {
    // Someone else holds the partial chunk (a lease, a fork): grow a copy instead.
    cow[h] = grow && stream(layer, h).chunks.back().host.use_count() > 1;
  }
  const uint64_t slots_needed = kvh * fresh_per_head + std::count(cow.begin(), cow.end(), true);
  fresh.reserve(slots_needed);
  for (uint64_t i = 0; i < slots_needed; ++i) {
    ASSIGN_OR_RETURN(SlotRef s, env_.host->Allocate(tenant_, slot_bytes()));
    fresh.push_back(std::move(s));
  }

  size_t next_fresh = 0;
  for (uint32_t h = 0; h < kvh; ++h) {
    Stream& s = stream(layer, h);
    const uint8_t* k_in = reinterpret_cast<const uint8_t*>(req.keys().data()) + (h * n + overlap) * rb;
    const uint8_t* v_in =
        reinterpret_cast<const uint8_t*>(req.values().data()) + (h * n + overlap) * rb;
    uint64_t position = stored;
    for (size_t seg = 0; seg < segments.size(); ++seg) {
      const uint32_t k = segments[seg].rows;
      if (seg > 0 || !grow) {
        Chunk c;
        c.host = std::move(fresh[next_fresh++]);
        std::memcpy(c.host->data(), k_in, k * rb);
        std::memcpy(c.host->data() + k * rb, v_in, k * rb);
        c.num_tokens = k;
        c.first = position;
        c.sealed = segments[seg].sealed;
        s.chunks.push_back(std::move(c));
        AddToSums(s, s.chunks.size() - 1, k_in, k);
        k_in += k * rb;
        v_in += k * rb;
        position += k;
        continue;
      }
      Chunk& c = s.chunks.back();
      const uint32_t m = c.num_tokens;
      const uint32_t grown = m + k;
      if (cow[h]) {
        SlotRef copy = std::move(fresh[next_fresh++]);
        std::memcpy(copy->data(), c.host->data(), m * rb);                 // old K
        std::memcpy(copy->data() + grown * rb, c.host->data() + m * rb, m * rb);  // old V
        c.host = std::move(copy);
      } else {
        // Nobody else can see this slot: move V down to make room for the new key rows.
        std::memmove(c.host->data() + grown * rb, c.host->data() + m * rb, m * rb);
        c.host->Renew();
      }
      std::memcpy(c.host->data() + m * rb, k_in, k * rb);
      std::memcpy(c.host->data() + (grown + m) * rb, v_in, k * rb);
      AddToSums(s, s.chunks.size() - 1, k_in, k);
      c.num_tokens = grown;
      c.sealed = segments[seg].sealed;
      c.device.reset();  // the promoted copy is stale
      k_in += k * rb;
      v_in += k * rb;
      position += k;
    }
  }
  layer_tokens_[layer] = start + n;
  RegroupSpans(layer);
  QuantizeCold(layer);
  IndexAgedOut(layer);
  return MinTokens();
}

uint32_t Session::cold_bits() const {
  if (policy_.lossless() || shape_.dtype() != v1::DTYPE_FP16) return 0;
  switch (policy_.cold_precision()) {
    case v1::PRECISION_INT4: return 4;
    case v1::PRECISION_INT8: return 8;
    default: return 0;
  }
}

void Session::WriteFp16(const Chunk& c, uint8_t* dst) const {
  if (!c.cold()) {
    std::memcpy(dst, c.host->data(), 2 * c.num_tokens * row_bytes());
    return;
  }
  auto* k = reinterpret_cast<uint16_t*>(dst);
  DequantizeChunk(c.host->data(), ColdLayout(c), k,
                  k + uint64_t{c.num_tokens} * shape_.head_dim());
}

const uint16_t* Session::Fp16Rows(const Chunk& c, std::vector<uint16_t>& scratch) const {
  if (!c.cold()) return reinterpret_cast<const uint16_t*>(c.host->data());
  scratch.resize(2ull * c.num_tokens * shape_.head_dim());
  WriteFp16(c, reinterpret_cast<uint8_t*>(scratch.data()));
  return scratch.data();
}

void Session::QuantizeCold(uint32_t layer) {
  const uint32_t bits = cold_bits();
  if (bits == 0) return;
  const uint32_t limit = FinalChunks(layer);
  if (cold_upto_[layer] >= limit) return;  // most appends (a decode step) quantize nothing
  const uint32_t d = shape_.head_dim();
  const v1::Precision precision = bits == 4 ? v1::PRECISION_INT4 : v1::PRECISION_INT8;
  std::vector<uint16_t> rows;
  uint32_t c = cold_upto_[layer];
  for (; c < limit; ++c) {
    for (uint32_t h = 0; h < shape_.num_kv_heads(); ++h) {
      Stream& s = stream(layer, h);
      Chunk& chunk = s.chunks[c];
      if (chunk.first < policy_.sink_tokens()) break;  // sinks stay fp16
      if (chunk.cold()) continue;
      const uint32_t n = chunk.num_tokens;
      const QuantLayout layout{d, n, bits};
      auto slot = env_.host->Allocate(tenant_, layout.Bytes());
      if (!slot.ok()) {
        cold_upto_[layer] = c;  // retried on the next append
        return;
      }
      const auto* k = reinterpret_cast<const uint16_t*>(chunk.host->data());
      QuantizeChunk(k, k + uint64_t{n} * d, layout, (*slot)->data());
      chunk.host = *std::move(slot);  // the fp16 slot goes back (unless a lease or fork holds it)
      chunk.precision = precision;
      chunk.device.reset();
      // The chunk's mean describes what attention will now read: the dequantized keys.
      rows.resize(2ull * n * d);
      DequantizeChunk(chunk.host->data(), layout, rows.data(), rows.data() + uint64_t{n} * d);
      std::fill_n(&s.key_sums[uint64_t{c} * d], d, 0.f);
      AddToSums(s, c, reinterpret_cast<const uint8_t*>(rows.data()), n);
      UpdatePeak(s, c, reinterpret_cast<const uint8_t*>(rows.data()), n);
    }
  }
  cold_upto_[layer] = c;
}

uint32_t Session::AgedOutChunks(uint32_t layer) const {
  const uint64_t total = layer_tokens_[layer];
  const uint64_t window = policy_.recent_window();
  if (total <= window) return 0;
  const uint64_t window_start = total - window;
  // Every chunk before the last one that starts by window_start ends by it; that one too
  // when its last row does (it is then sealed: a later chunk holds the window).
  const std::vector<Chunk>& chunks = stream(layer, 0).chunks;
  auto it = std::upper_bound(chunks.begin(), chunks.end(), window_start,
                             [](uint64_t t, const Chunk& c) { return t < c.first; });
  if (it == chunks.begin()) return 0;
  const auto n = static_cast<uint32_t>(it - chunks.begin());
  return (it - 1)->end() <= window_start ? n : n - 1;
}

uint32_t Session::FinalChunks(uint32_t layer) const {
  const uint32_t aged = AgedOutChunks(layer);
  return policy_.chunking() == v1::CHUNKING_SEMANTIC ? std::min(aged, regrouped_upto_[layer])
                                                    : aged;
}

void Session::RegroupSpans(uint32_t layer) {
  if (policy_.chunking() != v1::CHUNKING_SEMANTIC) return;
  const uint32_t kvh = shape_.num_kv_heads();
  const uint32_t d = shape_.head_dim();
  const uint32_t ct = policy_.chunk_tokens();
  const uint32_t aged = AgedOutChunks(layer);
  const std::vector<Chunk>& head0 = stream(layer, 0).chunks;
  uint32_t r = regrouped_upto_[layer];
  while (r < aged && head0[r].first < policy_.sink_tokens()) ++r;  // sinks stay as they are
  regrouped_upto_[layer] = r;
  const uint32_t span_rows = kSemanticSpanChunks * ct;
  std::vector<uint16_t> keys(static_cast<size_t>(span_rows) * d), values(keys.size()), scratch;
  std::vector<float> key_floats(keys.size());
  for (; r + kSemanticSpanChunks <= aged; r += kSemanticSpanChunks) {
    std::vector<SlotRef> slots;
    for (uint32_t i = 0; i < kvh * kSemanticSpanChunks; ++i) {
      auto slot = env_.host->Allocate(tenant_, slot_bytes());
      if (!slot.ok()) return;  // retried on the next append; the span stays contiguous
      slots.push_back(*std::move(slot));
    }
    const uint64_t base = head0[r].first;
    for (uint32_t h = 0; h < kvh; ++h) {
      Stream& s = stream(layer, h);
      // The span's rows in position order (its chunks are contiguous and full).
      for (uint32_t i = 0; i < kSemanticSpanChunks; ++i) {
        const Chunk& c = s.chunks[r + i];
        CHECK(c.offsets.empty() && c.num_tokens == ct && c.first == base + i * ct);
        const uint16_t* rows = Fp16Rows(c, scratch);
        std::copy_n(rows, size_t{ct} * d, keys.begin() + static_cast<ptrdiff_t>(i) * ct * d);
        std::copy_n(rows + size_t{ct} * d, size_t{ct} * d,
                    values.begin() + static_cast<ptrdiff_t>(i) * ct * d);
      }
      std::fill(key_floats.begin(), key_floats.end(), 0.f);
      for (uint32_t row = 0; row < span_rows; ++row) {
        AddRows(half_kind(), keys.data() + size_t{row} * d, 1, static_cast<int>(d),
                key_floats.data() + size_t{row} * d);
      }
      const auto groups = BalancedGroups(key_floats.data(), span_rows, static_cast<int>(d), ct);
      for (uint32_t g = 0; g < kSemanticSpanChunks; ++g) {
        Chunk c;
        c.host = std::move(slots[h * kSemanticSpanChunks + g]);
        c.num_tokens = ct;
        c.first = base;
        c.sealed = true;
        uint8_t* dst = c.host->data();
        for (uint32_t j = 0; j < ct; ++j) {
          const uint32_t row = groups[g][j];
          c.offsets.push_back(static_cast<uint16_t>(row));
          std::memcpy(dst + size_t{j} * row_bytes(), keys.data() + size_t{row} * d, row_bytes());
          std::memcpy(dst + size_t{ct + j} * row_bytes(), values.data() + size_t{row} * d,
                      row_bytes());
        }
        s.chunks[r + g] = std::move(c);  // the old slot goes back (unless a lease holds it)
        std::fill_n(&s.key_sums[uint64_t{r + g} * d], d, 0.f);
        AddToSums(s, r + g, dst, ct);
        UpdatePeak(s, r + g, dst, ct);
      }
    }
    regrouped_upto_[layer] = r + kSemanticSpanChunks;
  }
}

void Session::IndexAgedOut(uint32_t layer) {
  uint32_t limit = AgedOutChunks(layer);
  // Peaks are needed only once a chunk can be ranked, that is once it leaves the window:
  // computed here, once, rather than on every append to a growing chunk. A cold chunk got
  // its peak from its dequantized rows when it was quantized, a regrouped one when regrouped.
  std::vector<uint16_t> scratch;
  for (uint32_t c = peaked_upto_[layer]; c < limit; ++c) {
    for (uint32_t h = 0; h < shape_.num_kv_heads(); ++h) {
      Stream& s = stream(layer, h);
      if (s.chunks[c].cold()) continue;
      UpdatePeak(s, c, reinterpret_cast<const uint8_t*>(Fp16Rows(s.chunks[c], scratch)),
                 s.chunks[c].num_tokens);
    }
  }
  peaked_upto_[layer] = std::max(peaked_upto_[layer], limit);
  // The index keeps a chunk's statistics fixed, so it takes a chunk only once they are final:
  // regrouped (semantic chunking) and quantized (a chunk that should be cold but is not yet,
  // because the host tier was full, waits).
  limit = FinalChunks(layer);
  if (cold_bits() != 0) limit = std::min(limit, cold_upto_[layer]);
  for (uint32_t c = indexed_upto_[layer]; c < limit; ++c) {
    for (uint32_t h = 0; h < shape_.num_kv_heads(); ++h) {
      Stream& s = stream(layer, h);
      if (s.chunks[c].first < policy_.sink_tokens()) break;  // sinks are always returned
      if (!s.index) {
        // Clustered for the ranking the session has now; a later change of ranking leaves
        // the answers exact, only the search's work tuned for the other.
        ClusterIndex::Options options;
        options.cluster_by_peak = policy_.ranking() == v1::RANKING_LSE_PEAK;
        s.index = std::make_unique<ClusterIndex>(static_cast<int>(shape_.head_dim()), options);
      }
      s.index->Add(c, s.chunks[c].num_tokens, s.arrays());
    }
  }
  indexed_upto_[layer] = std::max(indexed_upto_[layer], limit);
}

void Session::FillHandle(const Chunk& c, const Slot* slot, const uint8_t* fp16,
                         uint64_t chunk_id, bool include_data, v1::BlockHandle* h) const {
  const uint64_t half = c.num_tokens * row_bytes();
  const ChunkAddress a = DecodeChunkId(chunk_id);
  h->set_chunk_id(chunk_id);
  h->set_tier(slot ? slot->tier() : v1::TIER_HOST);
  h->set_segment_id(slot ? slot->segment_id() : 0);
  h->set_offset(slot ? slot->offset() : 0);
  h->set_length(2 * half);
  h->set_precision(shape_.dtype() == v1::DTYPE_BF16 ? v1::PRECISION_BF16 : v1::PRECISION_FP16);
  h->set_stored_precision(c.cold() ? c.precision : h->precision());
  h->set_num_tokens(c.num_tokens);
  h->set_generation((slot ? slot : c.host.get())->generation());
  h->set_layer(a.layer);
  h->set_kv_head(a.kv_head);
  for (uint32_t r = 0; r < c.num_tokens; ++r) h->add_positions(static_cast<int64_t>(c.position(r)));
  if (include_data) {
    h->set_keys(fp16, half);
    h->set_values(fp16 + half, half);
  }
}

// Below this many candidate chunks a linear scan beats the index's best-first search.
// Measured with kvtier-bench select (16-token chunks, head_dim 64, budget 256; three runs,
// in us): the scan against the index took 51-58 against 90-116 at 512 chunks (8K tokens),
// 74-111 against 102-126 at 1024, and 196-222 against 104-120 at 2048; the index with
// semantic chunks took 168-195 at 2048. (Before the scan scored its candidates' exponentials
// and logarithms eight at a time, the index won from 1024 contiguous chunks.)
constexpr uint64_t kIndexMinCandidates = 2048;

std::vector<uint32_t> Session::RankCandidates(const Stream& s, std::span<const float> qh,
                                              uint32_t group, const std::vector<bool>& mandatory,
                                              uint64_t budget, uint32_t layer) {
  const int d = static_cast<int>(shape_.head_dim());
  const uint32_t ct = policy_.chunk_tokens();  // semantic chunks have it too; boundary vary
  auto candidate = [&s, d](uint32_t c) {
    const uint32_t n = s.chunks[c].num_tokens;
    return ChunkCandidate{c, n, &s.key_sums[static_cast<size_t>(c) * d],
                          1.f / static_cast<float>(n), &s.peaks[static_cast<size_t>(c) * d]};
  };
  std::vector<ChunkCandidate> extras;  // candidates the index does not hold
  uint64_t candidates = 0;
  bool uniform = true;
  for (uint32_t c = 0; c < mandatory.size(); ++c) {
    if (mandatory[c]) continue;
    ++candidates;
    uniform = uniform && s.chunks[c].num_tokens == ct;
    if (!s.index || !s.index->contains(c)) extras.push_back(candidate(c));
  }
  const bool record = layer != kNoLayer;
  if (record) select_candidates_[layer] += candidates;
  if (s.index && !uniform && candidates >= kIndexMinCandidates) {
    // Chunks of several sizes (boundary chunking): the index's greedy fill, the extras
    // scored beside it. The answer is the scan's.
    ClusterIndex::SearchStats stats;
    std::vector<uint32_t> found = s.index->SearchGreedy(policy_.ranking(), qh,
                                                        static_cast<int>(group), budget,
                                                        s.arrays(), mandatory, extras, &stats);
    if (record) select_scored_[layer] += stats.chunks_scored;
    return found;
  }
  if (!s.index || !uniform || candidates < kIndexMinCandidates) {
    // Nothing indexed yet, or too few chunks for pruning to pay for its bounds: scan. The
    // answer is the same.
    if (record) select_scored_[layer] += candidates;
    std::vector<ChunkCandidate> all;
    all.reserve(candidates);
    for (uint32_t c = 0; c < mandatory.size(); ++c) {
      if (!mandatory[c]) all.push_back(candidate(c));
    }
    return SelectChunks(policy_.ranking(), qh, static_cast<int>(group), d, all, budget);
  }
  // Whole chunks: the best budget / chunk_tokens. The index's answer is exact for its chunks;
  // the few it does not hold yet (a policy change, a chunk waiting for room to be quantized)
  // are scored here and merged by the same order.
  const size_t k = budget / ct;
  ClusterIndex::SearchStats stats;
  std::vector<uint32_t> found = s.index->Search(policy_.ranking(), qh, static_cast<int>(group),
                                                k, s.arrays(), mandatory, &stats);
  if (record) select_scored_[layer] += stats.chunks_scored + extras.size();
  if (extras.empty()) return found;
  for (uint32_t c : found) extras.push_back(candidate(c));
  std::sort(extras.begin(), extras.end(),
            [](const ChunkCandidate& a, const ChunkCandidate& b) { return a.index < b.index; });
  return SelectChunks(policy_.ranking(), qh, static_cast<int>(group), d, extras, budget);
}

absl::StatusOr<std::vector<float>> Session::CheckSelect(const v1::SelectRequest& req) const {
  const int d = static_cast<int>(shape_.head_dim());
  if (req.layer() >= shape_.num_layers()) {
    return Invalid("layer", absl::StrFormat("%d is outside [0, %d)", req.layer(),
                                            shape_.num_layers()));
  }
  const size_t want = static_cast<size_t>(shape_.num_q_heads()) * d * sizeof(float);
  if (req.query().size() != want) {
    return Invalid("query", absl::StrFormat("%d bytes; fp32 [num_q_heads %d][head_dim %d] is %d",
                                            req.query().size(), shape_.num_q_heads(), d, want));
  }
  std::vector<float> q(want / sizeof(float));
  std::memcpy(q.data(), req.query().data(), want);
  for (size_t i = 0; i < q.size(); ++i) {
    if (!std::isfinite(q[i])) {
      return Invalid("query", absl::StrFormat("element %d is not finite", i));
    }
  }
  switch (req.placement()) {
    case v1::TIER_UNSPECIFIED:
    case v1::TIER_HOST:
    case v1::TIER_DEVICE:
      break;
    default:
      return Invalid("placement", absl::StrCat(v1::Tier_Name(req.placement()),
                                               " is not readable by workers; use TIER_DEVICE "
                                               "or TIER_HOST"));
  }
  const uint32_t ttl = req.lease_ms() ? req.lease_ms() : env_.lease_ttl_ms;
  if (ttl > env_.max_lease_ms) {
    return Invalid("lease_ms", absl::StrFormat("%d is above the daemon's max_lease_ms %d", ttl,
                                               env_.max_lease_ms));
  }
  return q;
}

absl::StatusOr<bool> Session::Choose(uint32_t layer, std::span<const float> q, uint64_t budget,
                                     bool record,
                                     std::vector<std::vector<uint32_t>>* chosen) {
  const uint32_t kvh = shape_.num_kv_heads();
  const uint32_t group = shape_.num_q_heads() / kvh;
  const int d = static_cast<int>(shape_.head_dim());
  const uint64_t total = layer_tokens_[layer];
  const bool everything = layer < policy_.dense_layers() || total <= budget;
  const uint64_t sink_end = std::min<uint64_t>(policy_.sink_tokens(), total);
  const uint64_t window_start = total - std::min<uint64_t>(policy_.recent_window(), total);

  // Per head: which chunks, in position order. Always returned: every chunk with a row among
  // the sinks or in the recent window (a regrouped chunk counts by its first and last rows).
  chosen->assign(kvh, {});
  for (uint32_t h = 0; h < kvh; ++h) {
    Stream& s = stream(layer, h);
    const auto nchunks = static_cast<uint32_t>(s.chunks.size());
    std::vector<bool> mandatory(nchunks, everything);
    uint64_t mandatory_tokens = 0;
    if (!everything) {
      for (uint32_t c = 0; c < nchunks; ++c) {
        const Chunk& ch = s.chunks[c];
        if (ch.position(0) < sink_end || ch.end() > window_start) {
          mandatory[c] = true;
          mandatory_tokens += ch.num_tokens;
        }
      }
      if (mandatory_tokens > budget) {
        return Invalid("budget_tokens",
                       absl::StrFormat("%d is below the %d tokens of the sink and recent-window "
                                       "chunks (sink_tokens %d, recent_window %d, chunk_tokens "
                                       "%d, %s)",
                                       budget, mandatory_tokens, policy_.sink_tokens(),
                                       policy_.recent_window(), policy_.chunk_tokens(),
                                       v1::Chunking_Name(policy_.chunking())));
      }
    }
    std::vector<bool> take = mandatory;
    if (!everything) {
      std::span<const float> qh = q.subspan(static_cast<size_t>(h) * group * d,
                                            static_cast<size_t>(group) * d);
      for (uint32_t c : RankCandidates(s, qh, group, mandatory, budget - mandatory_tokens,
                                       record ? layer : kNoLayer)) {
        take[c] = true;
      }
    }
    for (uint32_t c = 0; c < nchunks; ++c) {
      if (take[c]) (*chosen)[h].push_back(c);
    }
  }
  return everything;
}

absl::Status Session::Select(const v1::SelectRequest& req, v1::SelectResponse* out) {
  ASSIGN_OR_RETURN(const std::vector<float> q, CheckSelect(req));
  const uint32_t kvh = shape_.num_kv_heads();
  const int d = static_cast<int>(shape_.head_dim());
  const uint32_t ttl = req.lease_ms() ? req.lease_ms() : env_.lease_ttl_ms;
  const bool to_device = req.placement() == v1::TIER_DEVICE;

  MutexLock lock(&mu_);
  RETURN_IF_ERROR(CheckOpen());
  last_access_ms_ = env_.clock->NowMs();
  const uint32_t layer = req.layer();
  const uint64_t total = layer_tokens_[layer];
  const uint64_t budget = req.budget_tokens() ? req.budget_tokens() : policy_.default_budget();
  std::vector<std::vector<uint32_t>> chosen;
  ASSIGN_OR_RETURN(const bool everything, Choose(layer, q, budget, /*record=*/true, &chosen));

  // Every chosen chunk must be readable in fp16 on the target tier: a warm chunk on the host
  // already is; a cold one needs its dequantized copy there, and device placement a device
  // copy. Copies come from the tier's promotion cache, which makes room by its eviction policy.
  ASSIGN_OR_RETURN(std::vector<std::vector<SlotRef>> readable,
                   Readable(layer, chosen, to_device, /*prefetch=*/false));

  std::vector<SlotRef> pinned;
  out->set_context_tokens(total);
  for (uint32_t h = 0; h < kvh; ++h) {
    Stream& s = stream(layer, h);
    v1::HeadSelection* hs = out->add_heads();
    hs->set_kv_head(h);
    for (size_t i = 0; i < chosen[h].size(); ++i) {
      const uint32_t c = chosen[h][i];
      const SlotRef& slot = readable[h][i];
      FillHandle(s.chunks[c], slot.get(), slot->data(), EncodeChunkId({layer, h, c}),
                 req.include_data(), hs->add_blocks());
      pinned.push_back(slot);
    }
    if (req.include_summaries() && !everything) {
      // One summary per cluster of the index over its left-out chunks; a left-out chunk the
      // index does not hold is its own group. Groups come in the order of their first chunk.
      struct Group {
        uint32_t tokens = 0;
        std::vector<float> key_sum, value_sum;
      };
      std::vector<Group> groups;
      std::map<uint32_t, size_t> group_of_cluster;
      std::vector<uint16_t> scratch;
      size_t next = 0;
      for (uint32_t c = 0; c < s.chunks.size(); ++c) {
        if (next < chosen[h].size() && chosen[h][next] == c) {
          ++next;
          continue;
        }
        const uint32_t cluster = s.index ? s.index->cluster_of(c) : ClusterIndex::kNoCluster;
        size_t g = groups.size();
        if (cluster != ClusterIndex::kNoCluster) {
          g = group_of_cluster.emplace(cluster, groups.size()).first->second;
        }
        if (g == groups.size()) groups.push_back({0, std::vector<float>(d, 0.f),
                                                  std::vector<float>(d, 0.f)});
        Group& grp = groups[g];
        const uint32_t n = s.chunks[c].num_tokens;
        grp.tokens += n;
        for (int j = 0; j < d; ++j) grp.key_sum[j] += s.key_sums[static_cast<size_t>(c) * d + j];
        const uint16_t* v_rows = Fp16Rows(s.chunks[c], scratch) + static_cast<size_t>(n) * d;
        AddRows(half_kind(), v_rows, static_cast<int>(n), d, grp.value_sum.data());
      }
      for (Group& grp : groups) {
        for (int j = 0; j < d; ++j) {
          grp.key_sum[j] /= static_cast<float>(grp.tokens);
          grp.value_sum[j] /= static_cast<float>(grp.tokens);
        }
        v1::ClusterSummary* sum = hs->add_summaries();
        sum->set_mean_key(grp.key_sum.data(), d * sizeof(float));
        sum->set_mean_value(grp.value_sum.data(), d * sizeof(float));
        sum->set_num_tokens(grp.tokens);
      }
    }
  }
  LeaseTable::Granted lease = env_.leases->Create(tenant_, id_, std::move(pinned), ttl);
  out->set_lease_id(lease.lease_id);
  out->set_lease_expires_unix_ms(lease.expires_unix_ms);
  return absl::OkStatus();
}

namespace {

// What it costs to remake an evicted copy, for the cost-aware eviction policy: a copy at
// about 10 GB/s; dequantizing int4 or int8 first, about 4 times that (quant_bench).
double RemakeCostUs(uint64_t bytes, bool cold) {
  return static_cast<double>(bytes) * 1e-4 * (cold ? 4 : 1);
}

}  // namespace

absl::StatusOr<std::vector<std::vector<SlotRef>>> Session::Readable(
    uint32_t layer, const std::vector<std::vector<uint32_t>>& chosen, bool to_device,
    bool prefetch, size_t* promoted) {
  PromotionCache* cache = copies(to_device);
  // Holding every slot found keeps the cache from evicting it while room is made.
  std::vector<std::vector<SlotRef>> out(chosen.size());
  std::vector<std::pair<uint32_t, size_t>> todo;  // (kv_head, position in chosen[h])
  for (uint32_t h = 0; h < chosen.size(); ++h) {
    for (size_t i = 0; i < chosen[h].size(); ++i) {
      const Chunk& ch = stream(layer, h).chunks[chosen[h][i]];
      // A prefetch only looks: it is not a read of the copies already there.
      const CopyRef& copy = to_device ? ch.device : ch.promoted;
      SlotRef slot = !to_device && !ch.cold() ? ch.host
                     : prefetch              ? cache->Peek(copy)
                                             : cache->Read(copy);
      if (!slot) todo.emplace_back(h, i);
      out[h].push_back(std::move(slot));
    }
  }
  ASSIGN_OR_RETURN(std::vector<SlotRef> slots,
                   cache->Allocate(tenant_, slot_bytes(), todo.size()));
  for (size_t j = 0; j < todo.size(); ++j) {
    const auto [h, i] = todo[j];
    Chunk& ch = stream(layer, h).chunks[chosen[h][i]];
    WriteFp16(ch, slots[j]->data());
    const double cost = RemakeCostUs(2 * ch.num_tokens * row_bytes(), ch.cold());
    (to_device ? ch.device : ch.promoted) = cache->Insert(slots[j], tenant_, cost, prefetch);
    out[h][i] = std::move(slots[j]);
  }
  cache->tier()->RecordPromotions(todo.size());
  if (promoted) *promoted = todo.size();
  return out;
}

absl::StatusOr<uint64_t> Session::Prefetch(const v1::SelectRequest& req,
                                           uint32_t extra_percent) {
  ASSIGN_OR_RETURN(const std::vector<float> q, CheckSelect(req));
  MutexLock lock(&mu_);
  RETURN_IF_ERROR(CheckOpen());
  const uint64_t budget = req.budget_tokens() ? req.budget_tokens() : policy_.default_budget();
  std::vector<std::vector<uint32_t>> chosen;
  ASSIGN_OR_RETURN(const bool everything,
                   Choose(req.layer(), q, budget + budget * extra_percent / 100,
                          /*record=*/false, &chosen));
  if (everything && req.layer() < policy_.dense_layers()) return 0;  // nothing to guess
  const bool to_device = req.placement() == v1::TIER_DEVICE;
  size_t made = 0;
  RETURN_IF_ERROR(Readable(req.layer(), chosen, to_device, /*prefetch=*/true, &made).status());
  return made;
}

absl::StatusOr<std::vector<v1::BlockHandle>> Session::ReadChunks(
    const std::vector<uint64_t>& ids) {
  MutexLock lock(&mu_);
  RETURN_IF_ERROR(CheckOpen());
  last_access_ms_ = env_.clock->NowMs();
  std::vector<v1::BlockHandle> out;
  out.reserve(ids.size());
  for (uint64_t id : ids) {
    ChunkAddress a = DecodeChunkId(id);
    if (EncodeChunkId(a) != id || a.layer >= shape_.num_layers() ||
        a.kv_head >= shape_.num_kv_heads() ||
        a.index >= stream(a.layer, a.kv_head).chunks.size()) {
      return absl::NotFoundError(absl::StrFormat(
          "chunk_ids: %d (layer %d, kv_head %d, index %d) is not in session \"%s\"", id, a.layer,
          a.kv_head, a.index, id_));
    }
    const Chunk& c = stream(a.layer, a.kv_head).chunks[a.index];
    // A cold chunk with no fp16 copy comes dequantized, inline only (segment_id 0).
    const SlotRef promoted = c.cold() ? env_.host_copies->Peek(c.promoted) : nullptr;
    const Slot* readable = c.cold() ? promoted.get() : c.host.get();
    std::vector<uint16_t> scratch;
    const uint8_t* fp16 =
        readable ? readable->data() : reinterpret_cast<const uint8_t*>(Fp16Rows(c, scratch));
    FillHandle(c, readable, fp16, id, /*include_data=*/true, &out.emplace_back());
  }
  return out;
}

absl::StatusOr<std::unique_ptr<Session>> Session::Fork(std::string new_id, uint64_t num_tokens) {
  auto child = std::unique_ptr<Session>(new Session(*this, std::move(new_id)));
  MutexLock lock(&mu_);
  RETURN_IF_ERROR(CheckOpen());
  const uint64_t have = MinTokens();
  if (num_tokens == 0) num_tokens = have;
  if (num_tokens > have) {
    return Invalid("num_tokens", absl::StrFormat("%d is above the %d tokens stored in every layer",
                                                 num_tokens, have));
  }
  const uint32_t kvh = shape_.num_kv_heads();
  const uint64_t rb = row_bytes();
  const size_t d = shape_.head_dim();
  // Per layer, the chunks wholly below num_tokens are shared (a regrouped span only whole);
  // the rows from `from` up to num_tokens are copied, in position order, into fresh chunks
  // of at most `piece` rows. Chunk boundaries are the same for every KV head of a layer.
  const uint32_t piece = policy_.chunking() == v1::CHUNKING_BOUNDARY ? chunk_capacity()
                                                                     : policy_.chunk_tokens();
  std::vector<uint32_t> keep(shape_.num_layers(), 0);
  std::vector<uint64_t> from(shape_.num_layers(), 0);
  uint64_t slots_needed = 0;
  for (uint32_t l = 0; l < shape_.num_layers(); ++l) {
    const std::vector<Chunk>& chunks = stream(l, 0).chunks;
    uint32_t k = 0;
    while (k < chunks.size()) {
      uint32_t span_end = k + 1;  // a regrouped span goes whole or not at all
      while (span_end < chunks.size() && !chunks[k].offsets.empty() &&
             chunks[span_end].first == chunks[k].first) {
        ++span_end;
      }
      bool below = true;
      for (uint32_t c = k; c < span_end; ++c) below = below && chunks[c].end() <= num_tokens;
      if (!below) break;
      k = span_end;
    }
    keep[l] = k;
    from[l] = k < chunks.size() ? chunks[k].first : num_tokens;
    slots_needed += kvh * ((num_tokens - from[l] + piece - 1) / piece);
  }
  std::vector<SlotRef> copies;
  for (uint64_t i = 0; i < slots_needed; ++i) {
    ASSIGN_OR_RETURN(SlotRef s, env_.host->Allocate(tenant_, slot_bytes()));
    copies.push_back(std::move(s));
  }
  size_t next_copy = 0;
  MutexLock child_lock(&child->mu_);  // not yet visible to anyone else
  std::vector<uint16_t> scratch;
  for (uint32_t l = 0; l < shape_.num_layers(); ++l) {
    for (uint32_t h = 0; h < kvh; ++h) {
      const Stream& src = stream(l, h);
      Stream& to = child->stream(l, h);
      const uint32_t k = keep[l];
      to.chunks.assign(src.chunks.begin(), src.chunks.begin() + k);
      to.key_sums.assign(src.key_sums.begin(), src.key_sums.begin() + k * d);
      // Peaks exist for the chunks that aged out in the parent; the child computes the rest.
      to.peaks.assign(src.peaks.begin(),
                      src.peaks.begin() + std::min(src.peaks.size(), size_t{k} * d));
      for (uint64_t p = from[l]; p < num_tokens;) {
        const auto rows = static_cast<uint32_t>(std::min<uint64_t>(piece, num_tokens - p));
        Chunk c;
        c.host = std::move(copies[next_copy++]);
        c.first = p;
        c.num_tokens = rows;
        c.sealed = rows == policy_.chunk_tokens() &&
                   policy_.chunking() != v1::CHUNKING_BOUNDARY;  // a boundary copy stays open
        uint32_t read = ~0u;  // the chunk whose fp16 rows `fp16` holds
        const uint8_t* fp16 = nullptr;
        for (uint32_t r = 0; r < rows; ++r, ++p) {
          const auto [index, row] = Locate(src, p);
          const Chunk& at = src.chunks[index];
          if (index != read) {
            fp16 = reinterpret_cast<const uint8_t*>(Fp16Rows(at, scratch));
            read = index;
          }
          std::memcpy(c.host->data() + r * rb, fp16 + row * rb, rb);
          std::memcpy(c.host->data() + (rows + r) * rb, fp16 + (at.num_tokens + row) * rb, rb);
        }
        to.chunks.push_back(std::move(c));
        AddToSums(to, to.chunks.size() - 1, to.chunks.back().host->data(), rows);
      }
    }
  }
  std::fill(child->layer_tokens_.begin(), child->layer_tokens_.end(), num_tokens);
  for (uint32_t l = 0; l < shape_.num_layers(); ++l) {
    child->cold_upto_[l] = std::min(cold_upto_[l], keep[l]);
    child->peaked_upto_[l] = std::min(peaked_upto_[l], keep[l]);
    child->regrouped_upto_[l] = std::min(regrouped_upto_[l], keep[l]);
    child->IndexAgedOut(l);  // the child's own index, over the chunks it shares
  }
  return child;
}

absl::StatusOr<uint64_t> Session::Evict(v1::Tier tier) {
  MutexLock lock(&mu_);
  RETURN_IF_ERROR(CheckOpen());
  switch (tier) {
    case v1::TIER_DEVICE: {
      uint64_t bytes = 0, chunks = 0;
      for (Stream& s : streams_) {
        for (Chunk& c : s.chunks) {
          if (!c.device) continue;
          const uint64_t b = env_.device_copies->Drop(c.device);
          bytes += b;
          chunks += b > 0;
          c.device.reset();  // a lease still holding it keeps the memory until released
        }
      }
      env_.device->RecordEvictions(chunks);
      return bytes;
    }
    case v1::TIER_HOST:
      return absl::FailedPreconditionError(absl::StrCat(
          "tier: TIER_HOST cannot be evicted: no remote tier is configured and session \"", id_,
          "\" is live"));
    default:
      return Invalid("tier", absl::StrCat(v1::Tier_Name(tier),
                                          " has no tier below it; use TIER_DEVICE or TIER_HOST"));
  }
}

absl::StatusOr<v1::SessionPolicy> Session::SetPolicy(const v1::SessionPolicy& policy) {
  MutexLock lock(&mu_);
  RETURN_IF_ERROR(CheckOpen());
  ASSIGN_OR_RETURN(v1::SessionPolicy next, ResolvePolicy(policy, policy_, "policy"));
  const bool stored = std::any_of(layer_tokens_.begin(), layer_tokens_.end(),
                                  [](uint64_t t) { return t > 0; });
  if (stored && next.chunk_tokens() != policy_.chunk_tokens()) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "policy.chunk_tokens: cannot change from %d to %d once tokens are stored",
        policy_.chunk_tokens(), next.chunk_tokens()));
  }
  if (stored && next.chunking() != policy_.chunking()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "policy.chunking: cannot change from ", v1::Chunking_Name(policy_.chunking()), " to ",
        v1::Chunking_Name(next.chunking()), " once tokens are stored"));
  }
  policy_ = next;
  // A smaller window or fewer sinks age chunks out now; the index takes them in.
  for (uint32_t l = 0; l < shape_.num_layers(); ++l) IndexAgedOut(l);
  return policy_;
}

void Session::Close() {
  std::vector<Stream> dropped;
  {
    MutexLock lock(&mu_);
    closed_ = true;
    dropped.swap(streams_);
  }
  // Slots go back to their tiers here, outside the session lock.
}

bool Session::demoted() const {
  MutexLock lock(&mu_);
  return demoted_;
}

int64_t Session::last_access_ms() const {
  MutexLock lock(&mu_);
  return last_access_ms_;
}

v1::SessionRecord Session::Export() const {
  v1::SessionRecord r;
  r.set_session_id(id_);
  r.set_tenant(tenant_);
  *r.mutable_shape() = shape_;
  *r.mutable_policy() = policy_;
  r.mutable_labels()->insert(labels_.begin(), labels_.end());
  r.set_created_unix_ms(created_ms_);
  for (uint64_t t : layer_tokens_) r.add_layer_tokens(t);
  for (const Stream& s : streams_) {
    v1::StreamRecord* sr = r.add_streams();
    for (const Chunk& c : s.chunks) {
      v1::ChunkRecord* cr = sr->add_chunks();
      cr->set_num_tokens(c.num_tokens);
      cr->set_first(c.first);
      if (!c.offsets.empty()) {
        std::string off(c.offsets.size() * 2, '\0');
        for (size_t i = 0; i < c.offsets.size(); ++i) {
          off[2 * i] = static_cast<char>(c.offsets[i] & 0xff);
          off[2 * i + 1] = static_cast<char>(c.offsets[i] >> 8);
        }
        cr->set_offsets(std::move(off));
      }
      cr->set_sealed(c.sealed);
      const v1::Precision warm =
          shape_.dtype() == v1::DTYPE_BF16 ? v1::PRECISION_BF16 : v1::PRECISION_FP16;
      cr->set_precision(c.cold() ? c.precision : warm);
      cr->set_data(c.host->data(), StoredBytes(c));
    }
  }
  return r;
}

absl::StatusOr<uint64_t> Session::Demote(
    const std::function<absl::Status(const v1::SessionRecord&)>& store) {
  std::vector<Stream> dropped;
  uint64_t bytes;
  {
    MutexLock lock(&mu_);
    RETURN_IF_ERROR(CheckOpen());
    if (size_t leases = env_.leases->CountForSession(id_); leases > 0) {
      return absl::FailedPreconditionError(absl::StrFormat(
          "session_id: \"%s\" has %d active leases; leased chunks are not moved", id_, leases));
    }
    const v1::SessionRecord record = Export();
    bytes = record.ByteSizeLong();
    RETURN_IF_ERROR(store(record));
    demoted_ = closed_ = true;
    dropped.swap(streams_);
  }
  return bytes;  // the slots go back to their tiers here, outside the lock
}

absl::StatusOr<std::unique_ptr<Session>> Session::Import(const v1::SessionRecord& r,
                                                         const SessionEnv& env) {
  auto bad = [&](absl::string_view why) {
    return absl::InvalidArgumentError(
        absl::StrCat("record of session \"", r.session_id(), "\": ", why));
  };
  auto resolved = ResolveShape(r.shape());
  if (!resolved.ok()) return bad(resolved.status().message());
  const v1::ModelShape& shape = *resolved;
  const size_t streams = static_cast<size_t>(shape.num_layers()) * shape.num_kv_heads();
  if ( r.streams_size() != static_cast<int>(streams) ||
      r.layer_tokens_size() != static_cast<int>(shape.num_layers())) {
    return bad("streams or layer_tokens do not match its shape");
  }
  auto policy = ResolvePolicy(r.policy(), BuiltinPolicy(), "policy");
  if (!policy.ok()) return bad(policy.status().message());
  auto s = std::make_unique<Session>(r.session_id(), r.tenant(), shape, *policy,
                                     std::map<std::string, std::string>(r.labels().begin(),
                                                                        r.labels().end()),
                                     env);
  MutexLock lock(&s->mu_);
  std::vector<uint16_t> scratch;
  for (size_t i = 0; i < streams; ++i) {
    Stream& st = s->streams_[i];
    for (const v1::ChunkRecord& cr : r.streams(static_cast<int>(i)).chunks()) {
      Chunk c;
      c.num_tokens = cr.num_tokens();
      c.first = cr.first();
      c.sealed = cr.sealed();
      c.precision = cr.precision();
      if (c.num_tokens == 0 || c.num_tokens > s->chunk_capacity() ||
          cr.offsets().size() % 2 != 0 ||
          (!cr.offsets().empty() && cr.offsets().size() != 2 * c.num_tokens)) {
        return bad("a chunk's size or offsets are out of range");
      }
      for (size_t j = 0; j < cr.offsets().size(); j += 2) {
        c.offsets.push_back(static_cast<uint16_t>(static_cast<uint8_t>(cr.offsets()[j]) |
                                                  static_cast<uint8_t>(cr.offsets()[j + 1]) << 8));
      }
      const uint64_t bytes = s->StoredBytes(c);
      if (cr.data().size() != bytes) return bad("a chunk's bytes do not match its size");
      ASSIGN_OR_RETURN(c.host, env.host->Allocate(r.tenant(), c.cold() ? bytes : s->slot_bytes()));
      std::memcpy(c.host->data(), cr.data().data(), bytes);
      st.chunks.push_back(std::move(c));
      const size_t index = st.chunks.size() - 1;
      const auto* rows = reinterpret_cast<const uint8_t*>(s->Fp16Rows(st.chunks.back(), scratch));
      s->AddToSums(st, index, rows, st.chunks.back().num_tokens);
      s->UpdatePeak(st, index, rows, st.chunks.back().num_tokens);
    }
  }
  s->created_ms_ = r.created_unix_ms();
  for (uint32_t l = 0; l < shape.num_layers(); ++l) {
    s->layer_tokens_[l] = r.layer_tokens(static_cast<int>(l));
    const std::vector<Chunk>& chunks = s->stream(l, 0).chunks;
    s->peaked_upto_[l] = static_cast<uint32_t>(chunks.size());  // every peak computed above
    for (uint32_t c = 0; c < chunks.size(); ++c) {
      if (!chunks[c].offsets.empty()) s->regrouped_upto_[l] = c + 1;
    }
    s->RegroupSpans(l);
    s->QuantizeCold(l);
    s->IndexAgedOut(l);  // the index, rebuilt over the chunks that had left the window
  }
  return s;
}

v1::SessionInfo Session::Info() const {
  MutexLock lock(&mu_);
  v1::SessionInfo info;
  info.set_session_id(id_);
  info.set_tenant(tenant_);
  *info.mutable_shape() = shape_;
  *info.mutable_policy() = policy_;
  info.set_num_tokens(closed_ ? 0 : MinTokens());
  info.set_created_unix_ms(created_ms_);
  info.set_last_access_unix_ms(last_access_ms_);
  info.mutable_labels()->insert(labels_.begin(), labels_.end());
  uint64_t host = 0, device = 0;
  const v1::Precision warm =
      shape_.dtype() == v1::DTYPE_BF16 ? v1::PRECISION_BF16 : v1::PRECISION_FP16;
  auto& by_precision = *info.mutable_chunks_by_precision();
  for (const Stream& s : streams_) {
    for (const Chunk& c : s.chunks) {
      host += c.host->bytes() + CopyBytes(env_.host_copies, c.promoted);
      device += CopyBytes(env_.device_copies, c.device);
      ++by_precision[v1::Precision_Name(c.cold() ? c.precision : warm)];
    }
  }
  (*info.mutable_bytes_by_tier())[v1::Tier_Name(v1::TIER_HOST)] = host;
  (*info.mutable_bytes_by_tier())[v1::Tier_Name(v1::TIER_DEVICE)] = device;
  info.set_active_leases(static_cast<uint32_t>(env_.leases->CountForSession(id_)));
  return info;
}

v1::ListChunksResponse Session::ListChunks(std::optional<uint32_t> layer, uint32_t limit) const {
  MutexLock lock(&mu_);
  v1::ListChunksResponse out;
  if (closed_) return out;
  const uint32_t kvh = shape_.num_kv_heads();
  uint64_t total = 0;
  for (uint32_t l = 0; l < shape_.num_layers(); ++l) {
    if (layer.has_value() && *layer != l) continue;
    for (uint32_t h = 0; h < kvh; ++h) {
      const Stream& s = streams_[static_cast<size_t>(l) * kvh + h];
      for (uint32_t i = 0; i < s.chunks.size(); ++i, ++total) {
        if (out.chunks_size() >= static_cast<int>(limit)) continue;
        const Chunk& c = s.chunks[i];
        v1::ChunkInfo* info = out.add_chunks();
        info->set_chunk_id(EncodeChunkId({l, h, i}));
        info->set_layer(l);
        info->set_kv_head(h);
        info->set_index(i);
        info->set_num_tokens(c.num_tokens);
        info->set_first_position(static_cast<int64_t>(c.position(0)));
        info->set_precision(c.cold() ? c.precision
                            : shape_.dtype() == v1::DTYPE_BF16 ? v1::PRECISION_BF16
                                                               : v1::PRECISION_FP16);
        info->set_host_bytes(c.host->bytes() + CopyBytes(env_.host_copies, c.promoted));
        info->set_device_bytes(CopyBytes(env_.device_copies, c.device));
        info->set_generation(c.host->generation());
        info->set_pinned(c.host->pinned());
        info->set_shared(c.host.use_count() > 1);
      }
    }
  }
  out.set_total(total);
  return out;
}

std::vector<v1::LayerStats> Session::Layers() const {
  MutexLock lock(&mu_);
  std::vector<v1::LayerStats> out;
  if (closed_) return out;
  for (uint32_t l = 0; l < shape_.num_layers(); ++l) {
    v1::LayerStats& st = out.emplace_back();
    st.set_layer(l);
    st.set_num_tokens(layer_tokens_[l]);
    uint64_t chunks = 0;
    for (uint32_t h = 0; h < shape_.num_kv_heads(); ++h) {
      chunks += streams_[static_cast<size_t>(l) * shape_.num_kv_heads() + h].chunks.size();
    }
    st.set_chunks(chunks);
    uint64_t clusters = 0, units = 0, indexed = 0;
    for (uint32_t h = 0; h < shape_.num_kv_heads(); ++h) {
      const auto& index = streams_[static_cast<size_t>(l) * shape_.num_kv_heads() + h].index;
      if (!index) continue;
      clusters += index->num_clusters();
      units += index->num_units();
      indexed += index->num_chunks();
    }
    st.set_clusters(clusters);
    st.set_units(units);
    st.set_indexed_chunks(indexed);
    st.set_depth(indexed ? 2 : 0);  // coarse units, then fine clusters
    st.set_select_candidates(select_candidates_[l]);
    st.set_select_chunks_scored(select_scored_[l]);
  }
  return out;
}

}  // namespace kvtier
