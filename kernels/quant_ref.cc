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
  // Zeroed: gcc cannot see that each is written.
  float mn[kMaxKeyGroups] = {}, mx[kMaxKeyGroups] = {}, need[kMaxKeyGroups];
  for (uint32_t t0 = 0; t0 < n; t0 += kKeySpan) {  // keys: per channel over a span of tokens
    const uint32_t span = std::min(kKeySpan, n - t0);
    for (uint32_t j = 0; j < d; ++j) {
      const uint32_t g = L.key_group(t0, j);
      GroupRange(keys + t0 * d + j, span, d, &mn[g], &mx[g]);
    }
  }
  EncodeParams(mn, mx, L.key_groups(), levels, q.key_header, q.key_zero, q.key_scale, need);
  for (uint32_t t = 0; t < n; ++t) {
    for (uint32_t j = 0; j < d; ++j) {
      const uint32_t g = L.key_group(t, j);
      const QuantParams p = DecodeParams(q.key_header, q.key_zero[g], q.key_scale[g]);
      PutCode(q.key_codes, uint64_t{t} * d + j,
              QuantizeValue(HalfToFloat(keys[t * d + j]), p, levels), L.bits);
    }
  }
  for (uint32_t t = 0; t < n; ++t) {  // values: per token, groups of kValueGroup channels
    for (uint32_t g = 0; g < G; ++g) {
      const uint32_t lo = g * kValueGroup, hi = std::min(d, lo + kValueGroup);
      GroupRange(values + t * d + lo, hi - lo, 1, &mn[t * G + g], &mx[t * G + g]);
    }
  }
  EncodeParams(mn, mx, n * G, levels, q.value_header, q.value_zero, q.value_scale, need);
  for (uint32_t t = 0; t < n; ++t) {
    for (uint32_t g = 0; g < G; ++g) {
      const uint32_t lo = g * kValueGroup, hi = std::min(d, lo + kValueGroup);
      const QuantParams p =
          DecodeParams(q.value_header, q.value_zero[t * G + g], q.value_scale[t * G + g]);
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
      const uint32_t kg = L.key_group(t, j);
      keys_out[i] =
          DequantizeValue(GetCode(q.key_codes, i, L.bits), ScaleOf(q.key_header, q.key_scale[kg]),
                          ZeroOf(q.key_header, q.key_zero[kg]));
      const uint32_t g = t * G + j / kValueGroup;
      values_out[i] = DequantizeValue(GetCode(q.value_codes, i, L.bits),
                                      ScaleOf(q.value_header, q.value_scale[g]),
                                      ZeroOf(q.value_header, q.value_zero[g]));
    }
  }
}

}  // namespace kvtier
