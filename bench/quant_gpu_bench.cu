// GPU: quantize and dequantize (gather into fp16 slots) kernel throughput against a
// device-to-device copy of the same fp16 bytes, CUDA events, median of repetitions. Prints
// one JSON object per figure. Self-contained (no gRPC) so scripts/device-check bundles it
// cheaply. Exits 0 with no output but a note when no GPU is present.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <random>
#include <vector>

#include "bench/cuda_check.h"
#include "kernels/chunk_layout.h"
#include "kernels/quant.h"

namespace kvtier {
namespace {

template <typename F>
float Ms(F&& f) {
  cudaEvent_t a, b;
  CHECK_CUDA(cudaEventCreate(&a));
  CHECK_CUDA(cudaEventCreate(&b));
  CHECK_CUDA(cudaEventRecord(a));
  f();
  CHECK_CUDA(cudaEventRecord(b));
  CHECK_CUDA(cudaEventSynchronize(b));
  float ms = 0;
  CHECK_CUDA(cudaEventElapsedTime(&ms, a, b));
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return ms;
}

float Median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

void Run(uint32_t d, uint32_t bits, int chunks) {
  const QuantLayout L{d, 16, bits};
  const uint64_t fb = ChunkLayout::SlotBytes(d, 16), qb = L.Bytes();
  std::vector<uint16_t> host(fb / 2 * chunks);
  std::mt19937 rng(d);
  std::normal_distribution<float> g(0, 1);
  for (auto& h : host) h = FloatToHalf(g(rng));
  uint8_t *fp, *q, *out, *copy;
  DeviceQuantJob *dq, *dd;
  CHECK_CUDA(cudaMalloc(&fp, fb * chunks));
  CHECK_CUDA(cudaMalloc(&out, fb * chunks));
  CHECK_CUDA(cudaMalloc(&copy, fb * chunks));
  CHECK_CUDA(cudaMalloc(&q, qb * chunks));
  CHECK_CUDA(cudaMalloc(&dq, sizeof(DeviceQuantJob) * chunks));
  CHECK_CUDA(cudaMalloc(&dd, sizeof(DeviceQuantJob) * chunks));
  CHECK_CUDA(cudaMemcpy(fp, host.data(), fb * chunks, cudaMemcpyHostToDevice));
  std::vector<DeviceQuantJob> jq(chunks), jd(chunks);
  for (int c = 0; c < chunks; ++c) {
    jq[c] = {fp + c * fb, q + c * qb};
    jd[c] = {out + ((c * 7919) % chunks) * fb, q + c * qb};  // a scattered gather
  }
  CHECK_CUDA(cudaMemcpy(dq, jq.data(), sizeof(DeviceQuantJob) * chunks, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(dd, jd.data(), sizeof(DeviceQuantJob) * chunks, cudaMemcpyHostToDevice));
  const double bytes = 2.0 * 16 * d * 2 * chunks;  // fp16 K and V of every chunk
  std::vector<float> tq, td, tc;
  for (int rep = 0; rep < 11; ++rep) {
    tq.push_back(Ms([&] { CHECK_CUDA(QuantizeChunks(dq, chunks, L, nullptr)); }));
    td.push_back(Ms([&] { CHECK_CUDA(DequantizeChunks(dd, chunks, L, nullptr)); }));
    tc.push_back(Ms([&] {
      CHECK_CUDA(cudaMemcpyAsync(copy, fp, static_cast<size_t>(bytes), cudaMemcpyDeviceToDevice));
    }));
  }
  const double copy_gbs = bytes / (Median(tc) * 1e-3) / 1e9;
  for (auto [name, t] :
       {std::pair{"quantize_gpu", Median(tq)}, std::pair{"dequantize_gpu", Median(td)}}) {
    const double gbs = bytes / (t * 1e-3) / 1e9;
    std::printf(
        "{\"name\": \"%s\", \"value\": %.4g, \"unit\": \"GB/s\", \"baseline\": %.4g, "
        "\"baseline_name\": \"device_to_device_copy\", \"ratio\": %.4f, \"parameters\": "
        "{\"head_dim\": %u, \"bits\": %u, \"chunk_tokens\": 16, \"chunks\": %d, "
        "\"reps\": 11, \"target_ratio\": 0.7}}\n",
        name, gbs, copy_gbs, gbs / copy_gbs, d, bits, chunks);
  }
  cudaFree(fp);
  cudaFree(out);
  cudaFree(copy);
  cudaFree(q);
  cudaFree(dq);
  cudaFree(dd);
}

}  // namespace
}  // namespace kvtier

int main() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
    std::fprintf(stderr, "quant_gpu_bench: no CUDA device\n");
    return 0;
  }
  for (uint32_t d : {64u, 128u}) kvtier::Run(d, 4, 65536);
  kvtier::Run(128, 8, 65536);
  return 0;
}
