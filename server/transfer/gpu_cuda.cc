// The GPU runtime over the CUDA runtime API (linked statically; libcuda is loaded at the first
// call, so a machine without a driver finds no device).
#include <cuda_runtime.h>

#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "server/transfer/gpu.h"

namespace kvtier {
namespace {

static_assert(sizeof(cudaIpcMemHandle_t) == kCudaIpcHandleBytes);

// A CUDA error as a status naming the call: no room is RESOURCE_EXHAUSTED, no device or
// driver FAILED_PRECONDITION, the rest INTERNAL.
absl::Status CudaError(cudaError_t e, absl::string_view call) {
  const std::string msg =
      absl::StrCat(call, ": ", cudaGetErrorName(e), " (", cudaGetErrorString(e), ")");
  switch (e) {
    case cudaErrorMemoryAllocation:
      return absl::ResourceExhaustedError(msg);
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

absl::Status CheckRange(uint64_t offset, uint64_t n, uint64_t size) {
  if (offset > size || n > size - offset) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%d bytes at %d pass the device memory's %d", n, offset, size));
  }
  return absl::OkStatus();
}

class CudaMemory final : public DeviceMemory {
 public:
  static absl::StatusOr<std::unique_ptr<DeviceMemory>> Make(int device, uint64_t bytes) {
    KVTIER_CUDA_RETURN(cudaSetDevice(device));
    void* p = nullptr;
    KVTIER_CUDA_RETURN(cudaMalloc(&p, bytes));
    auto m = std::unique_ptr<CudaMemory>(new CudaMemory(device, static_cast<uint8_t*>(p), bytes));
    cudaIpcMemHandle_t h;
    KVTIER_CUDA_RETURN(cudaIpcGetMemHandle(&h, p));
    m->handle_.assign(reinterpret_cast<const char*>(&h), sizeof h);
    KVTIER_CUDA_RETURN(cudaStreamCreateWithFlags(&m->stream_, cudaStreamNonBlocking));
    return std::unique_ptr<DeviceMemory>(std::move(m));
  }

  ~CudaMemory() override {
    (void)cudaSetDevice(device_);
    if (stream_ != nullptr) (void)cudaStreamDestroy(stream_);
    (void)cudaFree(data_);
  }

  uint64_t size() const override { return size_; }
  uint8_t* data() const override { return data_; }
  int device() const override { return device_; }
  std::string ipc_handle() const override { return handle_; }

  absl::Status Write(uint64_t offset, const void* src, uint64_t n) override {
    if (absl::Status s = CheckRange(offset, n, size_); !s.ok()) return s;
    KVTIER_CUDA_RETURN(cudaSetDevice(device_));
    KVTIER_CUDA_RETURN(cudaMemcpyAsync(data_ + offset, src, n, cudaMemcpyHostToDevice, stream_));
    KVTIER_CUDA_RETURN(cudaStreamSynchronize(stream_));
    return absl::OkStatus();
  }

  absl::Status Read(uint64_t offset, void* dst, uint64_t n) const override {
    if (absl::Status s = CheckRange(offset, n, size_); !s.ok()) return s;
    KVTIER_CUDA_RETURN(cudaSetDevice(device_));
    KVTIER_CUDA_RETURN(cudaMemcpyAsync(dst, data_ + offset, n, cudaMemcpyDeviceToHost, stream_));
    KVTIER_CUDA_RETURN(cudaStreamSynchronize(stream_));
    return absl::OkStatus();
  }

 private:
  CudaMemory(int device, uint8_t* data, uint64_t size)
      : device_(device), data_(data), size_(size) {}

  const int device_;
  uint8_t* const data_;
  const uint64_t size_;
  std::string handle_;
  cudaStream_t stream_ = nullptr;
};

}  // namespace

bool BuiltWithCuda() { return true; }

absl::StatusOr<std::vector<GpuInfo>> ProbeGpus() {
  int n = 0;
  KVTIER_CUDA_RETURN(cudaGetDeviceCount(&n));
  if (n == 0) return absl::FailedPreconditionError("cudaGetDeviceCount: no CUDA device");
  std::vector<GpuInfo> out;
  for (int i = 0; i < n; ++i) {
    cudaDeviceProp p;
    KVTIER_CUDA_RETURN(cudaGetDeviceProperties(&p, i));
    char bus[32] = {};
    (void)cudaDeviceGetPCIBusId(bus, sizeof bus, i);
    out.push_back({.index = i,
                   .name = p.name,
                   .memory_bytes = p.totalGlobalMem,
                   .compute_major = p.major,
                   .compute_minor = p.minor,
                   .pci_bus_id = bus});
  }
  return out;
}

absl::StatusOr<std::unique_ptr<DeviceMemory>> AllocateGpuMemory(int device, uint64_t bytes) {
  return CudaMemory::Make(device, bytes);
}

absl::StatusOr<std::unique_ptr<GpuMapping>> GpuMapping::Open(int device, absl::string_view handle) {
  if (handle.size() != sizeof(cudaIpcMemHandle_t)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("cuda_ipc_handle: %d bytes, not a CUDA IPC handle's %d", handle.size(),
                        sizeof(cudaIpcMemHandle_t)));
  }
  KVTIER_CUDA_RETURN(cudaSetDevice(device));
  cudaIpcMemHandle_t h;
  std::memcpy(&h, handle.data(), sizeof h);
  void* p = nullptr;
  KVTIER_CUDA_RETURN(cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess));
  return std::unique_ptr<GpuMapping>(new GpuMapping(static_cast<uint8_t*>(p), device));
}

GpuMapping::~GpuMapping() {
  (void)cudaSetDevice(device_);
  (void)cudaIpcCloseMemHandle(data_);
}

absl::Status GpuMapping::Read(uint64_t offset, void* dst, uint64_t n) const {
  KVTIER_CUDA_RETURN(cudaSetDevice(device_));
  KVTIER_CUDA_RETURN(cudaMemcpy(dst, data_ + offset, n, cudaMemcpyDeviceToHost));
  return absl::OkStatus();
}

}  // namespace kvtier
