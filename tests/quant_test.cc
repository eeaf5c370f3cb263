// Quantization: the AVX2 path against the scalar reference (bit for bit), and every element's
// error against the input within half a quantization step plus fp16 rounding, over head_dims,
// token counts and hard inputs.
#include "kernels/quant.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>

#include "gtest/gtest.h"
#include "server/common/fp16.h"
#include "server/quant/chunk_quant.h"

namespace kvtier {
namespace {

enum class Input { kNormal, kOutlierChannels, kConstant, kHuge, kExtremes, kDenormal, kMixedZero };

std::vector<uint16_t> Make(Input kind, uint32_t n, uint32_t d, std::mt19937& rng) {
  std::normal_distribution<float> g(0, 1);
  std::uniform_int_distribution<uint32_t> sub(1, 0x3ff);
  std::vector<uint16_t> x(size_t(n) * d);
  for (uint32_t t = 0; t < n; ++t) {
    for (uint32_t j = 0; j < d; ++j) {
      float v = 0.f;
      switch (kind) {
        case Input::kNormal:
          v = g(rng);
          break;
        case Input::kOutlierChannels:
          v = g(rng) * (j % 16 == 3 ? 40.f : 1.f);
          break;
        case Input::kConstant:
          v = j % 2 ? 1.5f : -0.75f;
          break;  // zero range per channel
        case Input::kHuge:
          v = std::clamp(g(rng) * 30000.f, -65504.f, 65504.f);
          break;
        case Input::kExtremes:
          v = (t + j) % 2 ? 65504.f : -65504.f;
          break;
        case Input::kDenormal: {
          uint16_t h = static_cast<uint16_t>(sub(rng) | ((t + j) % 3 == 0 ? 0x8000 : 0));
          x[size_t(t) * d + j] = h;
          continue;
        }
        case Input::kMixedZero:
          v = (t * 7 + j) % 3 == 0 ? -0.f : ((t + j) % 3 == 1 ? 0.f : g(rng));
          break;
      }
      x[size_t(t) * d + j] = FloatToHalf(v);
    }
  }
  return x;
}

// Half an fp16 ulp at |y| (the rounding of the dequantized output).
float HalfUlp(float y) {
  uint16_t h = FloatToHalf(std::fabs(y));
  return (HalfToFloat(HalfNextUp(h)) - HalfToFloat(h)) / 2;
}

class QuantTest : public ::testing::TestWithParam<std::tuple<uint32_t, uint32_t, uint32_t>> {};

TEST_P(QuantTest, VectorEqualsReferenceAndErrorIsBounded) {
  const auto [d, n, bits] = GetParam();
  const QuantLayout L{d, n, bits};
  std::mt19937 rng(d * 131 + n * 7 + bits);
  for (Input kind : {Input::kNormal, Input::kOutlierChannels, Input::kConstant, Input::kHuge,
                     Input::kExtremes, Input::kDenormal, Input::kMixedZero}) {
    auto k = Make(kind, n, d, rng), v = Make(kind, n, d, rng);
    std::vector<uint8_t> ref(L.Bytes(), 0xee), vec(L.Bytes(), 0x11);
    QuantizeChunkReference(k.data(), v.data(), L, ref.data());
    QuantizeChunk(k.data(), v.data(), L, vec.data());
    ASSERT_EQ(ref, vec) << "quantized bytes differ, input " << int(kind);
    std::vector<uint16_t> kr(k.size()), vr(v.size()), kv(k.size()), vv(v.size());
    DequantizeChunkReference(ref.data(), L, kr.data(), vr.data());
    DequantizeChunk(ref.data(), L, kv.data(), vv.data());
    ASSERT_EQ(kr, kv) << "dequantized keys differ, input " << int(kind);
    ASSERT_EQ(vr, vv) << "dequantized values differ, input " << int(kind);
    // The error bound, from the stored scales (independent of how they were chosen).
    const QuantSections<const uint8_t> q(ref.data(), L);
    for (uint32_t t = 0; t < n; ++t) {
      for (uint32_t j = 0; j < d; ++j) {
        const size_t i = size_t(t) * d + j;
        for (int which = 0; which < 2; ++which) {
          const float x = HalfToFloat(which ? v[i] : k[i]);
          const float y = HalfToFloat(which ? vr[i] : kr[i]);
          const uint32_t g = t * L.groups() + j / kValueGroup;
          const float scale = which ? ScaleOf(q.value_header, q.value_scale[g])
                                    : ScaleOf(q.key_header, q.key_scale[L.key_group(t, j)]);
          ASSERT_TRUE(std::isfinite(y));
          const float bound = scale / 2 * (1 + 1e-6f) + HalfUlp(y) + 1e-30f;
          ASSERT_LE(std::fabs(x - y), bound)
              << (which ? "value" : "key") << " t " << t << " j " << j << " x " << x << " y " << y
              << " scale " << scale << " input " << int(kind);
        }
      }
    }
    if (kind == Input::kConstant) {  // zero range: exact
      EXPECT_EQ(k, kr);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Sweep, QuantTest,
                         ::testing::Combine(::testing::Values(64u, 80u, 128u, 256u, 36u, 512u),
                                            ::testing::Values(1u, 3u, 7u, 16u, 32u, 64u),
                                            ::testing::Values(4u, 8u)));

TEST(QuantLayout, SizesAndAlignment) {
  const QuantLayout L{64, 16, 4};
  EXPECT_EQ(L.key_header(), 0u);
  EXPECT_EQ(L.key_zero(), 16u);  // a header of three floats, padded
  EXPECT_EQ(L.key_scale(), 80u);
  EXPECT_EQ(L.key_codes(), 144u);
  EXPECT_EQ(L.code_bytes(), 512u);
  EXPECT_EQ(L.value_header(), 656u);
  EXPECT_EQ(L.value_zero(), 672u);
  EXPECT_EQ(L.value_scale(), 688u);  // 16 tokens x 1 group of 64 channels x 1 byte
  EXPECT_EQ(L.value_codes(), 704u);
  EXPECT_EQ(L.Bytes(), 1216u);  // vs 4096 bytes of fp16 K and V: 0.297x
  // Two key spans: 2 x 128 zero and scale bytes each.
  EXPECT_EQ(QuantLayout({128, 32, 4}).key_codes(), 16u + 2 * 256);
  EXPECT_EQ(QuantLayout({128, 32, 4}).Bytes(), 4768u);  // vs 16384: 0.291x
  const QuantLayout odd{36, 3, 4};
  for (uint64_t off : {odd.key_zero(), odd.key_scale(), odd.key_codes(), odd.value_header(),
                       odd.value_zero(), odd.value_scale(), odd.value_codes(), odd.Bytes()}) {
    EXPECT_EQ(off % 16, 0u);
  }
}

// A key channel's parameters span 16 tokens: a chunk whose halves lie far apart keeps each
// half's own resolution (one range over both would make the step 100 / 15).
TEST(QuantLayout, KeyGroupsSpanSixteenTokens) {
  const uint32_t d = 64, n = 40;
  const QuantLayout L{d, n, 4};
  EXPECT_EQ(L.key_spans(), 3u);
  EXPECT_EQ(L.key_group(15, 5), 5u);
  EXPECT_EQ(L.key_group(16, 5), d + 5);
  EXPECT_EQ(L.key_group(39, 5), 2 * d + 5);
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> u(0.f, 1.f);
  std::vector<uint16_t> k(n * d), v(n * d);
  for (uint32_t t = 0; t < n; ++t) {
    const float base = (t / 16) % 2 ? 100.f : 0.f;
    for (uint32_t j = 0; j < d; ++j) {
      k[t * d + j] = FloatToHalf(base + u(rng));
      v[t * d + j] = FloatToHalf(u(rng));
    }
  }
  std::vector<uint8_t> ref(L.Bytes()), vec(L.Bytes());
  QuantizeChunkReference(k.data(), v.data(), L, ref.data());
  QuantizeChunk(k.data(), v.data(), L, vec.data());
  ASSERT_EQ(ref, vec);
  std::vector<uint16_t> kr(k.size()), vr(v.size());
  DequantizeChunk(ref.data(), L, kr.data(), vr.data());
  for (uint32_t i = 0; i < n * d; ++i) {
    const float x = HalfToFloat(k[i]), y = HalfToFloat(kr[i]);
    // Half a step of a span 1 wide, widened by the zero codes' step (the minima's spread
    // over 255) and the scale codes' 1/32, and half an fp16 ulp.
    ASSERT_LE(std::fabs(x - y), (1.f + 100.f / 255) / 15 / 2 * (1 + 1.f / 32) + HalfUlp(y)) << i;
  }
}

TEST(QuantLayout, NibblesArePackedLowFirst) {
  const QuantLayout L{2, 1, 4};
  const uint16_t k[2] = {FloatToHalf(0.f), FloatToHalf(15.f)}, v[2] = {k[0], k[1]};
  std::vector<uint8_t> out(L.Bytes());
  QuantizeChunkReference(k, v, L, out.data());
  const QuantSections<const uint8_t> q(out.data(), L);
  EXPECT_EQ(ScaleOf(q.key_header, q.key_scale[0]), 0.f);  // key channel 0 is constant
  EXPECT_EQ(ZeroOf(q.value_header, q.value_zero[0]), 0.f);
  EXPECT_EQ(ScaleOf(q.value_header, q.value_scale[0]), 1.f);  // 15 / 15
  EXPECT_EQ(out[L.value_codes()], 0xf0);  // element 0 -> low nibble 0, element 1 -> high 15
}

// The parameters by their definition (quant_layout.h), checked against a brute-force search
// over every code: the zero is the largest at or below the group's minimum, the scale the
// smallest that covers the group, and the header's scale base the smallest float whose largest
// scale covers the widest group.
TEST(QuantLayout, ParametersAreTheTightestCodesThatCoverEachGroup) {
  std::mt19937 rng(3);
  std::normal_distribution<float> g(0, 1);
  for (int trial = 0; trial < 200; ++trial) {
    const uint32_t count = 1 + rng() % 300;
    std::vector<float> mn(count), mx(count), need(count);
    for (uint32_t i = 0; i < count; ++i) {
      const float spread = trial % 3 == 0 ? 40.f : 1.f;
      const float a = HalfToFloat(FloatToHalf(g(rng) * spread * (i % 7 == 3 ? 30.f : 1.f)));
      const float b = HalfToFloat(FloatToHalf(a + std::fabs(g(rng)) * (trial % 5 ? 1.f : 0.f)));
      mn[i] = a;
      mx[i] = b;
    }
    float header[kHeaderFloats];
    std::vector<uint8_t> zc(count), sc(count);
    EncodeParams(mn.data(), mx.data(), count, 15, header, zc.data(), sc.data(), need.data());
    EXPECT_EQ(header[3], 0.f);
    float widest = 0.f;
    for (uint32_t i = 0; i < count; ++i) {
      const float zero = ZeroOf(header, zc[i]);
      ASSERT_LE(zero, mn[i]) << i;
      if (zc[i] < 255) {
        ASSERT_GT(ZeroOf(header, zc[i] + 1u), mn[i])
            << "zero code " << int(zc[i]) << " not largest";
      }
      const float want = (mx[i] - zero) / 15.f;
      widest = std::max(widest, want);
      uint32_t best = 256;
      for (uint32_t c = 0; c < 256 && best == 256; ++c) {
        if (ScaleOf(header, c) >= want) best = c;
      }
      ASSERT_EQ(sc[i], best) << "scale code of group " << i;
      ASSERT_GE(ScaleOf(header, sc[i]) * 15.f, (mx[i] - zero) * (1 - 1e-6f)) << i;
    }
    const float base = header[kScaleBase];
    EXPECT_GE(base * kMaxScaleFactor, widest);
    if (base > 0.f) {
      EXPECT_LT(std::nextafter(base, 0.f) * kMaxScaleFactor, widest);
    }
  }
}

TEST(FindNonFinite, FindsInfAndNaN) {
  std::vector<uint16_t> h(100, FloatToHalf(1.f));
  EXPECT_EQ(FindNonFinite(h.data(), h.size()), -1);
  h[37] = 0x7c00;  // +Inf
  EXPECT_EQ(FindNonFinite(h.data(), h.size()), 37);
  h[37] = FloatToHalf(1.f);
  h[99] = 0xfe01;  // NaN
  EXPECT_EQ(FindNonFinite(h.data(), h.size()), 99);
}

// CopyFinite copies every value, and is false exactly when FindNonFinite finds one, for fp16
// and bf16, at every length around its 64-value blocks and every place of the bad value
// (first, inside a block, in the tail), on the vector path and the scalar one.
TEST(CopyFinite, CopiesAndAgreesWithFindNonFinite) {
  std::mt19937 rng(11);
  for (const HalfKind kind : {HalfKind::kFp16, HalfKind::kBf16}) {
    const uint16_t inf = kind == HalfKind::kFp16 ? 0x7c00 : 0x7f80;
    const uint16_t nan = kind == HalfKind::kFp16 ? 0xfe01 : 0xffc1;
    const uint16_t max_finite = kind == HalfKind::kFp16 ? 0x7bff : 0x7f7f;  // exponent one short
    for (const uint64_t n : {0, 1, 15, 63, 64, 65, 127, 128, 200, 1031}) {
      std::vector<uint16_t> src(n);
      for (auto& h : src) h = static_cast<uint16_t>(rng()) & 0xbfff;  // exponent never all ones
      if (n > 0) src[n / 2] = max_finite;
      std::vector<int64_t> places = {-1};
      if (n > 0) places.insert(places.end(), {0, int64_t(n / 2), int64_t(n - 1)});
      for (const int64_t bad : places) {
        for (const uint16_t value : {inf, nan}) {
          std::vector<uint16_t> s = src;
          if (bad >= 0) s[bad] = value;
          const bool finite = FindNonFinite(kind, s.data(), n) < 0;
          EXPECT_EQ(finite, bad < 0);
          std::vector<uint16_t> b(n, 2);
          EXPECT_EQ(CopyFiniteReference(kind, b.data(), s.data(), n), finite) << n << " " << bad;
          if (finite) {
            EXPECT_EQ(b, s) << n;
          }
          for (const bool stream : {false, true}) {
            // 32-byte aligned, where the stores may stream, and not.
            for (const size_t skew : {0, 1}) {
              alignas(32) static uint16_t a[1031 + 16];
              std::fill(std::begin(a), std::end(a), uint16_t{1});
              EXPECT_EQ(CopyFinite(kind, a + skew, s.data(), n, stream), finite)
                  << n << " " << bad << " " << stream << skew;
              FenceStreamedStores();
              if (finite) {
                EXPECT_TRUE(std::equal(s.begin(), s.end(), a + skew)) << n;
                EXPECT_EQ(a[skew + n], 1) << "wrote past the end";
              }
            }
          }
        }
      }
    }
  }
}

// CopyFiniteRows copies rows of every head_dim as CopyFinite does, and adds them to the sums
// with the very bits AddRows gives (from zero, and onto sums already there), fp16 and bf16.
TEST(CopyFinite, RowsAddTheBitsAddRowsAdds) {
  std::mt19937 rng(12);
  for (const HalfKind kind : {HalfKind::kFp16, HalfKind::kBf16}) {
    // Every multiple of 16 up to 128 (the AVX2 path, 16 columns at a time), and sizes it does
    // not take (8, 24).
    for (const int d : {8, 16, 24, 32, 48, 64, 80, 96, 112, 128}) {
      for (const uint32_t rows : {1u, 7u, 16u}) {
        const size_t n = size_t{rows} * d;
        std::vector<uint16_t> src(n);
        for (auto& h : src) h = static_cast<uint16_t>(rng()) & 0xbfff;
        std::vector<float> start(d);
        for (auto& x : start) x = static_cast<float>(rng() % 1000) / 7.f - 70.f;
        for (const bool from_zero : {true, false}) {
          std::vector<float> want = from_zero ? std::vector<float>(d, 0.f) : start;
          AddRows(kind, src.data(), static_cast<int>(rows), d, want.data());
          for (const bool stream : {false, true}) {
            alignas(32) static uint16_t dst[16 * 128];
            std::vector<float> got = from_zero ? std::vector<float>(d, 0.f) : start;
            ASSERT_TRUE(CopyFiniteRows(kind, dst, src.data(), rows, d, got.data(), stream));
            FenceStreamedStores();
            EXPECT_TRUE(std::equal(src.begin(), src.end(), dst)) << d << " " << rows;
            EXPECT_EQ(0, std::memcmp(got.data(), want.data(), d * sizeof(float)))
                << d << " " << rows << " " << stream;
          }
        }
        // One value not finite, wherever it is: the last row's last, the first row's first,
        // and one in the middle of the middle row (NaN).
        for (const size_t at : {n - 1, size_t{0}, n / 2 + 3}) {
          std::vector<uint16_t> bad = src;
          bad[std::min(at, n - 1)] = kind == HalfKind::kFp16 ? 0x7c00 : 0x7f80;
          if (at == n / 2 + 3) bad[std::min(at, n - 1)] |= 1;  // NaN
          std::vector<float> sums(d, 0.f);
          alignas(32) static uint16_t dst[16 * 128];
          EXPECT_FALSE(CopyFiniteRows(kind, dst, bad.data(), rows, d, sums.data(), true))
              << d << " " << rows << " at " << at;
        }
      }
    }
  }
}

}  // namespace
}  // namespace kvtier
