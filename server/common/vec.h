// Vector helpers on the append and select paths. AVX2 (+F16C, +FMA) when the CPU has them
// (and AVX-512 VNNI for the ranking's integer dot products), chosen once at run time; scalar
// otherwise.
//
// AddRows adds rows of 2-byte floats (fp16 or bf16) into a float accumulator, the per-chunk
// key and value sums behind the mean-key ranking. Both paths give the same sums bit for bit:
// each lane adds its rows in order and the conversions are exact.
#ifndef KVTIER_SERVER_COMMON_VEC_H_
#define KVTIER_SERVER_COMMON_VEC_H_

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "absl/container/inlined_vector.h"

namespace kvtier {

enum class HalfKind { kFp16, kBf16 };

// Starts the loads of n bytes from p (a software prefetch of each 64-byte line), so that they
// arrive while other work runs.
inline void PrefetchBytes(const void* p, size_t n) {
  const char* c = static_cast<const char*>(p);
  for (size_t off = 0; off < n; off += 64) __builtin_prefetch(c + off);
}

// sum[j] += value(rows[r * d + j]) for r in [0, n), j in [0, d).
void AddRows(HalfKind kind, const uint16_t* rows, int n, int d, float* sum);

// The scalar path, always available (the reference for tests).
void AddRowsScalar(HalfKind kind, const uint16_t* rows, int n, int d, float* sum);

// out[i] = value(h[i]) for i in [0, n), exactly (AddRows onto zeros: a -0 comes out +0, which
// nothing that reads the floats as magnitudes or distances tells apart).
void HalvesToFloats(HalfKind kind, const uint16_t* h, size_t n, float* out);

// True when AddRows and Dot use the AVX2 paths on this machine.
bool AddRowsIsVectorized();

// a . b over n floats. The AVX2/FMA path sums in another order than the scalar one, so the
// two agree to rounding, not bit for bit.
float Dot(const float* a, const float* b, int n);
float DotScalar(const float* a, const float* b, int n);
// a . h over n floats and n 2-byte floats of `kind` (exactly widened): the ranking's dot
// product with a chunk's compact statistics. The same caveat as Dot between the two paths.
float DotHalves(HalfKind kind, const float* a, const uint16_t* h, int n);
float DotHalvesScalar(HalfKind kind, const float* a, const uint16_t* h, int n);
// out[r * group + g] = DotHalves(kind, a + g * n, h + r * n, n) for g in [0, group) and r in
// [0, rows), bit for bit, with each of h's halves widened once for the whole group (a query
// group against a run of key rows).
void DotHalvesRows(HalfKind kind, const float* a, int group, const uint16_t* h, int rows, int n,
                   float* out);
// The same values into out[r * out_row + g * out_group] (out_row 1, out_group `rows` or more:
// each query's dot products side by side, head-major).
void DotHalvesRows(HalfKind kind, const float* a, int group, const uint16_t* h, int rows, int n,
                   float* out, int out_row, int out_group);
// A query vector on an 8-bit grid, as the ranking of compact statistics takes it: scale = 2^e,
// the smallest power of two (e in [-100, 122]) with every |x[i]| / scale <= 127, and codes[i]
// = nearbyint(x[i] / scale) (NaN as 0, +-inf as +-FLT_MAX, then clamped to +-127). Returns
// scale. The scale being a power of two, a vector already on the grid (codes times scale)
// gets the same codes and scale back. Both paths give the same bytes and scale.
float QueryInt8Codes(const float* x, int n, int8_t* codes);
// x[i] = codes[i] * scale in place (QueryInt8Codes): the query every chunk of a stream is
// ranked against, so that scores from compact and from float statistics, and the cluster
// index's bounds, see one query.
void RoundQueryToInt8(float* x, int n);

// a . c over n floats and n signed bytes, the ranking's dot product with a chunk's compact
// statistics (before their scale): with a on QueryInt8Codes' grid first, scale times the exact
// integer sum of codes[j] * c[j]. So every path, every grouping of rows and heads below, and
// DotInt8Scalar give the same bits; for a query already on the grid it is the exact value of
// a . c (rounded once, past 2^24 in the integer sum). Rounding the query costs the ranking
// nothing measurable (bench/ranking/compare.py: lse-peak-int8 against lse-peak-int8q).
float DotInt8(const float* a, const int8_t* c, int n);
float DotInt8Scalar(const float* a, const int8_t* c, int n);
// out[g] = DotInt8(a + g * n, c, n) for g in [0, group), bit for bit, each head's codes made
// once for the whole group.
void DotInt8Group(const float* a, int group, const int8_t* c, int n, float* out);
// out[r * group + g] = DotInt8(a + g * n, c + r * n, n) for g in [0, group) and r in [0, rows),
// bit for bit: DotInt8Group over a run of rows (chunks' compact statistics side by side) in
// one call.
void DotInt8GroupRows(const float* a, int group, const int8_t* c, int rows, int n, float* out);
// The same with strides, bit for bit: row r at c + r * c_stride, its dot with vector g into
// out[r * out_row + g * out_group] (say, every other row of a run, the results head by head).
void DotInt8GroupRowsStrided(const float* a, int group, const int8_t* c, int rows, int n,
                             int c_stride, float* out, int out_row, int out_group);
// The integer kernels behind them: kVnni multiplies four bytes at a time (AVX-512 VNNI in
// 256-bit registers, n a multiple of 32), kAvx2 two int16 pairs (vpmaddwd, n a multiple of 16),
// kScalar one. BestInt8Kernel is the best this machine has, which the functions above take.
enum class Int8Kernel { kScalar, kAvx2, kVnni };
bool HaveInt8Kernel(Int8Kernel kernel);
Int8Kernel BestInt8Kernel();

// A query group's codes (QueryInt8Codes, head by head), made once for several calls of
// DotInt8GroupRowsStrided (a block's means, then its peaks): head g's n codes, its scale, and
// 128 times the sum of its codes (what the VNNI kernel, which takes a row's bytes as unsigned,
// c + 128, adds). For `kernel`; one not available here, or a width it does not take, runs as
// kScalar.
class QueryInt8Group {
 public:
  QueryInt8Group(const float* a, int group, int n, Int8Kernel kernel = BestInt8Kernel());
  QueryInt8Group(const QueryInt8Group&) = delete;
  QueryInt8Group& operator=(const QueryInt8Group&) = delete;
  int group() const { return group_; }
  int n() const { return n_; }
  Int8Kernel kernel() const { return kernel_; }
  const int8_t* codes(int g) const { return codes_.data() + static_cast<size_t>(g) * n_; }
  const int16_t* wide(int g) const { return wide_.data() + static_cast<size_t>(g) * n_; }
  float scale(int g) const { return scale_[g]; }
  int32_t bias(int g) const { return bias_[g]; }

 private:
  int group_, n_;
  Int8Kernel kernel_;
  absl::InlinedVector<int8_t, 2048> codes_;  // a query group's fit in the object
  absl::InlinedVector<float, 16> scale_;
  absl::InlinedVector<int32_t, 16> bias_;
  std::vector<int16_t> wide_;  // int16 copies of the codes: the AVX2 kernel's operands
};

// DotInt8GroupRowsStrided of q's group and width, bit for bit.
void DotInt8GroupRowsStrided(const QueryInt8Group& q, const int8_t* c, int rows, int c_stride,
                             float* out, int out_row, int out_group);
// DotInt8GroupRowsStrided by the given kernel (for tests).
void DotInt8GroupRowsWith(Int8Kernel kernel, const float* a, int group, const int8_t* c, int rows,
                          int n, int c_stride, float* out, int out_row, int out_group);

// Rows of signed bytes held a second time in tiles, for a scan of many rows against a query
// group with no sum across a register: `parts` vectors of n bytes per row (n a multiple of 4;
// a chunk's mean and peak, say), rows in tiles of kInt8TileRows, and in a tile each part's
// bytes [4k, 4k + 4) of its 16 rows side by side (64 bytes), as unsigned bytes (the code +
// 128, what vpdpbusd takes):
//   byte b of row r's part p, dims 4k + b:  ((r / 16 * parts + p) * (n / 4) + k) * 64 +
//                                           r % 16 * 4 + b
// One vpdpbusd then adds four dimensions of eight rows (half a tile) for one head.
constexpr int kInt8TileRows = 16;
// The bytes of tiles holding `rows` rows (whole tiles).
size_t Int8TileBytes(uint32_t rows, int parts, int n);
// Writes row r's part p (n codes) into tiles (at least Int8TileBytes(r + 1, parts, n) bytes).
void PutInt8TileRow(const int8_t* codes, uint32_t r, int parts, int p, int n, uint8_t* tiles);
// The dot products of q's group with part p of rows [first, first + rows) of tiles (first a
// multiple of kInt8TileRows): row first + i's with head g into out[g * out_group + i], the bits
// DotInt8GroupRowsStrided gives over the same codes. The VNNI kernel (AVX-512 VNNI on 256-bit
// registers, eight rows a register) where q's kernel is kVnni, else row by row.
void DotInt8GroupTiles(const QueryInt8Group& q, const uint8_t* tiles, int parts, int p,
                       uint32_t first, uint32_t rows, float* out, int out_group);
// The same by the scalar loop (for tests).
void DotInt8GroupTilesScalar(const QueryInt8Group& q, const uint8_t* tiles, int parts, int p,
                             uint32_t first, uint32_t rows, float* out, int out_group);

// out[h * out_stride + i] = sum_j a[h * a_stride + j] * cols[j * stride + i] for h in [0, m),
// i in [0, lanes): m vectors against `lanes` vectors stored channel-major (lane i's channel j
// at cols[j * stride + i]). One pass over the columns serves up to four of the m vectors,
// eight lanes per vector operation. stride is a multiple of 8, at least lanes: loads reach
// the lanes rounded up to 8.
void DotColumns(const float* a, int m, int a_stride, const float* cols, int n, int stride,
                int lanes, float* out, int out_stride);
// The same over columns of IEEE halves, or of unsigned bytes (each exactly widened to float).
void DotColumns(const float* a, int m, int a_stride, const uint16_t* cols, int n, int stride,
                int lanes, float* out, int out_stride);
void DotColumns(const float* a, int m, int a_stride, const uint8_t* cols, int n, int stride,
                int lanes, float* out, int out_stride);

// How far a point lies outside each of `lanes` boxes stored channel-major as IEEE halves
// (lane i's row r at cols[r * stride + i]), the rows in `pairs` pairs of blocks [hi (m rows) |
// lo (m rows)], the point x of pairs * m floats (x[p * m + j] against rows 2 p m + j and
// (2 p + 1) m + j): grow[i] = the sum over channels of max(x - hi, 0) + max(lo - x, 0), and
// width[i] = the sum of (hi - lo). Both paths add the rows in the same order: the same bits.
// stride is a multiple of 8, at least lanes. The same over boxes of floats.
void BoxGrowth(const float* x, int pairs, int m, const uint16_t* cols, int stride, int lanes,
               float* grow, float* width);
void BoxGrowthScalar(const float* x, int pairs, int m, const uint16_t* cols, int stride, int lanes,
                     float* grow, float* width);
void BoxGrowth(const float* x, int pairs, int m, const float* cols, int stride, int lanes,
               float* grow, float* width);
void BoxGrowthScalar(const float* x, int pairs, int m, const float* cols, int stride, int lanes,
                     float* grow, float* width);
// BoxGrowth over lanes in (0, 16], stopping early: false, grow and width then unwritten, once
// every lane's offset[i] + growth so far (offset null: 0) exceeds `bound`, so that its whole
// growth would too (every term is >= 0, and a rounded sum never falls as a term >= 0 is added,
// nor does offset[i] + it). Else true, with BoxGrowth's bits. How often a path looks is its
// own (the AVX2 and AVX-512 ones every 16 channels; the scalar one never stops).
bool BoxGrowthBelow(const float* x, int pairs, int m, const uint16_t* cols, int stride, int lanes,
                    const float* offset, float bound, float* grow, float* width);
bool BoxGrowthBelow(const float* x, int pairs, int m, const float* cols, int stride, int lanes,
                    const float* offset, float bound, float* grow, float* width);
bool BoxGrowthBelowScalar(const float* x, int pairs, int m, const uint16_t* cols, int stride,
                          int lanes, const float* offset, float bound, float* grow, float* width);
bool BoxGrowthBelowScalar(const float* x, int pairs, int m, const float* cols, int stride,
                          int lanes, const float* offset, float bound, float* grow, float* width);

// out[r * out_stride + i] = fma(codes[r * stride + i], step[r], base[r]) for r in [0, rows), i
// in [0, lanes): bytes decoded on a scale per row, each correctly rounded (one fused
// multiply-add), so that every path gives the same bits. The AVX2 path reads codes and writes
// out eight lanes at a time, up to lanes rounded up to 8 (out_stride is at least that).
void DecodeRows(const uint8_t* codes, int rows, int stride, int lanes, const float* base,
                const float* step, float* out, int out_stride);
void DecodeRowsScalar(const uint8_t* codes, int rows, int stride, int lanes, const float* base,
                      const float* step, float* out, int out_stride);

// The scale of codes over n boxes [lo[i], hi[i]] (finite, lo <= hi): code b stands for (k0[i]
// + b) step[i], step[i] = 2^e and inv[i] = 2^-e, base[i] = k0[i] step[i], all exact. e is the
// largest of -126, floor(log2 max(|lo|, |hi|)) - 22 (every k in reach stays below 2^24) and
// floor(log2(hi - lo)) - 7, plus one if 256 codes from k0 = floor(lo / 2^e) would not reach hi
// then (they always do with it). Both paths give the same values.
void PowerOfTwoScales(const float* lo, const float* hi, int n, int32_t* k0, float* base,
                      float* step, float* inv);
void PowerOfTwoScalesScalar(const float* lo, const float* hi, int n, int32_t* k0, float* base,
                            float* step, float* inv);

// out[i] = the squared Euclidean distance from `point` (d floats) to each of `lanes` rows held
// transposed (row i's channel j at cols[j * stride + i]): the float sum over j in order of
// (x - point[j])^2, each a subtraction, a product and an addition (no fused multiply-add), as
// a plain scalar loop over one row gives it; both paths give those bits. stride is a multiple
// of 8, at least lanes; lanes past `lanes` up to the next multiple of 8 are read.
void SquaredDistances(const float* cols, int stride, int lanes, int d, const float* point,
                      float* out);
void SquaredDistancesScalar(const float* cols, int stride, int lanes, int d, const float* point,
                            float* out);

// v[i] = the larger (up) or the smaller (!up) of the IEEE halves v[i] and x[i], ordered as
// their values with -0 below +0 (and a NaN beyond the infinities on its sign's side); returns
// whether every x[i] is finite. AVX2: sixteen at a time, the same bits.
bool WidenHalves(const uint16_t* x, int n, bool up, uint16_t* v);
bool WidenHalvesScalar(const uint16_t* x, int n, bool up, uint16_t* v);

// out[i] = x[i] as an IEEE half rounded towards +Inf (up) or towards -Inf (!up): the same bits
// as FloatToHalfUp / FloatToHalfDown (F16C's directed rounding, eight at a time).
void FloatsToHalvesDirected(const float* x, int n, bool up, uint16_t* out);

// x[i] = e^x[i] for i in [0, n), each input first clamped to [-87, 88] (so that results stay
// normal floats); relative error under 1e-6 (AVX2: Cephes' expf polynomial after range
// reduction, eight at a time; sixteen with AVX-512F, the same bits). Each result depends only
// on its input, not on n or i.
void ExpInPlace(float* x, int n);

// floor(x * inv) - k0 (up: the ceiling), x * inv first clamped to +-2^30 (a NaN to -2^30, as
// AVX2's max then min): for inv a power of two, the code of PowerOfTwoScales' scale at or below
// (above) x, not clamped to a byte. Truncated, then moved to the floor or the ceiling (no library
// call).
inline int32_t ScaledCode(float x, float inv, int32_t k0, bool up) {
  float t = x * inv;
  t = t > -0x1p30f ? t : -0x1p30f;
  t = t < 0x1p30f ? t : 0x1p30f;
  int32_t k = static_cast<int32_t>(t);
  k += up ? (static_cast<float>(k) < t) : -(static_cast<float>(k) > t);
  return k - k0;
}
// out[i] = ScaledCode(x[i], inv[i], k0[i], up); both paths give the same values.
void ScaledCodes(const float* x, const float* inv, const int32_t* k0, int n, bool up, int32_t* out);
void ScaledCodesScalar(const float* x, const float* inv, const int32_t* k0, int n, bool up,
                       int32_t* out);

// A vector as signed bytes and one scale: each x[i] taken as 0 if NaN and clamped to
// +-FLT_MAX, top the largest magnitude of those (0 for none), scale = top / 127 (returned),
// and codes[i] = clamp(nearbyint(x[i] * (top > 0 ? 127 / top : 0)), -127, 127), each
// operation rounded once. Both paths give the same bytes and scale.
float SymmetricInt8Codes(const float* x, int n, int8_t* codes);
float SymmetricInt8CodesScalar(const float* x, int n, int8_t* codes);
// out[i] = codes[i] * scale for i in [0, n), each product rounded once (a code widens to a
// float exactly): the vector SymmetricInt8Codes' codes and scale stand for, the same bits on
// every path.
void Int8Times(const int8_t* codes, int n, float scale, float* out);
void Int8TimesScalar(const int8_t* codes, int n, float scale, float* out);

// out[i] = a[i] * b[i] for i in [0, n) (each product rounded once: the same on every path).
void MultiplyInto(const float* a, const float* b, size_t n, float* out);
// out[i] = a[i] - b[i] for i in [0, n) (each difference rounded once: the same on every path).
void SubtractInto(const float* a, const float* b, size_t n, float* out);
void SubtractIntoScalar(const float* a, const float* b, size_t n, float* out);
// out[i] = a[i] + b[i] for i in [0, n) (each sum rounded once: the same on every path); out may
// be a.
void AddInto(const float* a, const float* b, size_t n, float* out);
void AddIntoScalar(const float* a, const float* b, size_t n, float* out);
// hi[i] = std::max(hi[i], x[i]) and lo[i] = std::min(lo[i], x[i]) for i in [0, n): a box over
// [lo, hi] widened to cover x, with std::max's and std::min's answers to NaNs and signed zeros
// (hi or lo stays) on every path.
void WidenBoxTo(const float* x, size_t n, float* hi, float* lo);
void WidenBoxToScalar(const float* x, size_t n, float* hi, float* lo);

// The largest of n floats (-inf for none).
float MaxOf(const float* x, size_t n);
// The indices, ascending, of the `take` largest of `value` (all of them when fewer), ties to
// the lower index: the first `take` in the order best first, ties to the earlier, without
// sorting (the take-th largest found by halving the range of its bits). REQUIRES: no NaN.
void TopByValue(std::span<const float> value, size_t take, std::vector<uint32_t>* chosen);

// How many of n keys are at least t.
size_t CountAtLeast(const int32_t* keys, size_t n, int32_t t);
size_t CountAtLeastScalar(const int32_t* keys, size_t n, int32_t t);
// Into out, ascending, every i < n with keys[i] > kth, and the first `ties` with keys[i] == kth.
// REQUIRES: out has room for them.
void PickTop(const int32_t* keys, size_t n, int32_t kth, size_t ties, uint32_t* out);
void PickTopScalar(const int32_t* keys, size_t n, int32_t kth, size_t ties, uint32_t* out);
// x[0] + ... + x[n - 1] in double, in a fixed order on every path: eight partial sums (the k-th
// takes x[i] for i % 8 == k), t_k = s_k + s_(k+4), then (t0 + t2) + (t1 + t3).
double SumAsDouble(const float* x, size_t n);
// out[i] += float(double(x[i]) * (1 / z)) for i in [0, n), the same bits on every path: the
// quotient through one reciprocal (a division each cost a refinement's softmax about 2 cycles
// an element), within an ulp of the double quotient before its rounding to float.
void AddQuotients(const float* x, double z, size_t n, float* out);

// x[i] = log x[i] for positive normal floats; error under 2e-7 (AVX2: Cephes' logf
// polynomial, eight at a time). Each result depends only on its input, not on n or i.
void LogInPlace(float* x, int n);

// x[i] = log(1 + e^x[i]): the bits of ExpInPlace, adding 1, then LogInPlace, in one pass.
void Log1pExpInPlace(float* x, int n);

// Whether the CPU (and the OS) run AVX-512F: ExpInPlace, LogInPlace and Log1pExpInPlace then
// take sixteen lanes at a time, with the bits of their eight-lane paths below (for tests;
// REQUIRES: AVX2 and FMA), and so do BoxGrowthBelow's passes of more than eight lanes.
bool HaveAvx512();
void ExpInPlaceEight(float* x, int n);
void LogInPlaceEight(float* x, int n);
void Log1pExpInPlaceEight(float* x, int n);

}  // namespace kvtier

#endif  // KVTIER_SERVER_COMMON_VEC_H_
