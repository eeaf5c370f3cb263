// The GPU runtime over the CUDA runtime API (linked statically; libcuda is loaded at the first
// call, so a machine without a driver finds no device).
#include <cuda_runtime.h>

#include <cstring>
#include <map>
#include <mutex>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "kernels/gather_chunks.h"
#include "kernels/quant.h"
#include "server/common/status_macros.h"
#include "server/transfer/cuda_status.h"
#include "server/transfer/device_fill.h"
#include "server/transfer/gpu.h"

namespace kvtier {
namespace {

static_assert(sizeof(cudaIpcMemHandle_t) == kCudaIpcHandleBytes);

// The bytes of the allocation holding device address `p` from `p` to its end: the driver's
// cuMemGetAddressRange, found through the runtime (which loads libcuda itself), so that nothing
// links the driver library.
absl::StatusOr<uint64_t> AllocationBytesFrom(const void* p) {
  using GetAddressRange = int (*)(unsigned long long* base, size_t* size, unsigned long long ptr);
  static const GetAddressRange get = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found{};
    if (cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &fn, 12000, cudaEnableDefault,
                                         &found) != cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
      fn = nullptr;
    }
    return reinterpret_cast<GetAddressRange>(fn);
  }();
  if (get == nullptr) {
    return absl::InternalError("cuMemGetAddressRange: not found through the CUDA runtime");
  }
  unsigned long long base = 0;
  size_t size = 0;
  const auto at = static_cast<unsigned long long>(reinterpret_cast<uintptr_t>(p));
  if (const int r = get(&base, &size, at); r != 0) {
    return absl::InternalError(absl::StrCat("cuMemGetAddressRange: CUresult ", r));
  }
  if (at < base || at - base > size) {
    return absl::InternalError("cuMemGetAddressRange: the mapping lies outside its allocation");
  }
  return size - (at - base);
}

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

// One device's promotion path: pinned host staging and device scratch that only grow, a
// stream of its own and an event per fill. One fill at a time per device: a fill waits only
// for its own event, and nothing of another's is on the stream by then.
class Promoter {
 public:
  explicit Promoter(int device) : device_(device) {}

  absl::Status Fill(std::span<const DeviceFill> fills) {
    std::lock_guard<std::mutex> lock(mu_);
    KVTIER_CUDA_RETURN(cudaSetDevice(device_));
    if (stream_ == nullptr) {
      KVTIER_CUDA_RETURN(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
      KVTIER_CUDA_RETURN(cudaEventCreateWithFlags(&done_, cudaEventDisableTiming));
    }
    // The staging layout: every source (256-aligned), then the gather entries, then each
    // layout's dequantize jobs; their device pointers point into the scratch.
    auto align = [](uint64_t x) { return (x + 255) & ~uint64_t{255}; };
    uint64_t at = 0;
    std::vector<uint64_t> src_at(fills.size());
    for (size_t i = 0; i < fills.size(); ++i) {
      src_at[i] = at = align(at);
      at += fills[i].src_bytes;
    }
    std::vector<size_t> plain;
    std::map<std::tuple<uint32_t, uint32_t, uint32_t>, std::vector<size_t>> by_layout;
    for (size_t i = 0; i < fills.size(); ++i) {
      if (const auto& q = fills[i].quantized) {
        by_layout[{q->head_dim, q->num_tokens, q->bits}].push_back(i);
      } else {
        plain.push_back(i);
      }
    }
    const uint64_t entries_at = align(at);
    at = entries_at + plain.size() * sizeof(GatherEntry);
    std::vector<uint64_t> jobs_at;
    for (const auto& [key, members] : by_layout) {
      jobs_at.push_back(at = align(at));
      at += members.size() * sizeof(DeviceQuantJob);
    }
    if (absl::Status s = Reserve(at); !s.ok()) return s;
    for (size_t i = 0; i < fills.size(); ++i) {
      std::memcpy(staging_ + src_at[i], fills[i].src, fills[i].src_bytes);
    }
    auto* entries = reinterpret_cast<GatherEntry*>(staging_ + entries_at);
    for (size_t j = 0; j < plain.size(); ++j) {
      const DeviceFill& f = fills[plain[j]];
      entries[j] = {scratch_ + src_at[plain[j]], f.dst->data() + f.offset, f.src_bytes};
    }
    size_t g = 0;
    for (const auto& [key, members] : by_layout) {
      auto* jobs = reinterpret_cast<DeviceQuantJob*>(staging_ + jobs_at[g++]);
      for (size_t j = 0; j < members.size(); ++j) {
        const DeviceFill& f = fills[members[j]];
        jobs[j] = {f.dst->data() + f.offset, scratch_ + src_at[members[j]]};
      }
    }
    const std::string what =
        absl::StrCat("promoting chunks ", fills.front().chunk_id,
                     fills.size() > 1 ? absl::StrCat(" and ", fills.size() - 1, " more") : "",
                     " to CUDA device ", device_, ": ");
    auto failed = [&](cudaError_t e, absl::string_view call) {
      (void)cudaGetLastError();
      absl::Status s = CudaError(e, call);
      return absl::Status(s.code(), absl::StrCat(what, s.message()));
    };
    cudaError_t e = cudaMemcpyAsync(scratch_, staging_, at, cudaMemcpyHostToDevice, stream_);
    if (e != cudaSuccess) return failed(e, "cudaMemcpyAsync");
    if (!plain.empty()) {
      e = GatherChunks(reinterpret_cast<const GatherEntry*>(scratch_ + entries_at),
                       static_cast<int>(plain.size()), stream_);
      if (e != cudaSuccess) return failed(e, "GatherChunks");
    }
    g = 0;
    for (const auto& [key, members] : by_layout) {
      const auto [d, n, bits] = key;
      e = DequantizeChunks(reinterpret_cast<const DeviceQuantJob*>(scratch_ + jobs_at[g++]),
                           static_cast<int>(members.size()), QuantLayout{d, n, bits}, stream_);
      if (e != cudaSuccess) return failed(e, "DequantizeChunks");
    }
    if ((e = cudaEventRecord(done_, stream_)) != cudaSuccess) return failed(e, "cudaEventRecord");
    if ((e = cudaEventSynchronize(done_)) != cudaSuccess) return failed(e, "cudaEventSynchronize");
    return absl::OkStatus();
  }

 private:
  // Staging and scratch of at least `bytes`, grown by doubling.
  absl::Status Reserve(uint64_t bytes) {
    if (bytes <= capacity_) return absl::OkStatus();
    uint64_t want = std::max<uint64_t>(bytes, 2 * capacity_);
    if (staging_ != nullptr) (void)cudaFreeHost(staging_);
    if (scratch_ != nullptr) (void)cudaFree(scratch_);
    staging_ = scratch_ = nullptr;
    capacity_ = 0;
    KVTIER_CUDA_RETURN(cudaHostAlloc(&staging_, want, cudaHostAllocDefault));
    KVTIER_CUDA_RETURN(cudaMalloc(&scratch_, want));
    capacity_ = want;
    return absl::OkStatus();
  }

  const int device_;
  std::mutex mu_;
  cudaStream_t stream_ = nullptr;
  cudaEvent_t done_ = nullptr;
  uint8_t* staging_ = nullptr;  // pinned host memory
  uint8_t* scratch_ = nullptr;  // device memory
  uint64_t capacity_ = 0;
};

// One promoter per device, for the process's life (never destroyed: no CUDA call at exit).
Promoter& PromoterOf(int device) {
  static std::mutex mu;
  static auto* promoters = new std::map<int, Promoter*>();
  std::lock_guard<std::mutex> lock(mu);
  Promoter*& p = (*promoters)[device];
  if (p == nullptr) p = new Promoter(device);
  return *p;
}

}  // namespace

absl::Status FillDevice(std::span<const DeviceFill> fills) {
  if (fills.empty()) return absl::OkStatus();
  // CUDA memory, by device, in one batch each; other memory (the CPU twin) on the host.
  std::map<int, std::vector<DeviceFill>> by_device;
  for (const DeviceFill& f : fills) {
    if (dynamic_cast<const CudaMemory*>(f.dst) == nullptr) return FillDeviceOnHost(fills);
    by_device[f.dst->device()].push_back(f);
  }
  for (const auto& [device, batch] : by_device) {
    if (absl::Status s = PromoterOf(device).Fill(batch); !s.ok()) return s;
  }
  return absl::OkStatus();
}

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
  auto m = std::unique_ptr<GpuMapping>(new GpuMapping(static_cast<uint8_t*>(p), device));
  // How far the allocation reaches: a range the worker names past it is refused before any copy
  // (the driver would read whatever lies there, another allocation of this process included).
  ASSIGN_OR_RETURN(m->size_, AllocationBytesFrom(p));
  cudaStream_t stream;
  KVTIER_CUDA_RETURN(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  m->stream_ = stream;
  cudaEvent_t done;
  KVTIER_CUDA_RETURN(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
  m->done_ = done;
  return m;
}

GpuMapping::~GpuMapping() {
  (void)cudaSetDevice(device_);
  if (done_ != nullptr) (void)cudaEventDestroy(static_cast<cudaEvent_t>(done_));
  if (stream_ != nullptr) (void)cudaStreamDestroy(static_cast<cudaStream_t>(stream_));
  (void)cudaIpcCloseMemHandle(data_);
}

absl::Status GpuMapping::Read(uint64_t offset, void* dst, uint64_t n) const {
  RETURN_IF_ERROR(CheckRange(offset, n, size_));
  auto stream = static_cast<cudaStream_t>(stream_);
  auto done = static_cast<cudaEvent_t>(done_);
  KVTIER_CUDA_RETURN(cudaSetDevice(device_));
  KVTIER_CUDA_RETURN(cudaMemcpyAsync(dst, data_ + offset, n, cudaMemcpyDeviceToHost, stream));
  KVTIER_CUDA_RETURN(cudaEventRecord(done, stream));
  KVTIER_CUDA_RETURN(cudaEventSynchronize(done));
  return absl::OkStatus();
}

}  // namespace kvtier
