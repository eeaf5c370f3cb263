// Character-class checks for names (instances, session ids, metric names). Plain loops, not
// std::regex: cheaper on request paths, and no locale cache shared between threads.
#ifndef KVTIER_SERVER_COMMON_NAMES_H_
#define KVTIER_SERVER_COMMON_NAMES_H_

#include <cstddef>

#include "absl/strings/ascii.h"
#include "absl/strings/string_view.h"

namespace kvtier {

// A tenant's name: 1..kMaxTenantName of letters, digits and kTenantExtra, so that it is safe in
// a log line and a metric label.
inline constexpr size_t kMaxTenantName = 128;
inline constexpr char kTenantExtra[] = "_.:@-";
// The rule as an error message states it.
inline constexpr char kTenantRule[] = "must be 1..128 of [A-Za-z0-9_.:@-]";

// 1..max_len characters, each an ASCII letter, digit, or one of `extra`.
inline bool IsName(absl::string_view s, absl::string_view extra, size_t max_len) {
  if (s.empty() || s.size() > max_len) return false;
  for (char c : s) {
    if (!absl::ascii_isalnum(static_cast<unsigned char>(c)) &&
        extra.find(c) == absl::string_view::npos) {
      return false;
    }
  }
  return true;
}

inline bool IsTenantName(absl::string_view s) { return IsName(s, kTenantExtra, kMaxTenantName); }

}  // namespace kvtier

#endif  // KVTIER_SERVER_COMMON_NAMES_H_
