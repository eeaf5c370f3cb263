#include "server/common/log.h"

#include <chrono>
#include <memory>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/time.h"
#include "server/common/names.h"
#include "spdlog/pattern_formatter.h"

namespace kvtier {
namespace {

// A JSON string literal of `s` (UTF-8 passed through, control bytes as \u00XX).
void AppendJsonString(absl::string_view s, std::string* out) {
  out->push_back('"');
  for (unsigned char ch : s) {
    switch (ch) {
      case '"':
        *out += "\\\"";
        break;
      case '\\':
        *out += "\\\\";
        break;
      case '\n':
        *out += "\\n";
        break;
      case '\t':
        *out += "\\t";
        break;
      case '\r':
        *out += "\\r";
        break;
      default:
        if (ch < 0x20 || ch == 0x7f) {
          absl::StrAppendFormat(out, "\\u%04x", ch);
        } else {
          out->push_back(static_cast<char>(ch));
        }
    }
  }
  out->push_back('"');
}

class JsonFormatter final : public spdlog::formatter {
 public:
  void format(const spdlog::details::log_msg& msg, spdlog::memory_buf_t& dest) override {
    const int64_t ms =
        std::chrono::duration_cast<std::chrono::milliseconds>(msg.time.time_since_epoch()).count();
    const auto level = spdlog::level::to_string_view(msg.level);
    const std::string line = LogfmtToJson(absl::string_view(msg.payload.data(), msg.payload.size()),
                                          absl::string_view(level.data(), level.size()), ms);
    dest.append(line.data(), line.data() + line.size());
    dest.push_back('\n');
  }
  std::unique_ptr<spdlog::formatter> clone() const override {
    return std::make_unique<JsonFormatter>();
  }
};

LogFormat g_format = LogFormat::kLogfmt;

void ApplyFormat() {
  if (g_format == LogFormat::kJson) {
    spdlog::set_formatter(std::make_unique<JsonFormatter>());
  } else {
    spdlog::set_formatter(std::make_unique<spdlog::pattern_formatter>(
        "ts=%Y-%m-%dT%H:%M:%S.%eZ level=%l %v", spdlog::pattern_time_type::utc));
  }
}

}  // namespace

void SetLogFormat(LogFormat format) {
  g_format = format;
  ApplyFormat();
}

absl::Status SetLogLevel(const std::string& level) {
  auto l = spdlog::level::from_str(level);
  if (l == spdlog::level::off && level != "off") {
    return absl::InvalidArgumentError(
        absl::StrCat("log_level: \"", level, "\" is not one of trace, debug, info, warn, error"));
  }
  spdlog::set_level(l);
  ApplyFormat();
  return absl::OkStatus();
}

std::string LogfmtToJson(absl::string_view message, absl::string_view level, int64_t unix_ms) {
  std::string out = "{\"ts\": ";
  AppendJsonString(
      absl::FormatTime("%Y-%m-%dT%H:%M:%E3SZ", absl::FromUnixMillis(unix_ms), absl::UTCTimeZone()),
      &out);
  out += ", \"level\": ";
  AppendJsonString(level, &out);
  size_t i = 0;
  while (i < message.size()) {
    while (i < message.size() && message[i] == ' ') ++i;
    if (i == message.size()) break;
    const size_t eq = message.find('=', i);
    const size_t space = message.find(' ', i);
    if (eq == absl::string_view::npos || (space != absl::string_view::npos && space < eq)) {
      // A word without a value: kept whole, under "msg".
      const size_t end = space == absl::string_view::npos ? message.size() : space;
      out += ", \"msg\": ";
      AppendJsonString(message.substr(i, end - i), &out);
      i = end;
      continue;
    }
    out += ", ";
    AppendJsonString(message.substr(i, eq - i), &out);
    out += ": ";
    i = eq + 1;
    if (i < message.size() && message[i] == '"') {
      // A LogValue: C escapes up to the closing quote that no backslash escapes.
      size_t j = i + 1;
      while (j < message.size() && message[j] != '"') j += message[j] == '\\' ? 2 : 1;
      std::string value;
      const absl::string_view quoted = message.substr(i + 1, std::min(j, message.size()) - i - 1);
      if (!absl::CUnescape(quoted, &value)) value = std::string(quoted);
      AppendJsonString(value, &out);
      i = std::min(j + 1, message.size());
    } else {
      const size_t end = message.find(' ', i);
      AppendJsonString(
          message.substr(i, (end == absl::string_view::npos ? message.size() : end) - i), &out);
      i = end == absl::string_view::npos ? message.size() : end;
    }
  }
  out += "}";
  return out;
}

std::string LogValue(absl::string_view value) {
  if (IsName(value, "_.:/@+-", value.size())) return std::string(value);
  return absl::StrCat("\"", absl::CHexEscape(value), "\"");
}

}  // namespace kvtier
