// GPU: the quantize and dequantize kernels are bit-identical to the CPU reference, for many
// chunks per launch (dequantize as a gather into fp16 slots). Skips without a GPU; the CPU
// twin is quant_test.
#include <cuda_runtime.h>

#include <cstring>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/chunk_layout.h"
#include "kernels/quant.h"
#include "tests/gpu_test_util.h"

namespace kvtier {
namespace {

using testing::HaveGpu;

TEST(QuantGpu, BitIdenticalToReference) {
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device here; the CPU twin is quant_test";
  std::mt19937 rng(17);
  std::normal_distribution<float> g(0, 1);
  for (uint32_t bits : {4u, 8u}) {
    for (uint32_t d : {64u, 80u, 128u, 256u, 36u}) {
      for (uint32_t n : {1u, 3u, 7u, 16u, 33u}) {  // 33: three key spans
        const QuantLayout L{d, n, bits};
        const ChunkLayout F{d, n};
        const int chunks = 41;
        const uint64_t fb = ChunkLayout::SlotBytes(d, 33), qb = L.Bytes();
        std::vector<uint8_t> fp16(fb * chunks), want_q(qb * chunks), want_f(fb * chunks, 0);
        for (int c = 0; c < chunks; ++c) {
          auto* h = reinterpret_cast<uint16_t*>(&fp16[c * fb]);
          for (uint64_t i = 0; i < 2ull * n * d; ++i) {
            float scale = (i % d) % 16 == 3 ? 30.f : 1.f;  // outlier channels
            h[i] = FloatToHalf(c % 5 == 0 ? 1.25f : g(rng) * scale);
          }
          QuantizeChunkReference(h, h + n * d, L, &want_q[c * qb]);
          auto* o = reinterpret_cast<uint16_t*>(&want_f[c * fb]);
          DequantizeChunkReference(&want_q[c * qb], L, o, o + n * d);
        }
        uint8_t *dfp, *dq, *dout;
        DeviceQuantJob* djobs;
        ASSERT_EQ(cudaMalloc(&dfp, fp16.size()), cudaSuccess);
        ASSERT_EQ(cudaMalloc(&dq, want_q.size()), cudaSuccess);
        ASSERT_EQ(cudaMalloc(&dout, want_f.size()), cudaSuccess);
        ASSERT_EQ(cudaMalloc(&djobs, sizeof(DeviceQuantJob) * chunks), cudaSuccess);
        ASSERT_EQ(cudaMemcpy(dfp, fp16.data(), fp16.size(), cudaMemcpyHostToDevice), cudaSuccess);
        ASSERT_EQ(cudaMemset(dq, 0xcd, want_q.size()), cudaSuccess);
        ASSERT_EQ(cudaMemset(dout, 0, want_f.size()), cudaSuccess);
        std::vector<DeviceQuantJob> jobs(chunks);
        for (int c = 0; c < chunks; ++c) jobs[c] = {dfp + c * fb, dq + c * qb};
        ASSERT_EQ(
            cudaMemcpy(djobs, jobs.data(), sizeof(DeviceQuantJob) * chunks, cudaMemcpyHostToDevice),
            cudaSuccess);
        ASSERT_EQ(QuantizeChunks(djobs, chunks, L, nullptr), cudaSuccess);
        ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
        std::vector<uint8_t> got_q(want_q.size());
        ASSERT_EQ(cudaMemcpy(got_q.data(), dq, got_q.size(), cudaMemcpyDeviceToHost), cudaSuccess);
        EXPECT_EQ(got_q, want_q) << "quantize d " << d << " n " << n << " bits " << bits;
        // Dequantize as a gather: chunk c into slot (c * 7) % chunks.
        for (int c = 0; c < chunks; ++c) jobs[c] = {dout + ((c * 7) % chunks) * fb, dq + c * qb};
        ASSERT_EQ(
            cudaMemcpy(djobs, jobs.data(), sizeof(DeviceQuantJob) * chunks, cudaMemcpyHostToDevice),
            cudaSuccess);
        ASSERT_EQ(DequantizeChunks(djobs, chunks, L, nullptr), cudaSuccess);
        ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
        std::vector<uint8_t> got_f(want_f.size());
        ASSERT_EQ(cudaMemcpy(got_f.data(), dout, got_f.size(), cudaMemcpyDeviceToHost),
                  cudaSuccess);
        for (int c = 0; c < chunks; ++c) {
          const int slot = (c * 7) % chunks;
          ASSERT_EQ(0, std::memcmp(&got_f[slot * fb], &want_f[c * fb], F.bytes()))
              << "dequantize d " << d << " n " << n << " bits " << bits << " chunk " << c;
        }
        cudaFree(dfp);
        cudaFree(dq);
        cudaFree(dout);
        cudaFree(djobs);
      }
    }
  }
}

}  // namespace
}  // namespace kvtier
