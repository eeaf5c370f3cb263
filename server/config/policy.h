// Session policy: defaults filled in, then checked. Used by the config (the daemon's defaults)
// and by sessions (each CreateSession and SetPolicy).
#ifndef KVTIER_SERVER_CONFIG_POLICY_H_
#define KVTIER_SERVER_CONFIG_POLICY_H_

#include "absl/status/statusor.h"
#include "kvtier/v1/kvtier.pb.h"

namespace kvtier {

inline constexpr uint32_t kMaxChunkTokens = 64;
inline constexpr uint32_t kMaxHeadDim = 512;
// Token-level refinement scores at most this many times the budget's rows.
inline constexpr uint32_t kMaxRefineFactor = 64;

// The built-in defaults: sinks 16, window 64, budget 256, dense layers 2, int4 cold
// precision, contiguous 16-token chunks, LSE-peak ranking, no token-level refinement.
v1::SessionPolicy BuiltinPolicy();

// Every zero or unspecified field of `requested` takes the value in `defaults`; then the
// result is checked. INVALID_ARGUMENT names the field (prefixed by `field`, e.g. "policy").
absl::StatusOr<v1::SessionPolicy> ResolvePolicy(const v1::SessionPolicy& requested,
                                                const v1::SessionPolicy& defaults,
                                                absl::string_view field);

}  // namespace kvtier

#endif  // KVTIER_SERVER_CONFIG_POLICY_H_
