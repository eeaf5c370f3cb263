// IEEE half and bfloat16 conversions, one definition for host code and CUDA kernels alike, so
// the CPU references and the kernels round identically. half -> float is exact; float -> half
// rounds to nearest even (FloatToHalf), towards +Inf (FloatToHalfUp) or towards -Inf
// (FloatToHalfDown).
#ifndef KVTIER_KERNELS_HALF_H_
#define KVTIER_KERNELS_HALF_H_

#include <cstdint>
#include <cstring>

#include "kernels/host_device.h"

namespace kvtier {

KVTIER_HOST_DEVICE inline uint32_t FloatBits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
#endif
}

KVTIER_HOST_DEVICE inline float BitsFloat(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
#endif
}

KVTIER_HOST_DEVICE inline float HalfToFloat(uint16_t h) {
  uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      exp = 127 - 15 + 1;
      while ((mant & 0x400u) == 0) {
        mant <<= 1;
        --exp;
      }
      mant &= 0x3ffu;
      bits = sign | (exp << 23) | (mant << 13);
    }
  } else if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  return BitsFloat(bits);
}

KVTIER_HOST_DEVICE inline uint16_t FloatToHalf(float f) {
  uint32_t x = FloatBits(f);
  uint32_t sign = (x >> 16) & 0x8000u;
  uint32_t absx = x & 0x7fffffffu;
  if (absx >= 0x7f800000u) {  // Inf or NaN
    return static_cast<uint16_t>(sign | 0x7c00u | (absx > 0x7f800000u ? 0x200u : 0));
  }
  if (absx >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // rounds to Inf
  if (absx < 0x38800000u) {  // below 2^-14: a subnormal half (value m * 2^-24) or zero
    if (absx < 0x33000000u) return static_cast<uint16_t>(sign);  // below 2^-25 rounds to 0
    uint32_t e = absx >> 23;
    uint32_t m = (absx & 0x7fffffu) | 0x800000u;  // 24-bit significand
    uint32_t shift = 126 - e;                     // m * 2^(e-150) / 2^-24 = m >> (126-e)
    uint32_t half_m = m >> shift;
    uint32_t rem = m & ((1u << shift) - 1);
    uint32_t halfway = 1u << (shift - 1);
    if (rem > halfway || (rem == halfway && (half_m & 1u))) ++half_m;  // nearest even
    return static_cast<uint16_t>(sign | half_m);
  }
  uint32_t rounded = absx + 0xfffu + ((absx >> 13) & 1u);
  return static_cast<uint16_t>(sign | ((rounded - 0x38000000u) >> 13));
}

// The next half towards +Inf (resp. -Inf) from h; Inf stays Inf.
KVTIER_HOST_DEVICE inline uint16_t HalfNextUp(uint16_t h) {
  if ((h & 0x7fffu) == 0) return 0x0001u;                // +-0 -> smallest subnormal
  if (h & 0x8000u) return static_cast<uint16_t>(h - 1);  // negative: towards zero
  return (h & 0x7fffu) >= 0x7c00u ? h : static_cast<uint16_t>(h + 1);
}
KVTIER_HOST_DEVICE inline uint16_t HalfNextDown(uint16_t h) {
  return static_cast<uint16_t>(HalfNextUp(static_cast<uint16_t>(h ^ 0x8000u)) ^ 0x8000u);
}

// Rounds towards +Inf: the smallest half >= f (f finite).
KVTIER_HOST_DEVICE inline uint16_t FloatToHalfUp(float f) {
  uint16_t h = FloatToHalf(f);
  return HalfToFloat(h) < f ? HalfNextUp(h) : h;
}
// Rounds towards -Inf: the largest half <= f (f finite).
KVTIER_HOST_DEVICE inline uint16_t FloatToHalfDown(float f) {
  uint16_t h = FloatToHalf(f);
  return HalfToFloat(h) > f ? HalfNextDown(h) : h;
}

KVTIER_HOST_DEVICE inline float Bf16ToFloat(uint16_t b) {
  return BitsFloat(static_cast<uint32_t>(b) << 16);
}

// A finite float as bfloat16, rounded to nearest even.
KVTIER_HOST_DEVICE inline uint16_t FloatToBf16(float f) {
  const uint32_t bits = FloatBits(f);
  return static_cast<uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

// Inf or NaN in a half's bit pattern.
KVTIER_HOST_DEVICE inline bool HalfIsNonFinite(uint16_t h) { return (h & 0x7c00u) == 0x7c00u; }

}  // namespace kvtier

#endif  // KVTIER_KERNELS_HALF_H_
