// Device memory for the CPU twins of the GPU path: bytes held in a host buffer the daemon code
// has no address of (Tier gives a device slot no host pointer), so a path that would read or
// write a device slot directly crashes here as it would on a GPU; every byte goes through
// Write and Read, which count calls and can be told to fail like a failed CUDA copy.
#ifndef KVTIER_TESTS_FAKE_DEVICE_H_
#define KVTIER_TESTS_FAKE_DEVICE_H_

#include <atomic>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_format.h"
#include "server/transfer/gpu.h"

namespace kvtier::testing {

struct FakeDeviceState {
  std::atomic<int> regions{0};  // alive
  std::atomic<int> writes{0}, reads{0};
  std::atomic<bool> fail_copies{false};
  std::atomic<bool> fail_allocations{false};
};

class FakeDeviceMemory final : public DeviceMemory {
 public:
  static constexpr int kDevice = 7;
  FakeDeviceMemory(uint64_t bytes, std::shared_ptr<FakeDeviceState> state)
      : bytes_(bytes), state_(std::move(state)), id_(++next_id_) {
    ++state_->regions;
  }
  ~FakeDeviceMemory() override { --state_->regions; }

  uint64_t size() const override { return bytes_.size(); }
  uint8_t* data() const override { return nullptr; }  // an address on "the device"
  int device() const override { return kDevice; }
  // 64 bytes that name this region.
  std::string ipc_handle() const override {
    std::string h(kCudaIpcHandleBytes, '\0');
    std::memcpy(h.data(), &id_, sizeof id_);
    return h;
  }
  absl::Status Write(uint64_t offset, const void* src, uint64_t n) override {
    if (state_->fail_copies) return absl::InternalError("cudaMemcpyAsync: injected failure");
    if (offset > size() || n > size() - offset) return absl::InvalidArgumentError("past the end");
    std::memcpy(bytes_.data() + offset, src, n);
    ++state_->writes;
    return absl::OkStatus();
  }
  absl::Status Read(uint64_t offset, void* dst, uint64_t n) const override {
    if (state_->fail_copies) return absl::InternalError("cudaMemcpyAsync: injected failure");
    if (offset > size() || n > size() - offset) return absl::InvalidArgumentError("past the end");
    std::memcpy(dst, bytes_.data() + offset, n);
    ++state_->reads;
    return absl::OkStatus();
  }
  // What the region holds, for the tests' own checks.
  const std::vector<uint8_t>& bytes() const { return bytes_; }

 private:
  std::vector<uint8_t> bytes_;
  std::shared_ptr<FakeDeviceState> state_;
  uint64_t id_;
  static inline std::atomic<uint64_t> next_id_{0};
};

// A worker's "device memory" (the CPU twin of GPU ingest): buffers by handle, read through
// DeviceSource; opens and reads are counted, and either can be made to fail.
struct FakeWorkerDevice {
  std::map<std::string, std::vector<uint8_t>> buffers;  // by CUDA IPC handle
  std::atomic<int> opens{0}, closes{0}, reads{0};
  std::atomic<bool> fail_reads{false};

  class Source final : public DeviceSource {
   public:
    Source(FakeWorkerDevice* dev, const std::vector<uint8_t>* bytes) : dev_(dev), bytes_(bytes) {}
    ~Source() override { ++dev_->closes; }
    uint64_t size() const override { return bytes_->size(); }
    absl::Status Read(uint64_t offset, void* dst, uint64_t n) const override {
      ++dev_->reads;
      if (dev_->fail_reads) return absl::InternalError("cudaMemcpyAsync: injected failure");
      if (offset > bytes_->size() || n > bytes_->size() - offset) {
        return absl::InvalidArgumentError("cudaMemcpyAsync: cudaErrorInvalidValue (past the end)");
      }
      std::memcpy(dst, bytes_->data() + offset, n);
      return absl::OkStatus();
    }

   private:
    FakeWorkerDevice* dev_;
    const std::vector<uint8_t>* bytes_;
  };

  DeviceSourceOpener Opener() {
    return [this](absl::string_view handle) -> absl::StatusOr<std::unique_ptr<DeviceSource>> {
      auto it = buffers.find(std::string(handle));
      if (it == buffers.end()) {
        return absl::InvalidArgumentError("cudaIpcOpenMemHandle: cudaErrorInvalidValue");
      }
      ++opens;
      return std::make_unique<Source>(this, &it->second);
    };
  }
};

// TierOptions::device_memory over fake regions sharing `state`.
inline auto FakeDeviceAllocator(std::shared_ptr<FakeDeviceState> state) {
  return [state](uint64_t bytes) -> absl::StatusOr<std::unique_ptr<DeviceMemory>> {
    if (state->fail_allocations) {
      return absl::ResourceExhaustedError(
          absl::StrFormat("cudaMalloc(%d): cudaErrorMemoryAllocation (injected)", bytes));
    }
    return std::make_unique<FakeDeviceMemory>(bytes, state);
  };
}

}  // namespace kvtier::testing

#endif  // KVTIER_TESTS_FAKE_DEVICE_H_
