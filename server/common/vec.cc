#include "server/common/vec.h"

#include <cpuid.h>
// GCC 12 warns that its AVX-512 intrinsics' own placeholder operand (__Y) may be used
// uninitialized, a false positive naming the header's lines: silenced there alone.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop
#else
#include <immintrin.h>
#endif

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

#include "absl/container/inlined_vector.h"
#include "server/common/check.h"
#include "server/common/fp16.h"

namespace kvtier {
namespace {

__attribute__((target("avx2,f16c"))) void AddRowsAvx2(HalfKind kind, const uint16_t* rows, int n,
                                                      int d, float* sum) {
  int j = 0;
  for (; j + 8 <= d; j += 8) {
    __m256 acc = _mm256_loadu_ps(sum + j);
    for (int r = 0; r < n; ++r) {
      __m128i h =
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows + static_cast<size_t>(r) * d + j));
      __m256 f = kind == HalfKind::kFp16
                     ? _mm256_cvtph_ps(h)
                     : _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
      acc = _mm256_add_ps(acc, f);
    }
    _mm256_storeu_ps(sum + j, acc);
  }
  if (j < d) {  // the last d % 8 channels
    for (int r = 0; r < n; ++r) {
      const uint16_t* row = rows + static_cast<size_t>(r) * d;
      for (int k = j; k < d; ++k) {
        sum[k] += kind == HalfKind::kFp16 ? HalfToFloat(row[k]) : Bf16ToFloat(row[k]);
      }
    }
  }
}

// cpuid leaf 1 ECX: FMA bit 12, OSXSAVE bit 27, F16C bit 29; leaf 7 EBX: AVX2 bit 5; and the
// OS must save the YMM registers (XCR0 bits 1 and 2). Not __builtin_cpu_supports: clang 14
// does not know "f16c".
// AVX-512F (the exponential's and logarithm's sixteen lanes): leaf 7 EBX bit 16 and the OS
// saving the opmask and upper ZMM state (XCR0 bits 5 to 7). AVX-512 VNNI with VL (its 256-bit
// forms, 32 vector registers): AVX-512F, leaf 7 EBX AVX512VL bit 31 and ECX AVX512_VNNI bit 11.
struct CpuFeatures {
  bool avx2 = false, fma = false, f16c = false, vnni = false, avx512f = false;
  CpuFeatures() {
    unsigned a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d)) return;
    const bool osxsave = c & (1u << 27);
    fma = c & (1u << 12);
    f16c = c & (1u << 29);
    unsigned xcr0 = 0;
    if (osxsave) {
      unsigned hi;
      __asm__("xgetbv" : "=a"(xcr0), "=d"(hi) : "c"(0));
    }
    const bool ymm = osxsave && (xcr0 & 6u) == 6u;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return;
    avx2 = ymm && (b & (1u << 5));
    avx512f = avx2 && (xcr0 & 0xE0u) == 0xE0u && (b & (1u << 16));
    vnni = avx512f && (b & (1u << 31)) && (c & (1u << 11));
    fma = fma && ymm;
    f16c = f16c && ymm;
  }
};

const CpuFeatures& Cpu() {
  static const CpuFeatures features;
  return features;
}

bool HaveAvx2F16c() { return Cpu().avx2 && Cpu().f16c; }

bool HaveAvx2Fma() { return Cpu().avx2 && Cpu().fma; }

// The sum of the 16 lanes of two accumulators, in the order the dot products below share.
__attribute__((target("avx"))) inline float SumLanes(__m256 acc0, __m256 acc1) {
  const __m256 acc = _mm256_add_ps(acc0, acc1);
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  s = _mm_hadd_ps(s, s);
  s = _mm_hadd_ps(s, s);
  return _mm_cvtss_f32(s);
}

__attribute__((target("avx2,fma"))) float DotAvx2(const float* a, const float* b, int n) {
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  int j = 0;
  for (; j + 16 <= n; j += 16) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + j), _mm256_loadu_ps(b + j), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + j + 8), _mm256_loadu_ps(b + j + 8), acc1);
  }
  for (; j + 8 <= n; j += 8) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + j), _mm256_loadu_ps(b + j), acc0);
  }
  float out = SumLanes(acc0, acc1);
  for (; j < n; ++j) out += a[j] * b[j];
  return out;
}

__attribute__((target("avx2,fma,f16c"))) inline __m256 Widen8(HalfKind kind, const uint16_t* h) {
  const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(h));
  return kind == HalfKind::kFp16
             ? _mm256_cvtph_ps(x)
             : _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(x), 16));
}

__attribute__((target("avx2,fma,f16c"))) float DotHalvesAvx2(HalfKind kind, const float* a,
                                                             const uint16_t* h, int n) {
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  int j = 0;
  for (; j + 16 <= n; j += 16) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + j), Widen8(kind, h + j), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + j + 8), Widen8(kind, h + j + 8), acc1);
  }
  for (; j + 8 <= n; j += 8)
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + j), Widen8(kind, h + j), acc0);
  float out = SumLanes(acc0, acc1);
  for (; j < n; ++j)
    out += a[j] * (kind == HalfKind::kFp16 ? HalfToFloat(h[j]) : Bf16ToFloat(h[j]));
  return out;
}

// The largest query group with a kernel of its own (larger groups go head by head).
constexpr int kMaxGroup = 8;

// G vectors of `a` against one vector `x` of n elements of a kind E (E::Load widens eight to
// floats, E::Value one), each summed exactly as DotHalvesAvx2 sums one: two
// accumulators over sixteen, then eight, SumLanes, then the tail. The group size is a template
// argument, so that the accumulators stay in registers, and the elements are widened once for
// the whole group (a query group against a key row).
template <HalfKind K>
struct HalfElements {
  using T = uint16_t;
  __attribute__((target("avx2,fma,f16c"))) static __m256 Load(const uint16_t* p) {
    return Widen8(K, p);
  }
  static float Value(uint16_t v) { return K == HalfKind::kFp16 ? HalfToFloat(v) : Bf16ToFloat(v); }
};
template <int G, typename E>
__attribute__((target("avx2,fma,f16c"))) inline void GroupDotAvx2(const float* a,
                                                                  const typename E::T* x, int n,
                                                                  float* out, int out_group) {
  __m256 acc0[G], acc1[G];
#pragma GCC unroll 8
  for (int g = 0; g < G; ++g) acc0[g] = acc1[g] = _mm256_setzero_ps();
  int j = 0;
  for (; j + 16 <= n; j += 16) {
    const __m256 lo = E::Load(x + j), hi = E::Load(x + j + 8);
#pragma GCC unroll 8
    for (int g = 0; g < G; ++g) {
      acc0[g] = _mm256_fmadd_ps(_mm256_loadu_ps(a + g * n + j), lo, acc0[g]);
      acc1[g] = _mm256_fmadd_ps(_mm256_loadu_ps(a + g * n + j + 8), hi, acc1[g]);
    }
  }
  for (; j + 8 <= n; j += 8) {
    const __m256 w = E::Load(x + j);
#pragma GCC unroll 8
    for (int g = 0; g < G; ++g)
      acc0[g] = _mm256_fmadd_ps(_mm256_loadu_ps(a + g * n + j), w, acc0[g]);
  }
#pragma GCC unroll 8
  for (int g = 0; g < G; ++g) {
    float v = SumLanes(acc0[g], acc1[g]);
    for (int t = j; t < n; ++t) v += a[g * n + t] * E::Value(x[t]);
    out[g * out_group] = v;
  }
}

// Up to kMaxGroup query vectors against each of `rows` rows of elements E (a refinement's
// run of pool rows, a run of chunks' compact statistics: one call per run, not per row), row r
// at x + r * x_stride, its dot with vector g into out[r * out_row + g * out_group].
template <int G, typename E>
__attribute__((target("avx2,fma,f16c"))) void GroupRowsAvx2(const float* a, const typename E::T* x,
                                                            int rows, int n, int x_stride,
                                                            float* out, int out_row,
                                                            int out_group) {
  for (int r = 0; r < rows; ++r, x += x_stride, out += out_row) {
    GroupDotAvx2<G, E>(a, x, n, out, out_group);
  }
}

template <typename E>
using GroupRowsFn = void (*)(const float*, const typename E::T*, int, int, int, float*, int, int);
template <typename E, int... G>
constexpr std::array<GroupRowsFn<E>, sizeof...(G)> RowsKernels(std::integer_sequence<int, G...>) {
  return {&GroupRowsAvx2<G + 1, E>...};
}
template <typename E>
constexpr std::array<GroupRowsFn<E>, kMaxGroup> kGroupRows =
    RowsKernels<E>(std::make_integer_sequence<int, kMaxGroup>());

// Eight lanes of a column row, as floats: plain loads, or fp16 widened by F16C.
__attribute__((target("avx2,fma,f16c"))) inline __m256 Load8(const float* p) {
  return _mm256_loadu_ps(p);
}
__attribute__((target("avx2,fma,f16c"))) inline __m256 Load8(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
__attribute__((target("avx2,fma,f16c"))) inline __m256 Load8(const uint8_t* p) {
  return _mm256_cvtepi32_ps(
      _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// H vectors against G groups of 8 lanes in one pass over the rows: H * G independent
// accumulators, so each row's cache line is read once for every vector. When registers allow,
// even and odd rows go to separate accumulators, halving the chains of dependent FMAs.
template <int H, int G, typename T>
__attribute__((target("avx2,fma,f16c"))) inline void DotColumnsTile(const float* a, int a_stride,
                                                                    const T* cols, int n,
                                                                    int stride, float* out,
                                                                    int out_stride) {
  constexpr int kSplit = H * G * 2 <= 12 ? 2 : 1;
  // Fully unrolled, so that the accumulators live in registers.
  __m256 acc[kSplit][H][G];
#pragma GCC unroll 2
  for (int s = 0; s < kSplit; ++s) {
#pragma GCC unroll 4
    for (int h = 0; h < H; ++h) {
#pragma GCC unroll 4
      for (int g = 0; g < G; ++g) acc[s][h][g] = _mm256_setzero_ps();
    }
  }
  int j = 0;
  for (; j + kSplit <= n; j += kSplit) {
#pragma GCC unroll 2
    for (int s = 0; s < kSplit; ++s) {
      const T* row = cols + static_cast<size_t>(j + s) * stride;
      __m256 c[G];
#pragma GCC unroll 4
      for (int g = 0; g < G; ++g) c[g] = Load8(row + 8 * g);
#pragma GCC unroll 4
      for (int h = 0; h < H; ++h) {
        const __m256 x = _mm256_set1_ps(a[static_cast<size_t>(h) * a_stride + j + s]);
#pragma GCC unroll 4
        for (int g = 0; g < G; ++g) acc[s][h][g] = _mm256_fmadd_ps(x, c[g], acc[s][h][g]);
      }
    }
  }
  for (; j < n; ++j) {  // an odd last row
    const T* row = cols + static_cast<size_t>(j) * stride;
#pragma GCC unroll 4
    for (int h = 0; h < H; ++h) {
      const __m256 x = _mm256_set1_ps(a[static_cast<size_t>(h) * a_stride + j]);
#pragma GCC unroll 4
      for (int g = 0; g < G; ++g)
        acc[0][h][g] = _mm256_fmadd_ps(x, Load8(row + 8 * g), acc[0][h][g]);
    }
  }
#pragma GCC unroll 4
  for (int h = 0; h < H; ++h) {
#pragma GCC unroll 4
    for (int g = 0; g < G; ++g) {
      __m256 sum = acc[0][h][g];
      if constexpr (kSplit == 2) sum = _mm256_add_ps(sum, acc[1][h][g]);
      _mm256_storeu_ps(out + h * out_stride + 8 * g, sum);
    }
  }
}

// Tiles of kG groups (8 to 12 accumulators), then the last lanes in as many groups as they
// need: every load stays below the lanes rounded up to 8.
template <int H, typename T>
__attribute__((target("avx2,fma,f16c"))) void DotColumnsHeads(const float* a, int a_stride,
                                                              const T* cols, int n, int stride,
                                                              int lanes, float* out,
                                                              int out_stride) {
  constexpr int kG = H <= 2 ? 4 : 2;
  alignas(32) float sum[H * 8 * kG];
  for (int i = 0; i < lanes; i += 8 * kG) {
    const int take = std::min(lanes - i, 8 * kG);
    const T* c = cols + i;
    switch ((take + 7) / 8) {
      case 1:
        DotColumnsTile<H, 1>(a, a_stride, c, n, stride, sum, 8 * kG);
        break;
      case 2:
        DotColumnsTile<H, 2>(a, a_stride, c, n, stride, sum, 8 * kG);
        break;
      case 3:
        DotColumnsTile<H, 3>(a, a_stride, c, n, stride, sum, 8 * kG);
        break;
      default:
        DotColumnsTile<H, kG>(a, a_stride, c, n, stride, sum, 8 * kG);
        break;
    }
    for (int h = 0; h < H; ++h) std::copy_n(sum + h * 8 * kG, take, out + h * out_stride + i);
  }
}

template <typename T>
__attribute__((target("avx2,fma,f16c"))) void DotColumnsAvx2(const float* a, int m, int a_stride,
                                                             const T* cols, int n, int stride,
                                                             int lanes, float* out,
                                                             int out_stride) {
  for (int h = 0; h < m;) {
    const float* ah = a + static_cast<size_t>(h) * a_stride;
    float* oh = out + static_cast<size_t>(h) * out_stride;
    switch (std::min(4, m - h)) {
      case 1:
        DotColumnsHeads<1>(ah, a_stride, cols, n, stride, lanes, oh, out_stride);
        h += 1;
        break;
      case 2:
        DotColumnsHeads<2>(ah, a_stride, cols, n, stride, lanes, oh, out_stride);
        h += 2;
        break;
      case 3:
        DotColumnsHeads<3>(ah, a_stride, cols, n, stride, lanes, oh, out_stride);
        h += 3;
        break;
      default:
        DotColumnsHeads<4>(ah, a_stride, cols, n, stride, lanes, oh, out_stride);
        h += 4;
        break;
    }
  }
}

// BoxGrowth for G groups of 8 lanes (cols starts at the first), every row read once; the
// sums go to grow[0, 8 G) and width[0, 8 G).
// Where BoxGrowthBelow may stop: lanes [0, lanes) of the pass, each with its offset.
struct GrowthCut {
  const float* offset;  // null: 0
  float bound;
  int lanes;
};

// The lanes of `g` (eight per register, G registers) whose offset + g exceeds cut.bound, or that
// lie past cut.lanes: all of them when every lane that counts does.
template <int G>
__attribute__((target("avx2,fma,f16c"))) inline bool EveryLaneAbove(const __m256* g,
                                                                    const GrowthCut& cut) {
  const __m256 bound = _mm256_set1_ps(cut.bound);
  int above = 0;
  for (int k = 0; k < G; ++k) {
    const __m256 off =
        cut.offset != nullptr ? _mm256_loadu_ps(cut.offset + 8 * k) : _mm256_setzero_ps();
    above |= _mm256_movemask_ps(_mm256_cmp_ps(_mm256_add_ps(off, g[k]), bound, _CMP_GT_OQ))
             << (8 * k);
  }
  const int counted = (1 << cut.lanes) - 1;
  return (above & counted) == counted;
}

// With a cut (kCut), every 16 channels: false (the outputs unwritten) once every lane's
// offset + growth so far exceeds the cut's bound.
template <int G, bool kCut, typename T>
__attribute__((target("avx2,fma,f16c"))) inline bool BoxGrowthLanes(const float* x, int pairs,
                                                                    int m, const T* cols,
                                                                    int stride, float* grow,
                                                                    float* width,
                                                                    const GrowthCut* cut) {
  const __m256 zero = _mm256_setzero_ps();
  __m256 g[G], w[G];
  for (int k = 0; k < G; ++k) g[k] = w[k] = zero;
  for (int p = 0; p < pairs; ++p) {
    for (int j = 0; j < m; ++j) {
      const __m256 xv = _mm256_set1_ps(x[static_cast<size_t>(p) * m + j]);
      const T* hi_row = cols + (static_cast<size_t>(2 * p) * m + j) * stride;
      const T* lo_row = cols + (static_cast<size_t>(2 * p + 1) * m + j) * stride;
      for (int k = 0; k < G; ++k) {
        const __m256 hi = Load8(hi_row + 8 * k), lo = Load8(lo_row + 8 * k);
        // max(v, 0) is 0 for a NaN v, as the scalar path's std::max(0.f, v) is. A channel's
        // two terms are summed first, so that each channel adds once to the running sum (one
        // add a channel on its chain, not two; at most one term is nonzero in a box, so the
        // bits are those of adding them one after the other).
        const __m256 out = _mm256_add_ps(_mm256_max_ps(_mm256_sub_ps(xv, hi), zero),
                                         _mm256_max_ps(_mm256_sub_ps(lo, xv), zero));
        g[k] = _mm256_add_ps(g[k], out);
        w[k] = _mm256_add_ps(w[k], _mm256_sub_ps(hi, lo));
      }
      if constexpr (kCut) {
        if (j % 16 == 15 && EveryLaneAbove<G>(g, *cut)) return false;
      }
    }
  }
  for (int k = 0; k < G; ++k) {
    _mm256_storeu_ps(grow + 8 * k, g[k]);
    _mm256_storeu_ps(width + 8 * k, w[k]);
  }
  return true;
}

template <typename T>
__attribute__((target("avx2,fma,f16c"))) void BoxGrowthAvx2(const float* x, int pairs, int m,
                                                            const T* cols, int stride, int lanes,
                                                            float* grow, float* width) {
  // Sixteen lanes per pass into scratch; loads reach the lanes rounded up to 8 (<= stride).
  float g[16], w[16];
  for (int first = 0; first < lanes; first += 16) {
    const int n = std::min(16, lanes - first);
    if (n > 8) {
      BoxGrowthLanes<2, false>(x, pairs, m, cols + first, stride, g, w, nullptr);
    } else {
      BoxGrowthLanes<1, false>(x, pairs, m, cols + first, stride, g, w, nullptr);
    }
    std::copy_n(g, n, grow + first);
    std::copy_n(w, n, width + first);
  }
}

template <typename T>
__attribute__((target("avx2,fma,f16c"))) bool BoxGrowthBelowAvx2(const float* x, int pairs, int m,
                                                                 const T* cols, int stride,
                                                                 int lanes, const float* offset,
                                                                 float bound, float* grow,
                                                                 float* width) {
  float g[16], w[16], off[16] = {};
  if (offset != nullptr) std::copy_n(offset, lanes, off);
  const GrowthCut cut{offset != nullptr ? off : nullptr, bound, lanes};
  const bool whole = lanes > 8 ? BoxGrowthLanes<2, true>(x, pairs, m, cols, stride, g, w, &cut)
                               : BoxGrowthLanes<1, true>(x, pairs, m, cols, stride, g, w, &cut);
  if (!whole) return false;
  std::copy_n(g, lanes, grow);
  std::copy_n(w, lanes, width);
  return true;
}

// An element-wise operation on floats, each result rounded once: the same bits eight at a time
// (Vector) as one at a time (Scalar).
struct MultiplyOp {
  __attribute__((target("avx2"))) static __m256 Vector(__m256 a, __m256 b) {
    return _mm256_mul_ps(a, b);
  }
  static float Scalar(float a, float b) { return a * b; }
};
struct SubtractOp {
  __attribute__((target("avx2"))) static __m256 Vector(__m256 a, __m256 b) {
    return _mm256_sub_ps(a, b);
  }
  static float Scalar(float a, float b) { return a - b; }
};
struct AddOp {
  __attribute__((target("avx2"))) static __m256 Vector(__m256 a, __m256 b) {
    return _mm256_add_ps(a, b);
  }
  static float Scalar(float a, float b) { return a + b; }
};

// out[i] = Op(a[i], b[i]) for i in [0, n); out may be a or b (each element is read before it
// is written).
template <typename Op>
void ElementwiseScalar(const float* a, const float* b, size_t n, float* out) {
  for (size_t i = 0; i < n; ++i) out[i] = Op::Scalar(a[i], b[i]);
}

template <typename Op>
__attribute__((target("avx2"))) void ElementwiseAvx(const float* a, const float* b, size_t n,
                                                    float* out) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(out + i, Op::Vector(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i)));
  }
  ElementwiseScalar<Op>(a + i, b + i, n - i, out + i);
}

// The AVX2 form where this machine has it.
template <typename Op>
void Elementwise(const float* a, const float* b, size_t n, float* out) {
  static void (*const impl)(const float*, const float*, size_t, float*) =
      Cpu().avx2 ? ElementwiseAvx<Op> : ElementwiseScalar<Op>;
  impl(a, b, n, out);
}

// max_ps(x, hi) is x > hi ? x : hi, which is std::max(hi, x) (hi < x ? x : hi), NaNs and equal
// values (signed zeros) included; min_ps(x, lo) likewise std::min(lo, x).
__attribute__((target("avx2"))) void WidenBoxToAvx(const float* x, size_t n, float* hi, float* lo) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    _mm256_storeu_ps(hi + i, _mm256_max_ps(v, _mm256_loadu_ps(hi + i)));
    _mm256_storeu_ps(lo + i, _mm256_min_ps(v, _mm256_loadu_ps(lo + i)));
  }
  WidenBoxToScalar(x + i, n - i, hi + i, lo + i);
}

// SymmetricInt8Codes' steps for one value: x with a NaN as 0 and the rest clamped to
// +-FLT_MAX, and its code on the scale's inverse.
inline float FiniteOrZero(float x) {
  return std::isnan(x)
             ? 0.f
             : std::clamp(x, -std::numeric_limits<float>::max(), std::numeric_limits<float>::max());
}
inline int8_t SymmetricInt8Code(float x, float inv) {
  return static_cast<int8_t>(std::clamp(std::nearbyint(FiniteOrZero(x) * inv), -127.f, 127.f));
}

// FiniteOrZero, eight lanes.
__attribute__((target("avx2"))) inline __m256 FiniteLanes(__m256 x) {
  const __m256 kMax = _mm256_set1_ps(std::numeric_limits<float>::max());
  x = _mm256_and_ps(x, _mm256_cmp_ps(x, x, _CMP_ORD_Q));  // NaN: all bits clear, 0
  return _mm256_min_ps(_mm256_max_ps(x, _mm256_sub_ps(_mm256_setzero_ps(), kMax)), kMax);
}

// The largest magnitude of x's values (each FiniteOrZero), eight at a time.
__attribute__((target("avx2"))) float TopMagnitudeAvx2(const float* x, int n) {
  const int whole = n / 8 * 8;
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 top8 = _mm256_setzero_ps();
  for (int i = 0; i < whole; i += 8) {
    top8 = _mm256_max_ps(top8, _mm256_and_ps(FiniteLanes(_mm256_loadu_ps(x + i)), abs_mask));
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, top8);
  float top = 0.f;
  for (float v : lanes) top = std::max(top, v);
  for (int i = whole; i < n; ++i) top = std::max(top, std::fabs(FiniteOrZero(x[i])));
  return top;
}

// codes[i] = SymmetricInt8Code(x[i], inv), eight at a time.
__attribute__((target("avx2"))) void Int8CodesAvx2(const float* x, int n, float inv,
                                                   int8_t* codes) {
  const int whole = n / 8 * 8;
  const __m256 inv8 = _mm256_set1_ps(inv), lo = _mm256_set1_ps(-127.f), hi = _mm256_set1_ps(127.f);
  for (int i = 0; i < whole; i += 8) {
    __m256 c = _mm256_mul_ps(FiniteLanes(_mm256_loadu_ps(x + i)), inv8);
    c = _mm256_round_ps(c, _MM_FROUND_CUR_DIRECTION | _MM_FROUND_NO_EXC);  // as nearbyint
    const __m256i q = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(c, lo), hi));
    const __m128i h = _mm_packs_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(codes + i), _mm_packs_epi16(h, h));
  }
  for (int i = whole; i < n; ++i) codes[i] = SymmetricInt8Code(x[i], inv);
}

__attribute__((target("avx2"))) float SymmetricInt8CodesAvx2(const float* x, int n, int8_t* codes) {
  const float top = TopMagnitudeAvx2(x, n);
  Int8CodesAvx2(x, n, top > 0.f ? 127.f / top : 0.f, codes);
  return top / 127.f;
}

__attribute__((target("avx2"))) void Int8TimesAvx2(const int8_t* codes, int n, float scale,
                                                   float* out) {
  const __m256 s = _mm256_set1_ps(scale);
  int i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i eight = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + i));
    _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(eight)), s));
  }
  Int8TimesScalar(codes + i, n - i, scale, out + i);
}

__attribute__((target("avx2,fma,f16c"))) void ScaledCodesAvx2(const float* x, const float* inv,
                                                              const int32_t* k0, int n, bool up,
                                                              int32_t* out) {
  int i = 0;
  const __m256 lim = _mm256_set1_ps(0x1p30f), neg_lim = _mm256_set1_ps(-0x1p30f);
  for (; i + 8 <= n; i += 8) {
    __m256 t = _mm256_mul_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(inv + i));
    t = _mm256_min_ps(_mm256_max_ps(t, neg_lim), lim);
    const __m256 r = up ? _mm256_ceil_ps(t) : _mm256_floor_ps(t);
    _mm256_storeu_si256(
        reinterpret_cast<__m256i*>(out + i),
        _mm256_sub_epi32(_mm256_cvttps_epi32(r),
                         _mm256_loadu_si256(reinterpret_cast<const __m256i*>(k0 + i))));
  }
  ScaledCodesScalar(x + i, inv + i, k0 + i, n - i, up, out + i);
}

__attribute__((target("avx2,fma,f16c"))) void DecodeRowsAvx2(const uint8_t* codes, int rows,
                                                             int stride, int lanes,
                                                             const float* base, const float* step,
                                                             float* out, int out_stride) {
  for (int r = 0; r < rows; ++r) {
    const __m256 b = _mm256_set1_ps(base[r]), s = _mm256_set1_ps(step[r]);
    const uint8_t* row = codes + static_cast<size_t>(r) * stride;
    float* o = out + static_cast<size_t>(r) * out_stride;
    for (int i = 0; i < lanes; i += 8)
      _mm256_storeu_ps(o + i, _mm256_fmadd_ps(Load8(row + i), s, b));
  }
}

// floor(log2 x) from the bits of a float x >= 0 (-127 for 0).
inline int32_t FloorLog2Bits(float x) {
  return static_cast<int32_t>((std::bit_cast<uint32_t>(x) >> 23) & 0xff) - 127;
}
// 2^e as a float, for e in [-126, 127].
inline float PowerOfTwo(int32_t e) {
  return std::bit_cast<float>(static_cast<uint32_t>(127 + e) << 23);
}

// FloorLog2Bits and PowerOfTwo, eight at a time.
__attribute__((target("avx2"))) inline __m256i FloorLog2Bits8(__m256 x) {
  return _mm256_sub_epi32(
      _mm256_and_si256(_mm256_srli_epi32(_mm256_castps_si256(x), 23), _mm256_set1_epi32(0xff)),
      _mm256_set1_epi32(127));
}
__attribute__((target("avx2"))) inline __m256 PowerOfTwo8(__m256i e) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(e, _mm256_set1_epi32(127)), 23));
}

__attribute__((target("avx2,fma,f16c"))) void PowerOfTwoScalesAvx2(const float* lo, const float* hi,
                                                                   int n, int32_t* k0, float* base,
                                                                   float* step, float* inv) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  int i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 l = _mm256_loadu_ps(lo + i), h = _mm256_loadu_ps(hi + i);
    const __m256 m = _mm256_max_ps(_mm256_and_ps(l, abs_mask), _mm256_and_ps(h, abs_mask));
    // A zero magnitude or width gives -149 or -134, below -126: no test needed.
    __m256i e = _mm256_max_epi32(_mm256_set1_epi32(-126),
                                 _mm256_sub_epi32(FloorLog2Bits8(m), _mm256_set1_epi32(22)));
    e = _mm256_max_epi32(
        e, _mm256_sub_epi32(FloorLog2Bits8(_mm256_sub_ps(h, l)), _mm256_set1_epi32(7)));
    __m256 iv = PowerOfTwo8(_mm256_sub_epi32(_mm256_setzero_si256(), e));
    const __m256 over = _mm256_cmp_ps(
        _mm256_sub_ps(_mm256_ceil_ps(_mm256_mul_ps(h, iv)), _mm256_floor_ps(_mm256_mul_ps(l, iv))),
        _mm256_set1_ps(255.f), _CMP_GT_OQ);
    e = _mm256_sub_epi32(e, _mm256_castps_si256(over));  // the mask is -1 where over
    iv = PowerOfTwo8(_mm256_sub_epi32(_mm256_setzero_si256(), e));
    const __m256 s = PowerOfTwo8(e);
    const __m256 k = _mm256_floor_ps(_mm256_mul_ps(l, iv));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(k0 + i), _mm256_cvttps_epi32(k));
    _mm256_storeu_ps(base + i, _mm256_mul_ps(k, s));
    _mm256_storeu_ps(step + i, s);
    _mm256_storeu_ps(inv + i, iv);
  }
  PowerOfTwoScalesScalar(lo + i, hi + i, n - i, k0 + i, base + i, step + i, inv + i);
}

// acc + (x - p)^2 for eight lanes of x at `at`, rounded after each operation.
__attribute__((target("avx2"))) inline __m256 AddSquaredDifference(__m256 acc, const float* at,
                                                                   __m256 p) {
  const __m256 t = _mm256_sub_ps(_mm256_loadu_ps(at), p);
  return _mm256_add_ps(acc, _mm256_mul_ps(t, t));
}

// SquaredDistances for G (1 to 8) groups of 8 lanes (cols starts at the first), one chain per
// group, each a named register (an array of them is kept in memory by the compiler): eight
// chains keep both adders busy where each chain waits on its last add.
template <int G>
__attribute__((target("avx2"))) inline void SquaredDistanceLanes(const float* cols, int stride,
                                                                 int d, const float* point,
                                                                 float* out) {
  static_assert(G >= 1 && G <= 8);
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
  for (int j = 0; j < d; ++j) {
    const __m256 p = _mm256_set1_ps(point[j]);
    const float* row = cols + static_cast<size_t>(j) * stride;
    a0 = AddSquaredDifference(a0, row, p);
    if constexpr (G > 1) a1 = AddSquaredDifference(a1, row + 8, p);
    if constexpr (G > 2) a2 = AddSquaredDifference(a2, row + 16, p);
    if constexpr (G > 3) a3 = AddSquaredDifference(a3, row + 24, p);
    if constexpr (G > 4) a4 = AddSquaredDifference(a4, row + 32, p);
    if constexpr (G > 5) a5 = AddSquaredDifference(a5, row + 40, p);
    if constexpr (G > 6) a6 = AddSquaredDifference(a6, row + 48, p);
    if constexpr (G > 7) a7 = AddSquaredDifference(a7, row + 56, p);
  }
  _mm256_storeu_ps(out, a0);
  if constexpr (G > 1) _mm256_storeu_ps(out + 8, a1);
  if constexpr (G > 2) _mm256_storeu_ps(out + 16, a2);
  if constexpr (G > 3) _mm256_storeu_ps(out + 24, a3);
  if constexpr (G > 4) _mm256_storeu_ps(out + 32, a4);
  if constexpr (G > 5) _mm256_storeu_ps(out + 40, a5);
  if constexpr (G > 6) _mm256_storeu_ps(out + 48, a6);
  if constexpr (G > 7) _mm256_storeu_ps(out + 56, a7);
}

__attribute__((target("avx2"))) void SquaredDistancesAvx2(const float* cols, int stride, int lanes,
                                                          int d, const float* point, float* out) {
  int i = 0;
  for (; i + 64 <= lanes; i += 64) SquaredDistanceLanes<8>(cols + i, stride, d, point, out + i);
  for (; i + 32 <= lanes; i += 32) SquaredDistanceLanes<4>(cols + i, stride, d, point, out + i);
  float tail[32];
  if (i < lanes) {  // up to four groups of 8, through scratch so that out holds only `lanes`
    const int groups = (lanes - i + 7) / 8;
    switch (groups) {
      case 1:
        SquaredDistanceLanes<1>(cols + i, stride, d, point, tail);
        break;
      case 2:
        SquaredDistanceLanes<2>(cols + i, stride, d, point, tail);
        break;
      case 3:
        SquaredDistanceLanes<3>(cols + i, stride, d, point, tail);
        break;
      default:
        SquaredDistanceLanes<4>(cols + i, stride, d, point, tail);
        break;
    }
    std::copy_n(tail, lanes - i, out + i);
  }
}

inline float ColumnValue(float x) { return x; }
inline float ColumnValue(uint16_t h) { return HalfToFloat(h); }
inline float ColumnValue(uint8_t b) { return static_cast<float>(b); }

template <typename T>
void DotColumnsScalar(const float* a, int m, int a_stride, const T* cols, int n, int stride,
                      int lanes, float* out, int out_stride) {
  for (int h = 0; h < m; ++h) {
    for (int i = 0; i < lanes; ++i) {
      float s = 0;
      for (int j = 0; j < n; ++j) {
        s += a[static_cast<size_t>(h) * a_stride + j] *
             ColumnValue(cols[static_cast<size_t>(j) * stride + i]);
      }
      out[static_cast<size_t>(h) * out_stride + i] = s;
    }
  }
}

// Eight at a time, every element by the same instructions: a tail shorter than eight goes
// through the same vector code in a padded copy, so that no result depends on its place.
template <typename Eight>
__attribute__((target("avx2,fma"))) inline void EightAtATime(float* x, int n, float pad,
                                                             const Eight& eight) {
  int i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(x + i, eight(_mm256_loadu_ps(x + i)));
  if (i < n) {
    alignas(32) float tail[8];
    std::fill_n(tail, 8, pad);
    std::copy(x + i, x + n, tail);
    _mm256_store_ps(tail, eight(_mm256_load_ps(tail)));
    std::copy(tail, tail + (n - i), x + i);
  }
}

// e^x = 2^k e^r with k = round(x / ln 2) and |r| <= ln 2 / 2; ln 2 split in two parts so that
// r is exact, and e^r by Cephes' expf polynomial.
struct ExpEight {
  __attribute__((target("avx2,fma"))) __m256 operator()(__m256 v) const {
    const __m256 lo = _mm256_set1_ps(-87.f), hi = _mm256_set1_ps(88.f);
    const __m256 log2e = _mm256_set1_ps(1.44269504088896341f);
    const __m256 c1 = _mm256_set1_ps(0.693359375f), c2 = _mm256_set1_ps(-2.12194440e-4f);
    const __m256 p0 = _mm256_set1_ps(1.9875691500e-4f), p1 = _mm256_set1_ps(1.3981999507e-3f);
    const __m256 p2 = _mm256_set1_ps(8.3334519073e-3f), p3 = _mm256_set1_ps(4.1665795894e-2f);
    const __m256 p4 = _mm256_set1_ps(1.6666665459e-1f), p5 = _mm256_set1_ps(5.0000001201e-1f);
    const __m256 one = _mm256_set1_ps(1.f);
    v = _mm256_min_ps(_mm256_max_ps(v, lo), hi);
    const __m256 k =
        _mm256_round_ps(_mm256_mul_ps(v, log2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    v = _mm256_fnmadd_ps(k, c1, v);
    v = _mm256_fnmadd_ps(k, c2, v);
    __m256 y = _mm256_fmadd_ps(p0, v, p1);
    y = _mm256_fmadd_ps(y, v, p2);
    y = _mm256_fmadd_ps(y, v, p3);
    y = _mm256_fmadd_ps(y, v, p4);
    y = _mm256_fmadd_ps(y, v, p5);
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(v, v), _mm256_add_ps(v, one));
    const __m256i e =
        _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
  }
};

__attribute__((target("avx2,fma"))) void ExpInPlaceAvx2(float* x, int n) {
  EightAtATime(x, n, 0.f, ExpEight());
}

// log x = log m + e log 2 for x = m 2^e, m in [sqrt(1/2), sqrt(2)): Cephes' logf polynomial
// in m - 1, log 2 split in two parts.
struct LogEight {
  __attribute__((target("avx2,fma"))) __m256 operator()(__m256 v) const {
    const __m256i bits = _mm256_castps_si256(v);
    // v = m 2^e with m in [0.5, 1), then m in [sqrt(1/2), sqrt(2)) by one doubling.
    __m256 e =
        _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(bits, 23), _mm256_set1_epi32(126)));
    __m256 m = _mm256_castsi256_ps(_mm256_or_si256(
        _mm256_and_si256(bits, _mm256_set1_epi32(0x007fffff)), _mm256_set1_epi32(0x3f000000)));
    const __m256 one = _mm256_set1_ps(1.f);
    const __m256 small = _mm256_cmp_ps(m, _mm256_set1_ps(0.707106781186547524f), _CMP_LT_OQ);
    e = _mm256_sub_ps(e, _mm256_and_ps(small, one));
    m = _mm256_sub_ps(_mm256_add_ps(m, _mm256_and_ps(small, m)), one);
    const __m256 z = _mm256_mul_ps(m, m);
    __m256 y = _mm256_set1_ps(7.0376836292E-2f);
    y = _mm256_fmadd_ps(y, m, _mm256_set1_ps(-1.1514610310E-1f));
    y = _mm256_fmadd_ps(y, m, _mm256_set1_ps(1.1676998740E-1f));
    y = _mm256_fmadd_ps(y, m, _mm256_set1_ps(-1.2420140846E-1f));
    y = _mm256_fmadd_ps(y, m, _mm256_set1_ps(1.4249322787E-1f));
    y = _mm256_fmadd_ps(y, m, _mm256_set1_ps(-1.6668057665E-1f));
    y = _mm256_fmadd_ps(y, m, _mm256_set1_ps(2.0000714765E-1f));
    y = _mm256_fmadd_ps(y, m, _mm256_set1_ps(-2.4999993993E-1f));
    y = _mm256_fmadd_ps(y, m, _mm256_set1_ps(3.3333331174E-1f));
    y = _mm256_mul_ps(_mm256_mul_ps(y, m), z);
    y = _mm256_fmadd_ps(e, _mm256_set1_ps(-2.12194440e-4f), y);
    y = _mm256_fnmadd_ps(_mm256_set1_ps(0.5f), z, y);
    return _mm256_fmadd_ps(e, _mm256_set1_ps(0.693359375f), _mm256_add_ps(m, y));
  }
};

__attribute__((target("avx2,fma"))) void LogInPlaceAvx2(float* x, int n) {
  EightAtATime(x, n, 1.f, LogEight());
}

// log(1 + e^v): ExpEight, adding 1, LogEight.
struct Log1pExpEight {
  __attribute__((target("avx2,fma"))) __m256 operator()(__m256 v) const {
    return LogEight()(_mm256_add_ps(ExpEight()(v), _mm256_set1_ps(1.f)));
  }
};

__attribute__((target("avx2,fma"))) void Log1pExpInPlaceAvx2(float* x, int n) {
  EightAtATime(x, n, 0.f, Log1pExpEight());
}

// The same three functions sixteen lanes at a time (AVX-512F): each lane the same operations
// on the same operands as ExpEight and LogEight, so the same bits; the selects of LogEight's
// masks are masked operations here. Twice the work in flight: the chains are long (about forty
// dependent operations a value) and the core's window, not its units, bounds eight lanes.
#define KVTIER_AVX512 __attribute__((target("avx2,fma,avx512f")))

template <typename Sixteen>
KVTIER_AVX512 inline void SixteenAtATime(float* x, int n, float pad, const Sixteen& sixteen) {
  int i = 0;
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(x + i, sixteen(_mm512_loadu_ps(x + i)));
  if (i < n) {
    alignas(64) float tail[16];
    std::fill_n(tail, 16, pad);
    std::copy(x + i, x + n, tail);
    _mm512_store_ps(tail, sixteen(_mm512_load_ps(tail)));
    std::copy(tail, tail + (n - i), x + i);
  }
}

struct ExpSixteen {
  KVTIER_AVX512 __m512 operator()(__m512 v) const {
    const __m512 lo = _mm512_set1_ps(-87.f), hi = _mm512_set1_ps(88.f);
    const __m512 log2e = _mm512_set1_ps(1.44269504088896341f);
    const __m512 c1 = _mm512_set1_ps(0.693359375f), c2 = _mm512_set1_ps(-2.12194440e-4f);
    const __m512 p0 = _mm512_set1_ps(1.9875691500e-4f), p1 = _mm512_set1_ps(1.3981999507e-3f);
    const __m512 p2 = _mm512_set1_ps(8.3334519073e-3f), p3 = _mm512_set1_ps(4.1665795894e-2f);
    const __m512 p4 = _mm512_set1_ps(1.6666665459e-1f), p5 = _mm512_set1_ps(5.0000001201e-1f);
    const __m512 one = _mm512_set1_ps(1.f);
    v = _mm512_min_ps(_mm512_max_ps(v, lo), hi);
    const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(v, log2e),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    v = _mm512_fnmadd_ps(k, c1, v);
    v = _mm512_fnmadd_ps(k, c2, v);
    __m512 y = _mm512_fmadd_ps(p0, v, p1);
    y = _mm512_fmadd_ps(y, v, p2);
    y = _mm512_fmadd_ps(y, v, p3);
    y = _mm512_fmadd_ps(y, v, p4);
    y = _mm512_fmadd_ps(y, v, p5);
    y = _mm512_fmadd_ps(y, _mm512_mul_ps(v, v), _mm512_add_ps(v, one));
    const __m512i e =
        _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(k), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(y, _mm512_castsi512_ps(e));
  }
};

struct LogSixteen {
  KVTIER_AVX512 __m512 operator()(__m512 v) const {
    const __m512i bits = _mm512_castps_si512(v);
    __m512 e =
        _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_srli_epi32(bits, 23), _mm512_set1_epi32(126)));
    __m512 m = _mm512_castsi512_ps(_mm512_or_si512(
        _mm512_and_si512(bits, _mm512_set1_epi32(0x007fffff)), _mm512_set1_epi32(0x3f000000)));
    const __m512 one = _mm512_set1_ps(1.f);
    const __mmask16 small =
        _mm512_cmp_ps_mask(m, _mm512_set1_ps(0.707106781186547524f), _CMP_LT_OQ);
    // LogEight subtracts 1 (else 0) and adds m (else 0): e and m are exact either way.
    e = _mm512_mask_sub_ps(e, small, e, one);
    m = _mm512_sub_ps(_mm512_mask_add_ps(m, small, m, m), one);
    const __m512 z = _mm512_mul_ps(m, m);
    __m512 y = _mm512_set1_ps(7.0376836292E-2f);
    y = _mm512_fmadd_ps(y, m, _mm512_set1_ps(-1.1514610310E-1f));
    y = _mm512_fmadd_ps(y, m, _mm512_set1_ps(1.1676998740E-1f));
    y = _mm512_fmadd_ps(y, m, _mm512_set1_ps(-1.2420140846E-1f));
    y = _mm512_fmadd_ps(y, m, _mm512_set1_ps(1.4249322787E-1f));
    y = _mm512_fmadd_ps(y, m, _mm512_set1_ps(-1.6668057665E-1f));
    y = _mm512_fmadd_ps(y, m, _mm512_set1_ps(2.0000714765E-1f));
    y = _mm512_fmadd_ps(y, m, _mm512_set1_ps(-2.4999993993E-1f));
    y = _mm512_fmadd_ps(y, m, _mm512_set1_ps(3.3333331174E-1f));
    y = _mm512_mul_ps(_mm512_mul_ps(y, m), z);
    y = _mm512_fmadd_ps(e, _mm512_set1_ps(-2.12194440e-4f), y);
    y = _mm512_fnmadd_ps(_mm512_set1_ps(0.5f), z, y);
    return _mm512_fmadd_ps(e, _mm512_set1_ps(0.693359375f), _mm512_add_ps(m, y));
  }
};

struct Log1pExpSixteen {
  KVTIER_AVX512 __m512 operator()(__m512 v) const {
    return LogSixteen()(_mm512_add_ps(ExpSixteen()(v), _mm512_set1_ps(1.f)));
  }
};

KVTIER_AVX512 void ExpInPlaceAvx512(float* x, int n) { SixteenAtATime(x, n, 0.f, ExpSixteen()); }
KVTIER_AVX512 void LogInPlaceAvx512(float* x, int n) { SixteenAtATime(x, n, 1.f, LogSixteen()); }
KVTIER_AVX512 void Log1pExpInPlaceAvx512(float* x, int n) {
  SixteenAtATime(x, n, 0.f, Log1pExpSixteen());
}

// A half's bits as a key whose unsigned order is the value order: negatives flipped, positives
// with the sign bit set. Its own inverse is KeyHalf.
inline uint16_t HalfOrderKey(uint16_t h) {
  return (h & 0x8000u) ? static_cast<uint16_t>(~h) : static_cast<uint16_t>(h | 0x8000u);
}
inline uint16_t KeyHalf(uint16_t k) {
  return (k & 0x8000u) ? static_cast<uint16_t>(k & 0x7fffu) : static_cast<uint16_t>(~k);
}

__attribute__((target("avx2"))) bool WidenHalvesAvx2(const uint16_t* x, int n, bool up,
                                                     uint16_t* v) {
  const __m256i sign = _mm256_set1_epi16(static_cast<int16_t>(0x8000));
  const __m256i exp = _mm256_set1_epi16(0x7c00);
  const __m256i ones = _mm256_set1_epi16(-1);
  __m256i nonfinite = _mm256_setzero_si256();
  int i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256i hx = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i));
    const __m256i hv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + i));
    // key = h ^ ((h >> 15 arithmetic) | 0x8000); back: k ^ (~(k >> 15) | 0x8000).
    const __m256i kx = _mm256_xor_si256(hx, _mm256_or_si256(_mm256_srai_epi16(hx, 15), sign));
    const __m256i kv = _mm256_xor_si256(hv, _mm256_or_si256(_mm256_srai_epi16(hv, 15), sign));
    const __m256i k = up ? _mm256_max_epu16(kx, kv) : _mm256_min_epu16(kx, kv);
    const __m256i back = _mm256_or_si256(_mm256_andnot_si256(_mm256_srai_epi16(k, 15), ones), sign);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(v + i), _mm256_xor_si256(k, back));
    nonfinite = _mm256_or_si256(nonfinite, _mm256_cmpeq_epi16(_mm256_and_si256(hx, exp), exp));
  }
  bool finite = _mm256_testz_si256(nonfinite, nonfinite);
  return WidenHalvesScalar(x + i, n - i, up, v + i) && finite;
}

__attribute__((target("avx2,f16c"))) void FloatsToHalvesDirectedF16c(const float* x, int n, bool up,
                                                                     uint16_t* out) {
  int i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    const __m128i h = up ? _mm256_cvtps_ph(v, _MM_FROUND_TO_POS_INF | _MM_FROUND_NO_EXC)
                         : _mm256_cvtps_ph(v, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), h);
  }
  for (; i < n; ++i) out[i] = up ? FloatToHalfUp(x[i]) : FloatToHalfDown(x[i]);
}

void FloatsToHalvesDirectedScalar(const float* x, int n, bool up, uint16_t* out) {
  for (int i = 0; i < n; ++i) out[i] = up ? FloatToHalfUp(x[i]) : FloatToHalfDown(x[i]);
}

// CountAtLeast eight keys per compare: each lane counts the keys below t (as -1s, the compare's
// all-ones); the others are at least t.
__attribute__((target("avx2"))) size_t CountAtLeastAvx2(const int32_t* keys, size_t n, int32_t t) {
  const __m256i below = _mm256_set1_epi32(t);
  __m256i c0 = _mm256_setzero_si256(), c1 = c0;
  size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(keys + i));
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(keys + i + 8));
    c0 = _mm256_add_epi32(c0, _mm256_cmpgt_epi32(below, a));  // -1 where a < t
    c1 = _mm256_add_epi32(c1, _mm256_cmpgt_epi32(below, b));
  }
  alignas(32) int32_t lanes[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), _mm256_add_epi32(c0, c1));
  size_t under = 0;
  for (int k = 0; k < 8; ++k) under += static_cast<size_t>(-static_cast<int64_t>(lanes[k]));
  return i - under + CountAtLeastScalar(keys + i, n - i, t);
}

// PickTop, eight keys a step: their picks read off two compare masks (a branch per pick, not
// one per key: a pool's keys above the k-th lie in no order a predictor could learn).
__attribute__((target("avx2"))) void PickTopAvx2(const int32_t* keys, size_t n, int32_t kth,
                                                 size_t ties, uint32_t* out) {
  const __m256i t = _mm256_set1_epi32(kth);
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(keys + i));
    auto above =
        static_cast<uint32_t>(_mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(a, t))));
    auto equal =
        static_cast<uint32_t>(_mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpeq_epi32(a, t))));
    for (; equal != 0 && ties > 0; --ties) {  // the lowest equal ones first
      above |= equal & (0u - equal);
      equal &= equal - 1;
    }
    for (; above != 0; above &= above - 1) {
      *out++ = static_cast<uint32_t>(i + static_cast<size_t>(__builtin_ctz(above)));
    }
  }
  for (; i < n; ++i) {
    if (keys[i] > kth || (keys[i] == kth && ties > 0 && ties-- > 0)) {
      *out++ = static_cast<uint32_t>(i);
    }
  }
}

// MaxOf, SumAsDouble and AddQuotients: the softmax weights of a refinement's pool (thousands
// of rows per KV head, per Select). Each AVX2 path gives its scalar twin's bits: a maximum is
// exact in any order, SumAsDouble's order is fixed (eight partial sums), and a product by the
// one reciprocal is correctly rounded however many are computed at once.
__attribute__((target("avx2"))) float MaxOfAvx2(const float* x, size_t n) {
  __m256 m0 = _mm256_set1_ps(-std::numeric_limits<float>::infinity()), m1 = m0;
  size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    m0 = _mm256_max_ps(m0, _mm256_loadu_ps(x + i));
    m1 = _mm256_max_ps(m1, _mm256_loadu_ps(x + i + 8));
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, _mm256_max_ps(m0, m1));
  float m = lanes[0];
  for (int k = 1; k < 8; ++k) m = std::max(m, lanes[k]);
  for (; i < n; ++i) m = std::max(m, x[i]);
  return m;
}

float MaxOfScalar(const float* x, size_t n) {
  float m = -std::numeric_limits<float>::infinity();
  for (size_t i = 0; i < n; ++i) m = std::max(m, x[i]);
  return m;
}

// Partial sum k takes x[i] for i % 8 == k; then t_k = s_k + s_(k+4), and (t0 + t2) + (t1 + t3),
// the one order both paths finish in.
double SumEight(const double* s) {
  const double t0 = s[0] + s[4], t1 = s[1] + s[5], t2 = s[2] + s[6], t3 = s[3] + s[7];
  return (t0 + t2) + (t1 + t3);
}

__attribute__((target("avx2"))) double SumAsDoubleAvx2(const float* x, size_t n) {
  __m256d s0 = _mm256_setzero_pd(), s1 = _mm256_setzero_pd();
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    s0 = _mm256_add_pd(s0, _mm256_cvtps_pd(_mm_loadu_ps(x + i)));
    s1 = _mm256_add_pd(s1, _mm256_cvtps_pd(_mm_loadu_ps(x + i + 4)));
  }
  alignas(32) double s[8];
  _mm256_store_pd(s, s0);
  _mm256_store_pd(s + 4, s1);
  for (; i < n; ++i) s[i % 8] += x[i];
  return SumEight(s);
}

double SumAsDoubleScalar(const float* x, size_t n) {
  double s[8] = {};
  for (size_t i = 0; i < n; ++i) s[i % 8] += x[i];
  return SumEight(s);
}

__attribute__((target("avx2"))) void AddQuotientsAvx2(const float* x, double z, size_t n,
                                                      float* out) {
  const double r = 1.0 / z;
  const __m256d rr = _mm256_set1_pd(r);
  size_t i = 0;
  for (; i + 4 <= n; i += 4) {
    const __m128 q = _mm256_cvtpd_ps(_mm256_mul_pd(_mm256_cvtps_pd(_mm_loadu_ps(x + i)), rr));
    _mm_storeu_ps(out + i, _mm_add_ps(_mm_loadu_ps(out + i), q));
  }
  for (; i < n; ++i) out[i] += static_cast<float>(x[i] * r);
}

void AddQuotientsScalar(const float* x, double z, size_t n, float* out) {
  const double r = 1.0 / z;
  for (size_t i = 0; i < n; ++i) out[i] += static_cast<float>(x[i] * r);
}

void ExpInPlaceScalar(float* x, int n) {
  for (int i = 0; i < n; ++i) x[i] = std::exp(std::min(std::max(x[i], -87.f), 88.f));
}

void LogInPlaceScalar(float* x, int n) {
  for (int i = 0; i < n; ++i) x[i] = std::log(x[i]);
}

void Log1pExpInPlaceScalar(float* x, int n) {
  ExpInPlaceScalar(x, n);
  for (int i = 0; i < n; ++i) x[i] += 1.f;
  LogInPlaceScalar(x, n);
}

}  // namespace

void AddRowsScalar(HalfKind kind, const uint16_t* rows, int n, int d, float* sum) {
  for (int r = 0; r < n; ++r) {
    const uint16_t* row = rows + static_cast<size_t>(r) * d;
    for (int k = 0; k < d; ++k) {
      sum[k] += kind == HalfKind::kFp16 ? HalfToFloat(row[k]) : Bf16ToFloat(row[k]);
    }
  }
}

void AddRows(HalfKind kind, const uint16_t* rows, int n, int d, float* sum) {
  if (HaveAvx2F16c()) {
    AddRowsAvx2(kind, rows, n, d, sum);
  } else {
    AddRowsScalar(kind, rows, n, d, sum);
  }
}

bool AddRowsIsVectorized() { return HaveAvx2F16c(); }

void HalvesToFloats(HalfKind kind, const uint16_t* h, size_t n, float* out) {
  std::fill_n(out, n, 0.f);
  AddRows(kind, h, 1, static_cast<int>(n), out);
}

float DotScalar(const float* a, const float* b, int n) {
  float s = 0.f;
  for (int j = 0; j < n; ++j) s += a[j] * b[j];
  return s;
}

namespace {
// Chosen once, at load: a Select calls Dot tens of thousands of times.
float (*const kDot)(const float*, const float*, int) = HaveAvx2Fma() ? DotAvx2 : DotScalar;
}  // namespace

float Dot(const float* a, const float* b, int n) { return kDot(a, b, n); }

float DotHalvesScalar(HalfKind kind, const float* a, const uint16_t* h, int n) {
  float s = 0.f;
  for (int j = 0; j < n; ++j) {
    s += a[j] * (kind == HalfKind::kFp16 ? HalfToFloat(h[j]) : Bf16ToFloat(h[j]));
  }
  return s;
}

namespace {
float (*const kDotHalves)(HalfKind, const float*, const uint16_t*,
                          int) = HaveAvx2Fma() && HaveAvx2F16c() ? DotHalvesAvx2 : DotHalvesScalar;
}  // namespace

float DotHalves(HalfKind kind, const float* a, const uint16_t* h, int n) {
  return kDotHalves(kind, a, h, n);
}

void DotHalvesRows(HalfKind kind, const float* a, int group, const uint16_t* h, int rows, int n,
                   float* out) {
  DotHalvesRows(kind, a, group, h, rows, n, out, group, 1);
}

void DotHalvesRows(HalfKind kind, const float* a, int group, const uint16_t* h, int rows, int n,
                   float* out, int out_row, int out_group) {
  if (kDotHalves == DotHalvesAvx2 && group >= 1 && group <= kMaxGroup) {
    if (kind == HalfKind::kBf16) {
      kGroupRows<HalfElements<HalfKind::kBf16>>[group - 1](a, h, rows, n, n, out, out_row,
                                                           out_group);
    } else {
      kGroupRows<HalfElements<HalfKind::kFp16>>[group - 1](a, h, rows, n, n, out, out_row,
                                                           out_group);
    }
    return;
  }
  for (int r = 0; r < rows; ++r) {
    for (int g = 0; g < group; ++g) {
      out[static_cast<size_t>(r) * out_row + static_cast<size_t>(g) * out_group] =
          kDotHalves(kind, a + static_cast<size_t>(g) * n, h + static_cast<size_t>(r) * n, n);
    }
  }
}

namespace {

// QueryInt8Codes' exponent of 2 for the largest magnitude `top` (0 or more, finite).
int QueryExponent(float top) {
  constexpr int kLow = -100, kHigh = 122;  // 2^-kLow and 2^-kHigh are normal floats
  if (!(top > 0.f)) return kLow;
  int t;
  const float m = std::frexp(top, &t);  // top = m 2^t, m in [0.5, 1)
  // top / 2^(t - 7) = 128 m, at most 127 when m <= 127/128; else top / 2^(t - 6) = 64 m < 64.
  const int e = m * 128.f <= 127.f ? t - 7 : t - 6;
  return std::clamp(e, kLow, kHigh);
}

float TopMagnitudeScalar(const float* x, int n) {
  float top = 0.f;
  for (int i = 0; i < n; ++i) top = std::max(top, std::fabs(FiniteOrZero(x[i])));
  return top;
}

float QueryInt8CodesScalar(const float* x, int n, int8_t* codes) {
  const int e = QueryExponent(TopMagnitudeScalar(x, n));
  const float inv = std::ldexp(1.f, -e);  // exact: a power of two
  for (int i = 0; i < n; ++i) codes[i] = SymmetricInt8Code(x[i], inv);
  return std::ldexp(1.f, e);
}

float QueryInt8CodesAvx2(const float* x, int n, int8_t* codes) {
  const int e = QueryExponent(TopMagnitudeAvx2(x, n));
  Int8CodesAvx2(x, n, std::ldexp(1.f, -e), codes);
  return std::ldexp(1.f, e);
}

// The exact integer sum, then its scale: the same on every path (an int32 holds it for any
// head_dim under 66000; its conversion to float is exact under 2^24 and rounds alike past it).
inline float Scaled(int32_t sum, float scale) { return static_cast<float>(sum) * scale; }

void Int8RowsScalar(const QueryInt8Group& q, int group, const int8_t* c, int rows, int n,
                    int c_stride, float* out, int out_row, int out_group) {
  for (int r = 0; r < rows; ++r) {
    const int8_t* x = c + static_cast<size_t>(r) * c_stride;
    for (int g = 0; g < group; ++g) {
      const int8_t* a = q.codes(g);
      int32_t sum = 0;
      for (int j = 0; j < n; ++j) sum += int32_t{a[j]} * x[j];
      out[static_cast<size_t>(r) * out_row + static_cast<size_t>(g) * out_group] =
          Scaled(sum, q.scale(g));
    }
  }
}

#define KVTIER_VNNI __attribute__((target("avx2,avx512f,avx512vl,avx512vnni")))

// The four lanes' sums of four rows' accumulators: [row 0, row 1, row 2, row 3].
__attribute__((target("avx2"))) inline __m128i SumRows4(__m256i a0, __m256i a1, __m256i a2,
                                                        __m256i a3) {
  const __m256i s = _mm256_hadd_epi32(_mm256_hadd_epi32(a0, a1), _mm256_hadd_epi32(a2, a3));
  return _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
}

// Four rows' sums of head g (less `bias`), scaled, into out[k * out_row + g * out_group].
__attribute__((target("avx2"))) inline void StoreRows4(__m128i sums, int32_t bias, float scale,
                                                       float* o, int out_row) {
  const __m128 v =
      _mm_mul_ps(_mm_cvtepi32_ps(_mm_sub_epi32(sums, _mm_set1_epi32(bias))), _mm_set1_ps(scale));
  if (out_row == 1) {
    _mm_storeu_ps(o, v);
    return;
  }
  alignas(16) float four[4];
  _mm_store_ps(four, v);
  for (int k = 0; k < 4; ++k) o[static_cast<size_t>(k) * out_row] = four[k];
}

// Without VNNI: heads [g0, g0 + G) against rows [r, r + 4), n a multiple of 16, each row's bytes
// widened to int16 once and multiplied with the heads' int16 codes in pairs (vpmaddwd).
template <int G>
__attribute__((target("avx2"))) inline void Int8Rows4Avx2(const QueryInt8Group& q, int g0,
                                                          const int8_t* x, int n, int c_stride,
                                                          float* out, int out_row, int out_group) {
  __m256i acc[G][4];
#pragma GCC unroll 4
  for (int g = 0; g < G; ++g) {
#pragma GCC unroll 4
    for (int k = 0; k < 4; ++k) acc[g][k] = _mm256_setzero_si256();
  }
  for (int j = 0; j < n; j += 16) {
#pragma GCC unroll 4
    for (int k = 0; k < 4; ++k) {
      const __m256i w = _mm256_cvtepi8_epi16(_mm_loadu_si128(
          reinterpret_cast<const __m128i*>(x + static_cast<size_t>(k) * c_stride + j)));
#pragma GCC unroll 4
      for (int g = 0; g < G; ++g) {
        acc[g][k] = _mm256_add_epi32(
            acc[g][k],
            _mm256_madd_epi16(
                w, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q.wide(g0 + g) + j))));
      }
    }
  }
#pragma GCC unroll 4
  for (int g = 0; g < G; ++g) {
    StoreRows4(SumRows4(acc[g][0], acc[g][1], acc[g][2], acc[g][3]), 0, q.scale(g0 + g),
               out + static_cast<size_t>(g0 + g) * out_group, out_row);
  }
}

__attribute__((target("avx2"))) void Int8RowsAvx2(const QueryInt8Group& q, int group,
                                                  const int8_t* c, int rows, int n, int c_stride,
                                                  float* out, int out_row, int out_group) {
  int r = 0;
  for (; r + 4 <= rows; r += 4) {
    const int8_t* x = c + static_cast<size_t>(r) * c_stride;
    float* o = out + static_cast<size_t>(r) * out_row;
    int g = 0;  // heads three at a time: twelve accumulators in sixteen registers
    for (; g + 3 <= group; g += 3) Int8Rows4Avx2<3>(q, g, x, n, c_stride, o, out_row, out_group);
    if (group - g == 2) Int8Rows4Avx2<2>(q, g, x, n, c_stride, o, out_row, out_group);
    if (group - g == 1) Int8Rows4Avx2<1>(q, g, x, n, c_stride, o, out_row, out_group);
  }
  if (r < rows) {
    Int8RowsScalar(q, group, c + static_cast<size_t>(r) * c_stride, rows - r, n, c_stride,
                   out + static_cast<size_t>(r) * out_row, out_row, out_group);
  }
}

// Heads [g0, g0 + G) of the group against rows [r, r + 4), n a multiple of 32: each row's bytes
// made unsigned (c + 128, one xor) and multiplied with the heads' signed codes four at a time
// (vpdpbusd), the 128 times the codes' sum taken off after.
template <int G>
KVTIER_VNNI inline void Int8Rows4Vnni(const QueryInt8Group& q, int g0, const int8_t* x, int n,
                                      int c_stride, float* out, int out_row, int out_group) {
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
  __m256i acc[G][4];
#pragma GCC unroll 4
  for (int g = 0; g < G; ++g) {
#pragma GCC unroll 4
    for (int k = 0; k < 4; ++k) acc[g][k] = _mm256_setzero_si256();
  }
  for (int j = 0; j < n; j += 32) {
#pragma GCC unroll 4
    for (int k = 0; k < 4; ++k) {
      const __m256i u = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(
                                             x + static_cast<size_t>(k) * c_stride + j)),
                                         flip);
#pragma GCC unroll 4
      for (int g = 0; g < G; ++g) {
        acc[g][k] = _mm256_dpbusd_epi32(
            acc[g][k], u,
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q.codes(g0 + g) + j)));
      }
    }
  }
#pragma GCC unroll 4
  for (int g = 0; g < G; ++g) {
    StoreRows4(SumRows4(acc[g][0], acc[g][1], acc[g][2], acc[g][3]), q.bias(g0 + g),
               q.scale(g0 + g), out + static_cast<size_t>(g0 + g) * out_group, out_row);
  }
}

KVTIER_VNNI void Int8RowsVnni(const QueryInt8Group& q, int group, const int8_t* c, int rows, int n,
                              int c_stride, float* out, int out_row, int out_group) {
  int r = 0;
  for (; r + 4 <= rows; r += 4) {
    const int8_t* x = c + static_cast<size_t>(r) * c_stride;
    float* o = out + static_cast<size_t>(r) * out_row;
    int g = 0;  // heads four at a time (the rows stay in the first-level cache meanwhile)
    for (; g + 4 <= group; g += 4) Int8Rows4Vnni<4>(q, g, x, n, c_stride, o, out_row, out_group);
    switch (group - g) {
      case 3:
        Int8Rows4Vnni<3>(q, g, x, n, c_stride, o, out_row, out_group);
        break;
      case 2:
        Int8Rows4Vnni<2>(q, g, x, n, c_stride, o, out_row, out_group);
        break;
      case 1:
        Int8Rows4Vnni<1>(q, g, x, n, c_stride, o, out_row, out_group);
        break;
      default:
        break;
    }
  }
  if (r < rows) {
    Int8RowsScalar(q, group, c + static_cast<size_t>(r) * c_stride, rows - r, n, c_stride,
                   out + static_cast<size_t>(r) * out_row, out_row, out_group);
  }
}

// Heads [g0, g0 + G) against one tile's part (16 rows, n4 groups of four bytes, 64 bytes
// each): the rows' bytes as they are (unsigned, code + 128), four of each head's codes
// broadcast, eight rows a 256-bit register (the row kernel's width: no 512-bit arithmetic),
// each half of the tile in accumulators of its own; the bias taken off after, as
// Int8Rows4Vnni does. The first `lanes` rows stored.
template <int G>
KVTIER_VNNI inline void Int8TileVnni(const QueryInt8Group& q, int g0, const uint8_t* tile, int n4,
                                     int lanes, float* out, int out_group) {
  __m256i acc[G][2];
#pragma GCC unroll 4
  for (int g = 0; g < G; ++g) acc[g][0] = acc[g][1] = _mm256_setzero_si256();
  const int32_t* codes[G];
#pragma GCC unroll 4
  for (int g = 0; g < G; ++g) codes[g] = reinterpret_cast<const int32_t*>(q.codes(g0 + g));
  for (int k = 0; k < n4; ++k) {
    const uint8_t* at = tile + static_cast<size_t>(k) * 64;
    const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(at));
    const __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(at + 32));
#pragma GCC unroll 4
    for (int g = 0; g < G; ++g) {
      int32_t four;
      std::memcpy(&four, codes[g] + k, sizeof(four));
      const __m256i b = _mm256_set1_epi32(four);
      acc[g][0] = _mm256_dpbusd_epi32(acc[g][0], lo, b);
      acc[g][1] = _mm256_dpbusd_epi32(acc[g][1], hi, b);
    }
  }
#pragma GCC unroll 4
  for (int g = 0; g < G; ++g) {
    const __m256i bias = _mm256_set1_epi32(q.bias(g0 + g));
    const __m256 scale = _mm256_set1_ps(q.scale(g0 + g));
    float* o = out + static_cast<size_t>(g0 + g) * out_group;
#pragma GCC unroll 2
    for (int half = 0; half < 2; ++half) {
      const int n = std::min(8, lanes - 8 * half);
      if (n <= 0) break;
      const __m256 v =
          _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(acc[g][half], bias)), scale);
      _mm256_mask_storeu_ps(o + 8 * half, static_cast<__mmask8>((1u << n) - 1), v);
    }
  }
}

// Part p of rows [first, first + rows) of tiles against the whole group, four heads a pass.
KVTIER_VNNI void Int8TilesVnni(const QueryInt8Group& q, const uint8_t* tiles, int parts, int p,
                               uint32_t first, uint32_t rows, float* out, int out_group) {
  const int n4 = q.n() / 4, group = q.group();
  const size_t tile_bytes = static_cast<size_t>(parts) * n4 * 64;
  for (uint32_t i = 0; i < rows; i += kInt8TileRows) {
    const uint8_t* tile = tiles + static_cast<size_t>((first + i) / kInt8TileRows) * tile_bytes +
                          static_cast<size_t>(p) * n4 * 64;
    const int lanes = static_cast<int>(std::min<uint32_t>(kInt8TileRows, rows - i));
    float* o = out + i;
    int g = 0;
    for (; g + 4 <= group; g += 4) Int8TileVnni<4>(q, g, tile, n4, lanes, o, out_group);
    switch (group - g) {
      case 3:
        Int8TileVnni<3>(q, g, tile, n4, lanes, o, out_group);
        break;
      case 2:
        Int8TileVnni<2>(q, g, tile, n4, lanes, o, out_group);
        break;
      case 1:
        Int8TileVnni<1>(q, g, tile, n4, lanes, o, out_group);
        break;
      default:
        break;
    }
  }
}

#undef KVTIER_VNNI

}  // namespace

float QueryInt8Codes(const float* x, int n, int8_t* codes) {
  static const auto impl = Cpu().avx2 ? QueryInt8CodesAvx2 : QueryInt8CodesScalar;
  return impl(x, n, codes);
}

void RoundQueryToInt8(float* x, int n) {
  absl::InlinedVector<int8_t, 512> codes(static_cast<size_t>(n));
  const float scale = QueryInt8Codes(x, n, codes.data());
  for (int i = 0; i < n; ++i) x[i] = static_cast<float>(codes[i]) * scale;
}

bool HaveInt8Kernel(Int8Kernel k) {
  switch (k) {
    case Int8Kernel::kScalar:
      return true;
    case Int8Kernel::kAvx2:
      return Cpu().avx2;
    case Int8Kernel::kVnni:
      return Cpu().vnni;
  }
  return false;
}

Int8Kernel BestInt8Kernel() {
  static const Int8Kernel best = Cpu().vnni   ? Int8Kernel::kVnni
                                 : Cpu().avx2 ? Int8Kernel::kAvx2
                                              : Int8Kernel::kScalar;
  return best;
}

QueryInt8Group::QueryInt8Group(const float* a, int group, int n, Int8Kernel kernel)
    : group_(std::max(group, 0)),
      n_(std::max(n, 0)),
      codes_(static_cast<size_t>(group_) * n_),
      scale_(static_cast<size_t>(group_)),
      bias_(static_cast<size_t>(group_)) {
  // A kernel not available here, or a width it does not take, runs as the scalar one.
  if (kernel == Int8Kernel::kVnni && !(Cpu().vnni && n_ % 32 == 0)) kernel = Int8Kernel::kScalar;
  if (kernel == Int8Kernel::kAvx2 && !(Cpu().avx2 && n_ % 16 == 0)) kernel = Int8Kernel::kScalar;
  kernel_ = kernel;
  if (kernel_ == Int8Kernel::kAvx2) wide_.reserve(static_cast<size_t>(group_) * n_);
  for (int g = 0; g < group_; ++g) {
    int8_t* q = codes_.data() + static_cast<size_t>(g) * n_;
    scale_[g] = QueryInt8Codes(a + static_cast<size_t>(g) * n_, n_, q);
    if (kernel_ == Int8Kernel::kAvx2) wide_.insert(wide_.end(), q, q + n_);
    int32_t sum = 0;
    for (int j = 0; j < n_; ++j) sum += q[j];
    bias_[g] = 128 * sum;
  }
}

void DotInt8GroupRowsStrided(const QueryInt8Group& q, const int8_t* c, int rows, int c_stride,
                             float* out, int out_row, int out_group) {
  const int group = q.group(), n = q.n();
  if (group < 1 || rows < 1 || n < 1) return;
  switch (q.kernel()) {
    case Int8Kernel::kVnni:
      Int8RowsVnni(q, group, c, rows, n, c_stride, out, out_row, out_group);
      return;
    case Int8Kernel::kAvx2:
      Int8RowsAvx2(q, group, c, rows, n, c_stride, out, out_row, out_group);
      return;
    case Int8Kernel::kScalar:
      break;
  }
  Int8RowsScalar(q, group, c, rows, n, c_stride, out, out_row, out_group);
}

size_t Int8TileBytes(uint32_t rows, int parts, int n) {
  const size_t tiles = (static_cast<size_t>(rows) + kInt8TileRows - 1) / kInt8TileRows;
  return tiles * static_cast<size_t>(parts) * static_cast<size_t>(n) * kInt8TileRows;
}

namespace {

// Where row r's part p begins in tiles: its first four bytes (the next four 64 bytes on).
size_t TileRowAt(uint32_t r, int parts, int p, int n) {
  return Int8TileBytes(r / kInt8TileRows * kInt8TileRows, parts, n) +
         static_cast<size_t>(p) * (n / 4) * 64 + r % kInt8TileRows * 4;
}

}  // namespace

void PutInt8TileRow(const int8_t* codes, uint32_t r, int parts, int p, int n, uint8_t* tiles) {
  CHECK(n % 4 == 0) << n;
  uint8_t* at = tiles + TileRowAt(r, parts, p, n);
  // Four bytes at a time: a byte plus 128 (mod 256) is the byte with its top bit flipped.
  for (int k = 0; k < n / 4; ++k) {
    uint32_t four;
    std::memcpy(&four, codes + 4 * k, sizeof(four));
    four ^= 0x80808080u;
    std::memcpy(at + static_cast<size_t>(k) * 64, &four, sizeof(four));
  }
}

void DotInt8GroupTilesScalar(const QueryInt8Group& q, const uint8_t* tiles, int parts, int p,
                             uint32_t first, uint32_t rows, float* out, int out_group) {
  const int n = q.n();
  for (uint32_t i = 0; i < rows; ++i) {
    const uint32_t r = first + i;
    const uint8_t* at = tiles + TileRowAt(r, parts, p, n);
    for (int g = 0; g < q.group(); ++g) {
      const int8_t* a = q.codes(g);
      int32_t sum = 0;
      for (int j = 0; j < n; ++j) {
        sum += int32_t{a[j]} * (int32_t{at[static_cast<size_t>(j / 4) * 64 + j % 4]} - 128);
      }
      out[static_cast<size_t>(g) * out_group + i] = Scaled(sum, q.scale(g));
    }
  }
}

void DotInt8GroupTiles(const QueryInt8Group& q, const uint8_t* tiles, int parts, int p,
                       uint32_t first, uint32_t rows, float* out, int out_group) {
  CHECK(first % kInt8TileRows == 0 && q.n() % 4 == 0) << first << " " << q.n();
  if (q.group() < 1 || rows == 0) return;
  if (q.kernel() == Int8Kernel::kVnni) {  // n a multiple of 32
    Int8TilesVnni(q, tiles, parts, p, first, rows, out, out_group);
    return;
  }
  DotInt8GroupTilesScalar(q, tiles, parts, p, first, rows, out, out_group);
}

void DotInt8GroupRowsWith(Int8Kernel kernel, const float* a, int group, const int8_t* c, int rows,
                          int n, int c_stride, float* out, int out_row, int out_group) {
  DotInt8GroupRowsStrided(QueryInt8Group(a, group, n, kernel), c, rows, c_stride, out, out_row,
                          out_group);
}

float DotInt8(const float* a, const int8_t* c, int n) {
  float out;
  DotInt8GroupRowsStrided(a, 1, c, 1, n, n, &out, 1, 1);
  return out;
}

float DotInt8Scalar(const float* a, const int8_t* c, int n) {
  absl::InlinedVector<int8_t, 512> codes(static_cast<size_t>(n));
  const float scale = QueryInt8CodesScalar(a, n, codes.data());
  int32_t sum = 0;
  for (int j = 0; j < n; ++j) sum += int32_t{codes[j]} * c[j];
  return Scaled(sum, scale);
}

void DotInt8Group(const float* a, int group, const int8_t* c, int n, float* out) {
  DotInt8GroupRows(a, group, c, 1, n, out);
}

void DotInt8GroupRows(const float* a, int group, const int8_t* c, int rows, int n, float* out) {
  DotInt8GroupRowsStrided(a, group, c, rows, n, n, out, group, 1);
}

void DotInt8GroupRowsStrided(const float* a, int group, const int8_t* c, int rows, int n,
                             int c_stride, float* out, int out_row, int out_group) {
  DotInt8GroupRowsStrided(QueryInt8Group(a, group, n), c, rows, c_stride, out, out_row, out_group);
}

template <typename T>
void BoxGrowthScalarOf(const float* x, int pairs, int m, const T* cols, int stride, int lanes,
                       float* grow, float* width) {
  for (int i = 0; i < lanes; ++i) {
    float g = 0, w = 0;
    for (int p = 0; p < pairs; ++p) {
      for (int j = 0; j < m; ++j) {
        const float xv = x[static_cast<size_t>(p) * m + j];
        const float hi = ColumnValue(cols[(static_cast<size_t>(2 * p) * m + j) * stride + i]);
        const float lo = ColumnValue(cols[(static_cast<size_t>(2 * p + 1) * m + j) * stride + i]);
        g += std::max(0.f, xv - hi) + std::max(0.f, lo - xv);  // the channel's, then the sum
        w += hi - lo;
      }
    }
    grow[i] = g;
    width[i] = w;
  }
}

void BoxGrowthScalar(const float* x, int pairs, int m, const uint16_t* cols, int stride, int lanes,
                     float* grow, float* width) {
  BoxGrowthScalarOf(x, pairs, m, cols, stride, lanes, grow, width);
}

void BoxGrowthScalar(const float* x, int pairs, int m, const float* cols, int stride, int lanes,
                     float* grow, float* width) {
  BoxGrowthScalarOf(x, pairs, m, cols, stride, lanes, grow, width);
}

template <typename T>
bool BoxGrowthBelowScalarOf(const float* x, int pairs, int m, const T* cols, int stride, int lanes,
                            const float*, float, float* grow, float* width) {
  BoxGrowthScalarOf(x, pairs, m, cols, stride, lanes, grow, width);
  return true;
}

KVTIER_AVX512 inline __m512 Load16(const float* p) { return _mm512_loadu_ps(p); }
KVTIER_AVX512 inline __m512 Load16(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// BoxGrowthBelowAvx2's sixteen lanes in one register (AVX-512F): each lane the same operations
// on the same operands in the same order (BoxGrowthLanes'), so the same bits, with half the
// instructions. Passes of eight lanes or fewer stay with the AVX2 form, whose loads reach no
// further than the lanes rounded up to 8.
template <typename T>
KVTIER_AVX512 bool BoxGrowthBelowAvx512(const float* x, int pairs, int m, const T* cols, int stride,
                                        int lanes, const float* offset, float bound, float* grow,
                                        float* width) {
  if (lanes <= 8) {
    return BoxGrowthBelowAvx2<T>(x, pairs, m, cols, stride, lanes, offset, bound, grow, width);
  }
  float off[16] = {};
  if (offset != nullptr) std::copy_n(offset, lanes, off);
  const __m512 zero = _mm512_setzero_ps(), limit = _mm512_set1_ps(bound),
               start = _mm512_loadu_ps(off);
  const __mmask16 counted = static_cast<__mmask16>((1u << lanes) - 1);
  __m512 g = zero, w = zero;
  for (int p = 0; p < pairs; ++p) {
    for (int j = 0; j < m; ++j) {
      const __m512 xv = _mm512_set1_ps(x[static_cast<size_t>(p) * m + j]);
      const __m512 hi = Load16(cols + (static_cast<size_t>(2 * p) * m + j) * stride);
      const __m512 lo = Load16(cols + (static_cast<size_t>(2 * p + 1) * m + j) * stride);
      const __m512 out = _mm512_add_ps(_mm512_max_ps(_mm512_sub_ps(xv, hi), zero),
                                       _mm512_max_ps(_mm512_sub_ps(lo, xv), zero));
      g = _mm512_add_ps(g, out);
      w = _mm512_add_ps(w, _mm512_sub_ps(hi, lo));
      if (j % 16 == 15 &&
          (_mm512_cmp_ps_mask(_mm512_add_ps(start, g), limit, _CMP_GT_OQ) & counted) == counted) {
        return false;
      }
    }
  }
  float gs[16], ws[16];
  _mm512_storeu_ps(gs, g);
  _mm512_storeu_ps(ws, w);
  std::copy_n(gs, lanes, grow);
  std::copy_n(ws, lanes, width);
  return true;
}

template <typename T>
bool BoxGrowthBelowOf(const float* x, int pairs, int m, const T* cols, int stride, int lanes,
                      const float* offset, float bound, float* grow, float* width) {
  CHECK(lanes > 0 && lanes <= 16) << lanes;
  static const auto impl = HaveAvx512() && Cpu().f16c    ? BoxGrowthBelowAvx512<T>
                           : HaveAvx2Fma() && Cpu().f16c ? BoxGrowthBelowAvx2<T>
                                                         : BoxGrowthBelowScalarOf<T>;
  return impl(x, pairs, m, cols, stride, lanes, offset, bound, grow, width);
}

bool BoxGrowthBelowScalar(const float* x, int pairs, int m, const uint16_t* cols, int stride,
                          int lanes, const float* offset, float bound, float* grow, float* width) {
  return BoxGrowthBelowScalarOf(x, pairs, m, cols, stride, lanes, offset, bound, grow, width);
}

bool BoxGrowthBelowScalar(const float* x, int pairs, int m, const float* cols, int stride,
                          int lanes, const float* offset, float bound, float* grow, float* width) {
  return BoxGrowthBelowScalarOf(x, pairs, m, cols, stride, lanes, offset, bound, grow, width);
}

bool BoxGrowthBelow(const float* x, int pairs, int m, const uint16_t* cols, int stride, int lanes,
                    const float* offset, float bound, float* grow, float* width) {
  return BoxGrowthBelowOf(x, pairs, m, cols, stride, lanes, offset, bound, grow, width);
}

bool BoxGrowthBelow(const float* x, int pairs, int m, const float* cols, int stride, int lanes,
                    const float* offset, float bound, float* grow, float* width) {
  return BoxGrowthBelowOf(x, pairs, m, cols, stride, lanes, offset, bound, grow, width);
}

void BoxGrowth(const float* x, int pairs, int m, const uint16_t* cols, int stride, int lanes,
               float* grow, float* width) {
  static const auto impl =
      HaveAvx2Fma() && Cpu().f16c ? BoxGrowthAvx2<uint16_t> : BoxGrowthScalarOf<uint16_t>;
  impl(x, pairs, m, cols, stride, lanes, grow, width);
}

void BoxGrowth(const float* x, int pairs, int m, const float* cols, int stride, int lanes,
               float* grow, float* width) {
  static const auto impl =
      HaveAvx2Fma() && Cpu().f16c ? BoxGrowthAvx2<float> : BoxGrowthScalarOf<float>;
  impl(x, pairs, m, cols, stride, lanes, grow, width);
}

float SymmetricInt8CodesScalar(const float* x, int n, int8_t* codes) {
  const float top = TopMagnitudeScalar(x, n);
  const float inv = top > 0.f ? 127.f / top : 0.f;
  for (int i = 0; i < n; ++i) codes[i] = SymmetricInt8Code(x[i], inv);
  return top / 127.f;
}

float SymmetricInt8Codes(const float* x, int n, int8_t* codes) {
  static const auto impl = Cpu().avx2 ? SymmetricInt8CodesAvx2 : SymmetricInt8CodesScalar;
  return impl(x, n, codes);
}

void Int8TimesScalar(const int8_t* codes, int n, float scale, float* out) {
  for (int i = 0; i < n; ++i) out[i] = static_cast<float>(codes[i]) * scale;
}

void Int8Times(const int8_t* codes, int n, float scale, float* out) {
  static const auto impl = Cpu().avx2 ? Int8TimesAvx2 : Int8TimesScalar;
  impl(codes, n, scale, out);
}

void ScaledCodesScalar(const float* x, const float* inv, const int32_t* k0, int n, bool up,
                       int32_t* out) {
  for (int i = 0; i < n; ++i) out[i] = ScaledCode(x[i], inv[i], k0[i], up);
}

void ScaledCodes(const float* x, const float* inv, const int32_t* k0, int n, bool up,
                 int32_t* out) {
  static const auto impl = HaveAvx2Fma() && Cpu().f16c ? ScaledCodesAvx2 : ScaledCodesScalar;
  impl(x, inv, k0, n, up, out);
}

void DecodeRowsScalar(const uint8_t* codes, int rows, int stride, int lanes, const float* base,
                      const float* step, float* out, int out_stride) {
  for (int r = 0; r < rows; ++r) {
    for (int i = 0; i < lanes; ++i) {
      out[static_cast<size_t>(r) * out_stride + i] = std::fma(
          static_cast<float>(codes[static_cast<size_t>(r) * stride + i]), step[r], base[r]);
    }
  }
}

void DecodeRows(const uint8_t* codes, int rows, int stride, int lanes, const float* base,
                const float* step, float* out, int out_stride) {
  static const auto impl = HaveAvx2Fma() && Cpu().f16c ? DecodeRowsAvx2 : DecodeRowsScalar;
  impl(codes, rows, stride, lanes, base, step, out, out_stride);
}

void PowerOfTwoScalesScalar(const float* lo, const float* hi, int n, int32_t* k0, float* base,
                            float* step, float* inv) {
  for (int i = 0; i < n; ++i) {
    const float m = std::max(std::fabs(lo[i]), std::fabs(hi[i]));
    int32_t e = std::max({-126, FloorLog2Bits(m) - 22, FloorLog2Bits(hi[i] - lo[i]) - 7});
    if (std::ceil(hi[i] * PowerOfTwo(-e)) - std::floor(lo[i] * PowerOfTwo(-e)) > 255) ++e;
    const float k = std::floor(lo[i] * PowerOfTwo(-e));
    k0[i] = static_cast<int32_t>(k);
    step[i] = PowerOfTwo(e);
    inv[i] = PowerOfTwo(-e);
    base[i] = k * step[i];
  }
}

void PowerOfTwoScales(const float* lo, const float* hi, int n, int32_t* k0, float* base,
                      float* step, float* inv) {
  static const auto impl =
      HaveAvx2Fma() && Cpu().f16c ? PowerOfTwoScalesAvx2 : PowerOfTwoScalesScalar;
  impl(lo, hi, n, k0, base, step, inv);
}

void SquaredDistancesScalar(const float* cols, int stride, int lanes, int d, const float* point,
                            float* out) {
  for (int i = 0; i < lanes; ++i) {
    float s = 0;
    for (int j = 0; j < d; ++j) {
      const float t = cols[static_cast<size_t>(j) * stride + i] - point[j];
      s += t * t;
    }
    out[i] = s;
  }
}

void SquaredDistances(const float* cols, int stride, int lanes, int d, const float* point,
                      float* out) {
  static const auto impl = Cpu().avx2 ? SquaredDistancesAvx2 : SquaredDistancesScalar;
  impl(cols, stride, lanes, d, point, out);
}

bool WidenHalvesScalar(const uint16_t* x, int n, bool up, uint16_t* v) {
  bool finite = true;
  for (int i = 0; i < n; ++i) {
    const uint16_t kx = HalfOrderKey(x[i]), kv = HalfOrderKey(v[i]);
    v[i] = KeyHalf(up ? std::max(kx, kv) : std::min(kx, kv));
    finite &= (x[i] & 0x7c00u) != 0x7c00u;
  }
  return finite;
}

bool WidenHalves(const uint16_t* x, int n, bool up, uint16_t* v) {
  static const auto impl = HaveAvx2F16c() ? WidenHalvesAvx2 : WidenHalvesScalar;
  return impl(x, n, up, v);
}

void FloatsToHalvesDirected(const float* x, int n, bool up, uint16_t* out) {
  static void (*const impl)(const float*, int, bool, uint16_t*) =
      HaveAvx2F16c() ? FloatsToHalvesDirectedF16c : FloatsToHalvesDirectedScalar;
  impl(x, n, up, out);
}

bool HaveAvx512() { return Cpu().avx512f && Cpu().fma; }

void ExpInPlace(float* x, int n) {
  static void (*const impl)(float*, int) = HaveAvx512()    ? ExpInPlaceAvx512
                                           : HaveAvx2Fma() ? ExpInPlaceAvx2
                                                           : ExpInPlaceScalar;
  impl(x, n);
}

void LogInPlace(float* x, int n) {
  static void (*const impl)(float*, int) = HaveAvx512()    ? LogInPlaceAvx512
                                           : HaveAvx2Fma() ? LogInPlaceAvx2
                                                           : LogInPlaceScalar;
  impl(x, n);
}

void Log1pExpInPlace(float* x, int n) {
  static void (*const impl)(float*, int) = HaveAvx512()    ? Log1pExpInPlaceAvx512
                                           : HaveAvx2Fma() ? Log1pExpInPlaceAvx2
                                                           : Log1pExpInPlaceScalar;
  impl(x, n);
}

void ExpInPlaceEight(float* x, int n) {
  CHECK(HaveAvx2Fma());
  ExpInPlaceAvx2(x, n);
}

void LogInPlaceEight(float* x, int n) {
  CHECK(HaveAvx2Fma());
  LogInPlaceAvx2(x, n);
}

void Log1pExpInPlaceEight(float* x, int n) {
  CHECK(HaveAvx2Fma());
  Log1pExpInPlaceAvx2(x, n);
}

void MultiplyInto(const float* a, const float* b, size_t n, float* out) {
  Elementwise<MultiplyOp>(a, b, n, out);
}

void SubtractIntoScalar(const float* a, const float* b, size_t n, float* out) {
  ElementwiseScalar<SubtractOp>(a, b, n, out);
}

void AddIntoScalar(const float* a, const float* b, size_t n, float* out) {
  ElementwiseScalar<AddOp>(a, b, n, out);
}

void AddInto(const float* a, const float* b, size_t n, float* out) {
  Elementwise<AddOp>(a, b, n, out);
}

void WidenBoxToScalar(const float* x, size_t n, float* hi, float* lo) {
  for (size_t i = 0; i < n; ++i) {
    hi[i] = std::max(hi[i], x[i]);
    lo[i] = std::min(lo[i], x[i]);
  }
}

void SubtractInto(const float* a, const float* b, size_t n, float* out) {
  Elementwise<SubtractOp>(a, b, n, out);
}

void WidenBoxTo(const float* x, size_t n, float* hi, float* lo) {
  static void (*const impl)(const float*, size_t, float*, float*) =
      Cpu().avx2 ? WidenBoxToAvx : WidenBoxToScalar;
  impl(x, n, hi, lo);
}

size_t CountAtLeastScalar(const int32_t* keys, size_t n, int32_t t) {
  size_t c = 0;
  for (size_t i = 0; i < n; ++i) c += keys[i] >= t;
  return c;
}

void PickTopScalar(const int32_t* keys, size_t n, int32_t kth, size_t ties, uint32_t* out) {
  for (size_t i = 0; i < n; ++i) {
    if (keys[i] > kth || (keys[i] == kth && ties > 0 && ties-- > 0)) {
      *out++ = static_cast<uint32_t>(i);
    }
  }
}

void PickTop(const int32_t* keys, size_t n, int32_t kth, size_t ties, uint32_t* out) {
  static void (*const impl)(const int32_t*, size_t, int32_t, size_t, uint32_t*) =
      Cpu().avx2 ? PickTopAvx2 : PickTopScalar;
  impl(keys, n, kth, ties, out);
}

void TopByValue(std::span<const float> value, size_t take, std::vector<uint32_t>* chosen) {
  const size_t n = value.size();
  take = std::min(take, n);
  chosen->resize(take);
  if (take == 0) return;
  // Each value as a signed key in the same order (-0 as +0, which compare equal); the
  // take-th largest key is the largest t with at least `take` keys at least t, found by
  // halving [smallest, largest] with a count of the keys per step (branch-free, eight at a
  // time). Then every key above it is chosen, and the first rows equal to it.
  std::vector<int32_t> keys(n);
  int64_t lo = std::numeric_limits<int32_t>::max(), hi = std::numeric_limits<int32_t>::min();
  for (size_t i = 0; i < n; ++i) {
    const int32_t b = std::bit_cast<int32_t>(value[i] + 0.f);
    keys[i] = b < 0 ? b ^ 0x7fffffff : b;
    lo = std::min<int64_t>(lo, keys[i]);
    hi = std::max<int64_t>(hi, keys[i]);
  }
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo + 1) / 2;
    if (CountAtLeast(keys.data(), n, static_cast<int32_t>(mid)) >= take) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  const int32_t kth = static_cast<int32_t>(lo);
  const size_t ties =
      take -
      (kth == std::numeric_limits<int32_t>::max() ? 0 : CountAtLeast(keys.data(), n, kth + 1));
  PickTop(keys.data(), n, kth, ties, chosen->data());
}

size_t CountAtLeast(const int32_t* keys, size_t n, int32_t t) {
  static size_t (*const impl)(const int32_t*, size_t, int32_t) =
      Cpu().avx2 ? CountAtLeastAvx2 : CountAtLeastScalar;
  return impl(keys, n, t);
}

float MaxOf(const float* x, size_t n) {
  static float (*const impl)(const float*, size_t) = HaveAvx2Fma() ? MaxOfAvx2 : MaxOfScalar;
  return impl(x, n);
}

double SumAsDouble(const float* x, size_t n) {
  static double (*const impl)(const float*, size_t) =
      HaveAvx2Fma() ? SumAsDoubleAvx2 : SumAsDoubleScalar;
  return impl(x, n);
}

void AddQuotients(const float* x, double z, size_t n, float* out) {
  static void (*const impl)(const float*, double, size_t, float*) =
      HaveAvx2Fma() ? AddQuotientsAvx2 : AddQuotientsScalar;
  impl(x, z, n, out);
}

void DotColumns(const float* a, int m, int a_stride, const float* cols, int n, int stride,
                int lanes, float* out, int out_stride) {
  static const auto impl =
      HaveAvx2Fma() && Cpu().f16c ? DotColumnsAvx2<float> : DotColumnsScalar<float>;
  impl(a, m, a_stride, cols, n, stride, lanes, out, out_stride);
}

void DotColumns(const float* a, int m, int a_stride, const uint16_t* cols, int n, int stride,
                int lanes, float* out, int out_stride) {
  static const auto impl =
      HaveAvx2Fma() && Cpu().f16c ? DotColumnsAvx2<uint16_t> : DotColumnsScalar<uint16_t>;
  impl(a, m, a_stride, cols, n, stride, lanes, out, out_stride);
}

void DotColumns(const float* a, int m, int a_stride, const uint8_t* cols, int n, int stride,
                int lanes, float* out, int out_stride) {
  static const auto impl =
      HaveAvx2Fma() && Cpu().f16c ? DotColumnsAvx2<uint8_t> : DotColumnsScalar<uint8_t>;
  impl(a, m, a_stride, cols, n, stride, lanes, out, out_stride);
}

}  // namespace kvtier
