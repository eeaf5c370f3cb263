#include "server/common/log.h"

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "server/common/names.h"

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

std::string LogValue(absl::string_view value) {
  if (IsName(value, "_.:/@+-", value.size())) return std::string(value);
  return absl::StrCat("\"", absl::CHexEscape(value), "\"");
}

}  // namespace kvtier
