#include "server/quant/chunk_quant.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "server/common/vec.h"

namespace kvtier {
namespace {

// 8 codes (uint32 lanes, each <= 15 or <= 255) packed into `out`: 4 bytes for 4 bits, 8 for 8.
__attribute__((target("avx2"))) inline void Pack8(__m256i codes, uint32_t bits, uint8_t* out) {
  if (bits == 4) {
    // Odd lanes move up a nibble; adjacent lanes add into one byte each: [c0|c1<<4, ...].
    __m256i v = _mm256_sllv_epi32(codes, _mm256_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4));
    v = _mm256_hadd_epi32(v, v);  // per 128-bit half: b0 b1 b0 b1 | b2 b3 b2 b3
    v = _mm256_permutevar8x32_epi32(v, _mm256_setr_epi32(0, 1, 4, 5, 0, 0, 0, 0));
    __m128i w = _mm_packus_epi32(_mm256_castsi256_si128(v), _mm256_castsi256_si128(v));
    w = _mm_packus_epi16(w, w);
    const uint32_t word = static_cast<uint32_t>(_mm_cvtsi128_si32(w));
    std::memcpy(out, &word, 4);
  } else {
    __m128i lo = _mm256_castsi256_si128(codes), hi = _mm256_extracti128_si256(codes, 1);
    __m128i w = _mm_packus_epi16(_mm_packus_epi32(lo, hi), _mm_setzero_si128());
    _mm_storel_epi64(reinterpret_cast<__m128i*>(out), w);
  }
}

// 32 consecutive codes (c0: elements 0..7, c1: 8..15, c2: 16..23, c3: 24..31) packed into
// `out`: 16 bytes for 4 bits, 32 for 8. Same bytes as four Pack8 calls.
__attribute__((target("avx2"))) inline void Pack32(__m256i c0, __m256i c1, __m256i c2, __m256i c3,
                                                   uint32_t bits, uint8_t* out) {
  // Saturating packs work within 128-bit lanes: bytes come out as dwords of elements
  // [0-3 8-11 16-19 24-27 | 4-7 12-15 20-23 28-31]; one permute puts them in order.
  const __m256i b = _mm256_permutevar8x32_epi32(
      _mm256_packus_epi16(_mm256_packus_epi32(c0, c1), _mm256_packus_epi32(c2, c3)),
      _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  if (bits == 8) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), b);
    return;
  }
  // Adjacent bytes into one: even + 16 * odd (the odd element in the high nibble).
  const __m256i pairs = _mm256_maddubs_epi16(b, _mm256_set1_epi16(0x1001));
  const __m256i packed = _mm256_packus_epi16(pairs, pairs);  // per lane: 8 bytes, twice
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out),
                   _mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0x08)));
}

// 8 codes starting at element i (i a multiple of 8) as float lanes.
__attribute__((target("avx2"))) inline __m256 Unpack8(const uint8_t* codes, uint64_t i,
                                                      uint32_t bits) {
  __m256i v;
  if (bits == 8) {
    v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + i)));
  } else {
    uint32_t word;
    std::memcpy(&word, codes + i / 2, 4);
    v = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(word)),
                                           _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28)),
                         _mm256_set1_epi32(0xf));
  }
  return _mm256_cvtepi32_ps(v);
}

// Eight halves as floats.
__attribute__((target("avx2,f16c"))) inline __m256 LoadHalf8(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// code = clamp(rint((x - zero) * inv), 0, L), with the reference's operation order. Clamping
// before rounding gives the same code (0 and L are integers and rounding is monotonic), and
// the conversion rounds to nearest even under the default MXCSR, as rint does.
__attribute__((target("avx2"))) inline __m256i Quantize8(__m256 x, __m256 zero, __m256 inv,
                                                         __m256 levels) {
  __m256 q = _mm256_mul_ps(_mm256_sub_ps(x, zero), inv);
  q = _mm256_min_ps(_mm256_max_ps(q, _mm256_setzero_ps()), levels);
  return _mm256_cvtps_epi32(q);
}

// Codes of channels c..c+7 of one key row, with those channels' parameters.
__attribute__((target("avx2,f16c"))) inline __m256i KeyCodes8(const uint16_t* row,
                                                              const float* zero, const float* inv,
                                                              uint32_t c, __m256 levels) {
  return Quantize8(LoadHalf8(row + c), _mm256_load_ps(zero + c), _mm256_load_ps(inv + c), levels);
}

// fp16(clamp(code * scale + zero, +-65504)), multiply and add rounded separately.
__attribute__((target("avx2,f16c"))) inline __m128i Dequantize8(__m256 code, __m256 scale,
                                                                __m256 zero) {
  __m256 y = _mm256_add_ps(_mm256_mul_ps(code, scale), zero);
  y = _mm256_min_ps(_mm256_max_ps(y, _mm256_set1_ps(-65504.f)), _mm256_set1_ps(65504.f));
  return _mm256_cvtps_ph(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}

// ZeroOf and ScaleOf (quant_layout.h) of 8 codes, the same operations.
__attribute__((target("avx2"))) inline __m256 ZeroOf8(__m256 base, __m256 step, __m256i c) {
  return _mm256_add_ps(base, _mm256_mul_ps(_mm256_cvtepi32_ps(c), step));
}
__attribute__((target("avx2"))) inline __m256 ScaleOf8(__m256 base, __m256i c) {
  const __m256i mant =
      _mm256_add_epi32(_mm256_set1_epi32(32), _mm256_and_si256(c, _mm256_set1_epi32(31)));
  return _mm256_mul_ps(base, _mm256_cvtepi32_ps(_mm256_sllv_epi32(mant, _mm256_srli_epi32(c, 5))));
}

// EncodeParams (quant_layout.h) eight groups at a time, to the same bytes: each code is the
// unique extreme its definition names, so an estimate adjusted until no lane moves gives it
// whatever the estimate was. Also each group's zero and 1/scale into zero_out and inv_out.
// mn and mx hold `count` groups and are readable (any values) up to count rounded up to 8.
__attribute__((target("avx2,f16c"))) void EncodeParamsAvx2(const float* mn, const float* mx,
                                                           uint32_t count, uint32_t levels,
                                                           float* header, uint8_t* zero_codes,
                                                           uint8_t* scale_codes, float* zero_out,
                                                           float* inv_out) {
  StartHeader(mn, count, header);
  const float lo = header[kZeroBase];
  const float step = header[kZeroStep], inv_step = step > 0.f ? 1.f / step : 0.f;
  const __m256 vlo = _mm256_set1_ps(lo), vstep = _mm256_set1_ps(step), pz = _mm256_setzero_ps();
  const __m256i one = _mm256_set1_epi32(1), zero_i = _mm256_setzero_si256(),
                top = _mm256_set1_epi32(255);
  const uint32_t padded = (count + 7) / 8 * 8;
  alignas(32) int32_t zc[kMaxKeyGroups], sc[kMaxKeyGroups];
  alignas(32) float need[kMaxKeyGroups];
  for (uint32_t i = 0; i < padded; i += 8) {
    const __m256 m = _mm256_add_ps(_mm256_loadu_ps(mn + i), pz);
    const __m256 r = _mm256_mul_ps(_mm256_sub_ps(m, vlo), _mm256_set1_ps(inv_step));
    __m256i c = _mm256_cvttps_epi32(_mm256_min_ps(_mm256_max_ps(r, pz), _mm256_set1_ps(255.f)));
    for (;;) {  // down while the zero is above the minimum
      const __m256i dn = _mm256_and_si256(
          _mm256_cmpgt_epi32(c, zero_i),
          _mm256_castps_si256(_mm256_cmp_ps(ZeroOf8(vlo, vstep, c), m, _CMP_GT_OQ)));
      if (_mm256_testz_si256(dn, dn)) break;
      c = _mm256_add_epi32(c, dn);  // dn lanes are -1
    }
    for (;;) {  // up while the next zero is still at or below it
      const __m256i up =
          _mm256_and_si256(_mm256_cmpgt_epi32(top, c),
                           _mm256_castps_si256(_mm256_cmp_ps(
                               ZeroOf8(vlo, vstep, _mm256_add_epi32(c, one)), m, _CMP_LE_OQ)));
      if (_mm256_testz_si256(up, up)) break;
      c = _mm256_sub_epi32(c, up);
    }
    const __m256 z = ZeroOf8(vlo, vstep, c);
    _mm256_store_si256(reinterpret_cast<__m256i*>(zc + i), c);
    _mm256_storeu_ps(zero_out + i, z);
    _mm256_store_ps(need + i,
                    _mm256_div_ps(_mm256_sub_ps(_mm256_add_ps(_mm256_loadu_ps(mx + i), pz), z),
                                  _mm256_set1_ps(static_cast<float>(levels))));
  }
  float largest = 0.f;
  for (uint32_t i = 0; i < count; ++i) largest = need[i] > largest ? need[i] : largest;
  const float base = ScaleBase(largest);
  header[kScaleBase] = base;
  const __m256 vbase = _mm256_set1_ps(base);
  const __m256 inv_base = _mm256_set1_ps(base > 0.f ? 1.f / base : 0.f);

  for (uint32_t i = 0; i < padded; i += 8) {
    const __m256 nd = _mm256_load_ps(need + i);
    // The estimate: octave * 32 + the mantissa's step, from need / base (0 below 32).
    const __m256 r = _mm256_mul_ps(nd, inv_base);
    const __m256i e = _mm256_sub_epi32(
        _mm256_and_si256(_mm256_srli_epi32(_mm256_castps_si256(r), 23), _mm256_set1_epi32(0xff)),
        _mm256_set1_epi32(132));
    const __m256i octave = _mm256_min_epi32(_mm256_max_epi32(e, zero_i), _mm256_set1_epi32(7));
    const __m256 pow = _mm256_castsi256_ps(
        _mm256_slli_epi32(_mm256_sub_epi32(_mm256_set1_epi32(127), octave), 23));  // 2^-octave
    const __m256 frac = _mm256_sub_ps(_mm256_mul_ps(r, pow), _mm256_set1_ps(32.f));
    const __m256i mi =
        _mm256_cvttps_epi32(_mm256_min_ps(_mm256_max_ps(frac, pz), _mm256_set1_ps(31.f)));
    __m256i c = _mm256_add_epi32(_mm256_slli_epi32(octave, 5), mi);
    c = _mm256_and_si256(c,
                         _mm256_castps_si256(_mm256_cmp_ps(r, _mm256_set1_ps(32.f), _CMP_GT_OQ)));
    for (;;) {  // up while the scale does not cover the need
      const __m256i up =
          _mm256_and_si256(_mm256_cmpgt_epi32(top, c),
                           _mm256_castps_si256(_mm256_cmp_ps(ScaleOf8(vbase, c), nd, _CMP_LT_OQ)));
      if (_mm256_testz_si256(up, up)) break;
      c = _mm256_sub_epi32(c, up);
    }
    for (;;) {  // down while the code below still covers it
      const __m256i dn =
          _mm256_and_si256(_mm256_cmpgt_epi32(c, zero_i),
                           _mm256_castps_si256(_mm256_cmp_ps(
                               ScaleOf8(vbase, _mm256_sub_epi32(c, one)), nd, _CMP_GE_OQ)));
      if (_mm256_testz_si256(dn, dn)) break;
      c = _mm256_add_epi32(c, dn);
    }
    const __m256 scale = ScaleOf8(vbase, c);
    const __m256 inv = _mm256_blendv_ps(pz, _mm256_div_ps(_mm256_set1_ps(1.f), scale),
                                        _mm256_cmp_ps(scale, pz, _CMP_GT_OQ));
    _mm256_store_si256(reinterpret_cast<__m256i*>(sc + i), c);
    _mm256_storeu_ps(inv_out + i, inv);
  }
  for (uint32_t i = 0; i < count; ++i) {
    zero_codes[i] = static_cast<uint8_t>(zc[i]);
    scale_codes[i] = static_cast<uint8_t>(sc[i]);
  }
}

__attribute__((target("avx2,f16c"))) void QuantizeAvx2(const uint16_t* keys, const uint16_t* values,
                                                       const QuantLayout& L, uint8_t* out) {
  const uint32_t n = L.num_tokens, d = L.head_dim, levels = L.levels(), G = L.groups();
  // Every code and parameter is written below; only the padding needs zeroing.
  for (int r = 0; r < QuantLayout::kPaddings; ++r) {
    uint64_t begin, end;
    L.Padding(r, &begin, &end);
    std::memset(out + begin, 0, end - begin);
  }
  const __m256 lv = _mm256_set1_ps(static_cast<float>(levels));
  const QuantSections<uint8_t> q(out, L);
  const uint32_t code_step = L.bits == 8 ? 8 : 4;  // bytes per 8 codes
  // Keys: each channel's range over each span of tokens, 8 channels at a time; then each token
  // row's codes, 32 channels at a time where d allows.
  // The ranges are taken row by row so that the chunk streams in address order.
  alignas(32) float kzero[kMaxKeyGroups], kinv[kMaxKeyGroups], kmn[kMaxKeyGroups],
      kmx[kMaxKeyGroups];
  for (uint32_t t = 0; t < n; ++t) {
    const uint16_t* row = keys + t * d;
    float* mn = kmn + L.key_group(t, 0);
    float* mx = kmx + L.key_group(t, 0);
    if (t % kKeySpan == 0) {  // a span's first row
      for (uint32_t j = 0; j < d; j += 8) {
        const __m256 x = LoadHalf8(row + j);
        _mm256_store_ps(mn + j, x);
        _mm256_store_ps(mx + j, x);
      }
      continue;
    }
    for (uint32_t j = 0; j < d; j += 8) {
      const __m256 x = LoadHalf8(row + j);
      _mm256_store_ps(mn + j, _mm256_min_ps(_mm256_load_ps(mn + j), x));
      _mm256_store_ps(mx + j, _mm256_max_ps(_mm256_load_ps(mx + j), x));
    }
  }
  // Every one of the key_groups() ranges is written above (d % 8 == 0, so none is padding);
  // gcc cannot see it through the span loop, and zeroing 16 KiB per chunk would cost more.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
  EncodeParamsAvx2(kmn, kmx, L.key_groups(), levels, q.key_header, q.key_zero, q.key_scale, kzero,
                   kinv);
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
  for (uint32_t t = 0; t < n; ++t) {
    const uint16_t* row = keys + t * d;
    const float* zero = kzero + L.key_group(t, 0);
    const float* inv = kinv + L.key_group(t, 0);
    uint32_t j = 0;
    for (; j + 32 <= d; j += 32) {
      Pack32(KeyCodes8(row, zero, inv, j, lv), KeyCodes8(row, zero, inv, j + 8, lv),
             KeyCodes8(row, zero, inv, j + 16, lv), KeyCodes8(row, zero, inv, j + 24, lv), L.bits,
             q.key_codes + (uint64_t{t} * d + j) / 8 * code_step);
    }
    for (; j < d; j += 8) {
      Pack8(KeyCodes8(row, zero, inv, j, lv), L.bits,
            q.key_codes + (uint64_t{t} * d + j) / 8 * code_step);
    }
  }
  // Values: per token, groups of kValueGroup channels (d % 8 == 0 here). First every group's range,
  // then the parameters, then the codes.
  const uint32_t groups = L.value_groups();
  // EncodeParamsAvx2 reads up to 8 groups at a time: the lanes past the last group are zeroed
  // (only those: the whole arrays are 4 KiB, as much as a chunk's keys and values at d 64).
  alignas(32) float gmn[kMaxValueGroups], gmx[kMaxValueGroups], gzero[kMaxValueGroups],
      ginv[kMaxValueGroups];
  for (uint32_t i = groups; i < (groups + 7) / 8 * 8; ++i) gmn[i] = gmx[i] = 0.f;
  for (uint32_t t = 0; t < n; ++t) {
    const uint16_t* row = values + t * d;
    for (uint32_t g = 0; g < G; ++g) {
      const uint32_t lo = g * kValueGroup, hi = std::min(d, lo + kValueGroup);
      __m256 mn = LoadHalf8(row + lo), mx = mn;
      for (uint32_t j = lo + 8; j < hi; j += 8) {
        __m256 x = LoadHalf8(row + j);
        mn = _mm256_min_ps(mn, x);
        mx = _mm256_max_ps(mx, x);
      }
      // Horizontal min and max of the 8 lanes.
      __m128 m4 = _mm_min_ps(_mm256_castps256_ps128(mn), _mm256_extractf128_ps(mn, 1));
      m4 = _mm_min_ps(m4, _mm_movehl_ps(m4, m4));
      m4 = _mm_min_ss(m4, _mm_shuffle_ps(m4, m4, 1));
      __m128 x4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
      x4 = _mm_max_ps(x4, _mm_movehl_ps(x4, x4));
      x4 = _mm_max_ss(x4, _mm_shuffle_ps(x4, x4, 1));
      gmn[t * G + g] = _mm_cvtss_f32(m4);
      gmx[t * G + g] = _mm_cvtss_f32(x4);
    }
  }
  EncodeParamsAvx2(gmn, gmx, groups, levels, q.value_header, q.value_zero, q.value_scale, gzero,
                   ginv);
  for (uint32_t t = 0; t < n; ++t) {
    const uint16_t* row = values + t * d;
    for (uint32_t g = 0; g < G; ++g) {
      const uint32_t lo = g * kValueGroup, hi = std::min(d, lo + kValueGroup);
      const __m256 zero = _mm256_set1_ps(gzero[t * G + g]), inv = _mm256_set1_ps(ginv[t * G + g]);
      uint8_t* dst = q.value_codes + (uint64_t{t} * d + lo) / 8 * code_step;
      uint32_t j = lo;
      for (; j + 32 <= hi; j += 32, dst += 4 * code_step) {
        Pack32(Quantize8(LoadHalf8(row + j), zero, inv, lv),
               Quantize8(LoadHalf8(row + j + 8), zero, inv, lv),
               Quantize8(LoadHalf8(row + j + 16), zero, inv, lv),
               Quantize8(LoadHalf8(row + j + 24), zero, inv, lv), L.bits, dst);
      }
      for (; j < hi; j += 8, dst += code_step) {
        Pack8(Quantize8(LoadHalf8(row + j), zero, inv, lv), L.bits, dst);
      }
    }
  }
}

__attribute__((target("avx2,f16c"))) void DequantizeAvx2(const uint8_t* in, const QuantLayout& L,
                                                         uint16_t* keys_out, uint16_t* values_out) {
  const uint32_t n = L.num_tokens, d = L.head_dim, G = L.groups();
  const QuantSections<const uint8_t> q(in, L);
  alignas(32) float kscale[kMaxKeyGroups], kzero[kMaxKeyGroups];
  for (uint32_t g = 0; g < L.key_groups(); ++g) {
    kscale[g] = ScaleOf(q.key_header, q.key_scale[g]);
    kzero[g] = ZeroOf(q.key_header, q.key_zero[g]);
  }
  for (uint32_t t = 0; t < n; ++t) {
    for (uint32_t j = 0; j < d; j += 8) {
      const __m256 scale = _mm256_load_ps(kscale + L.key_group(t, j));
      const __m256 zero = _mm256_load_ps(kzero + L.key_group(t, j));
      const uint64_t i = uint64_t{t} * d + j;
      _mm_storeu_si128(reinterpret_cast<__m128i*>(keys_out + i),
                       Dequantize8(Unpack8(q.key_codes, i, L.bits), scale, zero));
    }
  }
  for (uint32_t t = 0; t < n; ++t) {
    for (uint32_t g = 0; g < G; ++g) {
      const __m256 scale = _mm256_set1_ps(ScaleOf(q.value_header, q.value_scale[t * G + g]));
      const __m256 zero = _mm256_set1_ps(ZeroOf(q.value_header, q.value_zero[t * G + g]));
      const uint32_t lo = g * kValueGroup, hi = std::min(d, lo + kValueGroup);
      for (uint32_t j = lo; j < hi; j += 8) {
        const uint64_t i = uint64_t{t} * d + j;
        _mm_storeu_si128(reinterpret_cast<__m128i*>(values_out + i),
                         Dequantize8(Unpack8(q.value_codes, i, L.bits), scale, zero));
      }
    }
  }
}

// The index of the first 16-half block with an Inf or NaN (exponent all ones), or n rounded
// down to 16: everything before it is finite.
__attribute__((target("avx2"))) uint64_t SkipFinite(const uint16_t* h, uint64_t n) {
  const __m256i mask = _mm256_set1_epi16(0x7c00);
  uint64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m256i v = _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(h + i)), mask);
    if (_mm256_movemask_epi8(_mm256_cmpeq_epi16(v, mask)) != 0) return i;
  }
  return i;
}

// The exponent bits of `kind`: all ones means Inf or NaN.
uint16_t ExponentMask(HalfKind kind) { return kind == HalfKind::kFp16 ? 0x7c00u : 0x7f80u; }

// Stores 16 halves at dst: past the cache (dst 32-byte aligned), or as usual.
__attribute__((target("avx2"))) inline void Store16(bool stream, uint16_t* dst, __m256i v) {
  if (stream) {
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst), v);
  } else {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), v);
  }
}

// Lanes of `v` whose exponent bits under `mask` are all ones, as all-ones lanes.
__attribute__((target("avx2"))) inline __m256i NonFinite(__m256i v, __m256i mask) {
  return _mm256_cmpeq_epi16(_mm256_and_si256(v, mask), mask);
}

// CopyFinite's AVX2 path over whole 64-half blocks (the caller copies the tail): each block is
// copied as it is read, and its exponents checked. False at the first block that holds an
// all-ones exponent under `mask_bits`.
__attribute__((target("avx2"))) bool CopyFiniteAvx2(uint16_t mask_bits, bool stream, uint16_t* dst,
                                                    const uint16_t* src, uint64_t blocks) {
  const __m256i mask = _mm256_set1_epi16(static_cast<short>(mask_bits));
  for (uint64_t b = 0; b < blocks; ++b, src += 64, dst += 64) {
    const __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
    const __m256i v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 16));
    const __m256i v2 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 32));
    const __m256i v3 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 48));
    Store16(stream, dst, v0);
    Store16(stream, dst + 16, v1);
    Store16(stream, dst + 32, v2);
    Store16(stream, dst + 48, v3);
    const __m256i any = _mm256_or_si256(_mm256_or_si256(NonFinite(v0, mask), NonFinite(v1, mask)),
                                        _mm256_or_si256(NonFinite(v2, mask), NonFinite(v3, mask)));
    if (!_mm256_testz_si256(any, any)) return false;
  }
  return true;
}

// Eight halves of `kind` as floats.
__attribute__((target("avx2,f16c"))) inline __m256 HalvesToFloats(HalfKind kind, __m128i h) {
  return kind == HalfKind::kFp16
             ? _mm256_cvtph_ps(h)
             : _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// CopyFiniteRows' AVX2 path, d a multiple of 16: row by row, each 16 halves copied, checked
// and added to sums as floats (each lane's rows in order, as AddRows adds them).
__attribute__((target("avx2,f16c"))) bool CopyFiniteRowsAvx2(HalfKind kind, bool stream,
                                                             uint16_t* dst, const uint16_t* src,
                                                             uint32_t rows, int d, float* sums) {
  const __m256i mask = _mm256_set1_epi16(static_cast<short>(ExponentMask(kind)));
  for (uint32_t r = 0; r < rows; ++r, src += d, dst += d) {
    __m256i any = _mm256_setzero_si256();
    for (int j = 0; j < d; j += 16) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + j));
      Store16(stream, dst + j, v);
      any = _mm256_or_si256(any, NonFinite(v, mask));
      _mm256_storeu_ps(sums + j, _mm256_add_ps(_mm256_loadu_ps(sums + j),
                                               HalvesToFloats(kind, _mm256_castsi256_si128(v))));
      _mm256_storeu_ps(sums + j + 8,
                       _mm256_add_ps(_mm256_loadu_ps(sums + j + 8),
                                     HalvesToFloats(kind, _mm256_extracti128_si256(v, 1))));
    }
    if (!_mm256_testz_si256(any, any)) return false;
  }
  return true;
}

}  // namespace

bool CopyFiniteReference(HalfKind kind, uint16_t* dst, const uint16_t* src, uint64_t n) {
  const uint16_t mask = ExponentMask(kind);
  uint16_t bad = 0;
  for (uint64_t i = 0; i < n; ++i) {
    dst[i] = src[i];
    bad |= static_cast<uint16_t>((src[i] & mask) == mask);
  }
  return bad == 0;
}

bool CopyFinite(HalfKind kind, uint16_t* dst, const uint16_t* src, uint64_t n, bool stream) {
  uint64_t done = 0;
  if (AddRowsIsVectorized()) {
    stream = stream && reinterpret_cast<uintptr_t>(dst) % 32 == 0;
    done = n / 64 * 64;
    if (!CopyFiniteAvx2(ExponentMask(kind), stream, dst, src, n / 64)) return false;
  }
  return CopyFiniteReference(kind, dst + done, src + done, n - done);
}

void FenceStreamedStores() {
  if (AddRowsIsVectorized()) _mm_sfence();
}

bool CopyFiniteRows(HalfKind kind, uint16_t* dst, const uint16_t* src, uint32_t rows, int d,
                    float* sums, bool stream) {
  if (AddRowsIsVectorized() && d % 16 == 0) {
    stream = stream && reinterpret_cast<uintptr_t>(dst) % 32 == 0;
    return CopyFiniteRowsAvx2(kind, stream, dst, src, rows, d, sums);
  }
  if (!CopyFiniteReference(kind, dst, src, uint64_t{rows} * d)) return false;
  AddRows(kind, dst, static_cast<int>(rows), d, sums);
  return true;
}

bool QuantIsVectorized(const QuantLayout& layout) {
  return AddRowsIsVectorized() && layout.head_dim % 8 == 0;
}

void QuantizeChunk(const uint16_t* keys, const uint16_t* values, const QuantLayout& layout,
                   uint8_t* out) {
  if (QuantIsVectorized(layout)) {
    QuantizeAvx2(keys, values, layout, out);
  } else {
    QuantizeChunkReference(keys, values, layout, out);
  }
}

void DequantizeChunk(const uint8_t* in, const QuantLayout& layout, uint16_t* keys_out,
                     uint16_t* values_out) {
  if (QuantIsVectorized(layout)) {
    DequantizeAvx2(in, layout, keys_out, values_out);
  } else {
    DequantizeChunkReference(in, layout, keys_out, values_out);
  }
}

bool MatchesQuantizedRow(const uint8_t* quant, const QuantLayout& L, uint32_t row,
                         const uint16_t* k_row, const uint16_t* v_row) {
  const uint32_t d = L.head_dim, G = L.groups();
  const QuantSections<const uint8_t> q(quant, L);
  auto close = [](uint16_t stored, float scale, uint16_t given) {
    const float y = HalfToFloat(stored), x = HalfToFloat(given);
    const uint16_t a = FloatToHalf(y < 0 ? -y : y);
    const float half_ulp = (HalfToFloat(HalfNextUp(a)) - HalfToFloat(a)) / 2;
    const float diff = x > y ? x - y : y - x;
    return diff <= scale / 2 * (1 + 1e-6f) + half_ulp;
  };
  for (uint32_t j = 0; j < d; ++j) {
    const uint64_t i = uint64_t{row} * d + j;
    const uint32_t g = row * G + j / kValueGroup, kg = L.key_group(row, j);
    const float kscale = ScaleOf(q.key_header, q.key_scale[kg]);
    const float vscale = ScaleOf(q.value_header, q.value_scale[g]);
    const uint16_t k = DequantizeValue(GetCode(q.key_codes, i, L.bits), kscale,
                                       ZeroOf(q.key_header, q.key_zero[kg]));
    const uint16_t v = DequantizeValue(GetCode(q.value_codes, i, L.bits), vscale,
                                       ZeroOf(q.value_header, q.value_zero[g]));
    if (!close(k, kscale, k_row[j]) || !close(v, vscale, v_row[j])) return false;
  }
  return true;
}

int64_t FindNonFinite(HalfKind kind, const uint16_t* h, uint64_t n) {
  if (kind == HalfKind::kFp16) return FindNonFinite(h, n);
  for (uint64_t i = 0; i < n; ++i) {
    if ((h[i] & 0x7f80u) == 0x7f80u) return static_cast<int64_t>(i);
  }
  return -1;
}

absl::Status CheckQuantHeaders(const uint8_t* quant, const QuantLayout& L, absl::string_view what) {
  const QuantSections<const uint8_t> q(quant, L);
  for (const auto& [name, header] : {std::pair{"key", q.key_header}, {"value", q.value_header}}) {
    float h[kHeaderFloats];
    std::memcpy(h, header, sizeof(h));
    const bool ok = std::abs(h[kZeroBase]) <= 65504.f && h[kZeroStep] >= 0.f &&
                    h[kZeroStep] <= 65504.f && h[kScaleBase] >= 0.f && h[kScaleBase] <= 65504.f;
    if (!ok) {  // NaN fails every comparison above
      return absl::DataLossError(absl::StrCat(
          what, ": a cold chunk's ", name, " parameters are not an encoder's (zero base ",
          h[kZeroBase], ", step ", h[kZeroStep], ", scale base ", h[kScaleBase], ")"));
    }
  }
  return absl::OkStatus();
}

int64_t FindNonFinite(const uint16_t* h, uint64_t n) {
  uint64_t i = 0;
  if (AddRowsIsVectorized()) i = SkipFinite(h, n);  // to the first block that holds one
  for (; i < n; ++i) {
    if (HalfIsNonFinite(h[i])) return static_cast<int64_t>(i);
  }
  return -1;
}

}  // namespace kvtier
