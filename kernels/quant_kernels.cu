// CUDA quantize / dequantize of chunks, bit-identical to QuantizeChunkReference and
// DequantizeChunkReference: the per-element math is the __host__ __device__ code of
// quant_layout.h and half.h, and the library is built with --fmad=false.
#include "kernels/chunk_layout.h"
#include "kernels/quant.h"

namespace kvtier {
namespace {

constexpr int kThreads = 128;
constexpr uint32_t kMaxHeadDim = 512;

// One block per job. Phase 1: each group's range (per key span-channel, per value token-group)
// into shared memory; one thread encodes the keys' parameters and another the values' (the
// header needs every group's range); every thread then decodes them for its codes. Phase 2:
// each thread writes whole code bytes, so no two threads share one.
__global__ void QuantizeKernel(const DeviceQuantJob* __restrict__ jobs, QuantLayout L) {
  __shared__ float key_zero[kMaxKeyGroups], key_inv[kMaxKeyGroups];
  __shared__ float value_zero[kMaxValueGroups], value_inv[kMaxValueGroups];
  __shared__ float key_mx[kMaxKeyGroups], value_mx[kMaxValueGroups];
  const DeviceQuantJob job = jobs[blockIdx.x];
  const uint32_t n = L.num_tokens, d = L.head_dim, G = L.groups(), levels = L.levels();
  const uint32_t K = L.key_groups();
  const ChunkLayout fp{d, n};
  const uint16_t* keys = reinterpret_cast<const uint16_t*>(job.fp16 + fp.key_offset(0));
  const uint16_t* values = reinterpret_cast<const uint16_t*>(job.fp16 + fp.value_offset(0));
  const QuantSections<uint8_t> q(job.quant, L);

  // The ranges: minima into *_zero and maxima into *_mx (the *_inv arrays are EncodeParams'
  // scratch until the parameters are decoded).
  for (uint32_t g = threadIdx.x; g < K; g += blockDim.x) {
    const uint32_t t0 = g / d * kKeySpan, j = g % d;
    GroupRange(keys + t0 * d + j, min(kKeySpan, n - t0), d, &key_zero[g], &key_mx[g]);
  }
  for (uint32_t tg = threadIdx.x; tg < n * G; tg += blockDim.x) {
    const uint32_t t = tg / G, g = tg % G;
    const uint32_t lo = g * kValueGroup, hi = min(d, lo + kValueGroup);
    GroupRange(values + t * d + lo, hi - lo, 1, &value_zero[tg], &value_mx[tg]);
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    EncodeParams(key_zero, key_mx, K, levels, q.key_header, q.key_zero, q.key_scale, key_inv);
  } else if (threadIdx.x == 32) {
    EncodeParams(value_zero, value_mx, n * G, levels, q.value_header, q.value_zero, q.value_scale,
                 value_inv);
  }
  __syncthreads();
  for (uint32_t g = threadIdx.x; g < K; g += blockDim.x) {
    const QuantParams p = DecodeParams(q.key_header, q.key_zero[g], q.key_scale[g]);
    key_zero[g] = p.zero;
    key_inv[g] = p.inv_scale;
  }
  for (uint32_t tg = threadIdx.x; tg < n * G; tg += blockDim.x) {
    const QuantParams p = DecodeParams(q.value_header, q.value_zero[tg], q.value_scale[tg]);
    value_zero[tg] = p.zero;
    value_inv[tg] = p.inv_scale;
  }
  // The alignment padding between sections is zero, as in the reference (the headers'
  // fourth float, written zero by EncodeParams, is padding too).
  for (int r = 0; r < QuantLayout::kPaddings; ++r) {
    uint64_t begin, end;
    L.Padding(r, &begin, &end);
    for (uint64_t b = begin + threadIdx.x; b < end; b += blockDim.x) job.quant[b] = 0;
  }
  __syncthreads();

  const uint32_t per_byte = L.bits == 8 ? 1 : 2;
  const uint64_t bytes = L.code_bytes();
  for (uint64_t b = threadIdx.x; b < bytes; b += blockDim.x) {
    uint32_t kbyte = 0, vbyte = 0;
    for (uint32_t s = 0; s < per_byte; ++s) {
      const uint64_t i = b * per_byte + s;
      if (i >= uint64_t{n} * d) break;
      const uint32_t t = static_cast<uint32_t>(i / d), j = static_cast<uint32_t>(i % d);
      const uint32_t tg = t * G + j / kValueGroup;
      const uint32_t kg = L.key_group(t, j);
      const QuantParams kp{0.f, key_zero[kg], key_inv[kg]};
      const QuantParams vp{0.f, value_zero[tg], value_inv[tg]};
      kbyte |= QuantizeValue(HalfToFloat(keys[i]), kp, levels) << (4 * s);
      vbyte |= QuantizeValue(HalfToFloat(values[i]), vp, levels) << (4 * s);
    }
    q.key_codes[b] = static_cast<uint8_t>(kbyte);
    q.value_codes[b] = static_cast<uint8_t>(vbyte);
  }
}

__global__ void DequantizeKernel(const DeviceQuantJob* __restrict__ jobs, QuantLayout L) {
  const DeviceQuantJob job = jobs[blockIdx.x];
  const uint32_t n = L.num_tokens, d = L.head_dim, G = L.groups();
  const ChunkLayout fp{d, n};
  const QuantSections<const uint8_t> q(job.quant, L);
  uint16_t* keys = reinterpret_cast<uint16_t*>(job.fp16 + fp.key_offset(0));
  uint16_t* values = reinterpret_cast<uint16_t*>(job.fp16 + fp.value_offset(0));
  for (uint64_t i = threadIdx.x; i < uint64_t{n} * d; i += blockDim.x) {
    const uint32_t t = static_cast<uint32_t>(i / d), j = static_cast<uint32_t>(i % d);
    const uint32_t g = t * G + j / kValueGroup, kg = L.key_group(t, j);
    keys[i] =
        DequantizeValue(GetCode(q.key_codes, i, L.bits), ScaleOf(q.key_header, q.key_scale[kg]),
                        ZeroOf(q.key_header, q.key_zero[kg]));
    values[i] = DequantizeValue(GetCode(q.value_codes, i, L.bits),
                                ScaleOf(q.value_header, q.value_scale[g]),
                                ZeroOf(q.value_header, q.value_zero[g]));
  }
}

bool Supported(const QuantLayout& L) {
  return L.head_dim >= 1 && L.head_dim <= kMaxHeadDim && L.num_tokens >= 1 && L.num_tokens <= 64 &&
         (L.bits == 4 || L.bits == 8);
}

}  // namespace

cudaError_t QuantizeChunks(const DeviceQuantJob* jobs, int num_jobs, const QuantLayout& layout,
                           cudaStream_t stream) {
  if (!Supported(layout)) return cudaErrorInvalidValue;
  if (num_jobs <= 0) return cudaSuccess;
  QuantizeKernel<<<num_jobs, kThreads, 0, stream>>>(jobs, layout);
  return cudaGetLastError();
}

cudaError_t DequantizeChunks(const DeviceQuantJob* jobs, int num_jobs, const QuantLayout& layout,
                             cudaStream_t stream) {
  if (!Supported(layout)) return cudaErrorInvalidValue;
  if (num_jobs <= 0) return cudaSuccess;
  DequantizeKernel<<<num_jobs, kThreads, 0, stream>>>(jobs, layout);
  return cudaGetLastError();
}

}  // namespace kvtier
