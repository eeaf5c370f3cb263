// Gather: copy many chunks (each a K-then-V run, see chunk_layout.h) from source slots to
// destination slots in one launch. This is the promotion step of the device tier: selected
// chunks go from host slots (pinned, mapped) into device slots.
#ifndef KVTIER_KERNELS_GATHER_CHUNKS_H_
#define KVTIER_KERNELS_GATHER_CHUNKS_H_

#include <cstdint>

namespace kvtier {

struct GatherEntry {
  const uint8_t* src;  // a chunk's bytes: [2][num_tokens][head_dim] 2-byte values
  uint8_t* dst;        // a slot of at least `bytes`
  uint64_t bytes;      // ChunkLayout::bytes()
};

// CPU reference: copies every entry. Entries must not overlap.
void GatherChunksReference(const GatherEntry* entries, int num_entries);

}  // namespace kvtier

#if defined(KVTIER_WITH_CUDA) || defined(__CUDACC__)
#include <cuda_runtime.h>
namespace kvtier {
// `entries` lives in device memory ([num_entries]); src and dst are device-accessible
// (device memory, or pinned host memory mapped for the device). One block per entry.
// Returns the launch error, if any.
cudaError_t GatherChunks(const GatherEntry* entries, int num_entries, cudaStream_t stream);
}  // namespace kvtier
#endif

#endif  // KVTIER_KERNELS_GATHER_CHUNKS_H_
