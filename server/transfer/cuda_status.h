// CUDA runtime errors as statuses (the CUDA build's server/transfer sources only).
#ifndef KVTIER_SERVER_TRANSFER_CUDA_STATUS_H_
#define KVTIER_SERVER_TRANSFER_CUDA_STATUS_H_

#include <cuda_runtime.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace kvtier {

// A CUDA error as a status naming the call: no room is RESOURCE_EXHAUSTED, no device or
// driver FAILED_PRECONDITION, a bad value (a handle or range a worker gave) INVALID_ARGUMENT,
// the rest INTERNAL.
inline absl::Status CudaError(cudaError_t e, absl::string_view call) {
  const std::string msg =
      absl::StrCat(call, ": ", cudaGetErrorName(e), " (", cudaGetErrorString(e), ")");
  switch (e) {
    case cudaErrorMemoryAllocation:
      return absl::ResourceExhaustedError(msg);
    case cudaErrorInvalidValue:
    case cudaErrorInvalidResourceHandle:
    case cudaErrorInvalidDevicePointer:
      return absl::InvalidArgumentError(msg);
    case cudaErrorNoDevice:
    case cudaErrorInsufficientDriver:
    case cudaErrorInvalidDevice:
    case cudaErrorDevicesUnavailable:
    case cudaErrorNotSupported:
      return absl::FailedPreconditionError(msg);
    default:
      return absl::InternalError(msg);
  }
}

#define KVTIER_CUDA_RETURN(call)                                  \
  do {                                                            \
    const cudaError_t kvtier_cuda_e = (call);                     \
    if (kvtier_cuda_e != cudaSuccess) {                           \
      (void)cudaGetLastError(); /* a sticky error stays sticky */ \
      return CudaError(kvtier_cuda_e, #call);                     \
    }                                                             \
  } while (0)

}  // namespace kvtier

#endif  // KVTIER_SERVER_TRANSFER_CUDA_STATUS_H_
