// The checks a request passes before any session state is read: sizes against the model
// shape, finite values, fields within the daemon's limits. Each error is INVALID_ARGUMENT and
// names the field.
#ifndef KVTIER_SERVER_SESSION_REQUESTS_H_
#define KVTIER_SERVER_SESSION_REQUESTS_H_

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "kvtier/v1/kvtier.pb.h"

namespace kvtier {

// The layer, num_tokens, the sizes of keys, values and token_ids, and that every key and
// value is finite.
// `keys` and `values` are where the append's bytes are: req's own fields, or (`staged`) a
// staging area's range of the right size, whose sizes the caller checked.
absl::Status CheckAppend(const v1::ModelShape& shape, const v1::AppendKVRequest& req,
                         const uint8_t* keys, const uint8_t* values, bool staged);

// The layer, the query's size and finiteness, the placement, and lease_ms against
// `max_lease_ms` (0 takes `default_lease_ms`). Returns the query as floats.
absl::StatusOr<std::vector<float>> CheckSelect(const v1::ModelShape& shape,
                                               const v1::SelectRequest& req,
                                               uint32_t default_lease_ms, uint32_t max_lease_ms);

}  // namespace kvtier

#endif  // KVTIER_SERVER_SESSION_REQUESTS_H_
