#include "server/index/cluster_index.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <queue>
#include <string>

#include "absl/container/inlined_vector.h"
#include "absl/strings/str_format.h"
#include "server/common/check.h"
#include "server/common/fp16.h"
#include "server/common/vec.h"
#include "server/index/chunk_ranker.h"

namespace kvtier {
namespace {

// |x - y|^2 in float over n <= 1024 floats (a [mean | peak] point at head_dim 512).
float SquaredDistance(const float* x, const float* y, int n) {
  float diff[1024];
  SubtractInto(x, y, static_cast<size_t>(n), diff);
  return Dot(diff, diff, n);
}

}  // namespace

double ClusterIndex::Norm(const float* x, int d) {
  double s = 0;
  for (int j = 0; j < d; ++j) s += double(x[j]) * x[j];
  return std::sqrt(s);
}

ClusterIndex::ClusterIndex(int head_dim, Options options) : d_(head_dim), opt_(options) {
  CHECK(head_dim >= 1 && head_dim <= kMaxHeadDim);
}

size_t ClusterIndex::num_clusters() const { return clusters_.size(); }

size_t ClusterIndex::num_units() const { return units_.size(); }

size_t ClusterIndex::cluster_lanes() const {
  size_t lanes = 0;
  for (const Unit& u : units_) lanes += u.block.cap;
  return lanes;
}

size_t ClusterIndex::MemoryBytes() const {
  auto block = [](const Block& b) {
    return b.box.capacity() * sizeof(uint16_t) + b.codes.capacity() +
           b.scalars.capacity() * sizeof(float);
  };
  size_t bytes = sizeof(*this) + clusters_.capacity() * sizeof(Cluster) +
                 units_.capacity() * sizeof(Unit) + block(units_block_) +
                 node_of_.capacity() * sizeof(uint32_t);
  for (const Cluster& c : clusters_) {
    if (c.chunks.capacity() > 2 * kClusterChunks + 1)
      bytes += c.chunks.capacity() * sizeof(uint32_t);
  }
  for (const Unit& u : units_) bytes += u.clusters.capacity() * sizeof(uint32_t) + block(u.block);
  return bytes;
}

void ClusterIndex::Mean(uint32_t chunk, const ChunkStats& a, float* out) const {
  a.Mean(chunk, out);
}

void ClusterIndex::Peak(uint32_t chunk, const ChunkStats& a, float* out) const {
  a.Peak(chunk, out);
}

void ClusterIndex::ChunkPoint(uint32_t chunk, const ChunkStats& a, float* out) const {
  Mean(chunk, a, out);
  Peak(chunk, a, out + d_);
}

void ClusterIndex::Rebuild(Bounds& b, Lane l, std::span<const uint32_t> chunks,
                           const ChunkStats& a) {
  float box[kBoxParts * kMaxHeadDim];
  BoxOver(chunks, a, b, box);
  StoreBoxes(l, box);
  SetScalars(l, b, MeasureOf(l));
}

void ClusterIndex::EmptyBox(float* box) const {
  for (int part = 0; part < kBoxParts; ++part) {
    std::fill_n(&box[part * d_], d_,
                IsUpper(part) ? -std::numeric_limits<float>::infinity()
                              : std::numeric_limits<float>::infinity());
  }
}

void ClusterIndex::BoxOver(std::span<const uint32_t> chunks, const ChunkStats& a, Bounds& b,
                           float* box) const {
  // Every chunk widens the empty bounds, the boxes in float.
  const size_t d = d_;
  b.max_tokens = 0;
  b.min_tokens = std::numeric_limits<uint32_t>::max();
  EmptyBox(box);
  float mu[kMaxHeadDim], p[kMaxHeadDim];
  for (uint32_t ch : chunks) {
    Mean(ch, a, mu);
    Peak(ch, a, p);
    WidenTokens(b, a.tokens(ch));
    WidenBoxTo(mu, d, &box[kMuHi * d], &box[kMuLo * d]);
    WidenBoxTo(p, d, &box[kPeakHi * d], &box[kPeakLo * d]);
  }
}

void ClusterIndex::WidenTokens(Bounds& b, uint32_t tokens) {
  if (tokens > b.max_tokens || b.max_tokens == 0) {
    b.max_tokens = tokens;
    b.log_rest = b.max_tokens > 1 ? std::log(static_cast<float>(b.max_tokens - 1))
                                  : -std::numeric_limits<float>::infinity();
  }
  b.min_tokens = std::min(b.min_tokens, tokens);
}

void ClusterIndex::ReadLane(const Block& blk, uint32_t lane, const Grid* grid, float* box) const {
  const size_t w = TileWidth(blk, lane / kTile * kTile);  // row r at col[r * w]
  if (blk.coded) {
    const uint8_t* col = &blk.codes[BoxIndex(blk, lane, 0)];
    for (int part = 0; part < kBoxParts; ++part) {
      const size_t row = static_cast<size_t>(part) * d_, c = Channel(part, d_);
      for (int j = 0; j < d_; ++j) box[row + j] = grid->Value(c + j, col[(row + j) * w]);
    }
    return;
  }
  uint16_t halves[kBoxParts * kMaxHeadDim];
  const uint16_t* col = &blk.box[BoxIndex(blk, lane, 0)];
  for (size_t r = 0; r < BoxRows(); ++r) halves[r] = col[r * w];
  HalvesToFloats(HalfKind::kFp16, halves, BoxRows(), box);
}

void ClusterIndex::GridOf(uint32_t unit, Grid* g) const {
  const size_t d = d_;
  g->base.resize(2 * d);
  g->step.resize(2 * d);
  g->inv.resize(2 * d);
  g->k0.resize(2 * d);
  g->bounded = units_block_.scalars[ScalarIndex(units_block_, unit, kUnbounded)] == 0.f;
  if (!g->bounded) {
    std::fill(g->base.begin(), g->base.end(), 0.f);
    std::fill(g->step.begin(), g->step.end(), 0.f);
    std::fill(g->inv.begin(), g->inv.end(), 0.f);
    std::fill(g->k0.begin(), g->k0.end(), 0);
    return;
  }
  // A channel's hi and lo rows share its scale.
  float box[kBoxParts * kMaxHeadDim];
  ReadLane(units_block_, unit, nullptr, box);
  for (int kind : {0, 1}) {  // the mean's [hi | lo] rows, then the peak's
    const size_t hi = 2 * kind * d, lo = hi + d, c = kind * d;
    PowerOfTwoScales(&box[lo], &box[hi], d_, &g->k0[c], &g->base[c], &g->step[c], &g->inv[c]);
  }
}

ClusterIndex::LaneMeasure ClusterIndex::Measure(const float* f) const {
  const size_t d = d_;
  double mu = 0, peak = 0, extent = 0;
  for (size_t j = 0; j < d; ++j) {
    const double mh = f[kMuHi * d + j], ml = f[kMuLo * d + j], ph = f[kPeakHi * d + j],
                 pl = f[kPeakLo * d + j];
    mu += std::max(mh * mh, ml * ml);
    peak += std::max(ph * ph, pl * pl);
    extent += (mh - ml) * (mh - ml);
  }
  return {static_cast<float>(std::sqrt(mu) * (1 + 1e-6)),
          static_cast<float>(std::sqrt(peak) * (1 + 1e-6)),
          static_cast<float>(std::sqrt(extent) * (1 + 1e-6))};
}

void ClusterIndex::LaneMiddles(const Block& blk, uint32_t lane, const Grid* grid, float* mu,
                               float* peak) const {
  float box[kBoxParts * kMaxHeadDim];
  ReadLane(blk, lane, grid, box);
  auto side = [&](int part, int j) {
    return std::clamp(box[static_cast<size_t>(part) * d_ + j], -65504.f, 65504.f);
  };
  for (int j = 0; j < d_; ++j) {
    mu[j] = 0.5f * (side(kMuHi, j) + side(kMuLo, j));
    peak[j] = 0.5f * (side(kPeakHi, j) + side(kPeakLo, j));
  }
}

void ClusterIndex::Widen(Bounds& b, Lane l, const float* point, uint32_t tokens, bool inside) {
  WidenTokens(b, tokens);
  if (inside) {  // the boxes and what they measure stay; only the token count may move
    l.blk->scalars[ScalarIndex(*l.blk, l.lane, kLogRest)] = b.log_rest;
    return;
  }
  if (l.blk->coded) {  // a coded lane's margins are its unit's: only its extent is measured
    SetScalars(l, b, {0, 0, WidenCodes(l, point, point + d_)});
    return;
  }
  float box[kBoxParts * kMaxHeadDim];
  WidenBoxes(l, point, point + d_, box);
  SetScalars(l, b, Measure(box));
}

ClusterIndex::Lane ClusterIndex::ClusterLane(uint32_t cluster, const Grid& grid) {
  return {&units_[clusters_[cluster].unit].block, clusters_[cluster].lane, &grid};
}

void ClusterIndex::Reserve(Block& blk, uint32_t lane) const {
  if (lane < blk.cap) return;
  const uint32_t t = blk.cap / kTile * kTile;  // where the last tile begins
  const uint32_t old_w = blk.cap - t;          // its width; 0: every tile is full
  const uint32_t cap = lane + 1;
  const uint32_t new_w = std::min(kTile, cap - t);
  // The last tile's rows (`rows` of them) moved to the new width, last row first: a row's new
  // place is never below an unmoved row's old one. The new lanes are zeros, as is everything
  // past the tile (resize fills it).
  auto grow = [&](auto& v, size_t rows) {
    const size_t size = static_cast<size_t>(cap) * rows + kPad;
    if (cap <= kTile) v.reserve(size);
    v.resize(size, 0);
    if (old_w == 0) return;
    auto* at = &v[static_cast<size_t>(t) * rows];
    for (size_t r = rows; r-- > 0;) {
      std::memmove(at + r * new_w, at + r * old_w, old_w * sizeof *at);
      std::fill(at + r * new_w + old_w, at + (r + 1) * new_w, 0);
    }
  };
  if (blk.coded) {
    grow(blk.codes, BoxRows());
  } else {
    grow(blk.box, BoxRows());
  }
  grow(blk.scalars, size_t{kScalars});
  blk.cap = cap;
}

void ClusterIndex::StoreBoxes(Lane l, const float* box) const {
  Reserve(*l.blk, l.lane);
  const size_t w = TileWidth(*l.blk, l.lane / kTile * kTile);  // row r at out[r * w]
  float& unbounded = l.blk->scalars[ScalarIndex(*l.blk, l.lane, kUnbounded)];
  if (l.blk->coded) {
    const Grid& g = *l.grid;
    uint8_t* out = &l.blk->codes[BoxIndex(*l.blk, l.lane, 0)];
    unbounded = g.bounded ? 0.f : 1.f;
    if (!g.bounded) return;  // its codes mean nothing: its bound is +inf
    int32_t codes[kMaxHeadDim];
    for (int part = 0; part < kBoxParts; ++part) {
      const size_t row = static_cast<size_t>(part) * d_, c = Channel(part, d_);
      ScaledCodes(&box[row], &g.inv[c], &g.k0[c], d_, IsUpper(part), codes);
      for (int j = 0; j < d_; ++j)
        out[(row + j) * w] = static_cast<uint8_t>(std::clamp(codes[j], 0, 255));
    }
    return;
  }
  uint16_t rounded[kBoxParts * kMaxHeadDim];
  for (int part = 0; part < kBoxParts; ++part) {
    FloatsToHalvesDirected(&box[part * d_], d_, IsUpper(part), &rounded[part * d_]);
  }
  uint16_t* out = &l.blk->box[BoxIndex(*l.blk, l.lane, 0)];
  bool finite = true;
  for (size_t r = 0; r < BoxRows(); ++r) {
    out[r * w] = rounded[r];
    finite = finite && !HalfIsNonFinite(rounded[r]);
  }
  unbounded = finite ? 0.f : 1.f;
}

float ClusterIndex::WidenCodes(Lane l, const float* mu, const float* peak) const {
  // The point's own codes, the floor's for the lower sides and the ceiling's for the upper ones:
  // a side moves exactly where the point's code passes it (its value is x's floor or ceiling on
  // the scale, x inside the unit's box).
  const Grid& g = *l.grid;
  if (!g.bounded) return 0;  // the lane is marked unbounded: its codes mean nothing
  const size_t d = d_;
  int32_t point[kBoxParts * kMaxHeadDim];
  for (int part = 0; part < kBoxParts; ++part) {
    const size_t c = Channel(part, d_);
    ScaledCodes(part < kPeakHi ? mu : peak, &g.inv[c], &g.k0[c], d_, IsUpper(part),
                &point[static_cast<size_t>(part) * d]);
  }
  const size_t w = TileWidth(*l.blk, l.lane / kTile * kTile);  // row r at col[r * w]
  uint8_t* col = &l.blk->codes[BoxIndex(*l.blk, l.lane, 0)];
  for (int part = 0; part < kBoxParts; ++part) {
    uint8_t* at = col + static_cast<size_t>(part) * d * w;
    const int32_t* p = &point[static_cast<size_t>(part) * d];
    if (IsUpper(part)) {
      for (size_t j = 0; j < d; ++j) {
        at[j * w] = static_cast<uint8_t>(std::clamp(p[j], int32_t{at[j * w]}, 255));
      }
    } else {
      for (size_t j = 0; j < d; ++j) {
        at[j * w] = static_cast<uint8_t>(std::clamp(p[j], 0, int32_t{at[j * w]}));
      }
    }
  }
  return CodedExtent(*l.blk, l.lane, g);
}

float ClusterIndex::CodedExtent(const Block& blk, uint32_t lane, const Grid& g) const {
  const size_t d = d_;
  const size_t w = TileWidth(blk, lane / kTile * kTile);  // row r at col[r * w]
  const uint8_t* col = &blk.codes[BoxIndex(blk, lane, 0)];
  double extent = 0;
  for (size_t j = 0; j < d; ++j) {
    const double side = double(col[(kMuHi * d + j) * w] - col[(kMuLo * d + j) * w]) * g.step[j];
    extent += side * side;
  }
  return static_cast<float>(std::sqrt(extent) * (1 + 1e-6));
}

ClusterIndex::LaneMeasure ClusterIndex::MeasureOf(Lane l) const {
  if (l.blk->coded) return {0, 0, CodedExtent(*l.blk, l.lane, *l.grid)};
  float box[kBoxParts * kMaxHeadDim];
  ReadLane(*l.blk, l.lane, nullptr, box);
  return Measure(box);
}

void ClusterIndex::WidenBoxes(Lane l, const float* mu, const float* peak, float* out) const {
  const size_t d = d_;
  const size_t w = TileWidth(*l.blk, l.lane / kTile * kTile);  // row r at col[r * w]
  uint16_t rounded[kBoxParts * kMaxHeadDim], box[kBoxParts * kMaxHeadDim];
  FloatsToHalvesDirected(mu, d_, true, &rounded[kMuHi * d]);
  FloatsToHalvesDirected(mu, d_, false, &rounded[kMuLo * d]);
  FloatsToHalvesDirected(peak, d_, true, &rounded[kPeakHi * d]);
  FloatsToHalvesDirected(peak, d_, false, &rounded[kPeakLo * d]);
  uint16_t* col = &l.blk->box[BoxIndex(*l.blk, l.lane, 0)];
  for (size_t r = 0; r < BoxRows(); ++r) box[r] = col[r * w];
  bool finite = true;
  for (int part = 0; part < kBoxParts; ++part) {
    finite &= WidenHalves(&rounded[part * d], d_, IsUpper(part), &box[part * d]);
  }
  for (size_t r = 0; r < BoxRows(); ++r) col[r * w] = box[r];
  HalvesToFloats(HalfKind::kFp16, box, BoxRows(), out);
  if (!finite) l.blk->scalars[ScalarIndex(*l.blk, l.lane, kUnbounded)] = 1.f;
}

void ClusterIndex::Regrid(uint32_t unit, const Grid& from, const Grid& to) {
  Block& blk = units_[unit].block;
  const uint32_t lanes = static_cast<uint32_t>(units_[unit].clusters.size());
  if (!to.bounded) {  // the unit's box left the half range: so do its clusters' bounds
    for (uint32_t i = 0; i < lanes; ++i) blk.scalars[ScalarIndex(blk, i, kUnbounded)] = 1.f;
    return;
  }
  CHECK(from.bounded) << "a unit's box only grows between rebuilds";
  for (size_t c = 0; c < 2 * static_cast<size_t>(d_); ++c) {
    if (from.k0[c] == to.k0[c] && from.step[c] == to.step[c]) continue;
    const size_t hi = c / d_ * 2 * d_ + c % d_;  // the channel's hi row; its lo row d below
    for (size_t r : {hi, hi + d_}) {
      const bool up = r == hi;
      for (uint32_t i = 0; i < lanes; ++i) {
        uint8_t& code = blk.codes[BoxIndex(blk, i, r)];
        code = to.Code(c, from.Value(c, code), up);  // the value exact, as is its new place
      }
    }
  }
}

void ClusterIndex::SetScalars(Lane l, Bounds& b, const LaneMeasure& m) const {
  // The rounding margins scale with the largest norm of a point in each box (a coded block's
  // come from its unit's, at search time).
  Block& blk = *l.blk;
  b.extent = m.extent;
  if (!blk.coded) {
    blk.scalars[ScalarIndex(blk, l.lane, kMarginA)] = m.mu_corner;
    blk.scalars[ScalarIndex(blk, l.lane, kMarginP)] = m.peak_corner;
  }
  blk.scalars[ScalarIndex(blk, l.lane, kLogRest)] = b.log_rest;
}

uint32_t ClusterIndex::LeastWidened(const Block& blk, uint32_t lanes, const float* point,
                                    const Grid* grid, float* growth, uint32_t first) const {
  const int pairs = opt_.cluster_by_peak ? 2 : 1;  // [mu_hi | mu_lo] (| [peak_hi | peak_lo])
  constexpr float kInf = std::numeric_limits<float>::infinity();
  float grow[kTile], width[kTile], more[kTile], wider[kTile];
  uint32_t best = 0;
  float best_grow = kInf;
  float best_width = kInf;
  // A coded tile's boxes decoded first, kTile lanes a row (scratch kept between calls).
  thread_local std::vector<float> decoded;
  if (blk.coded) decoded.resize(BoxRows() * kTile);
  const uint32_t first_tile = first < lanes ? first / kTile * kTile : 0;
  for (uint32_t i = 0; i < lanes; i += kTile) {
    // first_tile, then the others in order.
    const uint32_t t = i == 0 ? first_tile : i <= first_tile ? i - kTile : i;
    const uint32_t n = std::min(kTile, lanes - t);
    int w = static_cast<int>(TileWidth(blk, t));
    const uint16_t* halves = blk.coded ? nullptr : &blk.box[BoxIndex(blk, t, 0)];
    if (blk.coded) {  // each part's d rows on its kind's scales
      for (int part = 0; part < kBoxParts; ++part) {
        const size_t row = static_cast<size_t>(part) * d_, c = Channel(part, d_);
        DecodeRows(&blk.codes[BoxIndex(blk, t, row)], d_, w, static_cast<int>(n), &grid->base[c],
                   &grid->step[c], &decoded[row * kTile], kTile);
      }
      w = kTile;
    }
    // False once every lane's `offset` plus growth so far exceeds the best so far: none of
    // them can be the least widened (every term is >= 0).
    auto box_growth = [&](const float* x, size_t row, const float* offset, float* g, float* width) {
      return blk.coded ? BoxGrowthBelow(x, 1, d_, decoded.data() + row * w, w, static_cast<int>(n),
                                        offset, best_grow, g, width)
                       : BoxGrowthBelow(x, 1, d_, halves + row * w, w, static_cast<int>(n), offset,
                                        best_grow, g, width);
    };
    // With the peak (cluster_by_peak), its growth first: a tile none of whose lanes grows less
    // than the best so far over the peak alone is passed without reading its mean boxes, and
    // the mean's growth stops once no lane's sum of the two can be the least.
    if (pairs == 2) {
      if (!box_growth(point + d_, static_cast<size_t>(2) * d_, nullptr, grow, width)) continue;
      float least = kInf;
      for (uint32_t i = 0; i < n; ++i) least = std::min(least, grow[i]);
      if (least > best_grow) continue;
    }
    if (!box_growth(point, 0, pairs == 2 ? grow : nullptr, more, wider)) continue;
    for (uint32_t i = 0; i < n; ++i) {
      grow[i] = pairs == 2 ? grow[i] + more[i] : more[i];
      width[i] = pairs == 2 ? width[i] + wider[i] : wider[i];
    }
    for (uint32_t i = 0; i < n; ++i) {
      // An unbounded lane (a box beyond the half range: infinite or NaN width) is taken only
      // when no lane is bounded.
      const float g = std::isfinite(width[i]) ? grow[i] : kInf;
      if (g < best_grow ||
          (g == best_grow && (width[i] < best_width || (width[i] == best_width && t + i < best)))) {
        best = t + i, best_grow = g, best_width = width[i];
      }
    }
  }
  if (growth != nullptr) *growth = best_grow;
  return best;
}

template <typename VecFn>
void ClusterIndex::TwoMeans(std::span<const uint32_t> ids, int dim, VecFn vec, bool spherical,
                            bool balanced, std::vector<uint32_t>* left,
                            std::vector<uint32_t>* right) const {
  // The points once (spherical: as unit vectors, and the means renormalized each round, so
  // that the nearer mean is the one closer in direction); then rounds of assignment to the
  // nearer mean by squared distance.
  const size_t n = ids.size(), d = dim;
  std::vector<float> pts(n * d);
  auto normalize = [&](float* x) {
    const float norm = std::sqrt(Dot(x, x, dim));
    for (size_t j = 0; j < d; ++j) x[j] = norm > 0 ? x[j] / norm : 0.f;
  };
  for (size_t i = 0; i < n; ++i) {
    std::copy_n(vec(i), d, &pts[i * d]);
    if (spherical) normalize(&pts[i * d]);
  }
  auto dist2 = [&](size_t i, const float* c) { return SquaredDistance(&pts[i * d], c, dim); };
  // Seeds: the point farthest from the first, then the point farthest from that one.
  auto farthest = [&](size_t from) {
    size_t best = 0;
    float most = -1.f;
    for (size_t i = 0; i < n; ++i) {
      const float x = dist2(i, &pts[from * d]);
      if (x > most) most = x, best = i;
    }
    return best;
  };
  const size_t s0 = farthest(0), s1 = farthest(s0);
  std::vector<float> c0(&pts[s0 * d], &pts[s0 * d] + d), c1(&pts[s1 * d], &pts[s1 * d] + d);
  std::vector<int> side(n, 0);
  std::vector<float> sum0(d), sum1(d);
  for (int iter = 0; iter < 6; ++iter) {
    // Once no point changes side, the means and every later round stay as they are.
    bool moved = iter == 0;
    for (size_t i = 0; i < n; ++i) {
      const int now = dist2(i, c1.data()) < dist2(i, c0.data());
      moved |= now != side[i];
      side[i] = now;
    }
    if (!moved) break;
    std::fill(sum0.begin(), sum0.end(), 0.f);
    std::fill(sum1.begin(), sum1.end(), 0.f);
    size_t n1 = 0;
    for (size_t i = 0; i < n; ++i) {
      float* sum = side[i] ? sum1.data() : sum0.data();
      n1 += side[i];
      for (size_t j = 0; j < d; ++j) sum[j] += pts[i * d + j];
    }
    // A side left empty keeps its mean.
    for (auto [sum, c, count] : {std::tuple{&sum0, &c0, n - n1}, std::tuple{&sum1, &c1, n1}}) {
      if (count == 0) continue;
      for (size_t j = 0; j < d; ++j) (*c)[j] = (*sum)[j] / static_cast<float>(count);
      if (spherical) normalize(c->data());
    }
  }
  left->clear();
  right->clear();
  if (balanced) {  // halves by how much nearer to c0 than to c1, the ties kept in order
    std::vector<std::pair<float, size_t>> margin(n);
    for (size_t i = 0; i < n; ++i) margin[i] = {dist2(i, c0.data()) - dist2(i, c1.data()), i};
    std::sort(margin.begin(), margin.end());
    for (size_t i = 0; i < n; ++i) (i < n / 2 ? left : right)->push_back(ids[margin[i].second]);
    return;
  }
  for (size_t i = 0; i < n; ++i) (side[i] ? right : left)->push_back(ids[i]);
  if (left->empty() || right->empty()) {  // identical points: split by position
    left->assign(ids.begin(), ids.begin() + n / 2);
    right->assign(ids.begin() + n / 2, ids.end());
  }
}

uint32_t ClusterIndex::NewCluster(std::vector<uint32_t> chunks, uint32_t unit, const Grid& grid,
                                  const ChunkStats& a) {
  const uint32_t id = static_cast<uint32_t>(clusters_.size());
  clusters_.emplace_back();
  Cluster& c = clusters_.back();
  c.chunks.assign(chunks.begin(), chunks.end());
  c.unit = unit;
  c.lane = static_cast<uint32_t>(units_[unit].clusters.size());
  units_[unit].clusters.push_back(id);
  Rebuild(c.b, ClusterLane(id, grid), c.chunks, a);
  c.built_extent = c.b.extent;
  for (uint32_t ch : c.chunks) node_of_[ch] = id;
  return id;
}

void ClusterIndex::SplitCluster(uint32_t cluster, const ChunkStats& a) {
  const auto& chunks = clusters_[cluster].chunks;
  // 2-means over the chunks' [mean | peak] themselves, not their directions: the boxes the
  // halves get are what the search reads (at 128K tokens the search's work 0.046 -> 0.042 of
  // the chunks, and 0.153 -> 0.132 at 32K).
  const size_t stride = 2 * static_cast<size_t>(d_);
  std::vector<float> points(chunks.size() * stride);
  for (size_t i = 0; i < chunks.size(); ++i) ChunkPoint(chunks[i], a, &points[i * stride]);
  std::vector<uint32_t> left, right;
  TwoMeans(
      chunks, PointDim(), [&](size_t i) { return &points[i * stride]; }, false, false, &left,
      &right);
  const uint32_t unit = clusters_[cluster].unit;
  Grid grid;
  GridOf(unit, &grid);
  clusters_[cluster].chunks.assign(left.begin(), left.end());
  Rebuild(clusters_[cluster].b, ClusterLane(cluster, grid), clusters_[cluster].chunks, a);
  clusters_[cluster].built_extent = clusters_[cluster].b.extent;
  // The new cluster takes the unit's next lane. The unit's bounds already cover every chunk.
  NewCluster(std::move(right), unit, grid, a);
  if (units_[unit].clusters.size() > 2 * opt_.unit_clusters) SplitUnit(unit, a);
}

void ClusterIndex::SplitUnit(uint32_t unit, const ChunkStats& a) {
  const std::vector<uint32_t>& cls = units_[unit].clusters;
  const size_t stride = 2 * static_cast<size_t>(d_);
  std::vector<float> points(cls.size() * stride);
  Grid grid;
  GridOf(unit, &grid);
  for (size_t i = 0; i < cls.size(); ++i) {
    float mu_m[kMaxHeadDim], peak_m[kMaxHeadDim];
    LaneMiddles(units_[unit].block, clusters_[cls[i]].lane, &grid, mu_m, peak_m);
    Point(mu_m, peak_m, &points[i * stride]);
  }
  std::vector<uint32_t> left, right;
  // Halves of equal count: a unit's box spans its clusters', and units split unevenly by
  // 2-means left many of one or two clusters, each a lane the search must bound.
  TwoMeans(
      cls, PointDim(), [&](size_t i) { return &points[i * stride]; }, true, true, &left, &right);
  // Each half's clusters' boxes from their chunks (their old codes are on the old box's scale;
  // moved across, they came out looser), the half's box their union, then the clusters' codes on
  // its scale.
  const uint32_t id = static_cast<uint32_t>(units_.size());
  units_.emplace_back();
  units_[unit].block = CodedBlock();
  for (auto [target, members] : {std::pair{unit, &left}, std::pair{id, &right}}) {
    units_[target].clusters = *members;
    for (uint32_t i = 0; i < members->size(); ++i) {
      clusters_[(*members)[i]].unit = target;
      clusters_[(*members)[i]].lane = i;
    }
    const size_t rows = BoxRows();
    std::vector<float> boxes(members->size() * rows);
    float unit_box[kBoxParts * kMaxHeadDim];
    EmptyBox(unit_box);
    Bounds& ub = units_[target].b;
    ub.max_tokens = 0;
    ub.min_tokens = std::numeric_limits<uint32_t>::max();
    for (size_t i = 0; i < members->size(); ++i) {
      Cluster& c = clusters_[(*members)[i]];
      const float* box = &boxes[i * rows];
      BoxOver(c.chunks, a, c.b, &boxes[i * rows]);
      WidenTokens(ub, c.b.max_tokens);
      WidenTokens(ub, c.b.min_tokens);
      for (size_t r = 0; r < rows; ++r) {
        unit_box[r] = IsUpper(static_cast<int>(r / d_)) ? std::max(unit_box[r], box[r])
                                                        : std::min(unit_box[r], box[r]);
      }
    }
    StoreBoxes(UnitLane(target), unit_box);
    SetScalars(UnitLane(target), ub, MeasureOf(UnitLane(target)));
    Reserve(units_[target].block, static_cast<uint32_t>(members->size()) - 1);  // one layout
    GridOf(target, &grid);
    for (size_t i = 0; i < members->size(); ++i) {
      Cluster& c = clusters_[(*members)[i]];
      const Lane l = ClusterLane((*members)[i], grid);
      StoreBoxes(l, &boxes[i * rows]);
      SetScalars(l, c.b, MeasureOf(l));
    }
  }
}

void ClusterIndex::Add(uint32_t chunk, const ChunkStats& a) {
  CHECK(chunk < a.final_chunks()) << "chunk " << chunk << "'s statistics are not final";
  if (contains(chunk)) return;
  if (node_of_.size() <= chunk) node_of_.resize(chunk + 1, kNone);
  ++num_chunks_;
  if (units_.empty()) {
    units_.emplace_back();
    Rebuild(units_[0].b, UnitLane(0), std::span<const uint32_t>(&chunk, 1), a);
    Grid grid;
    GridOf(0, &grid);
    NewCluster({chunk}, 0, grid, a);
    return;
  }
  // The unit whose box the chunk widens least, then the cluster of that unit likewise (the
  // R-tree's choice of subtree): a bound reads the boxes, so keeping them narrow is what
  // prunes. Widening is the chunk's distance outside the box, summed over the channels of its
  // mean and, with cluster_by_peak, of its peak; among boxes it does not widen, the narrowest.
  std::vector<float> point(2 * static_cast<size_t>(d_));
  ChunkPoint(chunk, a, point.data());
  float unit_growth = 0, cluster_growth = 0;
  const uint32_t best_unit = LeastWidened(units_block_, static_cast<uint32_t>(units_.size()),
                                          point.data(), nullptr, &unit_growth, last_unit_);
  last_unit_ = best_unit;
  const Unit& unit = units_[best_unit];
  thread_local Grid grid, now;  // scratch, kept between calls
  GridOf(best_unit, &grid);
  const uint32_t best_cluster =
      unit.clusters[LeastWidened(unit.block, static_cast<uint32_t>(unit.clusters.size()),
                                 point.data(), &grid, &cluster_growth)];
  Cluster& cl = clusters_[best_cluster];
  cl.chunks.push_back(chunk);
  node_of_[chunk] = best_cluster;
  // A chunk inside a node's boxes (no growth over its mean and its peak) leaves them as they
  // are: its halves rounded outwards stay inside too. The unit first: its clusters' codes move
  // to its new grid, on which the cluster then widens (a point inside the cluster's boxes stays
  // inside, re-encoding only widens them).
  const bool both = opt_.cluster_by_peak;  // growth covered the peak as well
  const bool unit_inside = both && unit_growth == 0.f;
  Widen(units_[best_unit].b, UnitLane(best_unit), point.data(), a.tokens(chunk), unit_inside);
  if (!unit_inside) {
    GridOf(best_unit, &now);
    Regrid(best_unit, grid, now);
    std::swap(grid, now);
  }
  Widen(cl.b, ClusterLane(best_cluster, grid), point.data(), a.tokens(chunk),
        both && cluster_growth == 0.f);
  const bool too_big = cl.chunks.size() > 2 * opt_.cluster_chunks;
  const bool too_wide = cl.chunks.size() >= 4 && cl.built_extent > 0 &&
                        cl.b.extent > opt_.resplit_extent * cl.built_extent;
  if (too_big || too_wide) SplitCluster(best_cluster, a);
}

std::string ClusterIndex::CheckInvariants(const ChunkStats& a) const {
  std::vector<int> seen(node_of_.size(), 0);
  std::vector<float> mu(d_), peak(d_);
  // Each node's bounds and its lane (the only copy of its boxes) cover each of its chunks:
  // boxes (unless the lane is marked unbounded), token counts; and the node's corners and
  // extent are those its lane's boxes give, as are the lane's scalars.
  // A cluster's extent may lag its codes (they only widen when its unit's grid moves), and its
  // margins are its unit's.
  Grid grid;
  auto covers = [&](const Bounds& b, const Block& blk, uint32_t lane, uint32_t ch) -> std::string {
    if (lane >= blk.cap) return "no lane";
    Mean(ch, a, mu.data());
    Peak(ch, a, peak.data());
    const float* p = peak.data();
    float boxes[kBoxParts * kMaxHeadDim];
    ReadLane(blk, lane, blk.coded ? &grid : nullptr, boxes);
    auto box = [&](int part, int j) { return boxes[static_cast<size_t>(part) * d_ + j]; };
    if (blk.scalars[ScalarIndex(blk, lane, kUnbounded)] == 0.f) {
      for (int j = 0; j < d_; ++j) {
        if (mu[j] < box(kMuLo, j) || mu[j] > box(kMuHi, j)) return "mean outside box";
        if (p[j] < box(kPeakLo, j) || p[j] > box(kPeakHi, j)) return "peak outside box";
      }
    }
    if (a.tokens(ch) > b.max_tokens) return "tokens above max";
    const LaneMeasure m = Measure(boxes);
    const bool bounded = blk.scalars[ScalarIndex(blk, lane, kUnbounded)] == 0.f;
    if (bounded && (Norm(mu.data(), d_) > m.mu_corner || Norm(p, d_) > m.peak_corner)) {
      return "a point beyond its box's corner";
    }
    if (bounded && (blk.coded ? m.extent < b.extent : m.extent != b.extent)) {
      return absl::StrFormat("extent differs from the lane's boxes (%s: %g, recorded %g)",
                             blk.coded ? "cluster" : "unit", m.extent, b.extent);
    }
    if ((!blk.coded && (blk.scalars[ScalarIndex(blk, lane, kMarginA)] != m.mu_corner ||
                        blk.scalars[ScalarIndex(blk, lane, kMarginP)] != m.peak_corner)) ||
        blk.scalars[ScalarIndex(blk, lane, kLogRest)] != b.log_rest) {
      return "lane scalars differ from the bounds and boxes";
    }
    return "";
  };
  for (uint32_t u = 0; u < units_.size(); ++u) {
    GridOf(u, &grid);
    if (!units_[u].block.coded) return absl::StrFormat("unit %d's block is not coded", u);
    for (uint32_t i = 0; i < units_[u].clusters.size(); ++i) {
      const uint32_t cl = units_[u].clusters[i];
      if (clusters_[cl].lane != i) {
        return absl::StrFormat("cluster %d's lane is %d, its place in unit %d is %d", cl,
                               clusters_[cl].lane, u, i);
      }
    }
    for (uint32_t cl : units_[u].clusters) {
      if (clusters_[cl].unit != u) return absl::StrFormat("cluster %d's unit is not %d", cl, u);
      if (clusters_[cl].chunks.empty()) return absl::StrFormat("cluster %d is empty", cl);
      for (uint32_t ch : clusters_[cl].chunks) {
        if (node_of_[ch] != cl) return absl::StrFormat("chunk %d's cluster is not %d", ch, cl);
        ++seen[ch];
        for (const std::string& why :
             {covers(clusters_[cl].b, units_[u].block, clusters_[cl].lane, ch),
              covers(units_[u].b, units_block_, u, ch)}) {
          if (!why.empty()) return absl::StrFormat("chunk %d: %s", ch, why);
        }
      }
    }
  }
  size_t n = 0;
  for (size_t ch = 0; ch < seen.size(); ++ch) {
    if (seen[ch] > 1) return absl::StrFormat("chunk %d is in %d clusters", ch, seen[ch]);
    if ((seen[ch] == 1) != (node_of_[ch] != kNone)) {
      return absl::StrFormat("chunk %d is indexed but in no cluster", ch);
    }
    n += seen[ch];
  }
  if (n != num_chunks_) return absl::StrFormat("%d chunks in clusters, %d added", n, num_chunks_);
  for (const Cluster& cl : clusters_) {
    if (cl.chunks.size() > 2 * opt_.cluster_chunks) {
      return absl::StrFormat("a cluster holds %d chunks", cl.chunks.size());
    }
  }
  for (const Unit& u : units_) {
    if (u.clusters.size() > 2 * opt_.unit_clusters) {
      return absl::StrFormat("a unit holds %d clusters", u.clusters.size());
    }
    // Units split into halves and never lose a cluster otherwise: once there are two, each
    // holds at least half of what made one split.
    if (units_.size() > 1 && u.clusters.size() < opt_.unit_clusters) {
      return absl::StrFormat("a unit holds %d clusters after a split", u.clusters.size());
    }
  }
  return "";
}

}  // namespace kvtier