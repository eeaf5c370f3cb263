// The byte layout of a quantized chunk, and the per-element arithmetic, shared by the CPU
// reference, the AVX2 path and the CUDA kernels (all __host__ __device__), so that they
// cannot disagree on where a byte lives or how a value rounds.
//
// KIVI-style asymmetric quantization of one chunk: n tokens (1..64), head_dim d, b bits
// (4 or 8), L = 2^b - 1 levels, G = ceil(d / 64) value groups. Keys per channel over the
// chunk's n tokens; values per token in groups of 64 channels. Every section starts 16-byte
// aligned (A(x) rounds x up to 16):
//
//   offset                          contents
//   0                               key_scale  fp16 [d]        per channel
//   A(2d)                           key_zero   fp16 [d]        per channel
//   A(2d)+A(2d)                     key_codes  [n][d] b-bit    row-major
//   ...+A(n*d*b/8)                  value_scale fp16 [n][G]    per token and group
//   ...+A(2nG)                      value_zero  fp16 [n][G]
//   ...+A(2nG)                      value_codes [n][d] b-bit   row-major
//   ...+A(n*d*b/8)                  end: Bytes()
//
// Codes are packed row-major: element i of a [n][d] array is byte i for 8 bits; for 4 bits
// it is byte i/2, the low nibble when i is even and the high nibble when odd:
//
//   byte:   |  k[0][1] : k[0][0]  |  k[0][3] : k[0][2]  | ...
//   bits:   |  7 .. 4  :  3 .. 0  |  7 .. 4  :  3 .. 0  |
//
// Parameters: zero = fp16 rounded down from the group's minimum, scale = fp16 rounded up from
// (max - zero) / L, so [zero, zero + L*scale] covers the group. code = clamp(rint((x - zero)
// * (1/scale)), 0, L); x' = fp16(clamp(code*scale + zero, +-65504)), with the multiply and add
// rounded separately (no FMA) everywhere. |x - x'| <= scale/2 + half an fp16 ulp of x'.
#ifndef KVTIER_KERNELS_QUANT_LAYOUT_H_
#define KVTIER_KERNELS_QUANT_LAYOUT_H_

#include <cstdint>
#include <type_traits>

#include "kernels/half.h"

namespace kvtier {

// Channels per value group: 64 rather than KIVI's 32 halves the values' scales and zeros
// (4 bytes per token at head_dim 64 instead of 8) at no measured cost in perplexity
// (docs/QUALITY.md, int4-only).
inline constexpr uint32_t kValueGroup = 64;

struct QuantLayout {
  uint32_t head_dim;    // d
  uint32_t num_tokens;  // n
  uint32_t bits;        // 4 or 8

  KVTIER_HOST_DEVICE static uint64_t Align(uint64_t x) { return (x + 15) & ~uint64_t{15}; }
  KVTIER_HOST_DEVICE uint32_t groups() const { return (head_dim + kValueGroup - 1) / kValueGroup; }
  KVTIER_HOST_DEVICE uint32_t levels() const { return (1u << bits) - 1; }
  KVTIER_HOST_DEVICE uint64_t code_bytes() const {
    return (static_cast<uint64_t>(num_tokens) * head_dim * bits + 7) / 8;
  }

  KVTIER_HOST_DEVICE uint64_t key_scale() const { return 0; }
  KVTIER_HOST_DEVICE uint64_t key_zero() const { return Align(2ull * head_dim); }
  KVTIER_HOST_DEVICE uint64_t key_codes() const { return key_zero() + Align(2ull * head_dim); }
  KVTIER_HOST_DEVICE uint64_t value_scale() const { return key_codes() + Align(code_bytes()); }
  KVTIER_HOST_DEVICE uint64_t value_zero() const {
    return value_scale() + Align(2ull * num_tokens * groups());
  }
  KVTIER_HOST_DEVICE uint64_t value_codes() const {
    return value_zero() + Align(2ull * num_tokens * groups());
  }
  KVTIER_HOST_DEVICE uint64_t Bytes() const { return value_codes() + Align(code_bytes()); }

  // The alignment padding after each of the six sections, [begin, end); always zero bytes.
  static constexpr int kPaddings = 6;
  KVTIER_HOST_DEVICE void Padding(int r, uint64_t* begin, uint64_t* end) const {
    const uint64_t scales = 2ull * num_tokens * groups();
    const uint64_t starts[kPaddings] = {
        key_scale() + 2ull * head_dim, key_zero() + 2ull * head_dim, key_codes() + code_bytes(),
        value_scale() + scales,        value_zero() + scales,        value_codes() + code_bytes()};
    const uint64_t ends[kPaddings] = {key_zero(),   key_codes(),   value_scale(),
                                      value_zero(), value_codes(), Bytes()};
    *begin = starts[r];
    *end = ends[r];
  }
};

// The sections of one quantized chunk at `base`, typed. `Byte` is uint8_t or const uint8_t.
template <typename Byte>
struct QuantSections {
  using Half = std::conditional_t<std::is_const_v<Byte>, const uint16_t, uint16_t>;
  Half* key_scale;    // [d]
  Half* key_zero;     // [d]
  Byte* key_codes;    // [n][d] packed
  Half* value_scale;  // [n][G]
  Half* value_zero;   // [n][G]
  Byte* value_codes;  // [n][d] packed

  KVTIER_HOST_DEVICE QuantSections(Byte* base, const QuantLayout& L)
      : key_scale(reinterpret_cast<Half*>(base + L.key_scale())),
        key_zero(reinterpret_cast<Half*>(base + L.key_zero())),
        key_codes(base + L.key_codes()),
        value_scale(reinterpret_cast<Half*>(base + L.value_scale())),
        value_zero(reinterpret_cast<Half*>(base + L.value_zero())),
        value_codes(base + L.value_codes()) {}
};

// Reads element i (row-major over [n][d]) of a packed code array.
KVTIER_HOST_DEVICE inline uint32_t GetCode(const uint8_t* codes, uint64_t i, uint32_t bits) {
  if (bits == 8) return codes[i];
  const uint8_t b = codes[i >> 1];
  return (i & 1) ? (b >> 4) : (b & 0xf);
}

struct QuantParams {
  uint16_t scale_h;
  uint16_t zero_h;
  float scale;
  float zero;
  float inv_scale;  // 1/scale, or 0 for a constant group
};

// Parameters of a group whose values lie in [mn, mx] (finite halves).
KVTIER_HOST_DEVICE inline QuantParams MakeQuantParams(float mn, float mx, uint32_t levels) {
  // -0 and +0 compare equal, so min/max may return either, depending on the order a path
  // scans in; adding +0 maps -0 to +0 and makes the stored bits independent of that order.
  mn = mn + 0.f;
  mx = mx + 0.f;
  QuantParams p;
  p.zero_h = FloatToHalfDown(mn);
  p.zero = HalfToFloat(p.zero_h);
  p.scale_h = FloatToHalfUp((mx - p.zero) / static_cast<float>(levels));
  p.scale = HalfToFloat(p.scale_h);
  p.inv_scale = p.scale > 0.f ? 1.f / p.scale : 0.f;
  return p;
}

// MakeQuantParams over `count` halves starting at `h`, `stride` apart: a key channel over
// a chunk's tokens (stride head_dim) or a value group within a token (stride 1).
KVTIER_HOST_DEVICE inline QuantParams GroupQuantParams(const uint16_t* h, uint32_t count,
                                                       uint32_t stride, uint32_t levels) {
  float mn = HalfToFloat(h[0]), mx = mn;
  for (uint32_t i = 1; i < count; ++i) {
    const float x = HalfToFloat(h[i * stride]);
    mn = x < mn ? x : mn;
    mx = x > mx ? x : mx;
  }
  return MakeQuantParams(mn, mx, levels);
}

KVTIER_HOST_DEVICE inline uint32_t QuantizeValue(float x, const QuantParams& p, uint32_t levels) {
#if defined(__CUDA_ARCH__)
  float q = rintf(__fmul_rn(__fsub_rn(x, p.zero), p.inv_scale));
#else
  float q = __builtin_rintf((x - p.zero) * p.inv_scale);
#endif
  q = q < 0.f ? 0.f : q;
  q = q > static_cast<float>(levels) ? static_cast<float>(levels) : q;
  return static_cast<uint32_t>(q);
}

KVTIER_HOST_DEVICE inline uint16_t DequantizeValue(uint32_t code, float scale, float zero) {
#if defined(__CUDA_ARCH__)
  float y = __fadd_rn(__fmul_rn(static_cast<float>(code), scale), zero);
#else
  // Built with -ffp-contract=off (see kernels/CMakeLists.txt): multiply, then add.
  float y = static_cast<float>(code) * scale + zero;
#endif
  y = y > 65504.f ? 65504.f : (y < -65504.f ? -65504.f : y);
  return FloatToHalf(y);
}

}  // namespace kvtier

#endif  // KVTIER_KERNELS_QUANT_LAYOUT_H_
