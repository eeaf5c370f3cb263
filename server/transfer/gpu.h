// The GPU runtime kvtierd drives: which CUDA devices this process can use, and device memory
// that another process maps through a CUDA IPC handle.
//
// Built with CUDA (KVTIER_HAVE_CUDA) it calls the CUDA runtime, linked statically: the driver
// (libcuda) is loaded when first called, so the same binary on a machine without one finds no
// device and says why. Built without CUDA it finds none ("built without CUDA"). Nothing here
// dereferences device memory on the host: bytes go in and out through Write and Read.
#ifndef KVTIER_SERVER_TRANSFER_GPU_H_
#define KVTIER_SERVER_TRANSFER_GPU_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace kvtier {

struct GpuInfo {
  int index = 0;
  std::string name;
  uint64_t memory_bytes = 0;
  int compute_major = 0, compute_minor = 0;
  std::string pci_bus_id;
};

// Whether this build calls the CUDA runtime at all.
bool BuiltWithCuda();

// The CUDA devices this process can use, in the runtime's order; FAILED_PRECONDITION saying
// why there are none (no driver, no device, a build without CUDA).
absl::StatusOr<std::vector<GpuInfo>> ProbeGpus();

// The size of a CUDA IPC memory handle (cudaIpcMemHandle_t), as ListSegments carries it.
inline constexpr size_t kCudaIpcHandleBytes = 64;

// Memory a tier's slots live in when it is not mapped into this process: on a GPU, one
// cudaMalloc'd region exported by a CUDA IPC handle. data() is an address on the device, never
// read or written here; Write and Read copy, and are done when they return.
class DeviceMemory {
 public:
  virtual ~DeviceMemory() = default;
  virtual uint64_t size() const = 0;
  // The device address (an opaque value on the host).
  virtual uint8_t* data() const = 0;
  virtual int device() const = 0;
  // kCudaIpcHandleBytes bytes another process opens (cudaIpcOpenMemHandle); empty where
  // there is none to give.
  virtual std::string ipc_handle() const = 0;
  // Host to device: `n` bytes of `src` at `offset`. INVALID_ARGUMENT past the end; the
  // runtime's error (INTERNAL, naming the call) when the copy fails.
  virtual absl::Status Write(uint64_t offset, const void* src, uint64_t n) = 0;
  // Device to host.
  virtual absl::Status Read(uint64_t offset, void* dst, uint64_t n) const = 0;
};

// `bytes` of memory on CUDA device `device` (cudaMalloc), exported for IPC. RESOURCE_EXHAUSTED
// when the device has no room; FAILED_PRECONDITION when there is no such device (or no CUDA).
absl::StatusOr<std::unique_ptr<DeviceMemory>> AllocateGpuMemory(int device, uint64_t bytes);

// Another process's device memory, as this one reads it: `n` bytes at `offset` copied to the
// host, done when Read returns (INVALID_ARGUMENT for a range past size()).
class DeviceSource {
 public:
  virtual ~DeviceSource() = default;
  // The bytes the allocation holds from where it is mapped: what a range is checked against
  // before anything is read or allocated for it.
  virtual uint64_t size() const = 0;
  virtual absl::Status Read(uint64_t offset, void* dst, uint64_t n) const = 0;
};

// Opens another process's memory by its CUDA IPC handle.
using DeviceSourceOpener =
    std::function<absl::StatusOr<std::unique_ptr<DeviceSource>>(absl::string_view handle)>;

// The other side of an IPC handle: another process's memory mapped on `device` of this one
// (cudaIpcOpenMemHandle), unmapped when destroyed; its size is the allocation's from the mapped
// address (cuMemGetAddressRange, through the runtime's driver entry points). Read copies on a
// stream of the mapping's own and waits for that copy's event.
class GpuMapping final : public DeviceSource {
 public:
  static absl::StatusOr<std::unique_ptr<GpuMapping>> Open(int device, absl::string_view handle);
  ~GpuMapping() override;
  GpuMapping(const GpuMapping&) = delete;
  GpuMapping& operator=(const GpuMapping&) = delete;
  uint8_t* data() const { return data_; }
  int device() const { return device_; }
  uint64_t size() const override { return size_; }
  absl::Status Read(uint64_t offset, void* dst, uint64_t n) const override;

 private:
  GpuMapping(uint8_t* data, int device) : data_(data), device_(device) {}
  uint8_t* data_;
  int device_;
  uint64_t size_ = 0;
  [[maybe_unused]] void* stream_ = nullptr;  // cudaStream_t (none in a build without CUDA)
  [[maybe_unused]] void* done_ = nullptr;    // cudaEvent_t
};

// The device sources one AppendKV stream has opened, by handle, closed with it (so nothing
// stays mapped for a worker whose stream ended); at most kMax, the oldest closed first.
class DeviceSources {
 public:
  static constexpr size_t kMax = 16;
  // The source of `handle`, opened by `open` on first use.
  absl::StatusOr<const DeviceSource*> Get(absl::string_view handle, const DeviceSourceOpener& open);
  size_t size() const { return sources_.size(); }

 private:
  std::vector<std::pair<std::string, std::unique_ptr<DeviceSource>>> sources_;  // oldest first
};

}  // namespace kvtier

#endif  // KVTIER_SERVER_TRANSFER_GPU_H_
