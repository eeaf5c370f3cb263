#include "server/common/log.h"

#include <cctype>

#include "absl/strings/escaping.h"
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

std::string LogValue(absl::string_view value) {
  bool plain = !value.empty();
  for (unsigned char c : value) {
    plain = plain && (std::isalnum(c) || std::string_view("_.:/@+-").find(static_cast<char>(c)) !=
                                             std::string_view::npos);
  }
  if (plain) return std::string(value);
  return absl::StrCat("\"", absl::CHexEscape(value), "\"");
}

}  // namespace kvtier
