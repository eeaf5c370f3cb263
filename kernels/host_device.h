// KVTIER_HOST_DEVICE marks functions that CUDA kernels and host code both call.
#ifndef KVTIER_KERNELS_HOST_DEVICE_H_
#define KVTIER_KERNELS_HOST_DEVICE_H_

#if defined(__CUDACC__)
#define KVTIER_HOST_DEVICE __host__ __device__
#else
#define KVTIER_HOST_DEVICE
#endif

#endif  // KVTIER_KERNELS_HOST_DEVICE_H_
