// The checks a request passes before any session state is read: sizes against the model
// shape, finite values, fields within the daemon's limits. Each error is INVALID_ARGUMENT and
// names the field.
#ifndef KVTIER_SERVER_SESSION_REQUESTS_H_
#define KVTIER_SERVER_SESSION_REQUESTS_H_

#include <cstdint>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "kvtier/v1/kvtier.pb.h"

namespace kvtier {

// The layer, num_tokens, and the sizes of keys, values and token_ids (`staged`: the bytes are
// a staging area's range, whose sizes the caller checked).
absl::Status CheckAppend(const v1::ModelShape& shape, const v1::AppendKVRequest& req, bool staged);
// That every key and value is finite, or the first that is not, by field, element, kv_head,
// token and channel. `keys` and `values` are where the append's bytes are (req's own fields,
// or a staging area's range), of the sizes CheckAppend passed. The append path checks them as
// it copies them (CopyFinite); this names the value once that fails.
absl::Status CheckAppendFinite(const v1::ModelShape& shape, const v1::AppendKVRequest& req,
                               const uint8_t* keys, const uint8_t* values);

// The layer, the query's size and finiteness, the placement, and lease_ms against
// `max_lease_ms` (0 takes `default_lease_ms`). Returns the query as floats.
absl::StatusOr<std::vector<float>> CheckSelect(const v1::ModelShape& shape,
                                               const v1::SelectRequest& req,
                                               uint32_t default_lease_ms, uint32_t max_lease_ms);

// What replies may still take of `limit` (--max_message_size, or a channel's response area).
// A Select takes its reply's bound from `left` under the same hold of its session's lock as
// its work, so an append between the check and the work cannot grow the reply past it, and
// the replies of one batch, taking from one room, never pass `limit` together.
struct ReplyRoom {
  uint64_t limit;
  uint64_t left;
};

// Takes `bound` bytes of `room`, or RESOURCE_EXHAUSTED naming `what`, the bound and the limit
// (and changes nothing).
absl::Status TakeReplyRoom(std::string_view what, uint64_t bound, ReplyRoom* room);

}  // namespace kvtier

#endif  // KVTIER_SERVER_SESSION_REQUESTS_H_
