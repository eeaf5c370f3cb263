#include "server/session/requests.h"

#include <cmath>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "server/common/error.h"
#include "server/quant/chunk_quant.h"

namespace kvtier {
namespace {

absl::Status CheckLayer(const v1::ModelShape& shape, uint32_t layer) {
  if (layer < shape.num_layers()) return absl::OkStatus();
  return InvalidField("layer", absl::StrFormat("%d is outside [0, %d)", layer, shape.num_layers()));
}

}  // namespace

absl::Status CheckAppend(const v1::ModelShape& shape, const v1::AppendKVRequest& req, bool staged) {
  const uint32_t kvh = shape.num_kv_heads();
  const uint64_t rb = uint64_t{shape.head_dim()} * 2;
  if (absl::Status s = CheckLayer(shape, req.layer()); !s.ok()) return s;
  const uint64_t n = req.num_tokens();
  if (n == 0) return InvalidField("num_tokens", "0; an append carries at least one token");
  const uint64_t want = kvh * n * rb;
  if (!staged && req.keys().size() != want) {
    return InvalidField("keys", absl::StrFormat("%d bytes; [num_kv_heads %d][num_tokens %d]"
                                                "[head_dim %d] of 2-byte values is %d bytes",
                                                req.keys().size(), kvh, n, shape.head_dim(), want));
  }
  if (!staged && req.values().size() != want) {
    return InvalidField("values",
                        absl::StrFormat("%d bytes; expected %d", req.values().size(), want));
  }
  if (req.token_ids_size() != 0 && static_cast<uint64_t>(req.token_ids_size()) != n) {
    return InvalidField("token_ids",
                        absl::StrFormat("%d ids for %d tokens", req.token_ids_size(), n));
  }
  return absl::OkStatus();
}

absl::Status CheckAppendFinite(const v1::ModelShape& shape, const v1::AppendKVRequest& req,
                               const uint8_t* keys, const uint8_t* values) {
  const uint64_t n = req.num_tokens();
  const uint64_t want = uint64_t{shape.num_kv_heads()} * n * shape.head_dim() * 2;
  for (const auto& [field, bytes] : {std::pair{"keys", keys}, {"values", values}}) {
    const auto* h = reinterpret_cast<const uint16_t*>(bytes);
    const int64_t bad = FindNonFinite(
        shape.dtype() == v1::DTYPE_BF16 ? HalfKind::kBf16 : HalfKind::kFp16, h, want / 2);
    if (bad >= 0) {
      const uint64_t d = shape.head_dim();
      return InvalidField(
          field, absl::StrFormat("element %d (kv_head %d, token %d, channel %d)"
                                 " is Inf or NaN",
                                 bad, bad / (n * d), req.start_token() + bad / d % n, bad % d));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<float>> CheckSelect(const v1::ModelShape& shape,
                                               const v1::SelectRequest& req,
                                               uint32_t default_lease_ms, uint32_t max_lease_ms) {
  const int d = static_cast<int>(shape.head_dim());
  if (absl::Status s = CheckLayer(shape, req.layer()); !s.ok()) return s;
  const size_t want = static_cast<size_t>(shape.num_q_heads()) * d * sizeof(float);
  if (req.query().size() != want) {
    return InvalidField("query",
                        absl::StrFormat("%d bytes; fp32 [num_q_heads %d][head_dim %d] is %d",
                                        req.query().size(), shape.num_q_heads(), d, want));
  }
  std::vector<float> q(want / sizeof(float));
  std::memcpy(q.data(), req.query().data(), want);
  for (size_t i = 0; i < q.size(); ++i) {
    if (!std::isfinite(q[i])) {
      return InvalidField("query", absl::StrFormat("element %d is not finite", i));
    }
  }
  switch (req.placement()) {
    case v1::TIER_UNSPECIFIED:
    case v1::TIER_HOST:
    case v1::TIER_DEVICE:
      break;
    default:
      return InvalidField("placement", absl::StrCat(v1::Tier_Name(req.placement()),
                                                    " is not readable by workers; use "
                                                    "TIER_DEVICE or TIER_HOST"));
  }
  const uint32_t ttl = req.lease_ms() ? req.lease_ms() : default_lease_ms;
  if (ttl > max_lease_ms) {
    return InvalidField(
        "lease_ms", absl::StrFormat("%d is above the daemon's max_lease_ms %d", ttl, max_lease_ms));
  }
  return q;
}

absl::Status TakeReplyRoom(std::string_view what, uint64_t bound, ReplyRoom* room) {
  if (bound <= room->left) {
    room->left -= bound;
    return absl::OkStatus();
  }
  const std::string before =
      room->left < room->limit
          ? absl::StrFormat(" (%d bytes of it left for this reply)", room->left)
          : "";
  return absl::ResourceExhaustedError(absl::StrFormat(
      "%s: a reply of up to %d bytes would pass max_message_size %d%s; ask for less (a smaller "
      "budget, no include_data, fewer requests per batch)",
      what, bound, room->limit, before));
}

}  // namespace kvtier
