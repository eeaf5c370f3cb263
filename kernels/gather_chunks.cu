#include "kernels/gather_chunks.h"

namespace kvtier {
namespace {

// One block per entry. Chunks are whole rows of 2-byte values, so 16-byte vector copies
// apply when both ends are 16-byte aligned (slots are); a byte loop finishes any tail.
__global__ void GatherChunksKernel(const GatherEntry* __restrict__ entries) {
  const GatherEntry e = entries[blockIdx.x];
  const bool aligned =
      ((reinterpret_cast<uintptr_t>(e.src) | reinterpret_cast<uintptr_t>(e.dst)) & 15) == 0;
  uint64_t done = 0;
  if (aligned) {
    const uint64_t vecs = e.bytes / 16;
    const uint4* s = reinterpret_cast<const uint4*>(e.src);
    uint4* d = reinterpret_cast<uint4*>(e.dst);
    for (uint64_t i = threadIdx.x; i < vecs; i += blockDim.x) d[i] = s[i];
    done = vecs * 16;
  }
  for (uint64_t i = done + threadIdx.x; i < e.bytes; i += blockDim.x) e.dst[i] = e.src[i];
}

}  // namespace

cudaError_t GatherChunks(const GatherEntry* entries, int num_entries, cudaStream_t stream) {
  if (num_entries <= 0) return cudaSuccess;
  GatherChunksKernel<<<num_entries, 256, 0, stream>>>(entries);
  return cudaGetLastError();
}

}  // namespace kvtier
