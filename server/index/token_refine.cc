#include "server/index/token_refine.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "server/common/check.h"
#include "server/common/vec.h"

namespace kvtier {

namespace {

// logits[h * rows + r] = q_h . k_r / sqrt(d) for every row r of `chunks`, in order: head-major,
// so that each head's logits lie side by side for its softmax.
std::vector<float> Logits(HalfKind kind, std::span<const float> queries, int group, int head_dim,
                          std::span<const RefineChunk> chunks) {
  const size_t d = static_cast<size_t>(head_dim);
  size_t total = 0;
  for (const RefineChunk& c : chunks) total += c.rows;
  std::vector<float> logits(total * group);
  const float inv_sqrt_d = 1.f / std::sqrt(static_cast<float>(head_dim));
  size_t r = 0;
  for (size_t i = 0; i < chunks.size(); ++i) {
    const RefineChunk& c = chunks[i];
    // The next chunk's keys are asked for while these are scored: a pool's chunks lie apart
    // (slots, cached copies), and a decode step's layers leave none of them in the cache.
    if (i + 1 < chunks.size()) {
      const RefineChunk& n = chunks[i + 1];
      PrefetchBytes(n.keys + n.first_row * d, n.rows * d * sizeof(*n.keys));
    }
    // Straight from the 2-byte keys (widened in registers, once for the group), no float copy
    // of the rows.
    DotHalvesRows(kind, queries.data(), group, c.keys + c.first_row * d, static_cast<int>(c.rows),
                  head_dim, logits.data() + r, 1, static_cast<int>(total));
    r += c.rows;
  }
  for (float& l : logits) l *= inv_sqrt_d;
  return logits;
}

// Per row of `rows` (logits, head-major as Logits makes them), the sum over heads of its softmax
// weight over `rows` and `others` together (from each head's largest logit, so no term
// overflows).
std::vector<float> SoftmaxMass(const std::vector<float>& rows, const std::vector<float>& others,
                               int group) {
  const size_t n = rows.size() / group, m = others.size() / group;
  std::vector<float> mass(n, 0.f);
  std::vector<float> e(n + m);  // one head's logits, then exps: the rows', then the others'
  for (int h = 0; h < group; ++h) {
    std::copy_n(rows.begin() + static_cast<ptrdiff_t>(h * n), n, e.begin());
    std::copy_n(others.begin() + static_cast<ptrdiff_t>(h * m), m,
                e.begin() + static_cast<ptrdiff_t>(n));
    const float top = MaxOf(e.data(), e.size());
    for (float& v : e) v -= top;
    ExpInPlace(e.data(), static_cast<int>(n + m));  // eight at a time; each within 1e-6
    AddQuotients(e.data(), SumAsDouble(e.data(), e.size()), n, mass.data());
  }
  return mass;
}

}  // namespace

std::vector<RefinedRow> RefineRows(v1::RefineScore score, HalfKind kind,
                                   std::span<const float> queries, int group, int head_dim,
                                   std::span<const RefineChunk> chunks, size_t k,
                                   std::span<const RefineChunk> fixed, float mass_target,
                                   float* missed) {
  CHECK(queries.size() == static_cast<size_t>(group) * head_dim);
  const std::vector<float> logits = Logits(kind, queries, group, head_dim, chunks);
  const size_t total = logits.size() / group;
  const bool by_mass = mass_target > 0.f;
  // The group's mean softmax weight of each pool row over `fixed` and the pool together.
  std::vector<float> mass;
  float fixed_mass = 0.f;
  if (by_mass || missed != nullptr) {
    const std::vector<float> fixed_logits = Logits(kind, queries, group, head_dim, fixed);
    mass = SoftmaxMass(logits, fixed_logits, group);
    for (float& v : mass) v /= static_cast<float>(group);
    for (float v : SoftmaxMass(fixed_logits, logits, group)) fixed_mass += v / group;
  }
  std::vector<float> value;
  if (by_mass) {
    value = mass;
  } else if (score == v1::REFINE_SCORE_MEAN_MASS) {
    value = SoftmaxMass(logits, {}, group);
  } else {
    // The largest of each row's heads, the first of equals kept (as max_element keeps it).
    value.assign(logits.begin(), logits.begin() + static_cast<ptrdiff_t>(total));
    for (int h = 1; h < group; ++h) {
      const float* l = logits.data() + static_cast<size_t>(h) * total;
      for (size_t i = 0; i < total; ++i) value[i] = value[i] < l[i] ? l[i] : value[i];
    }
  }
  size_t take = std::min(k, total);
  std::vector<uint32_t> chosen;  // pool rows, ascending
  double held = fixed_mass;
  if (by_mass) {
    // Each row's value beside its place in the pool, best first, ties to the earlier row: the
    // fewest best rows whose mass reaches the target.
    struct Ranked {
      float value;
      uint32_t row;
    };
    std::vector<Ranked> order(total);
    for (size_t i = 0; i < total; ++i) order[i] = {value[i], static_cast<uint32_t>(i)};
    std::sort(order.begin(), order.end(), [](const Ranked& a, const Ranked& b) {
      return a.value != b.value ? a.value > b.value : a.row < b.row;
    });
    size_t n = 0;
    for (float reached = fixed_mass; n < take && reached < mass_target;) {
      reached += order[n++].value;
    }
    chosen.reserve(n);
    for (size_t i = 0; i < n; ++i) {
      chosen.push_back(order[i].row);
      held += order[i].value;
    }
    std::sort(chosen.begin(), chosen.end());
  } else {
    // The best `take` (ties to the earlier row), and the mass they hold, summed in the pool's
    // order.
    TopByValue(value, take, &chosen);
    if (missed != nullptr) {
      for (uint32_t i : chosen) held += mass[i];
    }
  }
  if (missed != nullptr) *missed = static_cast<float>(std::max(0.0, 1.0 - held));
  // Each chosen pool row as its chunk's row: the chunks' runs in the pool's order.
  std::vector<RefinedRow> out;
  out.reserve(chosen.size());
  size_t r = 0, next = 0;
  for (const RefineChunk& c : chunks) {
    for (; next < chosen.size() && chosen[next] < r + c.rows; ++next) {
      out.push_back({c.chunk, c.first_row + static_cast<uint32_t>(chosen[next] - r)});
    }
    r += c.rows;
  }
  auto by_place = [](const RefinedRow& a, const RefinedRow& b) {
    return a.chunk != b.chunk ? a.chunk < b.chunk : a.row < b.row;
  };
  // Already in order when the pool lists its chunks in order (a Select's pool does).
  if (!std::is_sorted(out.begin(), out.end(), by_place))
    std::sort(out.begin(), out.end(), by_place);
  return out;
}

}  // namespace kvtier
