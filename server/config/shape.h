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
// Streams (layers x KV heads) per session: each costs its structures before any token comes
// (an 80-layer model with 128 KV heads has 10240).
inline constexpr uint32_t kMaxStreams = 1u << 16;

// Checks a ModelShape and fills its defaults (dtype fp16). INVALID_ARGUMENT names the field.
absl::StatusOr<v1::ModelShape> ResolveShape(const v1::ModelShape& shape);

}  // namespace kvtier

#endif  // KVTIER_SERVER_CONFIG_SHAPE_H_
