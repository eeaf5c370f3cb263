// The GPU benchmarks' CUDA error check: a failed call prints itself and exits 1.
#ifndef KVTIER_BENCH_CUDA_CHECK_H_
#define KVTIER_BENCH_CUDA_CHECK_H_

#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>

#define CHECK_CUDA(x)                                              \
  do {                                                             \
    cudaError_t e = (x);                                           \
    if (e != cudaSuccess) {                                        \
      std::fprintf(stderr, "%s: %s\n", #x, cudaGetErrorString(e)); \
      std::exit(1);                                                \
    }                                                              \
  } while (0)

#endif  // KVTIER_BENCH_CUDA_CHECK_H_
