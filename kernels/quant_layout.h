// The byte layout of a quantized chunk, and the per-element arithmetic, shared by the CPU
// reference, the AVX2 path and the CUDA kernels (all __host__ __device__), so that they
// cannot disagree on where a byte lives or how a value rounds.
//
// KIVI-style asymmetric quantization of one chunk: n tokens (1..64), head_dim d, b bits
// (4 or 8), L = 2^b - 1 levels, K = ceil(n / 16) key spans, G = ceil(d / 64) value groups.
// Keys per channel over a span of at most 16 of the chunk's tokens (K * d key groups: tokens
// [16s, 16s + 16) of channel j form group s * d + j); values per token in groups of 64 channels
// (n * G value groups). Each group's zero and scale are stored in one byte each against a header of
// three floats shared by every key group of the chunk (and another for its value groups): the
// parameters take 2 bytes per group instead of fp16's 4. Every section starts 16-byte aligned
// (A(x) rounds x up to 16):
//
//   offset                          contents
//   0                               key_header  float [3]       zero_base, zero_step, scale_base
//   16                              key_zero    uint8 [K][d]    per span and channel
//   16+A(Kd)                        key_scale   uint8 [K][d]
//   16+2A(Kd)                       key_codes   [n][d] b-bit    row-major
//   ...+A(n*d*b/8)                  value_header float [3]
//   ...+16                          value_zero  uint8 [n][G]    per token and group
//   ...+A(nG)                       value_scale uint8 [n][G]
//   ...+A(nG)                       value_codes [n][d] b-bit    row-major
//   ...+A(n*d*b/8)                  end: Bytes()
//
// Codes are packed row-major: element i of a [n][d] array is byte i for 8 bits; for 4 bits
// it is byte i/2, the low nibble when i is even and the high nibble when odd:
//
//   byte:   |  k[0][1] : k[0][0]  |  k[0][3] : k[0][2]  | ...
//   bits:   |  7 .. 4  :  3 .. 0  |  7 .. 4  :  3 .. 0  |
//
// Parameters (EncodeParams), from each group's minimum and maximum (finite halves):
//   zero  = zero_base + zc * zero_step, zc the largest byte with zero <= the group's minimum:
//           zero_base is the smallest minimum of the groups, zero_step (largest - smallest) / 255.
//   scale = scale_base * M(sc), M(c) = (32 + c % 32) * 2^(c / 32) (32 to 8064, steps of at
//           most 1/32), sc the smallest byte with scale >= (max - zero) / L: scale_base is the
//           smallest float with scale_base * 8064 >= the largest group's (max - zero) / L.
//   So [zero, zero + L*scale] covers the group. A group needing less than 1/252 of the
//   largest need gets that scale.
// code = clamp(rint((x - zero) * (1/scale)), 0, L); x' = fp16(clamp(code*scale + zero, +-65504)),
// every multiply and add rounded separately (no FMA) everywhere. |x - x'| <= scale/2 + half an
// fp16 ulp of x'.
#ifndef KVTIER_KERNELS_QUANT_LAYOUT_H_
#define KVTIER_KERNELS_QUANT_LAYOUT_H_

#include <cstdint>
#include <type_traits>

#include "kernels/half.h"

namespace kvtier {

// Channels per value group: 64 rather than KIVI's 32 halves the values' parameters at a cost
// measured in docs/QUALITY.md (int4-only).
inline constexpr uint32_t kValueGroup = 64;
// Tokens per key group: a chunk of 32 tokens keeps two parameter sets per channel, so that its
// key error is that of a 16-token chunk's (bench/model/FINDINGS.md, finding 14).
inline constexpr uint32_t kKeySpan = 16;
// The most groups of each kind a chunk has (n <= 64 tokens, head_dim <= 512).
inline constexpr uint32_t kMaxKeyGroups = 64 / kKeySpan * 512;
inline constexpr uint32_t kMaxValueGroups = 64 * (512 / kValueGroup);

// A parameter header: three floats, padded to 16 bytes.
enum ParamHeader { kZeroBase, kZeroStep, kScaleBase, kHeaderFloats = 4 };
inline constexpr uint32_t kHeaderBytes = kHeaderFloats * sizeof(float);

struct QuantLayout {
  uint32_t head_dim;    // d
  uint32_t num_tokens;  // n
  uint32_t bits;        // 4 or 8

  KVTIER_HOST_DEVICE static uint64_t Align(uint64_t x) { return (x + 15) & ~uint64_t{15}; }
  KVTIER_HOST_DEVICE uint32_t groups() const { return (head_dim + kValueGroup - 1) / kValueGroup; }
  KVTIER_HOST_DEVICE uint32_t key_spans() const { return (num_tokens + kKeySpan - 1) / kKeySpan; }
  KVTIER_HOST_DEVICE uint32_t key_groups() const { return key_spans() * head_dim; }
  // The key group of token t's channel j.
  KVTIER_HOST_DEVICE uint32_t key_group(uint32_t t, uint32_t j) const {
    return t / kKeySpan * head_dim + j;
  }
  KVTIER_HOST_DEVICE uint32_t value_groups() const { return num_tokens * groups(); }
  KVTIER_HOST_DEVICE uint32_t levels() const { return (1u << bits) - 1; }
  KVTIER_HOST_DEVICE uint64_t code_bytes() const {
    return (static_cast<uint64_t>(num_tokens) * head_dim * bits + 7) / 8;
  }

  KVTIER_HOST_DEVICE uint64_t key_header() const { return 0; }
  KVTIER_HOST_DEVICE uint64_t key_zero() const { return kHeaderBytes; }
  KVTIER_HOST_DEVICE uint64_t key_scale() const { return key_zero() + Align(key_groups()); }
  KVTIER_HOST_DEVICE uint64_t key_codes() const { return key_scale() + Align(key_groups()); }
  KVTIER_HOST_DEVICE uint64_t value_header() const { return key_codes() + Align(code_bytes()); }
  KVTIER_HOST_DEVICE uint64_t value_zero() const { return value_header() + kHeaderBytes; }
  KVTIER_HOST_DEVICE uint64_t value_scale() const { return value_zero() + Align(value_groups()); }
  KVTIER_HOST_DEVICE uint64_t value_codes() const { return value_scale() + Align(value_groups()); }
  KVTIER_HOST_DEVICE uint64_t Bytes() const { return value_codes() + Align(code_bytes()); }

  // The padding after each section, [begin, end); always zero bytes. The headers' fourth
  // float is padding too.
  static constexpr int kPaddings = 8;
  KVTIER_HOST_DEVICE void Padding(int r, uint64_t* begin, uint64_t* end) const {
    const uint64_t header = 3 * sizeof(float);
    const uint64_t starts[kPaddings] = {
        key_header() + header,          key_zero() + key_groups(),   key_scale() + key_groups(),
        key_codes() + code_bytes(),     value_header() + header,     value_zero() + value_groups(),
        value_scale() + value_groups(), value_codes() + code_bytes()};
    const uint64_t ends[kPaddings] = {key_zero(),   key_scale(),   key_codes(),   value_header(),
                                      value_zero(), value_scale(), value_codes(), Bytes()};
    *begin = starts[r];
    *end = ends[r];
  }
};

// The sections of one quantized chunk at `base`, typed. `Byte` is uint8_t or const uint8_t.
template <typename Byte>
struct QuantSections {
  using Float = std::conditional_t<std::is_const_v<Byte>, const float, float>;
  Float* key_header;    // [kHeaderFloats]
  Byte* key_zero;       // [K][d]
  Byte* key_scale;      // [K][d]
  Byte* key_codes;      // [n][d] packed
  Float* value_header;  // [kHeaderFloats]
  Byte* value_zero;     // [n][G]
  Byte* value_scale;    // [n][G]
  Byte* value_codes;    // [n][d] packed

  KVTIER_HOST_DEVICE QuantSections(Byte* base, const QuantLayout& L)
      : key_header(reinterpret_cast<Float*>(base + L.key_header())),
        key_zero(base + L.key_zero()),
        key_scale(base + L.key_scale()),
        key_codes(base + L.key_codes()),
        value_header(reinterpret_cast<Float*>(base + L.value_header())),
        value_zero(base + L.value_zero()),
        value_scale(base + L.value_scale()),
        value_codes(base + L.value_codes()) {}
};

// Reads element i (row-major over [n][d]) of a packed code array.
KVTIER_HOST_DEVICE inline uint32_t GetCode(const uint8_t* codes, uint64_t i, uint32_t bits) {
  if (bits == 8) return codes[i];
  const uint8_t b = codes[i >> 1];
  return (i & 1) ? (b >> 4) : (b & 0xf);
}

// The extremes of `count` halves starting at `h`, `stride` apart: a key channel over a span of
// a chunk's tokens (stride head_dim) or a value group within a token (stride 1).
KVTIER_HOST_DEVICE inline void GroupRange(const uint16_t* h, uint32_t count, uint32_t stride,
                                          float* mn, float* mx) {
  float lo = HalfToFloat(h[0]), hi = lo;
  for (uint32_t i = 1; i < count; ++i) {
    const float x = HalfToFloat(h[i * stride]);
    lo = x < lo ? x : lo;
    hi = x > hi ? x : hi;
  }
  *mn = lo;
  *mx = hi;
}

// One group's parameters as the codes are computed and read.
struct QuantParams {
  float scale;
  float zero;
  float inv_scale;  // 1/scale, or 0 for a constant group
};

// The zero of zero code c and the scale of scale code c under a header.
KVTIER_HOST_DEVICE inline float ZeroOf(const float* header, uint32_t c) {
  return header[kZeroBase] + static_cast<float>(c) * header[kZeroStep];
}
KVTIER_HOST_DEVICE inline float ScaleOf(const float* header, uint32_t c) {
  return header[kScaleBase] * static_cast<float>((32u + (c & 31u)) << (c >> 5));
}
inline constexpr float kMaxScaleFactor = 8064.f;  // M(255) = 63 * 2^7

KVTIER_HOST_DEVICE inline QuantParams DecodeParams(const float* header, uint32_t zero_code,
                                                   uint32_t scale_code) {
  QuantParams p;
  p.zero = ZeroOf(header, zero_code);
  p.scale = ScaleOf(header, scale_code);
  p.inv_scale = p.scale > 0.f ? 1.f / p.scale : 0.f;
  return p;
}

// The header's zero base and step from the groups' minima, its scale base zero (set once the
// needs are known) and its padding.
KVTIER_HOST_DEVICE inline void StartHeader(const float* mn, uint32_t count, float* header) {
  // -0 and +0 compare equal, so min/max may return either, depending on the order a path
  // scans in; adding +0 maps -0 to +0 and makes the stored bits independent of that order.
  float lo = mn[0] + 0.f, hi = lo;
  for (uint32_t i = 1; i < count; ++i) {
    const float m = mn[i] + 0.f;
    lo = m < lo ? m : lo;
    hi = m > hi ? m : hi;
  }
  header[kZeroBase] = lo;
  header[kZeroStep] = (hi - lo) / 255.f;
  header[kScaleBase] = 0.f;
  header[3] = 0.f;
}

// The smallest float base with base * M(255) >= largest (>= 0, so its bits order as it does).
KVTIER_HOST_DEVICE inline float ScaleBase(float largest) {
  float base = largest / kMaxScaleFactor;
  while (base * kMaxScaleFactor < largest) base = BitsFloat(FloatBits(base) + 1);
  while (base > 0.f && BitsFloat(FloatBits(base) - 1) * kMaxScaleFactor >= largest) {
    base = BitsFloat(FloatBits(base) - 1);
  }
  return base;
}

// The header and the two codes of each of `count` groups whose values lie in [mn[i], mx[i]]
// (finite halves widened). `need` is scratch of `count` floats. Serial: a chunk has at most
// 2048 key groups and 512 value groups, against n*d codes.
KVTIER_HOST_DEVICE inline void EncodeParams(const float* mn, const float* mx, uint32_t count,
                                            uint32_t levels, float* header, uint8_t* zero_codes,
                                            uint8_t* scale_codes, float* need) {
  StartHeader(mn, count, header);
  const float lo = header[kZeroBase];
  const float step = header[kZeroStep], inv_step = step > 0.f ? 1.f / step : 0.f;
  float largest = 0.f;
  for (uint32_t i = 0; i < count; ++i) {
    const float m = mn[i] + 0.f;
    // An estimate, then exact: the largest code whose zero is at most m.
    const float r = (m - lo) * inv_step;
    uint32_t c = r >= 255.f ? 255u : static_cast<uint32_t>(r);
    while (c > 0 && ZeroOf(header, c) > m) --c;
    while (c < 255 && ZeroOf(header, c + 1) <= m) ++c;
    zero_codes[i] = static_cast<uint8_t>(c);
    need[i] = (mx[i] + 0.f - ZeroOf(header, c)) / static_cast<float>(levels);
    largest = need[i] > largest ? need[i] : largest;
  }
  const float base = ScaleBase(largest);
  header[kScaleBase] = base;
  const float inv_base = base > 0.f ? 1.f / base : 0.f;
  for (uint32_t i = 0; i < count; ++i) {
    // An estimate from the exponent of need / base, then exact: the smallest code whose scale
    // covers the need.
    const float r = need[i] * inv_base;
    uint32_t c = 0;
    if (r > 32.f) {
      const uint32_t e = ((FloatBits(r) >> 23) & 0xffu) - 132u;  // floor(log2 r) - 5, >= 0
      const uint32_t octave = e > 7 ? 7 : e;
      const float m = r * BitsFloat((127u - octave) << 23) - 32.f;  // r / 2^octave - 32
      const uint32_t mi = m >= 31.f ? 31u : static_cast<uint32_t>(m);
      c = octave * 32 + mi;
    }
    while (c < 255 && ScaleOf(header, c) < need[i]) ++c;
    while (c > 0 && ScaleOf(header, c - 1) >= need[i]) --c;
    scale_codes[i] = static_cast<uint8_t>(c);
  }
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
