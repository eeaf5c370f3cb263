// What the daemon's errors carry beyond a code and a message.
//
// A message is for people: it names the field or the limit, and nothing branches on its text.
// Where a caller must tell one failure from another of the same code (a full tier, which an
// idle session's demotion can relieve, from a tenant's quota, which it cannot), the status
// carries an ErrorReason as its payload, set where the failure happens and read where it is
// handled. A reason survives any code that passes the status on unchanged; a status rebuilt
// with a new message (the gRPC edge, a field prefix) leaves it behind.
#ifndef KVTIER_SERVER_COMMON_ERROR_H_
#define KVTIER_SERVER_COMMON_ERROR_H_

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace kvtier {

enum class ErrorReason {
  kNone = 0,
  kHostTierFull,    // RESOURCE_EXHAUSTED: the host tier's capacity
  kDeviceTierFull,  // RESOURCE_EXHAUSTED: the device tier's capacity
  kQuota,           // RESOURCE_EXHAUSTED: the tenant's quota on a tier
  kSessionMoved,    // UNAVAILABLE: the session moved to the remote tier while the call waited
};

// `status` with `reason` attached (an OK status stays OK and carries nothing).
absl::Status WithReason(absl::Status status, ErrorReason reason);
// The reason `status` carries, kNone if none.
ErrorReason ReasonOf(const absl::Status& status);

// INVALID_ARGUMENT "<field>: <why>".
absl::Status InvalidField(absl::string_view field, absl::string_view why);

// What an error message may quote of a caller's string (an id, a tenant, a label).
inline constexpr size_t kQuotedPrefix = 128;
// `s` in double quotes, whole when it has at most kQuotedPrefix bytes, else its first
// kQuotedPrefix bytes, "...", and its length: a message never carries more than that of it.
std::string Quoted(absl::string_view s);

}  // namespace kvtier

#endif  // KVTIER_SERVER_COMMON_ERROR_H_
