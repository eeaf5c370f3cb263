// The byte layout of one chunk slot, shared by the server, the CUDA kernels and their CPU
// references, so that none of them can disagree on where a row lives.
//
// A chunk of n tokens (n <= chunk_tokens), head_dim d, 2-byte elements (fp16 or bf16):
//
//   byte 0              n*d*2              2*n*d*2         slot_bytes = chunk_tokens*d*4
//   +-------------------+------------------+---------------+
//   | K row 0 .. n-1    | V row 0 .. n-1   | unused        |
//   +-------------------+------------------+---------------+
//   each row: d little-endian 2-byte values
//
// A BlockHandle's (offset, length) covers exactly [0, 2*n*d*2) of its slot.
#ifndef KVTIER_KERNELS_CHUNK_LAYOUT_H_
#define KVTIER_KERNELS_CHUNK_LAYOUT_H_

#include <cstdint>

#include "kernels/host_device.h"

namespace kvtier {

struct ChunkLayout {
  uint32_t head_dim;    // d
  uint32_t num_tokens;  // n, rows stored

  KVTIER_HOST_DEVICE uint64_t row_bytes() const { return static_cast<uint64_t>(head_dim) * 2; }
  KVTIER_HOST_DEVICE uint64_t key_offset(uint32_t row) const { return row * row_bytes(); }
  KVTIER_HOST_DEVICE uint64_t value_offset(uint32_t row) const {
    return (static_cast<uint64_t>(num_tokens) + row) * row_bytes();
  }
  // Bytes a handle covers: K then V.
  KVTIER_HOST_DEVICE uint64_t bytes() const { return 2ull * num_tokens * row_bytes(); }
  // Bytes of a slot that holds up to `chunk_tokens` rows.
  KVTIER_HOST_DEVICE static uint64_t SlotBytes(uint32_t head_dim, uint32_t chunk_tokens) {
    return 4ull * head_dim * chunk_tokens;
  }
};

}  // namespace kvtier

#endif  // KVTIER_KERNELS_CHUNK_LAYOUT_H_
