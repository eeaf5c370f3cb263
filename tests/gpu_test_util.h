// Shared by the GPU tests: whether a CUDA device is present (else they skip with a message).
#ifndef KVTIER_TESTS_GPU_TEST_UTIL_H_
#define KVTIER_TESTS_GPU_TEST_UTIL_H_

#include <cuda_runtime.h>

namespace kvtier::testing {

inline bool HaveGpu() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

}  // namespace kvtier::testing

#endif  // KVTIER_TESTS_GPU_TEST_UTIL_H_
