// The GPU runtime of a build without CUDA: no device, ever, and the reason says so.
#include "server/transfer/carrier.h"
#include "server/transfer/device_fill.h"
#include "server/transfer/gpu.h"

namespace kvtier {
namespace {

absl::Status NoCuda() {
  return absl::FailedPreconditionError("no CUDA device: this kvtierd was built without CUDA");
}

}  // namespace

bool BuiltWithCuda() { return false; }

absl::StatusOr<std::vector<GpuInfo>> ProbeGpus() { return NoCuda(); }

absl::StatusOr<std::unique_ptr<DeviceMemory>> AllocateGpuMemory(int, uint64_t) { return NoCuda(); }

absl::StatusOr<std::unique_ptr<GpuMapping>> GpuMapping::Open(int, absl::string_view) {
  return NoCuda();
}

GpuMapping::~GpuMapping() = default;

absl::Status GpuMapping::Read(uint64_t, void*, uint64_t) const { return NoCuda(); }

absl::Status FillDevice(std::span<const DeviceFill> fills) { return FillDeviceOnHost(fills); }

absl::StatusOr<OfferedCarrier> OfferNcclCarrier(const CarrierOptions&) { return NoCuda(); }

absl::StatusOr<std::unique_ptr<ByteCarrier>> JoinNcclCarrier(absl::string_view,
                                                             const CarrierOptions&) {
  return NoCuda();
}

}  // namespace kvtier
