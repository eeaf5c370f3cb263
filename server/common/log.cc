#include "server/common/log.h"

#include "absl/strings/str_cat.h"

namespace kvtier {

absl::Status SetLogLevel(const std::string& level) {
  auto l = spdlog::level::from_str(level);
  if (l == spdlog::level::off && level != "off") {
    return absl::InvalidArgumentError(
        absl::StrCat("log_level: \"", level, "\" is not one of trace, debug, info, warn, error"));
  }
  spdlog::set_level(l);
  spdlog::set_pattern("%Y-%m-%dT%H:%M:%S.%e level=%l %v");
  return absl::OkStatus();
}

}  // namespace kvtier
