// Structured logging: spdlog with key=value messages, e.g.
//   KVLOG(info, "session.create", "id={} tenant={} layers={}", id, LogValue(tenant), layers);
// A value a caller chose (a tenant, an error message, a key) goes through LogValue, so that
// it cannot end its field or forge another.
#ifndef KVTIER_SERVER_COMMON_LOG_H_
#define KVTIER_SERVER_COMMON_LOG_H_

#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "spdlog/spdlog.h"

namespace kvtier {

// Sets the process-wide level: trace, debug, info, warn, error. INVALID_ARGUMENT otherwise.
absl::Status SetLogLevel(const std::string& level);

// How each line is written: logfmt ("ts=2026-01-02T03:04:05.678Z level=info event=x k=v", the
// time in UTC) or one JSON object per line ({"ts": ..., "level": ..., "event": ..., "k": ...}).
// The default is logfmt.
enum class LogFormat { kLogfmt, kJson };
void SetLogFormat(LogFormat format);
// The JSON line for one logfmt message (the part after ts= and level=), at `unix_ms`: each
// key=value field a string member, quoted values unescaped. Used by the json format; public
// for its test.
std::string LogfmtToJson(absl::string_view message, absl::string_view level, int64_t unix_ms);

// `value` as one key=value field's value: as it is when it is non-empty and all of
// [A-Za-z0-9_.:/@+-], else in double quotes with quotes, backslashes and bytes outside
// printable ASCII escaped (C style: \", \\, \n, \x1b).
std::string LogValue(absl::string_view value);

}  // namespace kvtier

#define KVLOG(level, event, fmt, ...) \
  ::spdlog::level("event=" event " " fmt __VA_OPT__(, ) __VA_ARGS__)

#endif  // KVTIER_SERVER_COMMON_LOG_H_
