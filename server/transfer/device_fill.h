// Filling device slots with chunks' fp16 rows: the copy a promotion to a GPU device tier makes.
#ifndef KVTIER_SERVER_TRANSFER_DEVICE_FILL_H_
#define KVTIER_SERVER_TRANSFER_DEVICE_FILL_H_

#include <cstdint>
#include <optional>
#include <span>

#include "absl/status/status.h"
#include "kernels/quant_layout.h"
#include "server/transfer/gpu.h"

namespace kvtier {

// One chunk into one device slot.
struct DeviceFill {
  DeviceMemory* dst;  // the slot's segment
  uint64_t offset;    // the slot: K [n][d] then V [n][d], 2-byte values
  // The chunk as the host stores it: those fp16 rows (2 * n * d * 2 bytes), or, with
  // `quantized`, its int4/int8 bytes (quantized->Bytes()), dequantized on the device.
  const uint8_t* src;
  uint64_t src_bytes;
  std::optional<QuantLayout> quantized;
  uint64_t chunk_id;  // named when its fill fails
};

// Every fill, done when it returns; the first failure names its chunk (INTERNAL for a failed
// copy or launch, the device's own code otherwise), and a fill that failed leaves its slot
// unspecified. On CUDA memory: the sources packed into pinned staging and sent in one
// host-to-device copy on the device's promotion stream, the fp16 chunks moved into their slots
// by one gather launch and the quantized ones dequantized by one launch per layout (the
// kernels of kernels/, bit-identical to their CPU references), then a CUDA event of this call's
// waited on. On other device memory (the CPU twin), each slot is made on the host by the same
// references and written.
absl::Status FillDevice(std::span<const DeviceFill> fills);

// The host path of FillDevice, whatever the memory.
absl::Status FillDeviceOnHost(std::span<const DeviceFill> fills);

}  // namespace kvtier

#endif  // KVTIER_SERVER_TRANSFER_DEVICE_FILL_H_
