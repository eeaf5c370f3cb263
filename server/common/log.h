// Structured logging: spdlog with key=value messages, e.g.
//   KVLOG(info, "session.create", "id={} tenant={} layers={}", id, tenant, layers);
#ifndef KVTIER_SERVER_COMMON_LOG_H_
#define KVTIER_SERVER_COMMON_LOG_H_

#include <string>

#include "absl/status/status.h"
#include "spdlog/spdlog.h"

namespace kvtier {

// Sets the process-wide level: trace, debug, info, warn, error. INVALID_ARGUMENT otherwise.
absl::Status SetLogLevel(const std::string& level);

}  // namespace kvtier

#define KVLOG(level, event, fmt, ...) \
  ::spdlog::level("event=" event " " fmt __VA_OPT__(, ) __VA_ARGS__)

#endif  // KVTIER_SERVER_COMMON_LOG_H_
