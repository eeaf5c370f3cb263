// RefineRows against a brute force in double: the k best rows of a pool by each score, in
// (chunk, row) order, and every row when the pool holds fewer.
#include "server/index/token_refine.h"

#include <algorithm>
#include <cmath>
#include <random>

#include "gtest/gtest.h"
#include "server/common/fp16.h"

namespace kvtier {
namespace {

constexpr int kD = 32, kGroup = 3;

struct Pool {
  std::vector<std::vector<uint16_t>> keys;  // per chunk [rows][kD]
  std::vector<RefineChunk> chunks;
};

Pool MakePool(std::mt19937& rng, int chunks) {
  std::normal_distribution<float> g(0, 1);
  Pool p;
  for (int c = 0; c < chunks; ++c) {
    const uint32_t rows = 1 + rng() % 20;
    std::vector<uint16_t> k(size_t(rows) * kD);
    for (auto& h : k) h = FloatToHalf(g(rng));
    p.keys.push_back(std::move(k));
  }
  for (int c = 0; c < chunks; ++c) {  // chunk indices out of order, as a pool may list them
    const uint32_t rows = uint32_t(p.keys[c].size() / kD);
    // Every third chunk stands for a run of a kept chunk's rows: its candidates start later.
    const uint32_t first = c % 3 == 2 ? rows / 2 : 0;
    p.chunks.push_back({uint32_t(3 * c + 1), p.keys[c].data(), rows - first, first});
  }
  return p;
}

std::vector<RefinedRow> BruteForce(v1::RefineScore score, const std::vector<float>& q,
                                   const Pool& p, size_t k) {
  struct Row {
    double value;
    size_t order;  // place in the pool
    RefinedRow id;
  };
  std::vector<std::vector<double>> logit;  // [row][h]
  std::vector<Row> rows;
  for (const RefineChunk& c : p.chunks) {
    for (uint32_t r = c.first_row; r < c.first_row + c.rows; ++r) {
      std::vector<double> s(kGroup, 0.0);
      for (int h = 0; h < kGroup; ++h) {
        for (int j = 0; j < kD; ++j)
          s[h] += double(q[h * kD + j]) * HalfToFloat(c.keys[r * kD + j]);
        s[h] /= std::sqrt(double(kD));
      }
      logit.push_back(s);
      rows.push_back({0, rows.size(), {c.chunk, r}});
    }
  }
  for (size_t i = 0; i < rows.size(); ++i) {
    if (score == v1::REFINE_SCORE_MAX) {
      rows[i].value = *std::max_element(logit[i].begin(), logit[i].end());
      continue;
    }
    for (int h = 0; h < kGroup; ++h) {
      double z = 0;
      for (const auto& l : logit) z += std::exp(l[h]);
      rows[i].value += std::exp(logit[i][h]) / z;
    }
  }
  std::stable_sort(rows.begin(), rows.end(),
                   [](const Row& a, const Row& b) { return a.value > b.value; });
  std::vector<RefinedRow> out;
  for (size_t i = 0; i < std::min(k, rows.size()); ++i) out.push_back(rows[i].id);
  std::sort(out.begin(), out.end(), [](const RefinedRow& a, const RefinedRow& b) {
    return a.chunk != b.chunk ? a.chunk < b.chunk : a.row < b.row;
  });
  return out;
}

TEST(RefineRows, TheBestRowsOfThePoolByEachScore) {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 20; ++trial) {
    const Pool p = MakePool(rng, 1 + trial * 3);
    std::normal_distribution<float> g(0, trial % 2 ? 2.f : 0.5f);
    std::vector<float> q(kGroup * kD);
    for (auto& x : q) x = g(rng);
    for (v1::RefineScore score : {v1::REFINE_SCORE_MAX, v1::REFINE_SCORE_MEAN_MASS}) {
      for (size_t k : {size_t(1), size_t(7), size_t(40), size_t(10000)}) {
        const std::vector<RefinedRow> got =
            RefineRows(score, HalfKind::kFp16, q, kGroup, kD, p.chunks, k);
        EXPECT_EQ(got, BruteForce(score, q, p, k))
            << v1::RefineScore_Name(score) << " k " << k << " trial " << trial;
      }
    }
  }
}

// A mass target: the fewest pool rows, best mass first, that with the fixed rows hold the
// target share of the group's mean softmax mass over fixed and pool rows, within k.
TEST(RefineRows, AMassTargetTakesTheSmallestSetReachingIt) {
  std::mt19937 rng(11);
  for (int trial = 0; trial < 12; ++trial) {
    const Pool p = MakePool(rng, 12), fixed = MakePool(rng, 2);
    std::normal_distribution<float> g(0, trial % 2 ? 2.f : 0.7f);
    std::vector<float> q(kGroup * kD);
    for (auto& x : q) x = g(rng);
    // Brute force in double: each row's group-mean mass over fixed + pool.
    auto logits = [&](const Pool& pool) {
      std::vector<std::vector<double>> out;
      for (const RefineChunk& c : pool.chunks) {
        for (uint32_t r = c.first_row; r < c.first_row + c.rows; ++r) {
          std::vector<double> s(kGroup, 0.0);
          for (int h = 0; h < kGroup; ++h) {
            for (int j = 0; j < kD; ++j)
              s[h] += double(q[h * kD + j]) * HalfToFloat(c.keys[r * kD + j]);
            s[h] /= std::sqrt(double(kD));
          }
          out.push_back(s);
        }
      }
      return out;
    };
    const auto lp = logits(p), lf = logits(fixed);
    std::vector<double> z(kGroup, 0.0);
    for (const auto* set : {&lp, &lf}) {
      for (const auto& s : *set)
        for (int h = 0; h < kGroup; ++h) z[h] += std::exp(s[h]);
    }
    auto mass = [&](const std::vector<double>& s) {
      double m = 0;
      for (int h = 0; h < kGroup; ++h) m += std::exp(s[h]) / z[h] / kGroup;
      return m;
    };
    double fixed_mass = 0;
    for (const auto& s : lf) fixed_mass += mass(s);
    std::vector<std::pair<double, size_t>> order;
    for (size_t i = 0; i < lp.size(); ++i) order.push_back({-mass(lp[i]), i});
    std::stable_sort(order.begin(), order.end(),
                     [](const auto& a, const auto& b) { return a.first < b.first; });
    std::vector<RefinedRow> ids;
    for (const RefineChunk& c : p.chunks)
      for (uint32_t r = c.first_row; r < c.first_row + c.rows; ++r) ids.push_back({c.chunk, r});
    for (float target : {0.3f, 0.8f, 0.99f, 1.f}) {
      for (size_t k : {size_t(5), size_t(1000)}) {
        std::vector<RefinedRow> want;
        double held = fixed_mass;
        for (size_t n = 0; n < order.size() && want.size() < k && held < target; ++n) {
          held += -order[n].first;
          want.push_back(ids[order[n].second]);
        }
        std::sort(want.begin(), want.end(), [](const RefinedRow& a, const RefinedRow& b) {
          return a.chunk != b.chunk ? a.chunk < b.chunk : a.row < b.row;
        });
        EXPECT_EQ(RefineRows(v1::REFINE_SCORE_MAX, HalfKind::kFp16, q, kGroup, kD, p.chunks, k,
                             fixed.chunks, target),
                  want)
            << "target " << target << " k " << k << " trial " << trial;
        // What those rows miss: the mass neither they nor the fixed rows hold.
        float missed = -1.f;
        RefineRows(v1::REFINE_SCORE_MAX, HalfKind::kFp16, q, kGroup, kD, p.chunks, k, fixed.chunks,
                   target, &missed);
        EXPECT_NEAR(missed, std::max(0.0, 1.0 - held), 1e-5) << "target " << target;
      }
    }
  }
}

TEST(RefineRows, ThePoolWithinTheBudgetComesWholeAndTiesGoToThePoolsOrder) {
  // Identical keys: every row ties; the first k rows of the pool win.
  std::vector<uint16_t> same(4 * kD, FloatToHalf(0.5f));
  const std::vector<RefineChunk> pool = {{9, same.data(), 4}, {2, same.data(), 4}};
  std::vector<float> q(kGroup * kD, 1.f);
  EXPECT_EQ(RefineRows(v1::REFINE_SCORE_MAX, HalfKind::kFp16, q, kGroup, kD, pool, 5),
            (std::vector<RefinedRow>{{2, 0}, {9, 0}, {9, 1}, {9, 2}, {9, 3}}));
  EXPECT_EQ(RefineRows(v1::REFINE_SCORE_MEAN_MASS, HalfKind::kFp16, q, kGroup, kD, pool, 8).size(),
            8u);
  EXPECT_TRUE(RefineRows(v1::REFINE_SCORE_MAX, HalfKind::kFp16, q, kGroup, kD, {}, 5).empty());
}

}  // namespace
}  // namespace kvtier
