#include "server/transfer/device_fill.h"

#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/quant.h"

namespace kvtier {

absl::StatusOr<const DeviceSource*> DeviceSources::Get(absl::string_view handle,
                                                       const DeviceSourceOpener& open) {
  for (const auto& [h, source] : sources_) {
    if (h == handle) return source.get();
  }
  absl::StatusOr<std::unique_ptr<DeviceSource>> opened = open(handle);
  if (!opened.ok()) return opened.status();
  if (sources_.size() == kMax) sources_.erase(sources_.begin());
  sources_.emplace_back(std::string(handle), *std::move(opened));
  return sources_.back().second.get();
}

absl::Status FillDeviceOnHost(std::span<const DeviceFill> fills) {
  std::vector<uint16_t> rows;
  for (const DeviceFill& f : fills) {
    const uint8_t* fp16 = f.src;
    uint64_t bytes = f.src_bytes;
    if (f.quantized) {
      const uint64_t half = uint64_t{f.quantized->num_tokens} * f.quantized->head_dim;
      rows.resize(2 * half);
      DequantizeChunkReference(f.src, *f.quantized, rows.data(), rows.data() + half);
      fp16 = reinterpret_cast<const uint8_t*>(rows.data());
      bytes = 2 * half * sizeof(uint16_t);
    }
    if (absl::Status s = f.dst->Write(f.offset, fp16, bytes); !s.ok()) {
      return absl::Status(
          s.code(), absl::StrCat("promoting chunk ", f.chunk_id, " to the device: ", s.message()));
    }
  }
  return absl::OkStatus();
}

}  // namespace kvtier
