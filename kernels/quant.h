// Quantize and dequantize chunks (layout: kernels/quant_layout.h). The CPU reference lives
// here; the AVX2 path is server/quant; the CUDA kernels are quant_kernels.cu. All three are
// bit-identical.
#ifndef KVTIER_KERNELS_QUANT_H_
#define KVTIER_KERNELS_QUANT_H_

#include <cstdint>

#include "kernels/quant_layout.h"

namespace kvtier {

// keys, values: fp16 [n][d] (finite). out: layout.Bytes() bytes.
void QuantizeChunkReference(const uint16_t* keys, const uint16_t* values, const QuantLayout& layout,
                            uint8_t* out);

// in: a quantized chunk. keys_out, values_out: fp16 [n][d].
void DequantizeChunkReference(const uint8_t* in, const QuantLayout& layout, uint16_t* keys_out,
                              uint16_t* values_out);

}  // namespace kvtier

#if defined(KVTIER_WITH_CUDA) || defined(__CUDACC__)
#include <cuda_runtime.h>
namespace kvtier {

// One quantize or dequantize job: a chunk's fp16 slot (K [n][d] then V [n][d]) and its
// quantized bytes, both device-accessible.
struct DeviceQuantJob {
  uint8_t* fp16;   // ChunkLayout{d, n}: K then V
  uint8_t* quant;  // QuantLayout{d, n, bits}
};

// Quantizes jobs[i].fp16 into jobs[i].quant, one block per job. `jobs` in device memory.
cudaError_t QuantizeChunks(const DeviceQuantJob* jobs, int num_jobs, const QuantLayout& layout,
                           cudaStream_t stream);
// Dequantizes jobs[i].quant into jobs[i].fp16 (a gather of many chunks into fp16 slots).
cudaError_t DequantizeChunks(const DeviceQuantJob* jobs, int num_jobs, const QuantLayout& layout,
                             cudaStream_t stream);

}  // namespace kvtier
#endif

#endif  // KVTIER_KERNELS_QUANT_H_
