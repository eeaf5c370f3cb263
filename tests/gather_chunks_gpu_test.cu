// GPU: the gather kernel is bit-identical to its CPU reference. Skips without a GPU; the
// CPU twin is gather_chunks_test.
#include <cuda_runtime.h>

#include <cstring>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/chunk_layout.h"
#include "kernels/gather_chunks.h"
#include "tests/gpu_test_util.h"

namespace kvtier {
namespace {

using testing::HaveGpu;

TEST(GatherChunksGpu, BitIdenticalToReference) {
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device here; the CPU twin is gather_chunks_test";
  std::mt19937 rng(5);
  for (uint32_t d : {3u, 64u, 80u, 128u, 256u}) {
    for (uint32_t n : {1u, 7u, 16u}) {
      const ChunkLayout layout{d, n};
      const uint64_t slot = ChunkLayout::SlotBytes(d, 16);
      const int chunks = 37;
      std::vector<uint8_t> src(slot * chunks);
      for (auto& b : src) b = static_cast<uint8_t>(rng());
      uint8_t *dsrc, *ddst;
      ASSERT_EQ(cudaMalloc(&dsrc, src.size()), cudaSuccess);
      ASSERT_EQ(cudaMalloc(&ddst, src.size() + 16), cudaSuccess);
      ASSERT_EQ(cudaMemcpy(dsrc, src.data(), src.size(), cudaMemcpyHostToDevice), cudaSuccess);
      ASSERT_EQ(cudaMemset(ddst, 0xA5, src.size() + 16), cudaSuccess);
      std::vector<uint8_t> want(src.size() + 16, 0xA5);
      std::vector<GatherEntry> host_entries, dev_entries;
      for (int i = 0; i < chunks; ++i) {
        const int from = (i * 11) % chunks;
        // odd destination offsets exercise the unaligned path
        const uint64_t dst_off = i * slot + (i % 3 == 0 ? 1 : 0);
        host_entries.push_back({&src[from * slot], &want[dst_off], layout.bytes()});
        dev_entries.push_back({dsrc + from * slot, ddst + dst_off, layout.bytes()});
      }
      GatherChunksReference(host_entries.data(), chunks);
      GatherEntry* dentries;
      ASSERT_EQ(cudaMalloc(&dentries, sizeof(GatherEntry) * chunks), cudaSuccess);
      ASSERT_EQ(cudaMemcpy(dentries, dev_entries.data(), sizeof(GatherEntry) * chunks,
                           cudaMemcpyHostToDevice),
                cudaSuccess);
      ASSERT_EQ(GatherChunks(dentries, chunks, nullptr), cudaSuccess);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      std::vector<uint8_t> got(want.size());
      ASSERT_EQ(cudaMemcpy(got.data(), ddst, got.size(), cudaMemcpyDeviceToHost), cudaSuccess);
      EXPECT_EQ(got, want) << "d " << d << " n " << n;
      cudaFree(dsrc);
      cudaFree(ddst);
      cudaFree(dentries);
    }
  }
}

}  // namespace
}  // namespace kvtier
