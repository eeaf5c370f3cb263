// Byte sizes as operators write them: "4096", "64K", "512M", "8G" (powers of 1024).
#ifndef KVTIER_SERVER_COMMON_SIZE_H_
#define KVTIER_SERVER_COMMON_SIZE_H_

#include <atomic>
#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace kvtier {

// Parses SIZE. INVALID_ARGUMENT names `field` on an empty string, a bad suffix, or overflow.
absl::StatusOr<uint64_t> ParseSize(absl::string_view text, absl::string_view field);

// "1.5 GiB", "512 KiB", "17 B": for tables meant for people.
std::string FormatBytes(uint64_t bytes);

// Adds `bytes` to `*used` in one step unless the sum would pass `limit`, so that claims at
// once cannot together pass it. False when it would, `*seen` then the total it saw.
bool ClaimBytes(std::atomic<uint64_t>* used, uint64_t bytes, uint64_t limit, uint64_t* seen);

}  // namespace kvtier

#endif  // KVTIER_SERVER_COMMON_SIZE_H_
