// Promotion: making a layer's chosen chunks readable in fp16 on the tier a Select asks for. A
// warm chunk on the host already is; a cold one needs its dequantized copy there, and device
// placement a device copy. Copies come from the tier's PromotionCache, which makes room by its
// eviction policy, and are kept by the chunk (Chunk::copies).
#ifndef KVTIER_SERVER_SESSION_PROMOTION_H_
#define KVTIER_SERVER_SESSION_PROMOTION_H_

#include <cstddef>
#include <span>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "server/session/stream.h"
#include "server/tier/promotion_cache.h"

namespace kvtier {

struct PromotionTarget {
  PromotionCache* cache;  // over the host tier or the device tier
  bool to_device;
  const TierAccount& account;                    // of the cache's tier
  const std::shared_ptr<CopyTally>& copy_bytes;  // where the new copies count
  ChunkFormat format;
  uint32_t layer;  // of the chunks promoted (their ids name them in an error)
};

// The fp16-readable slot of each chunk of `chosen` ([kv_head] -> chunk indices of `heads`),
// promoting the chunks that have none: all or nothing (RESOURCE_EXHAUSTED, with the tier's
// ErrorReason, when the cache cannot make room). `prefetch` marks the new copies as promoted
// ahead and only peeks at those already there; `promoted`, when given, receives how many
// copies were made.
absl::StatusOr<std::vector<std::vector<SlotRef>>> Readable(
    const PromotionTarget& target, std::span<Stream> heads,
    const std::vector<std::vector<uint32_t>>& chosen, bool prefetch, size_t* promoted = nullptr);

}  // namespace kvtier

#endif  // KVTIER_SERVER_SESSION_PROMOTION_H_
