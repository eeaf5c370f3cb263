#include "server/common/error.h"

#include <string>

#include "absl/strings/cord.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace kvtier {
namespace {

constexpr absl::string_view kReasonUrl = "type.kvtier.dev/kvtier.ErrorReason";

}  // namespace

absl::Status WithReason(absl::Status status, ErrorReason reason) {
  if (!status.ok() && reason != ErrorReason::kNone) {
    status.SetPayload(kReasonUrl, absl::Cord(absl::StrCat(static_cast<int>(reason))));
  }
  return status;
}

ErrorReason ReasonOf(const absl::Status& status) {
  const auto payload = status.GetPayload(kReasonUrl);
  int value = 0;
  if (!payload || !absl::SimpleAtoi(std::string(*payload), &value)) return ErrorReason::kNone;
  return static_cast<ErrorReason>(value);
}

absl::Status InvalidField(absl::string_view field, absl::string_view why) {
  return absl::InvalidArgumentError(absl::StrCat(field, ": ", why));
}

std::string Quoted(absl::string_view s) {
  if (s.size() <= kQuotedPrefix) return absl::StrCat("\"", s, "\"");
  return absl::StrCat("\"", s.substr(0, kQuotedPrefix), "...\" (", s.size(), " bytes)");
}

}  // namespace kvtier
