#include <algorithm>
#include <cstring>

#include "kernels/quant.h"

namespace kvtier {
namespace {

void PutCode(uint8_t* codes, uint64_t i, uint32_t code, uint32_t bits) {
  if (bits == 8) {
    codes[i] = static_cast<uint8_t>(code);
  } else {
    codes[i >> 1] |= static_cast<uint8_t>((i & 1) ? code << 4 : code);
  }
}

}  // namespace

void QuantizeChunkReference(const uint16_t* keys, const uint16_t* values, const QuantLayout& L,
                            uint8_t* out) {
  const uint32_t n = L.num_tokens, d = L.head_dim, levels = L.levels(), G = L.groups();
  std::memset(out, 0, L.Bytes());
  const QuantSections<uint8_t> q(out, L);
  for (uint32_t j = 0; j < d; ++j) {  // keys: per channel over the chunk's tokens
    const QuantParams p = GroupQuantParams(keys + j, n, d, levels);
    q.key_scale[j] = p.scale_h;
    q.key_zero[j] = p.zero_h;
    for (uint32_t t = 0; t < n; ++t) {
      PutCode(q.key_codes, uint64_t{t} * d + j,
              QuantizeValue(HalfToFloat(keys[t * d + j]), p, levels), L.bits);
    }
  }
  for (uint32_t t = 0; t < n; ++t) {  // values: per token, groups of kValueGroup channels
    for (uint32_t g = 0; g < G; ++g) {
      const uint32_t lo = g * kValueGroup, hi = std::min(d, lo + kValueGroup);
      const QuantParams p = GroupQuantParams(values + t * d + lo, hi - lo, 1, levels);
      q.value_scale[t * G + g] = p.scale_h;
      q.value_zero[t * G + g] = p.zero_h;
      for (uint32_t j = lo; j < hi; ++j) {
        PutCode(q.value_codes, uint64_t{t} * d + j,
                QuantizeValue(HalfToFloat(values[t * d + j]), p, levels), L.bits);
      }
    }
  }
}

void DequantizeChunkReference(const uint8_t* in, const QuantLayout& L, uint16_t* keys_out,
                              uint16_t* values_out) {
  const uint32_t n = L.num_tokens, d = L.head_dim, G = L.groups();
  const QuantSections<const uint8_t> q(in, L);
  for (uint32_t t = 0; t < n; ++t) {
    for (uint32_t j = 0; j < d; ++j) {
      const uint64_t i = uint64_t{t} * d + j;
      keys_out[i] = DequantizeValue(GetCode(q.key_codes, i, L.bits), HalfToFloat(q.key_scale[j]),
                                    HalfToFloat(q.key_zero[j]));
      const uint32_t g = t * G + j / kValueGroup;
      values_out[i] = DequantizeValue(GetCode(q.value_codes, i, L.bits),
                                      HalfToFloat(q.value_scale[g]), HalfToFloat(q.value_zero[g]));
    }
  }
}

}  // namespace kvtier
