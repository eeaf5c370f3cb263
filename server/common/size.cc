#include "server/common/size.h"

#include <algorithm>
#include <cctype>
#include <limits>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"

namespace kvtier {

absl::StatusOr<uint64_t> ParseSize(absl::string_view text, absl::string_view field) {
  absl::string_view s = absl::StripAsciiWhitespace(text);
  if (s.empty()) {
    return absl::InvalidArgumentError(absl::StrFormat("%s: empty size", field));
  }
  uint64_t mult = 1;
  char last = absl::ascii_toupper(s.back());
  if (!std::isdigit(static_cast<unsigned char>(last))) {
    switch (last) {
      case 'K':
        mult = 1ull << 10;
        break;
      case 'M':
        mult = 1ull << 20;
        break;
      case 'G':
        mult = 1ull << 30;
        break;
      case 'T':
        mult = 1ull << 40;
        break;
      default:
        return absl::InvalidArgumentError(absl::StrFormat(
            "%s: size \"%s\" has suffix '%c'; use bytes with an optional K, M, G or T", field, text,
            s.back()));
    }
    s.remove_suffix(1);
  }
  uint64_t n = 0;
  if (s.empty() || !absl::SimpleAtoi(s, &n)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: size \"%s\" is not a whole number of bytes", field, text));
  }
  if (n > std::numeric_limits<uint64_t>::max() / mult) {
    return absl::InvalidArgumentError(absl::StrFormat("%s: size \"%s\" overflows", field, text));
  }
  return n * mult;
}

std::string FormatBytes(uint64_t bytes) {
  static constexpr const char* kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(bytes);
  int u = 0;
  while (v >= 1024.0 && u < 4) {
    v /= 1024.0;
    ++u;
  }
  if (u == 0) return absl::StrFormat("%d B", bytes);
  return absl::StrFormat("%.1f %s", v, kUnits[u]);
}

bool ClaimBytes(std::atomic<uint64_t>* used, uint64_t bytes, uint64_t limit, uint64_t* seen) {
  uint64_t now = used->load(std::memory_order_relaxed);
  do {
    if (bytes > limit - std::min(now, limit)) {
      *seen = now;
      return false;
    }
  } while (!used->compare_exchange_weak(now, now + bytes, std::memory_order_relaxed));
  return true;
}

}  // namespace kvtier
