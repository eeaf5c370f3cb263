#include <algorithm>
#include <atomic>
#include <bit>
#include <cmath>
#include <limits>
#include <numeric>
#include <random>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "server/common/error.h"
#include "server/common/fp16.h"
#include "server/common/log.h"
#include "server/common/mutex.h"
#include "server/common/size.h"
#include "server/common/vec.h"
#include "tests/test_util.h"

namespace kvtier {
namespace {

using testing::StatusIs;

TEST(ParseSize, AcceptsBytesAndSuffixes) {
  EXPECT_EQ(*ParseSize("4096", "f"), 4096u);
  EXPECT_EQ(*ParseSize("64K", "f"), 64u << 10);
  EXPECT_EQ(*ParseSize("512m", "f"), 512ull << 20);
  EXPECT_EQ(*ParseSize(" 8G ", "f"), 8ull << 30);
  EXPECT_EQ(*ParseSize("0", "f"), 0u);
}

TEST(ParseSize, RejectsBadInputNamingTheField) {
  EXPECT_THAT(ParseSize("", "host_capacity"),
              StatusIs(absl::StatusCode::kInvalidArgument, "host_capacity"));
  EXPECT_THAT(ParseSize("12Q", "host_capacity"),
              StatusIs(absl::StatusCode::kInvalidArgument, "host_capacity"));
  EXPECT_THAT(ParseSize("G", "x"), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(ParseSize("-1", "x"), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(ParseSize("99999999999999999999", "x"), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(ParseSize("17179869184G", "x"),
              StatusIs(absl::StatusCode::kInvalidArgument, "overflow"));
}

TEST(FormatBytes, HumanUnits) {
  EXPECT_EQ(FormatBytes(17), "17 B");
  EXPECT_EQ(FormatBytes(4096), "4.0 KiB");
  EXPECT_EQ(FormatBytes(3ull << 29), "1.5 GiB");
}

// Claims at once never pass the limit together: eight threads each claiming 3 bytes a time
// until refused, under a limit of 1000, take 999 in all (the last 1 fits no claim), and each
// refusal saw a total that left no room.
TEST(ClaimBytes, ClaimsAtOnceStayWithinTheLimit) {
  std::atomic<uint64_t> used{0};
  std::atomic<uint64_t> claimed{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&] {
      uint64_t seen = 0;
      while (ClaimBytes(&used, 3, 1000, &seen)) claimed.fetch_add(3);
      EXPECT_GT(seen + 3, 1000u);
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(used.load(), 999u);
  EXPECT_EQ(claimed.load(), 999u);
  uint64_t seen = 0;
  EXPECT_TRUE(ClaimBytes(&used, 1, 1000, &seen));
  EXPECT_FALSE(ClaimBytes(&used, 1, 1000, &seen));
  EXPECT_EQ(seen, 1000u);
  std::atomic<uint64_t> over{2000};  // a limit lowered below what is held: nothing fits
  EXPECT_FALSE(ClaimBytes(&over, 1, 1000, &seen));
  EXPECT_EQ(seen, 2000u);
}

TEST(ErrorReason, TravelsWithTheStatusAndNotWithARebuiltOne) {
  const absl::Status s =
      WithReason(absl::ResourceExhaustedError("host tier full: ..."), ErrorReason::kHostTierFull);
  EXPECT_EQ(ReasonOf(s), ErrorReason::kHostTierFull);
  EXPECT_EQ(s.message(), "host tier full: ...");
  const absl::Status copy = s;  // passed on unchanged
  EXPECT_EQ(ReasonOf(copy), ErrorReason::kHostTierFull);
  EXPECT_EQ(ReasonOf(absl::Status(s.code(), std::string("x: ") + std::string(s.message()))),
            ErrorReason::kNone);
  EXPECT_EQ(ReasonOf(absl::ResourceExhaustedError("quota: tenant ...")), ErrorReason::kNone);
  EXPECT_TRUE(WithReason(absl::OkStatus(), ErrorReason::kQuota).ok());
  EXPECT_EQ(ReasonOf(WithReason(absl::OkStatus(), ErrorReason::kQuota)), ErrorReason::kNone);
  EXPECT_THAT(InvalidField("shape.head_dim", "0 is outside [1, 512]"),
              StatusIs(absl::StatusCode::kInvalidArgument, "shape.head_dim: 0 is outside"));
}

// The compiler's _Float16 is the reference below. clang before 15 has none on x86: there
// (the sanitizer build) the two tests skip, and the gcc build runs them.
#ifdef __FLT16_MAX__
#define KVTIER_SKIP_WITHOUT_FLOAT16() (void)0
#else
#define KVTIER_SKIP_WITHOUT_FLOAT16() GTEST_SKIP() << "this compiler has no _Float16"
#endif

// Every half bit pattern: half -> float -> half is the identity (NaNs stay NaN), and
// half -> float agrees with the compiler's _Float16.
TEST(Fp16, ExhaustiveRoundTripAgainstCompiler) {
  KVTIER_SKIP_WITHOUT_FLOAT16();
#ifdef __FLT16_MAX__
  for (uint32_t h = 0; h <= 0xffff; ++h) {
    const uint16_t bits = static_cast<uint16_t>(h);
    const float f = HalfToFloat(bits);
    const float expect = static_cast<float>(std::bit_cast<_Float16>(bits));
    if (std::isnan(expect)) {
      EXPECT_TRUE(std::isnan(f)) << h;
      EXPECT_TRUE(std::isnan(HalfToFloat(FloatToHalf(f)))) << h;
      continue;
    }
    ASSERT_EQ(std::bit_cast<uint32_t>(f), std::bit_cast<uint32_t>(expect)) << h;
    ASSERT_EQ(FloatToHalf(f), bits) << h;
  }
#endif
}

// float -> half rounds to nearest even exactly as the compiler does, across normal,
// subnormal, overflow and halfway cases.
TEST(Fp16, FloatToHalfMatchesCompilerRounding) {
  KVTIER_SKIP_WITHOUT_FLOAT16();
#ifdef __FLT16_MAX__
  std::mt19937 rng(7);
  std::uniform_int_distribution<uint32_t> any;
  auto check = [](float f) {
    ASSERT_EQ(FloatToHalf(f), std::bit_cast<uint16_t>(static_cast<_Float16>(f))) << f;
  };
  for (int i = 0; i < 2'000'000; ++i) {
    float f = std::bit_cast<float>(any(rng));
    if (!std::isnan(f)) check(f);
  }
  for (uint32_t h = 0; h < 0x7c00; ++h) {  // halfway points between neighbouring halves
    float lo = HalfToFloat(static_cast<uint16_t>(h));
    float hi = HalfToFloat(static_cast<uint16_t>(h + 1));
    check(std::midpoint(lo, hi));
    check(-std::midpoint(lo, hi));
  }
  check(65520.f);         // rounds to Inf
  check(65519.f);         // rounds to 65504
  check(1e-8f);           // below half the smallest subnormal
  check(2.98023224e-8f);  // exactly 2^-25: ties to even (zero)
#endif
}

TEST(Bf16, IsTheHighHalfOfFloat) {
  EXPECT_EQ(Bf16ToFloat(0x3f80), 1.0f);
  EXPECT_EQ(Bf16ToFloat(0xc040), -3.0f);
}

}  // namespace
}  // namespace kvtier

namespace kvtier {
namespace {

// The dispatched path against the scalar reference, bit for bit, over odd widths and both
// 2-byte formats (including infinities and subnormals in the inputs).
TEST(AddRows, DispatchedPathEqualsScalar) {
  std::mt19937 rng(3);
  std::uniform_int_distribution<uint32_t> any(0, 0xffff);
  for (HalfKind kind : {HalfKind::kFp16, HalfKind::kBf16}) {
    for (int d : {1, 7, 8, 17, 64, 80, 128, 256}) {
      for (int n : {1, 3, 16}) {
        std::vector<uint16_t> rows(size_t(n) * d);
        for (auto& h : rows) {
          h = static_cast<uint16_t>(any(rng));
          if ((h & 0x7c00) == 0x7c00) h &= 0x83ff;  // no NaN: NaN payloads need not match
        }
        std::vector<float> a(d, 0.5f), b(d, 0.5f);
        AddRows(kind, rows.data(), n, d, a.data());
        AddRowsScalar(kind, rows.data(), n, d, b.data());
        for (int j = 0; j < d; ++j) {
          ASSERT_EQ(std::bit_cast<uint32_t>(a[j]), std::bit_cast<uint32_t>(b[j]))
              << "d " << d << " n " << n << " j " << j;
        }
      }
    }
  }
  std::printf("AddRows vectorized here: %s\n", AddRowsIsVectorized() ? "yes" : "no");
}

// Every fp16 bit pattern and every bf16 one, as one array, each its exact float (a -0 as +0, a
// NaN as a NaN), nothing written past n.
TEST(HalvesToFloats, EachHalfIsItsExactFloat) {
  std::vector<uint16_t> all(1 << 16);
  std::iota(all.begin(), all.end(), uint16_t{0});
  for (HalfKind kind : {HalfKind::kFp16, HalfKind::kBf16}) {
    std::vector<float> out(all.size() + 1, -7.f);
    HalvesToFloats(kind, all.data(), all.size(), out.data());
    for (size_t i = 0; i < all.size(); ++i) {
      const uint16_t h = all[i];
      const float want = kind == HalfKind::kFp16
                             ? HalfToFloat(h)
                             : std::bit_cast<float>(static_cast<uint32_t>(h) << 16);
      if (std::isnan(want)) {
        EXPECT_TRUE(std::isnan(out[i])) << i;
      } else {
        EXPECT_EQ(out[i], want) << i;  // == : -0 and +0 compare equal
        EXPECT_FALSE(std::signbit(out[i]) && out[i] == 0.f) << "a -0 comes out +0: " << i;
      }
    }
    EXPECT_EQ(out[all.size()], -7.f);
  }
}

TEST(Dot, AgreesWithDoubleAcrossWidths) {
  std::mt19937 rng(9);
  std::normal_distribution<float> n(0, 1);
  for (int d : {1, 7, 8, 15, 16, 17, 64, 80, 129, 512}) {
    std::vector<float> a(d), b(d);
    double want = 0, mag = 0;
    for (int j = 0; j < d; ++j) {
      a[j] = n(rng);
      b[j] = n(rng);
      want += double(a[j]) * b[j];
      mag += std::fabs(double(a[j]) * b[j]);
    }
    EXPECT_NEAR(Dot(a.data(), b.data(), d), want, 1e-6 * mag + 1e-7) << d;
    EXPECT_NEAR(DotScalar(a.data(), b.data(), d), want, 1e-6 * mag + 1e-7) << d;
  }
}

// A query on QueryInt8Codes' grid: the smallest power of two that holds every value within
// 127 steps (OnQueryGrid finds it by halving and doubling), each value its nearest step; a
// vector already on the grid comes back as it is; NaN counts as 0 and infinities as FLT_MAX;
// the vector and scalar paths give the same bytes.
TEST(QueryInt8Codes, PutsAQueryOnThePowerOfTwoGrid) {
  std::mt19937 rng(11);
  std::normal_distribution<float> n(0, 1);
  for (float magnitude : {1e-35f, 1e-3f, 1.f, 127.f, 127.5f, 128.f, 3e5f, 1e38f}) {
    for (int d : {1, 7, 8, 15, 64, 80, 129}) {
      std::vector<float> x(d);
      for (auto& v : x) v = magnitude * n(rng);
      x[d / 2] = magnitude;  // the largest magnitude exactly, at a power-of-two boundary or not
      std::vector<float> want = x;
      testing::OnQueryGrid(&want, d);
      std::vector<int8_t> codes(d), again(d);
      const float scale = QueryInt8Codes(x.data(), d, codes.data());
      int e;
      ASSERT_EQ(std::frexp(scale, &e), 0.5f) << "a power of two";
      std::vector<float> rounded = x;
      RoundQueryToInt8(rounded.data(), d);
      for (int j = 0; j < d; ++j) {
        ASSERT_EQ(float(codes[j]) * scale, want[j]) << magnitude << " d " << d << " at " << j;
        ASSERT_EQ(rounded[j], want[j]);
      }
      EXPECT_EQ(QueryInt8Codes(rounded.data(), d, again.data()), scale) << "on the grid";
      EXPECT_EQ(again, codes);
    }
  }
  std::vector<float> odd = {std::nanf(""), std::numeric_limits<float>::infinity(),
                            -std::numeric_limits<float>::infinity(), 1.f, 0.f};
  for (int i = 0; i < 3; ++i) odd.insert(odd.end(), odd.begin(), odd.begin() + 5);
  std::vector<int8_t> codes(odd.size());
  const float scale = QueryInt8Codes(odd.data(), int(odd.size()), codes.data());
  EXPECT_EQ(scale, 0x1p122f);  // FLT_MAX is just under 2^128: past 127 * 2^121, 64 * 2^122
  for (size_t j = 0; j < odd.size(); j += 5) {
    EXPECT_EQ(codes[j], 0);
    EXPECT_EQ(codes[j + 1], 64);
    EXPECT_EQ(codes[j + 2], -64);
    EXPECT_EQ(codes[j + 3], 0);
  }
  std::vector<float> zero(9, 0.f);
  std::vector<int8_t> zc(9, 5);
  QueryInt8Codes(zero.data(), 9, zc.data());
  EXPECT_EQ(zc, std::vector<int8_t>(9, 0));
}

// DotInt8 is the exact dot product of the query on the grid with the bytes (their extremes
// -128 and 127 included), on every path and every kernel.
TEST(DotInt8, IsTheExactDotOfTheQueryOnItsGrid) {
  std::mt19937 rng(10);
  std::normal_distribution<float> n(0, 1);
  for (int d : {1, 7, 8, 15, 16, 17, 32, 64, 80, 96, 128, 129, 512}) {
    std::vector<float> a(d);
    std::vector<int8_t> c(d);
    for (int j = 0; j < d; ++j) {
      a[j] = n(rng);
      c[j] = static_cast<int8_t>(j % 5 == 0 ? (j % 2 ? 127 : -128) : int(rng() % 255) - 127);
    }
    std::vector<float> on = a;
    testing::OnQueryGrid(&on, d);
    double want = 0;  // exact: multiples of one power of two, under 2^53 of it
    for (int j = 0; j < d; ++j) want += double(on[j]) * c[j];
    EXPECT_EQ(DotInt8(a.data(), c.data(), d), float(want)) << d;
    EXPECT_EQ(DotInt8Scalar(a.data(), c.data(), d), float(want)) << d;
    for (Int8Kernel k : {Int8Kernel::kScalar, Int8Kernel::kAvx2, Int8Kernel::kVnni}) {
      float got = 0;
      DotInt8GroupRowsWith(k, a.data(), 1, c.data(), 1, d, d, &got, 1, 1);
      EXPECT_EQ(got, float(want)) << d << " kernel " << int(k);
    }
  }
}

// The softmax helpers of a refinement against their definitions, at lengths that leave every
// tail of the vector paths: MaxOf is the largest element, SumAsDouble sums in its stated
// order (bit for bit), AddQuotients adds each product by the reciprocal, rounded to float (and
// within a float's rounding of the quotient itself).
TEST(SoftmaxHelpers, MatchTheirDefinitions) {
  std::mt19937 rng(3);
  std::normal_distribution<float> g(0, 4);
  for (size_t n : {size_t(0), size_t(1), size_t(3), size_t(7), size_t(8), size_t(9), size_t(15),
                   size_t(16), size_t(17), size_t(33), size_t(1488)}) {
    std::vector<float> x(n);
    for (float& v : x) v = std::exp(g(rng));
    const float want_max =
        n ? *std::max_element(x.begin(), x.end()) : -std::numeric_limits<float>::infinity();
    EXPECT_EQ(MaxOf(x.data(), n), want_max) << n;
    double s[8] = {};
    for (size_t i = 0; i < n; ++i) s[i % 8] += x[i];
    const double want_sum = ((s[0] + s[4]) + (s[2] + s[6])) + ((s[1] + s[5]) + (s[3] + s[7]));
    EXPECT_EQ(std::bit_cast<uint64_t>(SumAsDouble(x.data(), n)), std::bit_cast<uint64_t>(want_sum))
        << n;
    const double z = want_sum + 1.0;
    std::vector<float> out(n, 0.5f);
    AddQuotients(x.data(), z, n, out.data());
    const double r = 1.0 / z;
    for (size_t i = 0; i < n; ++i) {
      EXPECT_EQ(out[i], 0.5f + static_cast<float>(x[i] * r)) << n << " " << i;
      const float q = static_cast<float>(x[i] / z);
      EXPECT_LE(std::abs(static_cast<float>(x[i] * r) - q),
                std::nextafter(q, std::numeric_limits<float>::infinity()) - q)
          << n << " " << i;
    }
  }
}

// The largest `take` values, ties to the lower index, against a full sort in that order: with
// many ties (values on a coarse grid), both zeros, negatives and infinities, every take from
// none to past the size.
TEST(TopByValue, TheFirstTakeOfAFullSort) {
  std::mt19937 rng(21);
  std::uniform_int_distribution<int> grid(-6, 6);
  std::normal_distribution<float> n(0, 1);
  for (int trial = 0; trial < 60; ++trial) {
    const size_t size = trial < 20 ? 1 + trial : 500 + 37 * trial;
    std::vector<float> value(size);
    for (size_t i = 0; i < size; ++i) {
      switch (trial % 4) {
        case 0:
          value[i] = static_cast<float>(grid(rng)) * 0.5f;
          break;
        case 1:
          value[i] = grid(rng) == 0 ? (i % 2 ? -0.f : 0.f) : n(rng);
          break;
        case 2:
          value[i] = grid(rng) == 6    ? std::numeric_limits<float>::infinity()
                     : grid(rng) == -6 ? -std::numeric_limits<float>::infinity()
                                       : n(rng) * 1e-30f;
          break;
        default:
          value[i] = n(rng) * 100.f;
      }
    }
    std::vector<uint32_t> order(size);
    std::iota(order.begin(), order.end(), 0u);
    std::sort(order.begin(), order.end(), [&](uint32_t a, uint32_t b) {
      return value[a] != value[b] ? value[a] > value[b] : a < b;
    });
    for (size_t take : {size_t{0}, size_t{1}, size / 3, size / 2, size - 1, size, size + 5}) {
      std::vector<uint32_t> want(order.begin(), order.begin() + std::min(take, size));
      std::sort(want.begin(), want.end());
      std::vector<uint32_t> got = {7};  // what was there goes
      TopByValue(value, take, &got);
      ASSERT_EQ(got, want) << "trial " << trial << " take " << take;
    }
  }
}

// CountAtLeast (a refinement's top-k search) against counting one by one, at lengths that leave
// every tail of the vector path, for thresholds at, between and past the keys, the extremes
// included.
TEST(CountAtLeast, CountsTheKeysAtLeastT) {
  std::mt19937 rng(8);
  std::uniform_int_distribution<int32_t> any(std::numeric_limits<int32_t>::min(),
                                             std::numeric_limits<int32_t>::max());
  std::uniform_int_distribution<int32_t> few(-3, 3);
  for (size_t n : {size_t(0), size_t(1), size_t(7), size_t(8), size_t(15), size_t(16), size_t(17),
                   size_t(33), size_t(1488)}) {
    for (bool ties : {false, true}) {
      std::vector<int32_t> keys(n);
      for (int32_t& k : keys) k = ties ? few(rng) : any(rng);
      std::vector<int32_t> ts = {
          std::numeric_limits<int32_t>::min(), std::numeric_limits<int32_t>::max(), -3, 0, 1, 4};
      for (int i = 0; i < 5 && n > 0; ++i) ts.push_back(keys[rng() % n]);
      for (int32_t t : ts) {
        const size_t want =
            std::count_if(keys.begin(), keys.end(), [&](int32_t k) { return k >= t; });
        EXPECT_EQ(CountAtLeast(keys.data(), n, t), want) << n << " " << t;
        EXPECT_EQ(CountAtLeastScalar(keys.data(), n, t), want) << n << " " << t;
      }
    }
  }
}

// PickTop (TopByValue's last step) against picking one by one: every key above kth and the
// first `ties` equal to it, ascending, at lengths that leave every tail of the vector path,
// with many ties and none, for counts of ties from none to all the equal ones.
TEST(PickTop, TheKeysAboveAndTheFirstTiesInOrder) {
  std::mt19937 rng(9);
  std::uniform_int_distribution<int32_t> any(std::numeric_limits<int32_t>::min(),
                                             std::numeric_limits<int32_t>::max());
  std::uniform_int_distribution<int32_t> few(-3, 3);
  for (size_t n : {size_t(1), size_t(7), size_t(8), size_t(9), size_t(16), size_t(17), size_t(33),
                   size_t(1488)}) {
    for (bool many_ties : {false, true}) {
      std::vector<int32_t> keys(n);
      for (int32_t& k : keys) k = many_ties ? few(rng) : any(rng);
      std::vector<int32_t> ts = {std::numeric_limits<int32_t>::min(), -3, 0, 3};
      for (int i = 0; i < 4; ++i) ts.push_back(keys[rng() % n]);
      for (int32_t kth : ts) {
        const size_t equal = std::count(keys.begin(), keys.end(), kth);
        for (size_t ties : {size_t(0), size_t(1), equal / 2, equal}) {
          std::vector<uint32_t> want;
          size_t left = ties;
          for (size_t i = 0; i < n; ++i) {
            if (keys[i] > kth) want.push_back(static_cast<uint32_t>(i));
            if (keys[i] == kth && left > 0) {
              want.push_back(static_cast<uint32_t>(i));
              --left;
            }
          }
          for (bool scalar : {false, true}) {
            std::vector<uint32_t> got(want.size() + 1, 0xdeadbeef);  // one past: left alone
            (scalar ? PickTopScalar : PickTop)(keys.data(), n, kth, ties, got.data());
            EXPECT_EQ(got.back(), 0xdeadbeef) << n << " " << kth << " " << ties;
            got.pop_back();
            EXPECT_EQ(got, want) << n << " " << kth << " " << ties << (scalar ? " scalar" : "");
          }
        }
      }
    }
  }
}

// A query group against one byte vector, and against a run of them (chunks' compact
// statistics side by side): each result is DotInt8's own, bit for bit, at every group size
// (the vectorized path's up to 8 and the fallback past it), width and run length; and every
// other row of a run with the results head by head (DotInt8GroupRowsStrided).
TEST(DotInt8Group, EachEqualsDotInt8BitForBit) {
  std::mt19937 rng(13);
  std::normal_distribution<float> n(0, 1);
  std::uniform_int_distribution<int> byte(-128, 127);
  for (int d : {1, 7, 8, 15, 16, 17, 32, 64, 80, 96, 128, 129}) {
    for (int group : {1, 2, 3, 4, 5, 6, 7, 8, 9, 16}) {
      for (int rows : {1, 2, 3, 5, 7, 9, 17}) {
        std::vector<float> a(size_t(group) * d);
        for (float& x : a) x = n(rng);
        std::vector<int8_t> c(size_t(rows) * d);
        for (int8_t& x : c) x = static_cast<int8_t>(byte(rng));
        std::vector<float> got(size_t(rows) * group);
        if (rows == 1) {
          DotInt8Group(a.data(), group, c.data(), d, got.data());
        } else {
          DotInt8GroupRows(a.data(), group, c.data(), rows, d, got.data());
        }
        // Every other row (a stride of two rows), the results head by head, by every kernel.
        const int odd = rows / 2;
        std::vector<std::vector<float>> strided;
        for (Int8Kernel k : {Int8Kernel::kScalar, Int8Kernel::kAvx2, Int8Kernel::kVnni}) {
          strided.emplace_back(size_t(std::max(odd, 1)) * group);
          DotInt8GroupRowsWith(k, a.data(), group, c.data() + d, odd, d, 2 * d,
                               strided.back().data(), 1, odd);
        }
        for (int r = 0; r < rows; ++r) {
          for (int g = 0; g < group; ++g) {
            const float want = DotInt8(a.data() + size_t(g) * d, c.data() + size_t(r) * d, d);
            EXPECT_EQ(std::bit_cast<uint32_t>(got[size_t(r) * group + g]),
                      std::bit_cast<uint32_t>(want))
                << "d " << d << " group " << group << " row " << r << " g " << g;
            for (size_t k = 0; r % 2 == 1 && k < strided.size(); ++k) {
              EXPECT_EQ(std::bit_cast<uint32_t>(strided[k][size_t(g) * odd + r / 2]),
                        std::bit_cast<uint32_t>(want))
                  << "strided, kernel " << k << ": d " << d << " group " << group << " row " << r
                  << " g " << g;
            }
          }
        }
      }
    }
  }
  EXPECT_TRUE(HaveInt8Kernel(Int8Kernel::kScalar));
  if (!HaveInt8Kernel(Int8Kernel::kVnni)) {
    std::printf("note: no AVX-512 VNNI here; its kernel ran as the scalar one\n");
  }
}

// Rows held in tiles (PutInt8TileRow, two parts a row as a chunk's mean and peak) against a
// query group: every row's part read from any first tile, whole or cut short, equals
// DotInt8's own over the same codes, bit for bit, by the machine's kernel and by the scalar
// loop, at group sizes on both sides of the kernel's four heads a pass; and nothing past the
// rows asked for is written.
TEST(DotInt8GroupTiles, EachEqualsDotInt8BitForBit) {
  std::mt19937 rng(17);
  std::normal_distribution<float> n(0, 1);
  std::uniform_int_distribution<int> byte(-128, 127);
  for (int d : {32, 64, 128}) {
    for (int group : {1, 2, 3, 4, 5, 7, 8, 9}) {
      const uint32_t rows = 53;  // three whole tiles and five rows
      std::vector<int8_t> codes(size_t(rows) * 2 * d);
      for (int8_t& x : codes) x = static_cast<int8_t>(byte(rng));
      std::vector<uint8_t> tiles(Int8TileBytes(rows, 2, d));
      for (uint32_t r = 0; r < rows; ++r) {
        for (int p = 0; p < 2; ++p) {
          PutInt8TileRow(&codes[(size_t(r) * 2 + p) * d], r, 2, p, d, tiles.data());
        }
      }
      std::vector<float> a(size_t(group) * d);
      for (float& x : a) x = n(rng);
      const QueryInt8Group q(a.data(), group, d);
      for (uint32_t first : {0u, 16u, 48u}) {
        for (uint32_t count : {1u, 5u, rows - first}) {
          for (int p = 0; p < 2; ++p) {
            const int column = static_cast<int>(count) + 3;  // room past the rows, kept
            std::vector<float> got(size_t(group) * column, -1.f), scalar = got;
            DotInt8GroupTiles(q, tiles.data(), 2, p, first, count, got.data(), column);
            DotInt8GroupTilesScalar(q, tiles.data(), 2, p, first, count, scalar.data(), column);
            for (int g = 0; g < group; ++g) {
              for (int i = 0; i < column; ++i) {
                const size_t at = size_t(g) * column + i;
                if (i >= static_cast<int>(count)) {
                  EXPECT_EQ(got[at], -1.f) << "written past the rows: d " << d << " g " << g;
                  continue;
                }
                const int8_t* row = &codes[((size_t(first) + i) * 2 + p) * d];
                const float want = DotInt8(a.data() + size_t(g) * d, row, d);
                EXPECT_EQ(std::bit_cast<uint32_t>(got[at]), std::bit_cast<uint32_t>(want))
                    << "d " << d << " group " << group << " first " << first << " row " << i
                    << " part " << p << " g " << g;
                EXPECT_EQ(std::bit_cast<uint32_t>(scalar[at]), std::bit_cast<uint32_t>(want));
              }
            }
          }
        }
      }
    }
  }
}

// A query group against a run of rows of halves: each result is DotHalves' own, bit for bit,
// at every group size (the vectorized path's up to 8 and the fallback past it), width and
// run length, row-major and head-major.
TEST(DotHalvesRows, EachEqualsDotHalvesBitForBit) {
  std::mt19937 rng(12);
  std::normal_distribution<float> n(0, 1);
  for (HalfKind kind : {HalfKind::kFp16, HalfKind::kBf16}) {
    for (int d : {1, 7, 8, 15, 16, 17, 64, 80, 128}) {
      for (int group : {1, 2, 3, 4, 5, 6, 7, 8, 9, 16}) {
        for (int rows : {1, 3}) {
          std::vector<float> a(size_t(group) * d);
          for (float& x : a) x = n(rng);
          std::vector<uint16_t> h(size_t(rows) * d);
          for (uint16_t& x : h) {
            x = kind == HalfKind::kFp16 ? FloatToHalf(n(rng)) : FloatToBf16(n(rng));
          }
          std::vector<float> got(size_t(rows) * group);
          DotHalvesRows(kind, a.data(), group, h.data(), rows, d, got.data());
          for (int r = 0; r < rows; ++r) {
            for (int g = 0; g < group; ++g) {
              const float want =
                  DotHalves(kind, a.data() + size_t(g) * d, h.data() + size_t(r) * d, d);
              EXPECT_EQ(std::bit_cast<uint32_t>(got[size_t(r) * group + g]),
                        std::bit_cast<uint32_t>(want))
                  << "d " << d << " group " << group << " row " << r << " g " << g;
            }
          }
          // Head-major (each query's values side by side, in a wider array): the same bits.
          const int stride = rows + 2;
          std::vector<float> by_head(size_t(stride) * group, -1.f);
          DotHalvesRows(kind, a.data(), group, h.data(), rows, d, by_head.data(), 1, stride);
          for (int r = 0; r < stride; ++r) {
            for (int g = 0; g < group; ++g) {
              const float v = by_head[size_t(g) * stride + r];
              if (r >= rows) {
                EXPECT_EQ(v, -1.f) << "written past the rows: g " << g << " r " << r;
                continue;
              }
              EXPECT_EQ(std::bit_cast<uint32_t>(v),
                        std::bit_cast<uint32_t>(got[size_t(r) * group + g]))
                  << "head-major d " << d << " group " << group << " row " << r << " g " << g;
            }
          }
        }
      }
    }
  }
}

// A value goes into a log line as one field: plain names as they are, anything else quoted
// with what could end the quotes or the line escaped.
TEST(LogValue, QuotesAndEscapesAnythingButAPlainName) {
  EXPECT_EQ(LogValue("alice"), "alice");
  EXPECT_EQ(LogValue("team-a/worker_1.2@host:7+x"), "team-a/worker_1.2@host:7+x");
  EXPECT_EQ(LogValue(""), "\"\"");
  EXPECT_EQ(LogValue("a tenant=admin"), "\"a tenant=admin\"");
  EXPECT_EQ(LogValue("x\" level=error event=\"forged"), "\"x\\\" level=error event=\\\"forged\"");
  EXPECT_EQ(LogValue("two\nlines\x1b[31m"), "\"two\\nlines\\x1b[31m\"");
  EXPECT_EQ(LogValue("back\\slash"), "\"back\\\\slash\"");
}

TEST(FloatsToHalvesDirected, SameBitsAsTheScalarRounding) {
  // Random magnitudes from subnormal halves to past the half range, both signs, and exact
  // halves; n not a multiple of 8, so the scalar tail runs too.
  std::mt19937 rng(12);
  std::uniform_real_distribution<float> e(-30.f, 18.f);
  std::vector<float> x;
  for (int i = 0; i < 100003; ++i) {
    const float m = std::exp2(e(rng)) * (rng() % 2 ? 1.f : -1.f);
    x.push_back(i % 5 == 0 ? HalfToFloat(FloatToHalf(m)) : m);
  }
  for (float v : {0.f, -0.f, 65504.f, -65504.f, 65520.f, -65520.f, 1e-8f, -1e-8f}) x.push_back(v);
  for (bool up : {true, false}) {
    std::vector<uint16_t> got(x.size());
    FloatsToHalvesDirected(x.data(), int(x.size()), up, got.data());
    for (size_t i = 0; i < x.size(); ++i) {
      ASSERT_EQ(got[i], up ? FloatToHalfUp(x[i]) : FloatToHalfDown(x[i]))
          << "x " << x[i] << " up " << up;
    }
  }
}

TEST(ExpInPlace, WithinAMillionthOfTheTrueValue) {
  std::vector<float> x, want;
  for (int i = 0; i <= 200000; ++i) x.push_back(-100.f + 200.f * float(i) / 200000.f);
  for (float v : {-std::numeric_limits<float>::infinity(), 0.f, -0.f, 1e-30f}) x.push_back(v);
  for (float v : x) want.push_back(float(std::exp(double(std::min(std::max(v, -87.f), 88.f)))));
  std::vector<float> got = x;
  ExpInPlace(got.data(), int(got.size()));
  for (size_t i = 0; i < x.size(); ++i) {
    ASSERT_NEAR(got[i], want[i], 1e-6 * want[i]) << "x " << x[i];
  }
}

TEST(LogInPlace, WithinTwoUlpsOfDouble) {
  // A dense grid over [1, 2] (what the LSE-peak score takes the log of), then values across
  // the whole range of normal floats.
  std::vector<float> x;
  for (int i = 0; i <= 200000; ++i) x.push_back(1.f + float(i) / 200000.f);
  for (float v = std::numeric_limits<float>::min(); v < 1e38f; v *= 1.37f) x.push_back(v);
  for (float v : {1.f, 2.f, 0.5f, 0.70710677f, 0.70710683f, 1.4142135f}) x.push_back(v);
  std::vector<float> got = x;
  LogInPlace(got.data(), int(got.size()));
  for (size_t i = 0; i < x.size(); ++i) {
    const double want = std::log(double(x[i]));
    ASSERT_NEAR(got[i], want, 2e-7 * std::abs(want) + 1e-7) << "x " << x[i];
  }
  EXPECT_EQ(got[x.size() - 6], 0.f) << "log 1 is exactly 0";
}

TEST(ExpAndLogInPlace, SixteenLanesGiveTheBitsOfEight) {
  if (!HaveAvx512()) GTEST_SKIP() << "no AVX-512F on this CPU: the eight-lane path serves";
  // Across both clamps of the exponential, the logarithm's whole normal range and its branch
  // at sqrt(1/2), the values the LSE-peak score takes (log of [1, 2], log(1 + e^t) for t <= 0),
  // and lengths that leave every tail.
  std::mt19937 rng(17);
  std::uniform_real_distribution<float> wide(-120.f, 100.f), near_zero(-30.f, 0.f);
  std::vector<float> x;
  for (int i = 0; i < 100000; ++i) x.push_back(i % 2 ? wide(rng) : near_zero(rng));
  for (float v : {0.f, -0.f, -87.f, 88.f, -87.5f, 88.5f, 1e-30f, -1e-30f}) x.push_back(v);
  std::vector<float> positive;
  for (float v = std::numeric_limits<float>::min(); v < 1e38f; v *= 1.0137f) positive.push_back(v);
  for (int i = 0; i <= 20000; ++i) positive.push_back(1.f + float(i) / 20000.f);
  for (float v : {0.70710677f, 0.70710683f, 0.70710678f, 1.4142135f}) positive.push_back(v);
  auto same_bits = [](const std::vector<float>& in, void (*sixteen)(float*, int),
                      void (*eight)(float*, int), const char* what) {
    for (int n : {int(in.size()), 1, 7, 15, 17, 31, 33}) {
      std::vector<float> a(in.begin(), in.begin() + n), b = a;
      sixteen(a.data(), n);
      eight(b.data(), n);
      for (int i = 0; i < n; ++i) {
        ASSERT_EQ(std::bit_cast<uint32_t>(a[i]), std::bit_cast<uint32_t>(b[i]))
            << what << " x " << in[i] << " n " << n;
      }
    }
  };
  same_bits(x, ExpInPlace, ExpInPlaceEight, "exp");
  same_bits(x, Log1pExpInPlace, Log1pExpInPlaceEight, "log1p(exp)");
  same_bits(positive, LogInPlace, LogInPlaceEight, "log");
}

TEST(ExpAndLogInPlace, ResultsDoNotDependOnTheirPlace) {
  // The same values at every offset and in arrays of every length give the same bits: the
  // LSE-peak score relies on it to be equal whether chunks are scored one by one or in blocks.
  // Log1pExpInPlace gives log(1 + e^x) the bits of the three steps, over a range past both of
  // the clamp's ends.
  std::mt19937 rng(13);
  std::uniform_real_distribution<float> u(-20.f, 0.f), wide(-100.f, 90.f);
  std::vector<float> values(80);
  for (size_t i = 0; i < values.size(); ++i) values[i] = i < 40 ? u(rng) : wide(rng);
  std::vector<float> exp_all = values, log_all = values;
  ExpInPlace(exp_all.data(), int(exp_all.size()));
  for (size_t i = 0; i < values.size(); ++i) log_all[i] = 1.f + exp_all[i];
  LogInPlace(log_all.data(), int(log_all.size()));
  for (int n = 1; n <= 35; ++n) {
    for (int first = 0; first + n <= int(values.size()); first += 3) {
      std::vector<float> e(values.begin() + first, values.begin() + first + n);
      ExpInPlace(e.data(), n);
      std::vector<float> l(n);
      for (int i = 0; i < n; ++i) l[i] = 1.f + e[i];
      LogInPlace(l.data(), n);
      // log(1 + e^x) in one pass: the bits of the three steps.
      std::vector<float> fused(values.begin() + first, values.begin() + first + n);
      Log1pExpInPlace(fused.data(), n);
      for (int i = 0; i < n; ++i) {
        ASSERT_EQ(e[i], exp_all[first + i]) << "n " << n << " first " << first << " i " << i;
        ASSERT_EQ(l[i], log_all[first + i]) << "n " << n << " first " << first << " i " << i;
        ASSERT_EQ(std::bit_cast<uint32_t>(fused[i]), std::bit_cast<uint32_t>(log_all[first + i]))
            << "n " << n << " first " << first << " i " << i;
      }
    }
  }
}

TEST(WidenHalves, TakesTheLargerOrSmallerValueWithTheSameBitsOnBothPaths) {
  // Random halves with every special among them: zeros of both signs, subnormals, the largest
  // finite, infinities and NaNs; lengths that leave a scalar tail.
  std::mt19937 rng(17);
  const uint16_t specials[] = {0x0000, 0x8000, 0x0001, 0x8001, 0x7bff, 0xfbff,
                               0x7c00, 0xfc00, 0x7e00, 0xfe00, 0x3c00, 0xbc00};
  auto half = [&] {
    return rng() % 4 == 0 ? specials[rng() % std::size(specials)] : static_cast<uint16_t>(rng());
  };
  auto value = [](uint16_t h) {  // the order: -NaN < -inf < ... < -0 < +0 < ... < +inf < +NaN
    const bool neg = (h & 0x8000) != 0;
    if ((h & 0x7fff) > 0x7c00) return neg ? -3.0 : 3.0;
    if ((h & 0x7fff) == 0x7c00) return neg ? -2.0 : 2.0;
    if ((h & 0x7fff) == 0) return neg ? -1e-20 : 0.0;
    return double(HalfToFloat(h)) / 70000.0;
  };
  for (int n : {1, 15, 16, 17, 64, 100}) {
    for (bool up : {true, false}) {
      std::vector<uint16_t> x(n), v(n);
      for (auto& h : x) h = half();
      for (auto& h : v) h = half();
      std::vector<uint16_t> fast = v, slow = v;
      bool finite = true;
      for (uint16_t h : x) finite &= (h & 0x7c00) != 0x7c00;
      EXPECT_EQ(WidenHalves(x.data(), n, up, fast.data()), finite);
      EXPECT_EQ(WidenHalvesScalar(x.data(), n, up, slow.data()), finite);
      EXPECT_EQ(fast, slow) << n << " " << up;
      for (int i = 0; i < n; ++i) {
        const double vx = value(x[i]), vv = value(v[i]);
        if (vx == vv) {  // the same value (NaNs of one sign): either one
          EXPECT_TRUE(fast[i] == x[i] || fast[i] == v[i]);
        } else {
          EXPECT_EQ(fast[i], (up ? vx > vv : vx < vv) ? x[i] : v[i])
              << std::hex << x[i] << " " << v[i] << " up " << up;
        }
      }
    }
  }
}

// Each lane is the plain loop over one row, bit for bit (subtract, square, add, in channel
// order, no fused multiply-add), on both paths, for lane counts with and without a tail.
TEST(SquaredDistances, EachLaneIsTheRowLoopOnBothPaths) {
  std::mt19937 rng(5);
  std::normal_distribution<float> n(0, 1);
  for (int lanes : {1, 7, 8, 13, 32, 40, 100, 128, 131}) {
    for (int d : {1, 3, 64, 128}) {
      const int stride = (lanes + 7) / 8 * 8 + 8;  // wider than needed, as a caller's may be
      std::vector<float> cols(size_t(d) * stride), point(d);
      for (auto& v : cols) v = n(rng);
      for (auto& v : point) v = n(rng);
      std::vector<float> out(lanes), scalar(lanes);
      SquaredDistances(cols.data(), stride, lanes, d, point.data(), out.data());
      SquaredDistancesScalar(cols.data(), stride, lanes, d, point.data(), scalar.data());
      for (int i = 0; i < lanes; ++i) {
        volatile float s = 0;  // volatile: one rounding per step, whatever the compiler
        for (int j = 0; j < d; ++j) {
          volatile float t = cols[size_t(j) * stride + i] - point[j];
          volatile float sq = t * t;
          s = s + sq;
        }
        ASSERT_EQ(std::bit_cast<uint32_t>(out[i]), std::bit_cast<uint32_t>(float(s)))
            << "lanes " << lanes << " d " << d << " lane " << i;
        ASSERT_EQ(std::bit_cast<uint32_t>(scalar[i]), std::bit_cast<uint32_t>(float(s)));
        double exact = 0;
        for (int j = 0; j < d; ++j) {
          exact += std::pow(double(cols[size_t(j) * stride + i]) - point[j], 2);
        }
        EXPECT_NEAR(out[i], exact, 1e-5 * (1 + exact));
      }
    }
  }
}

// BoxGrowthBelow, on halves and on floats: true with BoxGrowth's bits whenever some lane's
// offset + whole growth does not exceed the bound (it may not stop then); false only when every
// lane's does. On this machine's vector path (AVX2, or AVX-512 past eight lanes) a bound below
// every offset stops it at the first look (16 channels), so that a search can count on passing
// such tiles over.
TEST(BoxGrowthBelow, StopsOnlyWhenEveryLaneExceedsTheBound) {
  std::mt19937 rng(67);
  std::normal_distribution<float> n(0, 1);
  for (int m : {1, 15, 16, 33, 64}) {
    for (int lanes : {1, 7, 8, 9, 16}) {
      const int stride = 16;
      std::vector<uint16_t> cols(size_t(2 * m) * stride + 8);
      for (int j = 0; j < m; ++j) {
        for (int i = 0; i < stride; ++i) {
          float a = n(rng), b = n(rng);
          if (a < b) std::swap(a, b);
          cols[size_t(j) * stride + i] = FloatToHalfUp(a);
          cols[size_t(m + j) * stride + i] = FloatToHalfDown(b);
        }
      }
      std::vector<float> fcols(cols.size());
      for (size_t k = 0; k < cols.size(); ++k) fcols[k] = HalfToFloat(cols[k]);
      std::vector<float> x(m), offset(lanes);
      for (float& v : x) v = 2.f * n(rng);
      for (float& v : offset) v = std::fabs(n(rng));
      std::vector<float> grow(lanes), width(lanes);
      BoxGrowth(x.data(), 1, m, cols.data(), stride, lanes, grow.data(), width.data());
      for (const bool with_offset : {false, true}) {
        std::vector<float> total(lanes);
        for (int i = 0; i < lanes; ++i) total[i] = (with_offset ? offset[i] : 0.f) + grow[i];
        const float least = *std::min_element(total.begin(), total.end());
        const float most = *std::max_element(total.begin(), total.end());
        const float* off = with_offset ? offset.data() : nullptr;
        for (const float bound : {-1.f, std::nextafter(least, -1e30f), least, most, 1e30f}) {
          bool every_above = true;
          for (float t : total) every_above = every_above && t > bound;
          std::vector<float> g(lanes + 1, -7.f), w(lanes + 1, -7.f), fg(lanes, -7.f),
              fw(lanes, -7.f), sg(lanes, -7.f), sw(lanes, -7.f);
          const bool whole = BoxGrowthBelow(x.data(), 1, m, cols.data(), stride, lanes, off, bound,
                                            g.data(), w.data());
          const bool fwhole = BoxGrowthBelow(x.data(), 1, m, fcols.data(), stride, lanes, off,
                                             bound, fg.data(), fw.data());
          EXPECT_TRUE(BoxGrowthBelowScalar(x.data(), 1, m, cols.data(), stride, lanes, off, bound,
                                           sg.data(), sw.data()));
          const std::string at =
              absl::StrCat("m ", m, " lanes ", lanes, " offset ", with_offset, " bound ", bound);
          if (!every_above) {
            EXPECT_TRUE(whole) << at;
            EXPECT_TRUE(fwhole) << at;
          }
          if (bound == -1.f && m >= 16 && AddRowsIsVectorized()) {
            EXPECT_FALSE(whole) << at;
            EXPECT_FALSE(fwhole) << at;
          }
          for (int i = 0; i < lanes; ++i) {
            EXPECT_EQ(std::bit_cast<uint32_t>(sg[i]), std::bit_cast<uint32_t>(grow[i])) << at;
            EXPECT_EQ(std::bit_cast<uint32_t>(sw[i]), std::bit_cast<uint32_t>(width[i])) << at;
            if (whole) {
              EXPECT_EQ(std::bit_cast<uint32_t>(g[i]), std::bit_cast<uint32_t>(grow[i])) << at;
              EXPECT_EQ(std::bit_cast<uint32_t>(w[i]), std::bit_cast<uint32_t>(width[i])) << at;
            }
            if (fwhole) {
              EXPECT_EQ(std::bit_cast<uint32_t>(fg[i]), std::bit_cast<uint32_t>(grow[i])) << at;
              EXPECT_EQ(std::bit_cast<uint32_t>(fw[i]), std::bit_cast<uint32_t>(width[i])) << at;
            }
          }
          EXPECT_EQ(g[lanes], -7.f) << at;
        }
      }
    }
  }
}

TEST(BoxGrowth, EachLaneAgreesWithDoubleAndTheScalarPath) {
  // Boxes drawn as halves (hi >= lo), points inside, outside and on their faces; lane counts
  // around the groups of 8 and 16, and a stride with no room past the last group.
  std::mt19937 rng(21);
  std::normal_distribution<float> n(0, 1);
  for (int m : {1, 3, 64}) {
    for (int pairs : {1, 2}) {
      for (int lanes : {1, 7, 8, 9, 16, 17, 24}) {
        const int stride = (lanes + 7) / 8 * 8;
        std::vector<uint16_t> cols(size_t(2 * pairs * m) * stride);
        for (int p = 0; p < pairs; ++p) {
          for (int j = 0; j < m; ++j) {
            for (int i = 0; i < stride; ++i) {
              float a = n(rng), b = n(rng);
              if (a < b) std::swap(a, b);
              cols[(size_t(2 * p) * m + j) * stride + i] = FloatToHalfUp(a);
              cols[(size_t(2 * p + 1) * m + j) * stride + i] = FloatToHalfDown(b);
            }
          }
        }
        std::vector<float> x(size_t(pairs) * m);
        for (size_t r = 0; r < x.size(); ++r) {
          // Every third channel exactly on lane 0's upper face.
          x[r] = r % 3 == 0 ? HalfToFloat(cols[(size_t(2 * (r / m)) * m + r % m) * stride])
                            : 1.5f * n(rng);
        }
        std::vector<float> grow(lanes + 1, -7.f), width(lanes + 1, -7.f);
        std::vector<float> sgrow(lanes), swidth(lanes);
        BoxGrowth(x.data(), pairs, m, cols.data(), stride, lanes, grow.data(), width.data());
        BoxGrowthScalar(x.data(), pairs, m, cols.data(), stride, lanes, sgrow.data(),
                        swidth.data());
        // The same boxes as floats: the same bits on both paths.
        std::vector<float> fcols(cols.size());
        for (size_t k = 0; k < cols.size(); ++k) fcols[k] = HalfToFloat(cols[k]);
        std::vector<float> fgrow(lanes), fwidth(lanes), fsgrow(lanes), fswidth(lanes);
        BoxGrowth(x.data(), pairs, m, fcols.data(), stride, lanes, fgrow.data(), fwidth.data());
        BoxGrowthScalar(x.data(), pairs, m, fcols.data(), stride, lanes, fsgrow.data(),
                        fswidth.data());
        for (int i = 0; i < lanes; ++i) {
          EXPECT_EQ(std::bit_cast<uint32_t>(fgrow[i]), std::bit_cast<uint32_t>(sgrow[i]));
          EXPECT_EQ(std::bit_cast<uint32_t>(fwidth[i]), std::bit_cast<uint32_t>(swidth[i]));
          EXPECT_EQ(std::bit_cast<uint32_t>(fsgrow[i]), std::bit_cast<uint32_t>(sgrow[i]));
          EXPECT_EQ(std::bit_cast<uint32_t>(fswidth[i]), std::bit_cast<uint32_t>(swidth[i]));
        }
        for (int i = 0; i < lanes; ++i) {
          double g = 0, w = 0, mag = 0;
          for (int p = 0; p < pairs; ++p) {
            for (int j = 0; j < m; ++j) {
              const double xv = x[size_t(p) * m + j];
              const double hi = HalfToFloat(cols[(size_t(2 * p) * m + j) * stride + i]);
              const double lo = HalfToFloat(cols[(size_t(2 * p + 1) * m + j) * stride + i]);
              g += std::max(0.0, xv - hi) + std::max(0.0, lo - xv);
              w += hi - lo;
              mag += std::fabs(xv) + std::fabs(hi) + std::fabs(lo);
            }
          }
          EXPECT_NEAR(grow[i], g, 1e-6 * mag) << "m " << m << " pairs " << pairs << " i " << i;
          EXPECT_NEAR(width[i], w, 1e-6 * mag) << "m " << m << " pairs " << pairs << " i " << i;
          EXPECT_EQ(std::bit_cast<uint32_t>(grow[i]), std::bit_cast<uint32_t>(sgrow[i]));
          EXPECT_EQ(std::bit_cast<uint32_t>(width[i]), std::bit_cast<uint32_t>(swidth[i]));
        }
        EXPECT_EQ(grow[lanes], -7.f) << "wrote past lane " << lanes - 1;
        EXPECT_EQ(width[lanes], -7.f) << "wrote past lane " << lanes - 1;
      }
    }
  }
  // Fixed boxes [lo, hi] on one channel against the point 0.
  const uint16_t box[2 * 8] = {
      FloatToHalf(1.f),  FloatToHalf(2.f), FloatToHalf(0.5f),  FloatToHalf(0.f),
      FloatToHalf(3.f),  FloatToHalf(1.f), FloatToHalf(1.f),   FloatToHalf(1.f),
      FloatToHalf(-1.f), FloatToHalf(0.f), FloatToHalf(-0.5f), FloatToHalf(0.f),
      FloatToHalf(-3.f), FloatToHalf(1.f), FloatToHalf(0.f),   FloatToHalf(-2.f)};
  float g[8], w[8];
  const float inside = 0.f;
  BoxGrowth(&inside, 1, 1, box, 8, 8, g, w);
  EXPECT_EQ(g[0], 0.f);
  EXPECT_EQ(w[0], 2.f);
  EXPECT_EQ(g[1], 0.f);
  EXPECT_EQ(w[1], 2.f);
  EXPECT_EQ(g[3], 0.f);  // box [0, 0]: on both faces
  EXPECT_EQ(w[3], 0.f);
  EXPECT_EQ(g[5], 1.f);  // box [1, 1]: the point lies 1 below it
  EXPECT_EQ(w[5], 0.f);
  EXPECT_EQ(g[7], 0.f);  // box [-2, 1]
  EXPECT_EQ(w[7], 3.f);
}

TEST(DotColumns, EachVectorAndLaneAgreesWithDouble) {
  std::mt19937 rng(11);
  std::normal_distribution<float> n(0, 1);
  for (int d : {1, 2, 7, 64, 128}) {
    for (int lanes : {1, 5, 8, 9, 16, 17, 23, 40, 70}) {
      for (int m : {1, 2, 3, 4, 5, 9}) {
        const int stride = (lanes + 7) / 8 * 8;  // no room past the last group of 8
        const int a_stride = d + 3, out_stride = lanes + 1;
        std::vector<float> a(static_cast<size_t>(m) * a_stride);
        std::vector<float> cols(static_cast<size_t>(d) * stride);
        std::vector<float> out(static_cast<size_t>(m) * out_stride, -7.f);
        for (float& x : a) x = n(rng);
        for (float& x : cols) x = n(rng);
        // The same columns as halves, and those halves widened; and columns of bytes: each
        // overload against the floats the columns stand for.
        std::vector<uint16_t> halves(cols.size());
        for (size_t i = 0; i < cols.size(); ++i) {
          halves[i] = FloatToHalf(cols[i]);
          cols[i] = HalfToFloat(halves[i]);
        }
        std::vector<uint8_t> bytes(cols.size());
        const std::vector<float> half_cols = cols;
        for (uint8_t& x : bytes) x = static_cast<uint8_t>(rng() % 256);
        for (int kind : {0, 1, 2}) {  // floats, halves, bytes
          std::fill(out.begin(), out.end(), -7.f);
          if (kind == 2) {
            for (size_t i = 0; i < cols.size(); ++i) cols[i] = bytes[i];
            DotColumns(a.data(), m, a_stride, bytes.data(), d, stride, lanes, out.data(),
                       out_stride);
          } else if (kind == 1) {
            DotColumns(a.data(), m, a_stride, halves.data(), d, stride, lanes, out.data(),
                       out_stride);
          } else {
            cols = half_cols;
            DotColumns(a.data(), m, a_stride, cols.data(), d, stride, lanes, out.data(),
                       out_stride);
          }
          for (int h = 0; h < m; ++h) {
            for (int i = 0; i < lanes; ++i) {
              double want = 0, mag = 0;
              for (int j = 0; j < d; ++j) {
                const double x =
                    double(a[h * a_stride + j]) * cols[static_cast<size_t>(j) * stride + i];
                want += x;
                mag += std::fabs(x);
              }
              EXPECT_NEAR(out[h * out_stride + i], want, 1e-6 * mag + 1e-7)
                  << "kind " << kind << " d " << d << " lanes " << lanes << " m " << m << " h " << h
                  << " i " << i;
            }
            EXPECT_EQ(out[h * out_stride + lanes], -7.f) << "wrote past lane " << lanes - 1;
          }
        }
      }
    }
  }
}

}  // namespace
}  // namespace kvtier

namespace kvtier {
namespace {

// A ForegroundLock counts itself while it waits for the lock (and only then), and
// YieldToForeground waits while one does, until its bound (2 ms) when the waiter cannot get in.
TEST(ForegroundLock, CountsItsWaitAndBackgroundYieldsABoundedWhile) {
  absl::Mutex mu;
  std::atomic<int> waiting = 0;
  std::atomic<bool> got = false;
  mu.Lock();
  std::thread fg([&] {
    ForegroundLock lock(&mu, &waiting);
    got = true;
  });
  while (waiting.load() == 0) std::this_thread::yield();
  EXPECT_EQ(waiting.load(), 1);
  EXPECT_FALSE(got.load());
  const absl::Time t0 = absl::Now();
  YieldToForeground(waiting);  // the waiter cannot get in: the yield ends by its bound
  const absl::Duration yielded = absl::Now() - t0;
  EXPECT_GE(yielded, absl::Milliseconds(2));
  mu.Unlock();
  fg.join();
  EXPECT_TRUE(got.load());
  EXPECT_EQ(waiting.load(), 0);
}

}  // namespace
}  // namespace kvtier

namespace kvtier {
namespace {

// --log_format json: each logfmt field a string member, a quoted value unescaped (so that a
// caller's words with quotes, newlines and escapes arrive as they were), the time in UTC.
TEST(Log, JsonLinesCarryTheFieldsUnescaped) {
  const std::string tricky = "a \"quoted\" word\nand \\ a backslash\x01";
  const std::string message =
      "event=rpc.error method=Select code=NOT_FOUND message=" + LogValue(tricky) + " tenant=alice";
  EXPECT_EQ(LogfmtToJson(message, "info", 1767322445678),
            "{\"ts\": \"2026-01-02T02:54:05.678Z\", \"level\": \"info\", \"event\": "
            "\"rpc.error\", \"method\": \"Select\", \"code\": \"NOT_FOUND\", \"message\": "
            "\"a \\\"quoted\\\" word\\nand \\\\ a backslash\\u0001\", \"tenant\": \"alice\"}");
  EXPECT_EQ(LogfmtToJson("event=x empty= last=\"\"", "warn", 0),
            "{\"ts\": \"1970-01-01T00:00:00.000Z\", \"level\": \"warn\", \"event\": \"x\", "
            "\"empty\": \"\", \"last\": \"\"}");
}

TEST(DecodeRows, EachCodeIsOneFusedMultiplyAddOnItsRowsScale) {
  std::mt19937 rng(31);
  std::normal_distribution<float> n(0, 1);
  for (int rows : {1, 3, 64}) {
    for (int lanes : {1, 5, 8, 9, 16}) {
      const int stride = lanes + 3, out_stride = (lanes + 7) / 8 * 8;
      std::vector<uint8_t> codes(static_cast<size_t>(rows) * stride + 8);  // loads read 8 lanes
      for (uint8_t& c : codes) c = static_cast<uint8_t>(rng() % 256);
      std::vector<float> base(rows), step(rows);
      for (int r = 0; r < rows; ++r) {
        base[r] = 100.f * n(rng);
        step[r] = r % 5 == 0 ? 0.f : std::fabs(n(rng)) / 255;  // a point box: a zero step
      }
      const size_t size = static_cast<size_t>(rows) * out_stride;
      std::vector<float> out(size + 1, -7.f), scalar(size + 1, -7.f);
      DecodeRows(codes.data(), rows, stride, lanes, base.data(), step.data(), out.data(),
                 out_stride);
      DecodeRowsScalar(codes.data(), rows, stride, lanes, base.data(), step.data(), scalar.data(),
                       out_stride);
      for (int r = 0; r < rows; ++r) {
        for (int i = 0; i < lanes; ++i) {
          const size_t at = static_cast<size_t>(r) * out_stride + i;
          const float want = std::fma(
              static_cast<float>(codes[static_cast<size_t>(r) * stride + i]), step[r], base[r]);
          EXPECT_EQ(std::bit_cast<uint32_t>(out[at]), std::bit_cast<uint32_t>(want))
              << "rows " << rows << " lanes " << lanes << " r " << r << " i " << i;
          EXPECT_EQ(std::bit_cast<uint32_t>(scalar[at]), std::bit_cast<uint32_t>(want));
        }
      }
      EXPECT_EQ(out[size], -7.f) << "wrote past the last row";
    }
  }
}

TEST(MultiplyInto, EachProductRoundedOnceOnEveryPath) {
  std::mt19937 rng(41);
  std::normal_distribution<float> n(0, 100);
  for (size_t len : {0, 1, 7, 8, 9, 64, 77}) {
    std::vector<float> a(len), b(len), out(len + 1, -7.f);
    for (size_t i = 0; i < len; ++i) a[i] = n(rng), b[i] = n(rng);
    MultiplyInto(a.data(), b.data(), len, out.data());
    for (size_t i = 0; i < len; ++i) {
      const float want = static_cast<float>(double(a[i]) * b[i]);  // exact, then rounded once
      EXPECT_EQ(std::bit_cast<uint32_t>(out[i]), std::bit_cast<uint32_t>(want)) << len << " " << i;
    }
    EXPECT_EQ(out[len], -7.f) << "wrote past " << len;
  }
}

// An element-wise operation's two paths (fn, whose AVX2 form runs here, and scalar) against
// the exact result rounded once (want), and fn in place (out is a).
template <typename Fn, typename Want>
void ExpectEachRoundedOnce(Fn fn, Fn scalar, Want want, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> n(0, 100);
  for (size_t len : {0, 1, 7, 8, 9, 64, 77}) {
    std::vector<float> a(len), b(len), out(len + 1, -7.f), by_scalar(len + 1, -7.f);
    for (size_t i = 0; i < len; ++i) a[i] = n(rng), b[i] = std::ldexp(n(rng), int(rng() % 40) - 20);
    fn(a.data(), b.data(), len, out.data());
    scalar(a.data(), b.data(), len, by_scalar.data());
    std::vector<float> in_place(a);
    in_place.push_back(-7.f);
    fn(in_place.data(), b.data(), len, in_place.data());
    for (size_t i = 0; i < len; ++i) {
      const uint32_t bits = std::bit_cast<uint32_t>(want(a[i], b[i]));
      EXPECT_EQ(std::bit_cast<uint32_t>(out[i]), bits) << len << " " << i;
      EXPECT_EQ(std::bit_cast<uint32_t>(by_scalar[i]), bits) << len << " " << i;
      EXPECT_EQ(std::bit_cast<uint32_t>(in_place[i]), bits) << len << " " << i;
    }
    EXPECT_EQ(out[len], -7.f) << "wrote past " << len;
    EXPECT_EQ(in_place[len], -7.f) << "wrote past " << len;
  }
}

TEST(AddInto, EachSumRoundedOnceOnEveryPathAndInPlace) {
  // a + b exact in double (their exponents lie within 30 of each other), then rounded once.
  ExpectEachRoundedOnce(
      AddInto, AddIntoScalar, [](float a, float b) { return static_cast<float>(double(a) + b); },
      61);
}

TEST(SubtractInto, EachDifferenceRoundedOnceOnEveryPath) {
  ExpectEachRoundedOnce(
      SubtractInto, SubtractIntoScalar,
      [](float a, float b) { return static_cast<float>(double(a) - b); }, 59);
}

// A box widened to each point in turn keeps std::max's and std::min's bits on every path: NaN
// points leave it as it was, an equal value of the other sign leaves the box's zero, and an
// empty box (hi -inf, lo +inf) takes the first point.
TEST(WidenBoxTo, IsStdMaxAndStdMinOnEveryPath) {
  constexpr float kInf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::mt19937 rng(61);
  std::normal_distribution<float> n(0, 1);
  for (size_t len : {0, 1, 7, 8, 9, 64, 77}) {
    std::vector<float> hi(len + 1, -kInf), lo(len + 1, kInf), hi2(len + 1, -kInf),
        lo2(len + 1, kInf), want_hi(len, -kInf), want_lo(len, kInf);
    hi[len] = lo[len] = hi2[len] = lo2[len] = -7.f;
    for (int point = 0; point < 6; ++point) {
      std::vector<float> x(len);
      for (size_t i = 0; i < len; ++i) {
        const int kind = int(rng() % 8);
        x[i] = kind == 0 ? nan : kind == 1 ? 0.f : kind == 2 ? -0.f : n(rng);
      }
      WidenBoxTo(x.data(), len, hi.data(), lo.data());
      WidenBoxToScalar(x.data(), len, hi2.data(), lo2.data());
      for (size_t i = 0; i < len; ++i) {
        want_hi[i] = want_hi[i] < x[i] ? x[i] : want_hi[i];
        want_lo[i] = x[i] < want_lo[i] ? x[i] : want_lo[i];
        for (const auto* got : {&hi, &hi2}) {
          EXPECT_EQ(std::bit_cast<uint32_t>((*got)[i]), std::bit_cast<uint32_t>(want_hi[i]))
              << len << " " << i;
        }
        for (const auto* got : {&lo, &lo2}) {
          EXPECT_EQ(std::bit_cast<uint32_t>((*got)[i]), std::bit_cast<uint32_t>(want_lo[i]))
              << len << " " << i;
        }
      }
    }
    EXPECT_EQ(hi[len], -7.f) << "wrote past " << len;
    EXPECT_EQ(lo[len], -7.f) << "wrote past " << len;
  }
}

TEST(PowerOfTwoScales, CodesSpanTheBoxExactlyOnTheSmallestScale) {
  std::mt19937 rng(43);
  std::normal_distribution<float> n(0, 1);
  std::vector<float> lo, hi;
  auto add = [&](float a, float b) {
    lo.push_back(std::min(a, b));
    hi.push_back(std::max(a, b));
  };
  for (int i = 0; i < 300; ++i) {
    const float m = std::ldexp(1.f, static_cast<int>(rng() % 40) - 24);  // magnitudes 2^-24..2^15
    const float x = m * n(rng);
    switch (i % 5) {
      case 0:
        add(x, x);
        break;  // a point
      case 1:
        add(x, x + std::fabs(x) * 1e-3f);
        break;  // narrow, far from zero
      case 2:
        add(x, m * n(rng));
        break;  // any two
      case 3:
        add(-std::fabs(x), std::fabs(x));
        break;  // around zero
      default:
        add(x, std::nextafter(x, 2 * std::fabs(x) + 1));
        break;  // one ulp wide
    }
  }
  add(0.f, 0.f);
  add(-65504.f, 65504.f);                         // the half range's ends
  const int count = static_cast<int>(lo.size());  // not a multiple of 8: the scalar tail runs
  std::vector<int32_t> k0(count), sk0(count);
  std::vector<float> base(count), step(count), inv(count), sbase(count), sstep(count), sinv(count);
  PowerOfTwoScales(lo.data(), hi.data(), count, k0.data(), base.data(), step.data(), inv.data());
  PowerOfTwoScalesScalar(lo.data(), hi.data(), count, sk0.data(), sbase.data(), sstep.data(),
                         sinv.data());
  for (int i = 0; i < count; ++i) {
    SCOPED_TRACE(::testing::Message() << "[" << lo[i] << ", " << hi[i] << "]");
    EXPECT_EQ(k0[i], sk0[i]);
    EXPECT_EQ(base[i], sbase[i]);
    EXPECT_EQ(step[i], sstep[i]);
    EXPECT_EQ(inv[i], sinv[i]);
    int e;
    EXPECT_EQ(std::frexp(step[i], &e), 0.5f) << "a power of two";
    EXPECT_EQ(double(step[i]) * inv[i], 1.0);
    EXPECT_EQ(double(base[i]), double(k0[i]) * step[i]) << "base is k0 steps, exactly";
    EXPECT_LT(std::abs(k0[i]) + 255, 1 << 24) << "every code's value is exact";
    EXPECT_LE(base[i], lo[i]);
    EXPECT_GT(double(base[i]) + step[i], double(lo[i])) << "k0 is lo's floor";
    EXPECT_GE(double(k0[i] + 255) * step[i], double(hi[i])) << "the codes reach hi";
    // One step smaller would not reach hi, unless it is held by exactness or the smallest e.
    const double half = step[i] / 2.0;
    const double k_half = std::floor(double(lo[i]) / half);
    const bool smaller_reaches = std::ceil(double(hi[i]) / half) - k_half <= 255;
    const float m = std::max(std::fabs(lo[i]), std::fabs(hi[i]));
    const bool held = step[i] <= std::ldexp(1.f, -126) ||
                      (m > 0 && std::ldexp(1.0, std::ilogb(m) - 22) >= step[i]) ||
                      std::ldexp(1.0, std::ilogb(double(hi[i]) - lo[i]) - 7) >= step[i];
    EXPECT_TRUE(!smaller_reaches || held) << "step " << step[i] << " is not the smallest";
  }
}

// Both paths give the formula's bytes and scale, written out here in double where that is
// exact: on random vectors, vectors with NaN, infinities and the largest floats, all zeros,
// and lengths that are not multiples of 8.
TEST(SymmetricInt8Codes, EachPathGivesTheFormulasBytes) {
  std::mt19937 rng(53);
  std::normal_distribution<float> n(0, 1);
  constexpr float kMax = std::numeric_limits<float>::max();
  for (int trial = 0; trial < 40; ++trial) {
    const int len = std::vector<int>{1, 7, 8, 13, 64, 128}[trial % 6];
    std::vector<float> x(len);
    for (float& v : x) v = trial % 4 == 0 ? 0.f : std::ldexp(n(rng), int(rng() % 20) - 10);
    if (trial % 5 == 1) x[rng() % len] = std::numeric_limits<float>::quiet_NaN();
    if (trial % 5 == 2) x[rng() % len] = -std::numeric_limits<float>::infinity();
    if (trial % 5 == 3) x[rng() % len] = kMax;
    float top = 0.f;
    std::vector<float> f(len);
    for (int i = 0; i < len; ++i) {
      f[i] = std::isnan(x[i]) ? 0.f : std::max(-kMax, std::min(kMax, x[i]));
      top = std::max(top, std::fabs(f[i]));
    }
    const float inv = top > 0.f ? 127.f / top : 0.f;
    std::vector<int8_t> out(len), scalar(len);
    const float scale = SymmetricInt8Codes(x.data(), len, out.data());
    EXPECT_EQ(SymmetricInt8CodesScalar(x.data(), len, scalar.data()), scale) << trial;
    EXPECT_EQ(scale, top / 127.f) << trial;
    for (int i = 0; i < len; ++i) {
      const double c = std::nearbyint(double(f[i] * inv));  // the product rounded to float
      const int want = static_cast<int>(std::max(-127.0, std::min(127.0, c)));
      EXPECT_EQ(out[i], want) << "trial " << trial << " i " << i;
      EXPECT_EQ(scalar[i], want) << "trial " << trial << " i " << i;
    }
  }
}

// Both paths give each code times the scale, rounded once (computed here in double, where the
// product is exact), over every code, lengths that are not multiples of 8, and scales that
// round, overflow and underflow.
TEST(Int8Times, EachPathGivesEachProductRoundedOnce) {
  std::vector<int8_t> codes;
  for (int c = -128; c <= 127; ++c) codes.push_back(static_cast<int8_t>(c));
  for (float scale : {1.f, 0.37f, -2.5e-3f, 3e37f, 1e-44f, 0.f}) {
    for (int len : {0, 1, 7, 8, 13, 64, 256}) {
      const int8_t* at = codes.data() + (256 - len) / 2;
      std::vector<float> out(len + 1, -7.f), scalar(len + 1, -7.f);
      Int8Times(at, len, scale, out.data());
      Int8TimesScalar(at, len, scale, scalar.data());
      for (int i = 0; i < len; ++i) {
        const float want = static_cast<float>(double(at[i]) * double(scale));
        EXPECT_EQ(out[i], want) << scale << " " << len << " " << i;
        EXPECT_EQ(scalar[i], want) << scale << " " << len << " " << i;
      }
      EXPECT_EQ(out[len], -7.f);  // nothing past n
    }
  }
}

TEST(ScaledCodes, FloorOrCeilingOnTheScaleLessK0) {
  std::mt19937 rng(47);
  std::normal_distribution<float> n(0, 1);
  for (int len : {1, 7, 8, 13, 64}) {
    std::vector<float> x(len), inv(len);
    std::vector<int32_t> k0(len);
    for (int i = 0; i < len; ++i) {
      inv[i] = std::ldexp(1.f, static_cast<int>(rng() % 40) - 10);
      x[i] = i % 5 == 0
                 ? std::ldexp(static_cast<float>(rng() % 1000), -static_cast<int>(rng() % 12))
                 : 100 * n(rng);  // every fifth an exact multiple of some step
      k0[i] = static_cast<int32_t>(rng() % 2001) - 1000;
    }
    x[0] = 1e30f;   // clamped to 2^30 before the conversion
    if (len > 1) {  // infinity times a zero scale: NaN, which comes out -2^30
      x[1] = std::numeric_limits<float>::infinity();
      inv[1] = 0.f;
    }
    for (bool up : {false, true}) {
      std::vector<int32_t> out(len), scalar(len);
      ScaledCodes(x.data(), inv.data(), k0.data(), len, up, out.data());
      ScaledCodesScalar(x.data(), inv.data(), k0.data(), len, up, scalar.data());
      for (int i = 0; i < len; ++i) {
        const double p = double(x[i]) * inv[i];  // exact
        const double t = std::isnan(p) ? -0x1p30 : std::clamp(p, -0x1p30, 0x1p30);
        const double want = (up ? std::ceil(t) : std::floor(t)) - k0[i];
        EXPECT_EQ(out[i], want) << "len " << len << " i " << i << " up " << up;
        EXPECT_EQ(scalar[i], want) << "len " << len << " i " << i << " up " << up;
      }
    }
  }
}

}  // namespace
}  // namespace kvtier
