#include "server/index/token_refine.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "server/common/check.h"

namespace kvtier {

std::vector<RefinedRow> RefineRows(v1::RefineScore score, HalfKind kind,
                                   std::span<const float> queries, int group, int head_dim,
                                   std::span<const RefineChunk> chunks, size_t k) {
  CHECK(queries.size() == static_cast<size_t>(group) * head_dim);
  const size_t d = static_cast<size_t>(head_dim);
  size_t total = 0;
  for (const RefineChunk& c : chunks) total += c.rows;
  // logits[r][h] for every pool row r, in pool order.
  std::vector<float> logits(total * group), key(d);
  const float inv_sqrt_d = 1.f / std::sqrt(static_cast<float>(head_dim));
  size_t r = 0;
  for (const RefineChunk& c : chunks) {
    for (uint32_t row = 0; row < c.rows; ++row, ++r) {
      std::fill(key.begin(), key.end(), 0.f);
      AddRows(kind, c.keys + row * d, 1, head_dim, key.data());
      for (int h = 0; h < group; ++h) {
        logits[r * group + h] = Dot(queries.data() + h * d, key.data(), head_dim) * inv_sqrt_d;
      }
    }
  }
  std::vector<float> value(total);
  if (score == v1::REFINE_SCORE_MEAN_MASS) {
    // Per head, a softmax over the pool (from its largest logit, so no term overflows).
    std::fill(value.begin(), value.end(), 0.f);
    for (int h = 0; h < group; ++h) {
      float top = -std::numeric_limits<float>::infinity();
      for (size_t i = 0; i < total; ++i) top = std::max(top, logits[i * group + h]);
      double z = 0;
      for (size_t i = 0; i < total; ++i) z += std::exp(double(logits[i * group + h]) - top);
      for (size_t i = 0; i < total; ++i) {
        value[i] += static_cast<float>(std::exp(double(logits[i * group + h]) - top) / z);
      }
    }
  } else {
    for (size_t i = 0; i < total; ++i) {
      value[i] = *std::max_element(&logits[i * group], &logits[i * group] + group);
    }
  }
  std::vector<uint32_t> order(total);
  for (size_t i = 0; i < total; ++i) order[i] = static_cast<uint32_t>(i);
  const size_t take = std::min(k, total);
  // Best first; ties to the earlier row of the pool.
  std::partial_sort(order.begin(), order.begin() + take, order.end(), [&](uint32_t a, uint32_t b) {
    return value[a] != value[b] ? value[a] > value[b] : a < b;
  });
  std::vector<bool> chosen(total, false);
  for (size_t i = 0; i < take; ++i) chosen[order[i]] = true;
  std::vector<RefinedRow> out;
  out.reserve(take);
  r = 0;
  for (const RefineChunk& c : chunks) {
    for (uint32_t row = 0; row < c.rows; ++row, ++r) {
      if (chosen[r]) out.push_back({c.chunk, row});
    }
  }
  std::sort(out.begin(), out.end(), [](const RefinedRow& a, const RefinedRow& b) {
    return a.chunk != b.chunk ? a.chunk < b.chunk : a.row < b.row;
  });
  return out;
}

}  // namespace kvtier
