#include "server/config/shape.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "server/common/error.h"
#include "server/config/policy.h"

namespace kvtier {

absl::StatusOr<v1::ModelShape> ResolveShape(const v1::ModelShape& in) {
  v1::ModelShape s = in;
  if (s.num_layers() == 0 || s.num_layers() > kMaxLayers) {
    return InvalidField("shape.num_layers",
                        absl::StrFormat("%d is outside [1, %d]", s.num_layers(), kMaxLayers));
  }
  if (s.num_kv_heads() == 0 || s.num_kv_heads() > kMaxKvHeads) {
    return InvalidField("shape.num_kv_heads",
                        absl::StrFormat("%d is outside [1, %d]", s.num_kv_heads(), kMaxKvHeads));
  }
  if (uint64_t{s.num_layers()} * s.num_kv_heads() > kMaxStreams) {
    return InvalidField("shape.num_kv_heads",
                        absl::StrFormat("%d KV heads in each of %d layers make %d streams; at "
                                        "most %d per session",
                                        s.num_kv_heads(), s.num_layers(),
                                        uint64_t{s.num_layers()} * s.num_kv_heads(), kMaxStreams));
  }
  if (s.num_q_heads() == 0 || s.num_q_heads() % s.num_kv_heads() != 0) {
    return InvalidField("shape.num_q_heads",
                        absl::StrFormat("%d is not a positive multiple of num_kv_heads %d",
                                        s.num_q_heads(), s.num_kv_heads()));
  }
  if (s.num_q_heads() / s.num_kv_heads() > kMaxQueryGroup) {
    return InvalidField("shape.num_q_heads", "more than 256 query heads per KV head");
  }
  if (s.head_dim() == 0 || s.head_dim() > kMaxHeadDim) {
    return InvalidField("shape.head_dim",
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
      return InvalidField(
          "shape.dtype",
          absl::StrCat(v1::DType_Name(s.dtype()), " is not stored; send DTYPE_FP16 or DTYPE_BF16"));
  }
  return s;
}

}  // namespace kvtier
