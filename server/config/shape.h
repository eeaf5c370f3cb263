// The model shape of a session: checked, with its defaults filled in. Used by CreateSession
// and by records restored from the remote tier.
#ifndef KVTIER_SERVER_CONFIG_SHAPE_H_
#define KVTIER_SERVER_CONFIG_SHAPE_H_

#include <cstdint>

#include "absl/status/statusor.h"
#include "kvtier/v1/kvtier.pb.h"

namespace kvtier {

inline constexpr uint32_t kMaxLayers = 1u << 12;
inline constexpr uint32_t kMaxKvHeads = 1u << 12;
inline constexpr uint32_t kMaxQueryGroup = 256;  // query heads per KV head

// Checks a ModelShape and fills its defaults (dtype fp16). INVALID_ARGUMENT names the field.
absl::StatusOr<v1::ModelShape> ResolveShape(const v1::ModelShape& shape);

}  // namespace kvtier

#endif  // KVTIER_SERVER_CONFIG_SHAPE_H_
