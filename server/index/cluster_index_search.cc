#include <algorithm>
#include <cmath>
#include <limits>
#include <queue>
#include <string>
#include <type_traits>

#include "absl/container/inlined_vector.h"
#include "absl/strings/str_format.h"
#include "server/common/check.h"
#include "server/common/fp16.h"
#include "server/common/vec.h"
#include "server/index/chunk_ranker.h"
#include "server/index/cluster_index.h"

namespace kvtier {
ClusterIndex::Prepared ClusterIndex::Prepare(std::span<const float> queries, int group) const {
  Prepared p;
  // The bounds are of the query the chunks' compact statistics are scored against (DotInt8):
  // the query on the 8-bit grid (RankStream passes it so already; rounding again keeps it).
  p.queries.assign(queries.begin(), queries.begin() + static_cast<size_t>(group) * d_);
  for (int h = 0; h < group; ++h) RoundQueryToInt8(&p.queries[static_cast<size_t>(h) * d_], d_);
  p.pos_neg.resize(static_cast<size_t>(group) * 2 * d_);
  for (int h = 0; h < group; ++h) {
    const float* q = &p.queries[static_cast<size_t>(h) * d_];
    float* pn = &p.pos_neg[static_cast<size_t>(h) * 2 * d_];
    for (int j = 0; j < d_; ++j) {
      pn[j] = std::max(q[j], 0.f);
      pn[d_ + j] = std::min(q[j], 0.f);
    }
    p.norm.push_back(static_cast<float>(Norm(q, d_)));
  }
  return p;
}

void ClusterIndex::PrefetchChunks(const Cluster& c, const ChunkStats& a) const {
  for (uint32_t ch : c.chunks) {
    PrefetchBytes(a.mean_data(ch), a.vector_bytes(ch));
    PrefetchBytes(a.peak_data(ch), a.vector_bytes(ch));
  }
}

void ClusterIndex::BlockBounds(v1::Ranking ranking, const Block& blk, uint32_t lanes,
                               const Prepared& p, float* out, uint32_t unit) const {
  // Per head, q.x over the node's box is at most sum_j max(q_j lo_j, q_j hi_j) = max(q,0).hi
  // + min(q,0).lo: the [pos | neg] query meets the node's [hi | lo] rows. The margin covers
  // float rounding of this and of the chunk's own score (each under 1e-5 of its magnitude,
  // the 1e-6 of ExpInPlace included).
  //
  // Codes (a unit's clusters): side x = base + b step, so max(q,0).hi + min(q,0).lo is q.base
  // + (max(q,0) step).b_hi + (min(q,0) step).b_lo, the query scaled row by row against the
  // bytes. Its terms are at most |q| (|x| + 2 |base|) in all; a channel's base and every value
  // in reach are within a step of its unit's box, and a step is at most the larger of the box's
  // sides, so |x| and |base| are at most twice the unit box's corner: the margin scales with six
  // times that corner.
  const float inv_sqrt_d = 1.f / std::sqrt(static_cast<float>(d_));
  const int group = static_cast<int>(p.norm.size());
  const bool lse = ranking == v1::RANKING_LSE_PEAK;
  constexpr float kInf = std::numeric_limits<float>::infinity();
  const size_t d = d_, row2 = 2 * d;  // a [pos | neg] query; a kind's [hi | lo] rows
  float coded_margin[2] = {0, 0};     // a coded block's, for the mean and the peak
  if (blk.coded) {
    Grid& g = p.grid;
    GridOf(unit, &g);
    if (!g.bounded) {
      std::fill_n(out, lanes, kInf);
      return;
    }
    p.scaled.resize(2 * group * row2);
    p.offsets.resize(2 * group);
    for (int kind = 0; kind < (lse ? 2 : 1); ++kind) {
      const float* step = &g.step[kind * d];  // the mean's channels, then the peak's
      for (int h = 0; h < group; ++h) {       // [pos | neg] meets the [hi | lo] rows
        const float* pn = &p.pos_neg[h * row2];
        float* sq = &p.scaled[(kind * group + h) * row2];
        MultiplyInto(pn, step, d, sq);
        MultiplyInto(pn + d, step, d, sq + d);
        p.offsets[kind * group + h] = Dot(&p.queries[h * d], &g.base[kind * d], d_);
      }
      coded_margin[kind] =
          6 *
          units_block_.scalars[ScalarIndex(units_block_, unit, kind == 0 ? kMarginA : kMarginP)];
    }
  }
  // Tile by tile: [kind][group][kTile], the box bound of q.mu, then of q.peak, one pass over
  // the tile's rows serving every head; then the bounds in fixed loops of the tile's W lanes
  // (those without a node are bounded too, never reported), which the compiler vectorizes, the
  // exponentials eight at a time through ExpInPlace.
  std::vector<float>& dots = p.dots;
  dots.resize(2 * static_cast<size_t>(group) * kTile, 0.f);
  auto at = [&](int kind, int h) { return &dots[(static_cast<size_t>(kind) * group + h) * kTile]; };
  // W: the lanes the loops run over (8 or 16, at least the tile's width w).
  // The dots of a tile's lanes with the query (kind 0: the mean rows, 1: the peak's).
  auto tile_dots = [&]<typename T>(const T* tile, uint32_t t, uint32_t w, int computed) {
    if (t + w < lanes) {  // the next tile, of the width it has
      PrefetchBytes(tile + BoxRows() * w, BoxRows() * TileWidth(blk, t + w) * sizeof(T));
    }
    for (int kind = 0; kind < (lse ? 2 : 1); ++kind) {
      const T* rows = tile + kind * row2 * w;
      if constexpr (std::is_same_v<T, uint8_t>) {
        DotColumns(&p.scaled[kind * group * row2], group, static_cast<int>(row2), rows,
                   static_cast<int>(row2), w, computed, at(kind, 0), kTile);
        for (int h = 0; h < group; ++h) {
          float* a = at(kind, h);
          const float offset = p.offsets[kind * group + h];
          for (int i = 0; i < computed; ++i) a[i] += offset;
        }
      } else {
        DotColumns(p.pos_neg.data(), group, static_cast<int>(row2), rows, static_cast<int>(row2), w,
                   computed, at(kind, 0), kTile);
      }
    }
  };
  float coded_margins[2][kTile];
  std::fill_n(coded_margins[0], kTile, coded_margin[0]);
  std::fill_n(coded_margins[1], kTile, coded_margin[1]);
  auto bound_tile = [&]<uint32_t W>(uint32_t t, uint32_t w) {
    // Only the groups of eight lanes that hold nodes are computed; the others keep what they
    // held (bounded, never reported).
    const uint32_t in_tile = std::min(w, lanes - t);
    const int computed = static_cast<int>((in_tile + 7) / 8 * 8);
    if (blk.coded) {
      tile_dots(&blk.codes[BoxIndex(blk, t, 0)], t, w, computed);
    } else {
      tile_dots(&blk.box[BoxIndex(blk, t, 0)], t, w, computed);
    }
    const float* sc = &blk.scalars[ScalarIndex(blk, t, 0)];  // scalar s of lane i: sc[s * w + i]
    const float* margin_a = blk.coded ? coded_margins[0] : sc + kMarginA * w;
    const float* margin_p = blk.coded ? coded_margins[1] : sc + kMarginP * w;
    const float* log_rest = sc + kLogRest * w;
    float best[W];
    std::fill_n(best, W, -kInf);
    for (int h = 0; h < group; ++h) {
      const float* a = at(0, h);
      const float qn = p.norm[h];
      if (!lse) {
        for (uint32_t i = 0; i < W; ++i) {
          best[i] = std::max(best[i], a[i] + 1e-4f * (1 + qn * margin_a[i]));
        }
        continue;
      }
      // hi = max(x, y), t = min(x, y) - hi <= 0, and the bound hi + SoftplusUpperBound(t,
      // e^t) plus the rounding margin. t is clamped at -87: the bound then covers
      // log(1 + e^t) for any smaller t too.
      const float* pk = at(1, h);
      float hi[W], tt[W], e[W];
      for (uint32_t i = 0; i < W; ++i) {
        const float x = (a[i] + 1e-4f * (1 + qn * margin_a[i])) * inv_sqrt_d + log_rest[i];
        const float y = (pk[i] + 1e-4f * (1 + qn * margin_p[i])) * inv_sqrt_d;
        hi[i] = std::max(x, y);
        tt[i] = std::max(std::min(x, y) - hi[i], -87.f);
        e[i] = tt[i];
      }
      ExpInPlace(e, W);
      for (uint32_t i = 0; i < W; ++i) {
        const float bound = hi[i] + SoftplusUpperBound(tt[i], e[i]) + 1e-5f * (1 + std::abs(hi[i]));
        best[i] = std::max(best[i], bound);
      }
    }
    const float* unbounded = sc + kUnbounded * w;
    for (uint32_t i = 0; i < in_tile; ++i) out[t + i] = unbounded[i] != 0.f ? kInf : best[i];
  };
  for (uint32_t t = 0; t < lanes; t += kTile) {
    const uint32_t w = TileWidth(blk, t);
    if (w > 8) {
      bound_tile.template operator()<kTile>(t, w);
    } else {
      bound_tile.template operator()<8>(t, w);
    }
  }
}

void ClusterIndex::OpenUnit(v1::Ranking ranking, uint32_t unit, const Prepared& p,
                            std::vector<float>* bounds, SearchStats* stats) const {
  const Unit& u = units_[unit];
  bounds->resize(u.clusters.size());
  BlockBounds(ranking, u.block, static_cast<uint32_t>(u.clusters.size()), p, bounds->data(), unit);
  stats->bounds_scored += u.clusters.size();
  ++stats->units_opened;
}

float ClusterIndex::ChunkScore(v1::Ranking ranking, uint32_t chunk, std::span<const float> queries,
                               int group, const ChunkStats& a) const {
  float score;
  ScoreChunks(ranking, std::span<const uint32_t>(&chunk, 1), queries, group, a, &score);
  return score;
}

void ClusterIndex::ScoreChunks(v1::Ranking ranking, std::span<const uint32_t> chunks,
                               std::span<const float> queries, int group, const ChunkStats& a,
                               float* out, const QueryInt8Group* q8) const {
  // An indexed chunk is final, so compact: its codes, gathered, go through the vector kernel
  // with the search's query codes (ScoreCompact), the same bits as ScoreCandidates, which
  // scores a cluster's scattered chunks one by one, and the query's codes again each time.
  if (q8 != nullptr &&
      std::all_of(chunks.begin(), chunks.end(), [&](uint32_t ch) { return a.compact(ch); })) {
    a.ScoreCompact(ranking, *q8, chunks, out);
    return;
  }
  absl::InlinedVector<ChunkCandidate, 32> cands;
  for (uint32_t ch : chunks) {
    cands.push_back(a.candidate(ch));
  }
  ScoreCandidates(ranking, queries, group, d_, cands, out);
}

void ClusterIndex::ScoreCluster(v1::Ranking ranking, uint32_t cluster, const Cluster* next,
                                uint64_t max_tokens, const std::vector<bool>& skip,
                                std::span<const float> queries, int group, const QueryInt8Group& q8,
                                const ChunkStats& a, ClusterChunks* chunks,
                                ClusterScores* scores) const {
  // This cluster's chunks' loads all start at once, and the next cluster's too. (Started for
  // every cluster as its unit was opened, they were mostly wasted: kvtier-bench at 128K,
  // kvtier over quest 0.332 against 0.360, medians of 5 runs.)
  PrefetchChunks(clusters_[cluster], a);
  if (next) PrefetchChunks(*next, a);
  for (uint32_t ch : clusters_[cluster].chunks) {
    if ((ch >= skip.size() || !skip[ch]) && a.tokens(ch) <= max_tokens) chunks->push_back(ch);
  }
  scores->resize(chunks->size());
  ScoreChunks(ranking, *chunks, queries, group, a, scores->data(), &q8);
}

std::vector<uint32_t> ClusterIndex::Search(v1::Ranking ranking, std::span<const float> queries,
                                           int group, size_t k, const ChunkStats& a,
                                           const std::vector<bool>& skip,
                                           SearchStats* stats) const {
  struct Scored {
    float score;
    uint32_t chunk;
  };
  // `worse(x, y)`: x ranks below y (lower score, or equal score and higher index).
  auto worse = [](const Scored& x, const Scored& y) {
    return x.score != y.score ? x.score < y.score : x.chunk > y.chunk;
  };
  // The k best so far, the worst on top.
  auto best_first = [&](const Scored& x, const Scored& y) { return worse(y, x); };
  std::priority_queue<Scored, std::vector<Scored>, decltype(best_first)> kept(best_first);
  struct Node {
    float bound;
    bool is_unit;
    uint32_t id;
    bool operator<(const Node& o) const { return bound < o.bound; }
  };
  SearchStats local;
  if (k == 0) return {};
  const Prepared prep = Prepare(queries, group);
  const QueryInt8Group q8(queries.data(), group, d_);  // for every cluster's chunks
  std::vector<float> bounds(units_.size());
  BlockBounds(ranking, units_block_, static_cast<uint32_t>(units_.size()), prep, bounds.data());
  std::vector<Node> units;  // heaped at once rather than pushed one by one
  units.reserve(units_.size() + 64);
  for (uint32_t u = 0; u < units_.size(); ++u) units.push_back({bounds[u], true, u});
  std::priority_queue<Node> open(std::less<Node>(), std::move(units));
  local.bounds_scored += units_.size();
  while (!open.empty()) {
    const Node n = open.top();
    // A chunk tying the k-th score with a lower index would still win: stop only below it.
    if (kept.size() == k && n.bound < kept.top().score) break;
    open.pop();
    if (n.is_unit) {
      const Unit& u = units_[n.id];
      const float threshold =
          kept.size() == k ? kept.top().score : -std::numeric_limits<float>::infinity();
      OpenUnit(ranking, n.id, prep, &bounds, &local);
      for (size_t i = 0; i < u.clusters.size(); ++i) {
        if (bounds[i] < threshold) continue;  // it cannot win
        open.push({bounds[i], false, u.clusters[i]});
      }
      continue;
    }
    const Node* next = open.empty() || open.top().is_unit ? nullptr : &open.top();
    ClusterChunks chunks;
    ClusterScores scores;
    ScoreCluster(ranking, n.id, next ? &clusters_[next->id] : nullptr,
                 std::numeric_limits<uint32_t>::max(), skip, queries, group, q8, a, &chunks,
                 &scores);
    local.chunks_scored += chunks.size();
    for (size_t i = 0; i < chunks.size(); ++i) {
      const Scored s{scores[i], chunks[i]};
      if (kept.size() < k) {
        kept.push(s);
      } else if (worse(kept.top(), s)) {
        kept.pop();
        kept.push(s);
      }
    }
  }
  std::vector<Scored> all;
  while (!kept.empty()) {
    all.push_back(kept.top());
    kept.pop();
  }
  std::reverse(all.begin(), all.end());
  std::vector<uint32_t> out;
  for (const Scored& s : all) out.push_back(s.chunk);
  if (stats) stats->Add(local);
  return out;
}

std::vector<uint32_t> ClusterIndex::SearchGreedy(v1::Ranking ranking,
                                                 std::span<const float> queries, int group,
                                                 uint64_t budget, const ChunkStats& a,
                                                 const std::vector<bool>& skip,
                                                 std::span<const ChunkCandidate> extras,
                                                 SearchStats* stats) const {
  enum Kind : uint8_t { kUnit, kCluster, kChunk };
  struct Item {
    float value;  // a node's bound, a chunk's score
    Kind kind;
    uint32_t id;      // unit, cluster or chunk index
    uint32_t tokens;  // a chunk's
  };
  // Highest value first; at equal values a node before a chunk (it may hold an equal chunk
  // with a lower index), and chunks by index: the order SelectChunks takes them in.
  auto below = [](const Item& x, const Item& y) {
    if (x.value != y.value) return x.value < y.value;
    if ((x.kind == kChunk) != (y.kind == kChunk)) return x.kind == kChunk;
    return x.id > y.id;
  };
  std::priority_queue<Item, std::vector<Item>, decltype(below)> open(below);
  SearchStats local;
  const Prepared prep = Prepare(queries, group);
  const QueryInt8Group q8(queries.data(), group, d_);  // for every cluster's chunks
  uint32_t smallest = std::numeric_limits<uint32_t>::max();
  std::vector<float> extra_scores(extras.size());
  ScoreCandidates(ranking, queries, group, d_, extras, extra_scores.data());
  for (size_t i = 0; i < extras.size(); ++i) {
    open.push({extra_scores[i], kChunk, extras[i].index, extras[i].tokens});
    smallest = std::min(smallest, extras[i].tokens);
  }
  local.chunks_scored += extras.size();
  std::vector<float> bounds(units_.size());
  BlockBounds(ranking, units_block_, static_cast<uint32_t>(units_.size()), prep, bounds.data());
  local.bounds_scored += units_.size();
  for (uint32_t u = 0; u < units_.size(); ++u) {
    if (units_[u].b.min_tokens > budget) continue;
    open.push({bounds[u], kUnit, u, 0});
    smallest = std::min(smallest, units_[u].b.min_tokens);
  }
  std::vector<uint32_t> out;
  uint64_t left = budget;
  while (!open.empty() && left >= smallest) {
    const Item it = open.top();
    open.pop();
    switch (it.kind) {
      case kChunk:
        if (it.tokens <= left) {
          out.push_back(it.id);
          left -= it.tokens;
        }
        break;
      case kUnit: {
        const Unit& u = units_[it.id];
        OpenUnit(ranking, it.id, prep, &bounds, &local);
        for (size_t i = 0; i < u.clusters.size(); ++i) {
          const uint32_t cl = u.clusters[i];
          if (clusters_[cl].b.min_tokens > left) continue;  // nothing in it fits any more
          open.push({bounds[i], kCluster, cl, 0});
        }
        break;
      }
      case kCluster: {
        const Item* next = open.empty() || open.top().kind != kCluster ? nullptr : &open.top();
        ClusterChunks chunks;
        ClusterScores scores;
        ScoreCluster(ranking, it.id, next ? &clusters_[next->id] : nullptr, left, skip, queries,
                     group, q8, a, &chunks, &scores);
        local.chunks_scored += chunks.size();
        for (size_t i = 0; i < chunks.size(); ++i) {
          open.push({scores[i], kChunk, chunks[i], a.tokens(chunks[i])});
        }
        break;
      }
    }
  }
  if (stats) stats->Add(local);
  return out;
}

template <typename Visit>
void ClusterIndex::ForEachUnitBounds(v1::Ranking ranking, std::span<const float> queries, int group,
                                     Visit visit) const {
  const Prepared prep = Prepare(queries, group);
  std::vector<float> unit_bounds(units_.size()), cluster_bounds;
  BlockBounds(ranking, units_block_, static_cast<uint32_t>(units_.size()), prep,
              unit_bounds.data());
  for (uint32_t u = 0; u < units_.size(); ++u) {
    const std::vector<uint32_t>& cls = units_[u].clusters;
    cluster_bounds.resize(cls.size());
    BlockBounds(ranking, units_[u].block, static_cast<uint32_t>(cls.size()), prep,
                cluster_bounds.data(), u);
    visit(u, unit_bounds[u], std::span<const float>(cluster_bounds));
  }
}

ClusterIndex::UnitProfile ClusterIndex::ProfileUnits(v1::Ranking ranking,
                                                     std::span<const float> queries, int group,
                                                     float threshold) const {
  UnitProfile out;
  ForEachUnitBounds(
      ranking, queries, group, [&](uint32_t, float unit_bound, std::span<const float> bounds) {
        const auto reaching = static_cast<uint64_t>(
            std::count_if(bounds.begin(), bounds.end(), [&](float b) { return b >= threshold; }));
        out.units_reaching += unit_bound >= threshold;
        out.units_needed += reaching > 0;
        out.clusters_in_needed += reaching > 0 ? bounds.size() : 0;
        out.clusters_reaching += reaching;
      });
  return out;
}

uint64_t ClusterIndex::CountBoundViolations(v1::Ranking ranking, std::span<const float> queries,
                                            int group, const ChunkStats& a) const {
  uint64_t violations = 0;
  ForEachUnitBounds(ranking, queries, group,
                    [&](uint32_t u, float unit_bound, std::span<const float> bounds) {
                      const std::vector<uint32_t>& cls = units_[u].clusters;
                      for (size_t i = 0; i < cls.size(); ++i) {
                        for (uint32_t ch : clusters_[cls[i]].chunks) {
                          const float s = ChunkScore(ranking, ch, queries, group, a);
                          violations += (s > bounds[i]) + (s > unit_bound);
                        }
                      }
                    });
  return violations;
}

}  // namespace kvtier
