// A per-stream hierarchical cluster index over aged-out chunks: fine clusters (target 6
// chunks) under coarse units (target 6 clusters), grown as an R-tree is (a chunk joins the
// unit and the cluster whose boxes it widens least) with 2-means re-splits. A Select's
// best-first search visits units and clusters in order of an upper bound on the score of
// every chunk below them and stops when no unvisited node can beat the k-th best chunk found,
// so its answer equals the linear scan's (SelectChunks) exactly while scoring a fraction of
// the chunks.
//
// Bounds. For a node with box [lo, hi] of its chunks' means, and the same for their peaks,
// q . mu_c is at most sum_j max(q_j lo_j, q_j hi_j); the LSE-peak score is increasing in
// both dot products and in the token count, so the node bound is that score at the two
// maxima and the node's largest count, plus a margin for float rounding. Boxes only grow
// between rebuilds, and are stored rounded outwards, so bounds stay conservative; tests check
// that no chunk ever scores above a node's bound. A node keeps nothing else but a few scalars
// read from its boxes: the largest norm of a point in each box (the rounding margin) and the
// diagonal of its mean box, which steers re-splits. (Nodes kept a mean center and a radius
// around it until the bytes counted: a sixth of the index at head_dim 128.)
//
// The index keeps per chunk only its node: token counts, means and peaks are the stream's
// ChunkStats, handed to each call, and only chunks whose statistics are final enter it.
//
// Not thread-safe: its stream's owner serializes access. The build (Add and the splits) is
// cluster_index.cc, the searches cluster_index_search.cc.
#ifndef KVTIER_SERVER_INDEX_CLUSTER_INDEX_H_
#define KVTIER_SERVER_INDEX_CLUSTER_INDEX_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <span>
#include <vector>

#include "absl/container/inlined_vector.h"
#include "kvtier/v1/kvtier.pb.h"
#include "server/common/vec.h"
#include "server/index/chunk_stats.h"

namespace kvtier {

class ClusterIndex {
 public:
  // The default target of chunks per fine cluster (Options::cluster_chunks).
  static constexpr uint32_t kClusterChunks = 6;
  struct Options {
    // Sizes chosen by measurement (kvtier-bench, kvtier over quest, medians of 4 interleaved
    // runs, with chunks joining by box growth and units split in halves): units of 6 clusters
    // 0.196 at 128K tokens and 0.61 at 32K, against 0.206 and 0.76 for 8 and 0.257 and 0.48
    // for 4 (the more units, the longer the scan of every unit's bound). Clusters of 6 chunks
    // (first measured with units of 8: 4% less time than 8 chunks, a fifth more clusters).
    uint32_t cluster_chunks = kClusterChunks;  // target per fine cluster (re-split past 2x)
    uint32_t unit_clusters = 6;  // target clusters per coarse unit (split in halves past 2x)
    // Group chunks by their means and peaks together (a chunk joins the unit, then the
    // cluster, whose mean and peak boxes it widens least; splits by 2-means on both), so that the
    // peak boxes the LSE-peak bound reads stay tight; false: by the mean alone, for the mean
    // ranking. Only the search's work depends on it, never its answer. At 128K tokens
    // (kvtier-bench, when chunks joined by direction) it took the LSE-peak search's work from 0.10
    // to 0.08 of the chunks, and doubled the mean ranking's.
    bool cluster_by_peak = true;
    float resplit_extent = 1.5f;  // re-split a cluster past this times its built extent
  };

  struct SearchStats {
    uint64_t chunks_scored = 0;  // chunks whose score was computed
    uint64_t bounds_scored = 0;  // unit and cluster bounds computed
    uint64_t units_opened = 0;   // units whose clusters' bounds were computed
    void Add(const SearchStats& o) {
      chunks_scored += o.chunks_scored;
      bounds_scored += o.bounds_scored;
      units_opened += o.units_opened;
    }
  };

  explicit ClusterIndex(int head_dim) : ClusterIndex(head_dim, Options{}) {}
  ClusterIndex(int head_dim, Options options);

  // Adds chunk `chunk` of `stats` (a no-op if it is indexed already). Joins the unit, then its
  // cluster, whose boxes it widens least (LeastWidened); re-splits what outgrew. REQUIRES:
  // the chunk's statistics are final (chunk < stats.final_chunks()), and every later call
  // passes the same stats, grown only by chunks beyond those indexed.
  void Add(uint32_t chunk, const ChunkStats& stats);

  // The k best indexed chunks by `ranking` for queries [group][head_dim] (score as
  // SelectChunks computes it; ties to the lower index), best first. `skip[c]` (when c <
  // skip.size()) leaves chunk c out.
  std::vector<uint32_t> Search(v1::Ranking ranking, std::span<const float> queries, int group,
                               size_t k, const ChunkStats& chunks, const std::vector<bool>& skip,
                               SearchStats* stats) const;

  // The greedy fill of SelectChunks over the indexed chunks plus `extras` (candidates the
  // index does not hold), for chunks of any sizes: best score first (ties to the lower
  // index), each taken when it still fits in `budget` tokens. Equal to SelectChunks over the
  // same candidates; it stops once nothing left can fit, and never opens a node whose
  // smallest chunk is larger than what is left of the budget.
  std::vector<uint32_t> SearchGreedy(v1::Ranking ranking, std::span<const float> queries, int group,
                                     uint64_t budget, const ChunkStats& chunks,
                                     const std::vector<bool>& skip,
                                     std::span<const ChunkCandidate> extras,
                                     SearchStats* stats) const;

  static constexpr uint32_t kNoCluster = ~0u;
  // The fine cluster holding `chunk`, kNoCluster if it is not indexed.
  uint32_t cluster_of(uint32_t chunk) const {
    return chunk < node_of_.size() ? node_of_[chunk] : kNoCluster;
  }
  bool contains(uint32_t chunk) const {
    return chunk < node_of_.size() && node_of_[chunk] != kNone;
  }
  size_t num_chunks() const { return num_chunks_; }
  size_t num_clusters() const;
  // Every byte the index holds: the object, its arrays' capacities, the clusters' chunk lists
  // that spill out of their inline room and each unit's lists and block.
  size_t MemoryBytes() const;
  size_t num_units() const;

  // How tight the unit level is for a query whose k-th best score is `threshold`: units whose
  // bound reaches it (a search opens at least these), units holding a cluster whose bound
  // reaches it (all a search would need to open, were each unit's bound the largest of its
  // clusters'), the clusters those hold, and the clusters whose bound reaches it.
  struct UnitProfile {
    uint64_t units_reaching = 0;
    uint64_t units_needed = 0;
    uint64_t clusters_in_needed = 0;
    uint64_t clusters_reaching = 0;
  };
  UnitProfile ProfileUnits(v1::Ranking ranking, std::span<const float> queries, int group,
                           float threshold) const;

  // Test hooks: bound violations for these queries (a chunk scoring above its cluster's or
  // unit's bound), and structural invariants (every chunk in exactly one cluster, every
  // cluster in one unit, radii and boxes covering their chunks). Empty string: all good.
  // The lanes the units' blocks hold, one per cluster (a block's last tile is as wide as it
  // needs).
  size_t cluster_lanes() const;
  uint64_t CountBoundViolations(v1::Ranking ranking, std::span<const float> queries, int group,
                                const ChunkStats& stats) const;
  std::string CheckInvariants(const ChunkStats& stats) const;

 private:
  static constexpr uint32_t kNone = ~0u;
  static constexpr int kMaxHeadDim = 512;  // ModelShape.head_dim is at most 512

  // The bound fields shared by clusters and units, beside the boxes and scalars in its lane of
  // a block (below). A cluster's extent is its boxes' as last built or widened (its unit's box
  // widening may widen its codes a little without updating it).
  struct Bounds {
    float extent = 0;  // the mean box's diagonal (MeasureOf), which re-splits compare
    uint32_t max_tokens = 0;
    uint32_t min_tokens = std::numeric_limits<uint32_t>::max();
    float log_rest = 0;  // log(max_tokens - 1), -inf for one token
  };

  // Blocks: what a search reads of a set of nodes (every unit; one unit's clusters), laid out
  // channel-major in tiles of kTile lanes, so that one pass over a tile bounds its nodes eight
  // per vector operation (DotColumns) and reads memory in order. A block's last tile is as wide
  // as the lanes it holds (cap % kTile of them): units hold 6 to 12 clusters, and tiles of 8 or
  // 16 lanes left a quarter of the lanes empty (2.2 of a 32-token stream's 10.4 index bytes per
  // token at head_dim 128). Vector loads read a row's lanes in groups of eight, so a narrow
  // tile's row reads into the next, and the last row up to kPad elements past the tiles: each
  // array ends in kPad zeros. What those lanes compute is never reported. Tile t of width w
  // holds box[kBoxParts * d][w]: a node's per-channel boxes of its chunks' means and peaks,
  // [mu_hi | mu_lo | peak_hi | peak_lo], as IEEE halves rounded outwards (hi up, lo down), so
  // they cover every chunk in half the bytes of floats; then scalars[kScalars][w]. The lane is
  // the only copy of a node's boxes. A box beyond the half range (|x| > 65504) marks its lane
  // unbounded: its bound is +inf.
  //
  // A unit's clusters (its block, `coded`) hold their boxes as codes, a byte per side instead of
  // a half, on a scale drawn from the unit's own box in that channel (Grid): code b stands for
  // (k0 + b) 2^e, exactly a float, with the smallest e at which 256 codes from k0 = floor(lo /
  // 2^e) reach the box's high side (and |k0| < 2^23). Lower sides round down to a code, upper
  // sides up, so the codes still cover every chunk (a step is 1/256 to 1/64 of the unit's width). A
  // unit's box widening moves the scale only when it passes k0 2^e or needs a larger e; its
  // clusters' codes are then re-encoded in those channels, exactly (a code's value, floored or
  // ceiled on the new scale). At 128K tokens of 32-token chunks the clusters' boxes as halves were
  // 6 of the index's 8.2 bytes per token at head_dim 128. A search bounds a coded block with the
  // query scaled by the steps (DotColumns over the bytes) plus q . base; its rounding margins
  // scale with the unit's corners. A unit whose box is unbounded leaves each of its
  // clusters unbounded.
  //
  // The searches bound by the box alone. The ball (q.center + |q| R) was measured beside it:
  // on SmolLM2's keys (bench/out/qkv.npz, 5 layers, clusters of 4 chunks) it was the tighter
  // of the two for 2.3% of (node, query) pairs and took 0.3% off the box's slack, and at
  // 128K synthetic tokens dropping it changed no search's work, while it cost a third of
  // the reads.
  enum BoxPart { kMuHi, kMuLo, kPeakHi, kPeakLo, kBoxParts };
  // The parts that bound from above (rounded up; widened upwards).
  static constexpr bool IsUpper(int part) { return part == kMuHi || part == kPeakHi; }
  enum Scalar { kMarginA, kMarginP, kLogRest, kUnbounded, kScalars };
  static constexpr uint32_t kTile = 16, kPad = 8;
  struct Block {
    uint32_t cap = 0;            // lanes: full tiles, then one of cap % kTile lanes
    bool coded = false;          // boxes as codes on a unit's grid (a unit's clusters)
    std::vector<uint16_t> box;   // the tiles' boxes (!coded), then kPad zeros
    std::vector<uint8_t> codes;  // the tiles' boxes (coded), then kPad zeros
    std::vector<float> scalars;  // the tiles' scalars, then kPad zeros
  };
  static Block CodedBlock() {
    Block b;
    b.coded = true;
    return b;
  }
  // A unit's boxes as the scale of its clusters' codes, per channel c of [mean | peak] (2 d; a
  // lane's hi and lo rows of a channel share its scale: part p's row j is channel p / 2 * d +
  // j): code b stands for (k0 + b) step = base + b step, exactly, step = 2^e and inv = 2^-e. An
  // unbounded unit's grid is zeros.
  struct Grid {
    bool bounded = false;
    std::vector<float> base, step, inv;  // [2 * d]
    std::vector<int32_t> k0;
    float Value(size_t c, uint8_t b) const { return static_cast<float>(k0[c] + b) * step[c]; }
    // The largest code standing for at most x (up: the smallest standing for at least x),
    // clamped to the codes (x lies in the unit's box). x / 2^e is exact, its floor or ceiling
    // an integer below 2^24 inside the box, and that less k0 too.
    uint8_t Code(size_t c, float x, bool up) const {
      return static_cast<uint8_t>(std::clamp(ScaledCode(x, inv[c], k0[c], up), 0, 255));
    }
  };
  static size_t Channel(int part, int d) { return static_cast<size_t>(part / 2) * d; }
  void GridOf(uint32_t unit, Grid* g) const;
  size_t BoxRows() const { return static_cast<size_t>(kBoxParts) * d_; }
  // The width of the tile that begins at lane t (a multiple of kTile below cap).
  static uint32_t TileWidth(const Block& blk, uint32_t t) { return std::min(kTile, blk.cap - t); }
  // Where row r of lane `lane` lies in a block's box (rows < BoxRows()) or scalars; rows of
  // its tile lie TileWidth apart.
  size_t BoxIndex(const Block& blk, uint32_t lane, size_t r) const {
    const uint32_t t = lane / kTile * kTile;
    return t * BoxRows() + r * TileWidth(blk, t) + lane % kTile;
  }
  static size_t ScalarIndex(const Block& blk, uint32_t lane, int s) {
    const uint32_t t = lane / kTile * kTile;
    return static_cast<size_t>(t) * kScalars + static_cast<size_t>(s) * TileWidth(blk, t) +
           lane % kTile;
  }
  // What a lane's boxes give, computed in double from the stored halves (which bound the
  // chunks) and inflated past the float rounding; a side beyond the half range makes them
  // infinite (the lane is unbounded then). Corners: the largest norm of a point in the mean
  // box and in the peak box, sqrt(sum_j max(lo_j^2, hi_j^2)), what a bound's rounding margins
  // scale with. Extent: the mean box's diagonal, |hi - lo|.
  struct LaneMeasure {
    float mu_corner, peak_corner, extent;
  };
  // A node's lane: its boxes and scalars, and for a cluster its unit's exact grid. Taken afresh
  // where used (units_ may grow).
  struct Lane {
    Block* blk;
    uint32_t lane;
    const Grid* grid = nullptr;
  };
  Lane ClusterLane(uint32_t cluster, const Grid& grid);
  Lane UnitLane(uint32_t unit) { return {&units_block_, unit}; }
  // Grows blk to hold `lane` (its last tile widens; the full tiles stay where they are). A
  // block of one tile (a unit's) is allocated to the lane, a larger one as vectors grow.
  void Reserve(Block& blk, uint32_t lane) const;
  // Writes a lane's boxes from floats [kBoxParts][d], rounding outwards, and marks it
  // unbounded if they leave the half range (or its grid is unbounded).
  void StoreBoxes(Lane l, const float* box) const;
  // Widens a lane's boxes over one chunk's mean key and peak, rounding outwards; `out` gets
  // the widened boxes as ReadLane gives them. WidenCodes: the same of a coded lane, returning
  // its extent (as Measure gives it).
  void WidenBoxes(Lane l, const float* mu, const float* peak, float* out) const;
  float WidenCodes(Lane l, const float* mu, const float* peak) const;
  // A coded lane's extent (the mean box's diagonal) as Measure gives it from the decoded boxes:
  // each channel's hi - lo is (b_hi - b_lo) 2^e exactly, summed squared in double in order.
  float CodedExtent(const Block& blk, uint32_t lane, const Grid& g) const;
  // What SetScalars needs of a lane: a coded one's extent alone (its margins are its unit's).
  LaneMeasure MeasureOf(Lane l) const;
  // Re-encodes the codes of every cluster of `unit` from grid `from` to its grid now `to`, in the
  // rows where they differ.
  void Regrid(uint32_t unit, const Grid& from, const Grid& to);
  // Writes the lane's scalars (the unbounded mark stays): its margins from m (its boxes'
  // measure), its log_rest from b; and b's extent.
  void SetScalars(Lane l, Bounds& b, const LaneMeasure& m) const;
  // The lane among blk's first `lanes` (at least one) whose boxes `point` ([mu | peak], 2 *
  // head_dim floats) widens least, ties to the narrowest (BoxGrowth), then to the lowest lane.
  // `growth` (when given) gets the chosen lane's growth: 0 when the point lies in its boxes.
  // grid: a coded block's (exact). The tile of lane `first` is looked at first (any lane gives
  // the same answer; the likelier the winner, the sooner the rest are passed over).
  uint32_t LeastWidened(const Block& blk, uint32_t lanes, const float* point, const Grid* grid,
                        float* growth = nullptr, uint32_t first = 0) const;

  struct Cluster {
    Bounds b;
    // Held in the struct up to twice the default cluster size and the one chunk that makes it
    // split (one read when the search opens the cluster, not two).
    absl::InlinedVector<uint32_t, 2 * kClusterChunks + 1> chunks;
    uint32_t unit = kNone;
    uint32_t lane = 0;  // its place in the unit's clusters and block
    float built_extent = 0;
  };
  struct Unit {
    Bounds b;
    std::vector<uint32_t> clusters;
    Block block = CodedBlock();  // its clusters' bounds, lane i = clusters[i]
  };

  void Mean(uint32_t chunk, const ChunkStats& a, float* out) const;
  void Peak(uint32_t chunk, const ChunkStats& a, float* out) const;
  // [mean | peak] of a chunk: 2 * head_dim floats into out.
  void ChunkPoint(uint32_t chunk, const ChunkStats& a, float* out) const;
  // Recomputes b and its lane from scratch over these chunks: boxes, tokens, scalars.
  void Rebuild(Bounds& b, Lane l, std::span<const uint32_t> chunks, const ChunkStats& a);
  // The boxes over these chunks in float ([kBoxParts][head_dim], before any rounding) and b's
  // token counts; EmptyBox: boxes no point lies in (hi -inf, lo +inf).
  void BoxOver(std::span<const uint32_t> chunks, const ChunkStats& a, Bounds& b, float* box) const;
  void EmptyBox(float* box) const;
  // Widens b and its lane to cover one more chunk of `tokens` tokens, whose [mean | peak] is
  // `point`; `inside`: the point lies in the lane's boxes already (LeastWidened's growth 0).
  void Widen(Bounds& b, Lane l, const float* point, uint32_t tokens, bool inside);
  // b's token counts over one more chunk of `tokens`.
  static void WidenTokens(Bounds& b, uint32_t tokens);
  // The measure of boxes read out of their lane: [kBoxParts][head_dim] floats.
  LaneMeasure Measure(const float* box) const;
  // A lane's boxes, [kBoxParts][head_dim] floats, out of its tile: halves widened, or codes
  // decoded on `grid` (a coded block's, exact).
  void ReadLane(const Block& blk, uint32_t lane, const Grid* grid, float* box) const;
  // The middle of a lane's mean box and of its peak box (head_dim floats each; a side beyond
  // the half range counts as +-65504).
  void LaneMiddles(const Block& blk, uint32_t lane, const Grid* grid, float* mu, float* peak) const;
  // |x| over d floats, summed in double.
  static double Norm(const float* x, int d);
  // A query group prepared for bounds: each head's |q| and q split by sign, laid out to meet
  // a node's [hi | lo] pairs in one pass.
  struct Prepared {
    std::vector<float> pos_neg;  // [group][2 * d]: max(q, 0), then min(q, 0)
    std::vector<float> norm;     // [group]
    std::vector<float> queries;  // [group][d]
    // BlockBounds' scratch, kept for the whole search: dots, and a coded block's scaled
    // queries ([kind][group][2 * d]) and q . base ([kind][group]).
    mutable std::vector<float> dots, scaled, offsets;
    mutable Grid grid;
  };
  Prepared Prepare(std::span<const float> queries, int group) const;
  // Opens unit `u` for a search: the bounds of its clusters into `bounds` (lane i =
  // u.clusters[i]), counted in `stats`.
  void OpenUnit(v1::Ranking ranking, uint32_t u, const Prepared& p, std::vector<float>* bounds,
                SearchStats* stats) const;
  // Upper bounds on the score of every chunk under each of the first `lanes` nodes of blk:
  // out[i] for lane i; of a coded block (a unit's clusters, `unit`), on the unit's grid.
  void BlockBounds(v1::Ranking ranking, const Block& blk, uint32_t lanes, const Prepared& p,
                   float* out, uint32_t unit = kNone) const;
  float ChunkScore(v1::Ranking ranking, uint32_t chunk, std::span<const float> queries, int group,
                   const ChunkStats& a) const;
  // ChunkScore of each of `chunks` into out[i], the same values, computed together. q8, when
  // given, is the QueryInt8Group of `queries` (a search makes it once for every cluster it
  // scores): compact chunks are then gathered and scored with it (ChunkStats::ScoreCompact).
  void ScoreChunks(v1::Ranking ranking, std::span<const uint32_t> chunks,
                   std::span<const float> queries, int group, const ChunkStats& a, float* out,
                   const QueryInt8Group* q8 = nullptr) const;
  // A searched cluster's chunks and their scores: those not in `skip` and of at most
  // max_tokens tokens, scored together (their exponentials and logarithms in one pass), with
  // the search's query codes q8 (QueryInt8Group of queries, made once). Its chunks' loads
  // start first, and those of `next` (the cluster the search may open next).
  using ClusterChunks = absl::InlinedVector<uint32_t, 32>;
  using ClusterScores = absl::InlinedVector<float, 32>;
  void ScoreCluster(v1::Ranking ranking, uint32_t cluster, const Cluster* next, uint64_t max_tokens,
                    const std::vector<bool>& skip, std::span<const float> queries, int group,
                    const QueryInt8Group& q8, const ChunkStats& a, ClusterChunks* chunks,
                    ClusterScores* scores) const;
  // visit(u, unit_bound, cluster_bounds) for every unit u: its bound and its clusters' (lane
  // i = clusters[i]), all computed as the searches compute them (the test and profile hooks).
  template <typename Visit>
  void ForEachUnitBounds(v1::Ranking ranking, std::span<const float> queries, int group,
                         Visit visit) const;
  // Starts the loads of a cluster's chunks' sums and peaks: the search reads them scattered,
  // and mostly from outside the cache.
  void PrefetchChunks(const Cluster& c, const ChunkStats& a) const;

  // Splits ids in two by 2-means over their points, vec(i) the `dim` floats of ids[i]'s:
  // by direction (`spherical`: the points and means as unit vectors) or as they are.
  // `balanced`: into halves of equal count (the odd one to the right), by how much nearer
  // each point is to one mean than to the other.
  template <typename VecFn>
  void TwoMeans(std::span<const uint32_t> ids, int dim, VecFn vec, bool spherical, bool balanced,
                std::vector<uint32_t>* left, std::vector<uint32_t>* right) const;
  // The floats a chunk or a node is split by: PointDim() of them, [mean | peak] with
  // cluster_by_peak, else the mean alone. Point writes a unit's: the directions of the middles
  // of its clusters' two boxes side by side (Pair), or the mean box's middle.
  int PointDim() const { return opt_.cluster_by_peak ? 2 * d_ : d_; }
  void Point(const float* mu, const float* peak, float* out) const {
    if (opt_.cluster_by_peak) {
      Pair(mu, peak, out);
    } else {
      std::copy_n(mu, d_, out);
    }
  }
  // [x / |x| | y / |y|] (zeros for a zero vector): 2 * head_dim floats.
  void Pair(const float* x, const float* y, float* out) const {
    const float nx = std::sqrt(Dot(x, x, d_)), ny = std::sqrt(Dot(y, y, d_));
    for (int j = 0; j < d_; ++j) {
      out[j] = nx > 0 ? x[j] / nx : 0.f;
      out[d_ + j] = ny > 0 ? y[j] / ny : 0.f;
    }
  }
  void SplitCluster(uint32_t cluster, const ChunkStats& a);
  void SplitUnit(uint32_t unit, const ChunkStats& a);
  // A cluster over these chunks, appended to the unit's clusters (and lanes); grid: the unit's.
  uint32_t NewCluster(std::vector<uint32_t> chunks, uint32_t unit, const Grid& grid,
                      const ChunkStats& a);

  int d_;
  Options opt_;
  std::vector<Cluster> clusters_;
  std::vector<Unit> units_;
  Block units_block_;              // every unit's bounds, lane u = units_[u]
  std::vector<uint32_t> node_of_;  // chunk -> cluster, kNone if not indexed
  size_t num_chunks_ = 0;
  uint32_t last_unit_ = 0;  // the unit the last Add chose: the next chunk's likely one
};

}  // namespace kvtier

#endif  // KVTIER_SERVER_INDEX_CLUSTER_INDEX_H_
