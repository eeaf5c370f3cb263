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

void QuantizeChunkReference(const uint16_t* keys, const uint16_t* values,
                            const QuantLayout& L, uint8_t* out) {
  const uint32_t n = L.num_tokens, d = L.head_dim, levels = L.levels(), G = L.groups();
  std::memset(out, 0, L.Bytes());
  auto* key_scale = reinterpret_cast<uint16_t*>(out + L.key_scale());
  auto* key_zero = reinterpret_cast<uint16_t*>(out + L.key_zero());
  uint8_t* key_codes = out + L.key_codes();
  for (uint32_t j = 0; j < d; ++j) {  // keys: per channel over the chunk's tokens
    float mn = HalfToFloat(keys[j]), mx = mn;
    for (uint32_t t = 1; t < n; ++t) {
      float x = HalfToFloat(keys[t * d + j]);
      mn = std::min(mn, x);
      mx = std::max(mx, x);
    }
    QuantParams p = MakeQuantParams(mn, mx, levels);
    key_scale[j] = p.scale_h;
    key_zero[j] = p.zero_h;
    for (uint32_t t = 0; t < n; ++t) {
      PutCode(key_codes, uint64_t{t} * d + j, QuantizeValue(HalfToFloat(keys[t * d + j]), p, levels),
              L.bits);
    }
  }
  auto* value_scale = reinterpret_cast<uint16_t*>(out + L.value_scale());
  auto* value_zero = reinterpret_cast<uint16_t*>(out + L.value_zero());
  uint8_t* value_codes = out + L.value_codes();
  for (uint32_t t = 0; t < n; ++t) {  // values: per token, groups of 32 channels
    for (uint32_t g = 0; g < G; ++g) {
      const uint32_t lo = g * kValueGroup, hi = std::min(d, lo + kValueGroup);
      float mn = HalfToFloat(values[t * d + lo]), mx = mn;
      for (uint32_t j = lo + 1; j < hi; ++j) {
        float x = HalfToFloat(values[t * d + j]);
        mn = std::min(mn, x);
        mx = std::max(mx, x);
      }
      QuantParams p = MakeQuantParams(mn, mx, levels);
      value_scale[t * G + g] = p.scale_h;
      value_zero[t * G + g] = p.zero_h;
      for (uint32_t j = lo; j < hi; ++j) {
        PutCode(value_codes, uint64_t{t} * d + j,
                QuantizeValue(HalfToFloat(values[t * d + j]), p, levels), L.bits);
      }
    }
  }
}

void DequantizeChunkReference(const uint8_t* in, const QuantLayout& L, uint16_t* keys_out,
                              uint16_t* values_out) {
  const uint32_t n = L.num_tokens, d = L.head_dim, G = L.groups();
  const auto* key_scale = reinterpret_cast<const uint16_t*>(in + L.key_scale());
  const auto* key_zero = reinterpret_cast<const uint16_t*>(in + L.key_zero());
  const auto* value_scale = reinterpret_cast<const uint16_t*>(in + L.value_scale());
  const auto* value_zero = reinterpret_cast<const uint16_t*>(in + L.value_zero());
  for (uint32_t t = 0; t < n; ++t) {
    for (uint32_t j = 0; j < d; ++j) {
      const uint64_t i = uint64_t{t} * d + j;
      keys_out[i] = DequantizeValue(GetCode(in + L.key_codes(), i, L.bits),
                                    HalfToFloat(key_scale[j]), HalfToFloat(key_zero[j]));
      const uint32_t g = t * G + j / kValueGroup;
      values_out[i] = DequantizeValue(GetCode(in + L.value_codes(), i, L.bits),
                                      HalfToFloat(value_scale[g]), HalfToFloat(value_zero[g]));
    }
  }
}

}  // namespace kvtier
