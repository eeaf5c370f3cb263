// kvtier-bench select: one stream's selection, every policy on the same keys and queries in
// the same run: the time of one Select's ranking work per KV head and the attention mass the
// policy keeps.
//
//   build/bin/kvtier-bench select --tokens 4096,32768,131072 --budget 256 --json
//
// --chunk_tokens (16) and --cluster_chunks (the index's default) set the stream's chunks and
// its indexes' fine clusters; the Quest baseline's pages are the contiguous chunks.
//
// One JSON line per (tokens, policy) with policy, tokens, budget, us_per_select (median over
// the queries), oracle_ratio (mean and 10th percentile of kept mass over the exact top-budget
// tokens' mass, softmax averaged over the GQA group), chunk_oracle_ratio (over the best
// budget/16 whole chunks' mass), chunks_scored_fraction (chunks, or pages, whose bound or
// keys were scored, over all chunks), and EVAL.md's figure fields (name, value, unit,
// baseline = the exact scan's time, ratio). Then per policy the growth exponent of
// us_per_select over the token counts (a log-log fit; below 1 is sub-linear).
//
// Policies: exact (score every key, keep the best tokens), quest (pages of the contiguous chunks,
// by the min/max box bound), window (sinks + most recent), kvtier-scan (the LSE-peak score over
// every chunk), kvtier (the same score through the cluster index: the same answer, pruned),
// kvtier-mean (the index with the mean score, clustered by means as the daemon does for that
// ranking), and the other chunking modes with the
// LSE-peak score as the daemon runs them: kvtier-boundary (chunks cut after delimiter
// tokens, 8 to 32 tokens: sizes vary, so the index runs the greedy fill) and
// kvtier-semantic (spans of 8 aged-out chunks regrouped by balanced k-means, then indexed).
// chunk_oracle_ratio is over the best whole chunks of the policy's own chunking.
//
// The baselines get the index's own kernel: exact reads the keys as fp16 (as the daemon
// stores them) and quest the pages' [hi | lo] as outward-rounded halves, both in channel-major
// tiles through DotColumns, every query head in one pass. Their inputs are laid out before
// the timing, as an index is built before it is searched.
//
// Keys are synthetic and shaped like a model's: text comes in sentences of 4 to 30 tokens,
// each ending in a delimiter token; a sentence may move to another of 48 topic directions
// (neighbours share topics); every 16th channel is an outlier channel, and now and then one
// key points hard at its topic (a delimiter, a name). Queries point at one or two topics.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "bench/bench_util.h"
#include "server/common/fp16.h"
#include "server/common/vec.h"
#include "server/index/chunk_ranker.h"
#include "server/index/chunk_stats.h"
#include "server/index/chunking.h"
#include "server/index/cluster_index.h"

namespace kvtier {
namespace {

constexpr int kD = 64, kGroup = 3, kSinks = 16, kWindow = 64, kTopics = 48;
// --chunk_tokens and --cluster_chunks: the stream's chunks and its indexes' fine clusters.
int chunk_tokens = 16;
uint32_t cluster_chunks = ClusterIndex::kClusterChunks;

struct Stream {
  int n = 0;
  std::vector<float> keys;      // [n][kD]
  std::vector<bool> delimiter;  // [n]: the token ends a sentence
};

Stream MakeStream(int n, const std::vector<float>& topics, std::mt19937& rng) {
  Stream s;
  s.n = n;
  s.keys.resize(size_t(n) * kD);
  s.delimiter.assign(n, false);
  std::normal_distribution<float> g(0, 1);
  std::uniform_real_distribution<float> u(0, 1);
  int topic = 0;
  for (int t = 0; t < n;) {
    if (u(rng) < 0.3f) topic = std::uniform_int_distribution<int>(0, kTopics - 1)(rng);
    const int end = std::min(n, t + std::uniform_int_distribution<int>(4, 30)(rng));
    for (; t < end; ++t) {
      const float pull = u(rng) < 0.02f ? 3.f : 0.6f;  // the odd key that points hard
      for (int j = 0; j < kD; ++j) {
        const float x = pull * topics[topic * kD + j] + g(rng);
        s.keys[size_t(t) * kD + j] = x * (j % 16 == 0 ? 6.f : 1.f);
      }
    }
    s.delimiter[end - 1] = true;
  }
  return s;
}

// One chunking of a stream: each chunk's rows (positions, ascending) and the statistics the
// rankings read.
struct Layout {
  std::vector<std::vector<int>> rows;
  ChunkStats stats{kD};         // sums and peaks, final (as an index reads them)
  std::vector<float> lo, hi;    // [chunks][kD] per-channel box (Quest pages)
  std::vector<bool> mandatory;  // a row among the sinks or in the window
  int mandatory_tokens = 0;
  size_t chunks() const { return rows.size(); }
};

Layout Finish(const Stream& s, std::vector<std::vector<int>> rows) {
  Layout l;
  l.rows = std::move(rows);
  const size_t nc = l.rows.size();
  l.lo.assign(nc * kD, 1e30f);
  l.hi.assign(nc * kD, -1e30f);
  l.mandatory.assign(nc, false);
  std::vector<float> chunk_keys;
  for (size_t c = 0; c < nc; ++c) {
    const std::vector<int>& r = l.rows[c];
    chunk_keys.clear();
    float sum[kD] = {};
    for (int t : r) {
      for (int j = 0; j < kD; ++j) {
        const float x = s.keys[size_t(t) * kD + j];
        chunk_keys.push_back(x);
        sum[j] += x;
        l.lo[c * kD + j] = std::min(l.lo[c * kD + j], x);
        l.hi[c * kD + j] = std::max(l.hi[c * kD + j], x);
      }
    }
    float mean[kD];
    for (int j = 0; j < kD; ++j) mean[j] = sum[j] / float(r.size());
    const float* peak = FarthestRow(chunk_keys.data(), uint32_t(r.size()), kD, mean);
    l.stats.Append(uint32_t(r.size()), sum, peak);
    l.mandatory[c] = r.front() < kSinks || r.back() >= s.n - kWindow;
    if (l.mandatory[c]) l.mandatory_tokens += int(r.size());
  }
  l.stats.MarkFinal(uint32_t(nc));
  return l;
}

// Vectors [n][rows] as IEEE halves in channel-major tiles of kTile: tile t holds
// [rows][kTile], the layout DotColumns reads (as the cluster index lays out its bounds).
constexpr int kTile = 16;
struct Tiles {
  int rows = 0;
  std::vector<uint16_t> data;
  const uint16_t* At(int first) const { return &data[size_t(first / kTile) * rows * kTile]; }
};

// round(x, row) gives the half for row `row` of a vector.
template <typename Round>
Tiles MakeTiles(const float* v, int n, int rows, Round round) {
  Tiles t;
  t.rows = rows;
  t.data.assign(size_t((n + kTile - 1) / kTile) * rows * kTile, 0);
  for (int i = 0; i < n; ++i) {
    for (int r = 0; r < rows; ++r) {
      t.data[(size_t(i / kTile) * rows + r) * kTile + i % kTile] =
          round(v[size_t(i) * rows + r], r);
    }
  }
  return t;
}

std::vector<std::vector<int>> ContiguousRows(int n) {
  std::vector<std::vector<int>> rows;
  for (int t = 0; t < n; ++t) {
    if (t % chunk_tokens == 0) rows.emplace_back();
    rows.back().push_back(t);
  }
  return rows;
}

Layout Boundary(const Stream& s) {
  std::vector<std::vector<int>> rows;
  bool open = false;
  for (int t = 0; t < s.n; ++t) {
    if (!open) rows.emplace_back(), open = true;
    rows.back().push_back(t);
    if (EndsChunk(uint32_t(rows.back().size()), chunk_tokens, true, s.delimiter[t])) open = false;
  }
  return Finish(s, std::move(rows));
}

// Spans of 8 contiguous chunks between the sinks and the window, regrouped as the daemon does.
Layout Semantic(const Stream& s) {
  std::vector<std::vector<int>> rows = ContiguousRows(s.n);
  const int first = (kSinks + chunk_tokens - 1) / chunk_tokens;
  const int aged = (s.n - kWindow) / chunk_tokens;
  std::vector<float> span_keys(size_t(8) * chunk_tokens * kD);
  for (int c = first; c + 8 <= aged; c += 8) {
    const int base = rows[c].front();
    std::copy_n(&s.keys[size_t(base) * kD], span_keys.size(), span_keys.begin());
    const auto groups = BalancedGroups(span_keys.data(), 8 * chunk_tokens, kD, chunk_tokens);
    for (int g = 0; g < 8; ++g) {
      rows[c + g].clear();
      for (uint32_t r : groups[g]) rows[c + g].push_back(base + int(r));
    }
  }
  return Finish(s, std::move(rows));
}

std::vector<float> MakeQuery(const std::vector<float>& topics, std::mt19937& rng) {
  std::normal_distribution<float> g(0, 1);
  const int a = std::uniform_int_distribution<int>(0, kTopics - 1)(rng);
  const int b = std::uniform_int_distribution<int>(0, kTopics - 1)(rng);
  std::vector<float> q(kGroup * kD);
  for (int h = 0; h < kGroup; ++h) {
    for (int j = 0; j < kD; ++j) {
      const float dir = (h == 2 ? topics[b * kD + j] : topics[a * kD + j]);
      q[h * kD + j] = (1.2f * dir + 0.3f * g(rng)) / (j % 16 == 0 ? 6.f : 1.f);
    }
  }
  return q;
}

struct Truth {
  std::vector<double> p;  // group-mean softmax over every key
  double oracle = 0;      // mass of the best `budget` tokens
};

Truth Exact(const Stream& s, const std::vector<float>& q, int budget) {
  Truth t;
  t.p.assign(s.n, 0.0);
  std::vector<double> logit(s.n);
  for (int h = 0; h < kGroup; ++h) {
    double mx = -1e300;
    for (int i = 0; i < s.n; ++i) {
      double x = 0;
      for (int j = 0; j < kD; ++j) x += double(q[h * kD + j]) * s.keys[size_t(i) * kD + j];
      logit[i] = x / std::sqrt(double(kD));
      mx = std::max(mx, logit[i]);
    }
    double z = 0;
    for (int i = 0; i < s.n; ++i) z += std::exp(logit[i] - mx);
    for (int i = 0; i < s.n; ++i) t.p[i] += std::exp(logit[i] - mx) / z / kGroup;
  }
  std::vector<double> sorted = t.p;
  std::nth_element(sorted.begin(), sorted.begin() + budget, sorted.end(), std::greater<>());
  for (int i = 0; i < budget; ++i) t.oracle += sorted[i];
  return t;
}

// The mass of the best whole chunks of a layout within the budget (greedy by mass; exact
// for chunks of one size).
double ChunkOracle(const Truth& t, const Layout& l, int budget) {
  std::vector<std::pair<double, size_t>> mass;
  for (size_t c = 0; c < l.chunks(); ++c) {
    double m = 0;
    for (int r : l.rows[c]) m += t.p[r];
    mass.push_back({m, c});
  }
  std::sort(mass.begin(), mass.end(), std::greater<>());
  double kept = 0;
  int used = 0;
  for (auto [m, c] : mass) {
    if (used + int(l.rows[c].size()) > budget) continue;
    used += int(l.rows[c].size());
    kept += m;
  }
  return kept;
}

struct Result {
  std::vector<double> us, ratio, chunk_ratio;
  double scored = 0, total = 0;
};

double Mean(const std::vector<double>& v) {
  double s = 0;
  for (double x : v) s += x;
  return v.empty() ? 0 : s / v.size();
}

// Mass of a chunk set plus the mandatory chunks.
double ChunkMass(const Truth& t, const Layout& l, const std::vector<uint32_t>& chosen) {
  std::vector<bool> take = l.mandatory;
  for (uint32_t c : chosen) take[c] = true;
  double r = 0;
  for (size_t c = 0; c < l.chunks(); ++c) {
    if (!take[c]) continue;
    for (int row : l.rows[c]) r += t.p[row];
  }
  return r;
}

// A layout's candidates (not mandatory) and, when `index` is given, its cluster index.
std::vector<ChunkCandidate> Candidates(const Layout& l, ClusterIndex* index) {
  std::vector<ChunkCandidate> cands;
  for (size_t c = 0; c < l.chunks(); ++c) {
    if (l.mandatory[c]) continue;
    if (index) index->Add(uint32_t(c), l.stats);
    cands.push_back(l.stats.candidate(uint32_t(c)));
  }
  return cands;
}

void Run(int tokens, int budget, int queries, uint32_t seed,
         std::map<std::string, std::vector<std::pair<double, double>>>* growth) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> g(0, 1);
  std::vector<float> topics(kTopics * kD);
  for (auto& x : topics) x = g(rng) * 0.9f;
  const Stream s = MakeStream(tokens, topics, rng);
  const Layout contiguous = Finish(s, ContiguousRows(s.n));
  const Layout boundary = Boundary(s);
  const Layout semantic = Semantic(s);
  auto left = [budget](const Layout& l) -> uint64_t {
    return budget > l.mandatory_tokens ? budget - l.mandatory_tokens : 0;
  };
  ClusterIndex::Options options;
  options.cluster_chunks = cluster_chunks;
  ClusterIndex index(kD, options), semantic_index(kD, options), boundary_index(kD, options);
  ClusterIndex::Options by_mean =
      options;  // as the daemon clusters a session with the mean ranking
  by_mean.cluster_by_peak = false;
  ClusterIndex mean_index(kD, by_mean);
  // The default index's insertions, each timed over the last tenth of the chunks: what one
  // more chunk costs an index grown to this many tokens (index_add_us).
  std::vector<ChunkCandidate> cands;
  double add_seconds = 0;
  int adds_timed = 0;
  for (size_t c = 0; c < contiguous.chunks(); ++c) {
    if (contiguous.mandatory[c]) continue;
    if (c < contiguous.chunks() * 9 / 10) {
      index.Add(uint32_t(c), contiguous.stats);
    } else {
      const double t0 = bench::NowSeconds();
      index.Add(uint32_t(c), contiguous.stats);
      add_seconds += bench::NowSeconds() - t0;
      ++adds_timed;
    }
    cands.push_back(contiguous.stats.candidate(uint32_t(c)));
  }
  Candidates(contiguous, &mean_index);
  Candidates(boundary, &boundary_index);
  Candidates(semantic, &semantic_index);
  // The baselines' inputs, laid out once as an index is built once: keys as fp16, and each
  // page's [hi | lo] rounded outwards (hi up, lo down).
  const Tiles key_tiles =
      MakeTiles(s.keys.data(), s.n, kD, [](float x, int) { return FloatToHalf(x); });
  std::vector<float> hi_lo(contiguous.chunks() * 2 * kD);
  for (size_t c = 0; c < contiguous.chunks(); ++c) {
    std::copy_n(&contiguous.hi[c * kD], kD, &hi_lo[c * 2 * kD]);
    std::copy_n(&contiguous.lo[c * kD], kD, &hi_lo[c * 2 * kD + kD]);
  }
  const Tiles page_tiles =
      MakeTiles(hi_lo.data(), int(contiguous.chunks()), 2 * kD,
                [](float x, int r) { return r < kD ? FloatToHalfUp(x) : FloatToHalfDown(x); });
  std::vector<float> scratch;
  std::map<std::string, Result> res;
  struct {
    double opened = 0, reaching = 0, needed = 0, clusters_in_needed = 0, chunks_scored = 0;
    int searches = 0;
  } units;  // kvtier's unit level, summed over queries
  std::vector<double> scores(s.n);
  for (int qi = 0; qi < queries; ++qi) {
    const std::vector<float> q = MakeQuery(topics, rng);
    const Truth truth = Exact(s, q, budget);
    std::map<const Layout*, double> chunk_oracle;
    auto record = [&](const std::string& name, double seconds, double kept, double scored,
                      const Layout& l) {
      Result& r = res[name];
      if (!chunk_oracle.count(&l)) chunk_oracle[&l] = ChunkOracle(truth, l, budget);
      r.us.push_back(seconds * 1e6);
      r.ratio.push_back(kept / truth.oracle);
      r.chunk_ratio.push_back(kept / chunk_oracle[&l]);
      r.scored += scored;
      r.total += double(l.chunks());
    };
    {  // exact: every key scored, the best tokens kept. Keys as the daemon stores them (fp16),
       // in channel-major tiles, scored by the index's own kernel (DotColumns), every head
       // in one pass.
      const double t0 = bench::NowSeconds();
      std::vector<float>& dots = scratch;
      dots.resize(size_t(kGroup) * s.n);
      for (int t = 0; t < s.n; t += kTile) {
        DotColumns(q.data(), kGroup, kD, key_tiles.At(t), kD, kTile, std::min(kTile, s.n - t),
                   dots.data() + t, s.n);
      }
      for (int i = 0; i < s.n; ++i) {
        scores[i] = std::max({dots[i], dots[size_t(s.n) + i], dots[2 * size_t(s.n) + i]});
      }
      std::vector<int> order(s.n);
      for (int i = 0; i < s.n; ++i) order[i] = i;
      std::nth_element(order.begin(), order.begin() + budget, order.end(),
                       [&](int a, int b) { return scores[a] > scores[b]; });
      const double secs = bench::NowSeconds() - t0;
      double kept = 0;
      for (int i = 0; i < budget; ++i) kept += truth.p[order[i]];
      record("exact", secs, kept, double(contiguous.chunks()), contiguous);
    }
    {  // quest: the box bound of every page, sum_j max(q_j lo_j, q_j hi_j) = max(q, 0) . hi +
       // min(q, 0) . lo, with the index's own layout and kernel: pages' [hi | lo] as halves
       // rounded outwards, in channel-major tiles, every head in one pass.
      const Layout& l = contiguous;
      const int pages = int(l.chunks());
      const double t0 = bench::NowSeconds();
      float pos_neg[kGroup * 2 * kD];
      for (int h = 0; h < kGroup; ++h) {
        for (int j = 0; j < kD; ++j) {
          pos_neg[h * 2 * kD + j] = std::max(q[h * kD + j], 0.f);
          pos_neg[h * 2 * kD + kD + j] = std::min(q[h * kD + j], 0.f);
        }
      }
      std::vector<float>& dots = scratch;
      dots.resize(size_t(kGroup) * pages);
      for (int t = 0; t < pages; t += kTile) {
        DotColumns(pos_neg, kGroup, 2 * kD, page_tiles.At(t), 2 * kD, kTile,
                   std::min(kTile, pages - t), dots.data() + t, pages);
      }
      std::vector<std::pair<float, uint32_t>> ranked;
      for (int c = 0; c < pages; ++c) {
        if (l.mandatory[c]) continue;
        const float best =
            std::max({dots[c], dots[size_t(pages) + c], dots[2 * size_t(pages) + c]});
        ranked.push_back({-best, uint32_t(c)});
      }
      const size_t k = std::min<size_t>(ranked.size(), left(l) / chunk_tokens);
      std::partial_sort(ranked.begin(), ranked.begin() + k, ranked.end());
      std::vector<uint32_t> chosen;
      for (size_t i = 0; i < k; ++i) chosen.push_back(ranked[i].second);
      const double secs = bench::NowSeconds() - t0;
      record("quest", secs, ChunkMass(truth, l, chosen), double(l.chunks()), l);
    }
    {  // window: sinks and the most recent tokens, nothing scored
      const double t0 = bench::NowSeconds();
      double kept = 0;
      for (int i = 0; i < s.n; ++i) {
        kept += (i < kSinks || i >= s.n - (budget - kSinks)) ? truth.p[i] : 0;
      }
      record("window", bench::NowSeconds() - t0, kept, 0, contiguous);
    }
    {  // kvtier-scan: the LSE-peak score of every chunk
      const double t0 = bench::NowSeconds();
      auto chosen = SelectChunks(v1::RANKING_LSE_PEAK, q, kGroup, kD, cands, left(contiguous));
      const double secs = bench::NowSeconds() - t0;
      record("kvtier-scan", secs, ChunkMass(truth, contiguous, chosen), double(cands.size()),
             contiguous);
    }
    {  // kvtier-boundary: chunks of several sizes, the index's greedy fill
      ClusterIndex::SearchStats st;
      const double t0 = bench::NowSeconds();
      auto chosen = boundary_index.SearchGreedy(v1::RANKING_LSE_PEAK, q, kGroup, left(boundary),
                                                boundary.stats, {}, {}, &st);
      const double secs = bench::NowSeconds() - t0;
      record("kvtier-boundary", secs, ChunkMass(truth, boundary, chosen),
             double(st.chunks_scored + st.bounds_scored), boundary);
    }
    for (auto [name, ranking, layout, idx] :
         {std::tuple{"kvtier", v1::RANKING_LSE_PEAK, &contiguous, &index},
          std::tuple{"kvtier-mean", v1::RANKING_MEAN, &contiguous, &mean_index},
          std::tuple{"kvtier-semantic", v1::RANKING_LSE_PEAK, &semantic, &semantic_index}}) {
      ClusterIndex::SearchStats st;
      const double t0 = bench::NowSeconds();
      auto chosen =
          idx->Search(ranking, q, kGroup, left(*layout) / chunk_tokens, layout->stats, {}, &st);
      const double secs = bench::NowSeconds() - t0;
      // Work counts every bound computed as well as every chunk scored.
      record(name, secs, ChunkMass(truth, *layout, chosen),
             double(st.chunks_scored + st.bounds_scored), *layout);
      if (idx == &index && !chosen.empty()) {  // the unit level against the k-th score
        const float kth = LsePeakScore(q, kGroup, layout->stats.candidate(chosen.back()), kD);
        const ClusterIndex::UnitProfile p = index.ProfileUnits(ranking, q, kGroup, kth);
        units.opened += double(st.units_opened);
        units.reaching += double(p.units_reaching);
        units.needed += double(p.units_needed);
        units.clusters_in_needed += double(p.clusters_in_needed);
        units.chunks_scored += double(st.chunks_scored);
        units.searches += 1;
      }
    }
  }
  const double exact_us = bench::Median(res["exact"].us);
  for (const std::string name : {"exact", "quest", "window", "kvtier-scan", "kvtier", "kvtier-mean",
                                 "kvtier-boundary", "kvtier-semantic"}) {
    const Result& r = res[name];
    const double us = bench::Median(r.us);
    std::printf(
        "{\"name\": \"select_policy_us\", \"value\": %.3f, \"unit\": \"us\", \"baseline\": "
        "%.3f, \"baseline_name\": \"exact\", \"ratio\": %.4f, \"policy\": \"%s\", \"tokens\": %d, "
        "\"budget\": %d, \"us_per_select\": %.3f, \"oracle_ratio\": %.4f, \"oracle_ratio_p10\": "
        "%.4f, \"chunk_oracle_ratio\": %.4f, \"chunks_scored_fraction\": %.4f, \"parameters\": "
        "{\"policy\": \"%s\", \"tokens\": %d, \"budget\": %d, \"queries\": %d, \"head_dim\": %d, "
        "\"gqa_group\": %d, \"chunk_tokens\": %d, \"cluster_chunks\": %u, \"clusters\": %zu, "
        "\"units\": %zu, \"data\": \"synthetic topics\"}}\n",
        us, exact_us, us / exact_us, name.c_str(), tokens, budget, us, Mean(r.ratio),
        bench::Quantile(r.ratio, 0.1), Mean(r.chunk_ratio), r.total ? r.scored / r.total : 0.0,
        name.c_str(), tokens, budget, queries, kD, kGroup, chunk_tokens, cluster_chunks,
        index.num_clusters(), index.num_units());
    (*growth)[name].push_back({double(tokens), us});
  }
  if (adds_timed > 0) {
    const double add_us = add_seconds / adds_timed * 1e6,
                 search_us = bench::Median(res["kvtier"].us);
    std::printf(
        "{\"name\": \"index_add_us\", \"value\": %.3f, \"unit\": \"us\", \"baseline\": %.3f, "
        "\"baseline_name\": \"the same index's search\", \"ratio\": %.4f, \"policy\": "
        "\"kvtier\", \"tokens\": %d, \"parameters\": {\"tokens\": %d, \"chunks_timed\": %d, "
        "\"timed\": \"each Add of the last tenth of the chunks\", \"clusters\": %zu, "
        "\"units\": %zu}}\n",
        add_us, search_us, add_us / search_us, tokens, tokens, adds_timed, index.num_clusters(),
        index.num_units());
  }
  // How loose the unit level is: the units a search opened against those holding a cluster
  // whose bound reaches the k-th score (all it would open were each unit's bound the largest
  // of its clusters'), and the work it would then do (the units' bounds, the clusters' bounds
  // of the units needed, the chunks scored) beside the work it did.
  if (units.searches > 0) {
    const double m = units.searches, chunks = double(contiguous.chunks());
    std::printf(
        "{\"name\": \"select_units_opened\", \"value\": %.2f, \"unit\": \"units\", "
        "\"baseline\": %.2f, \"baseline_name\": \"units holding a cluster reaching the k-th "
        "score\", \"ratio\": %.3f, \"policy\": \"kvtier\", \"tokens\": %d, \"parameters\": "
        "{\"policy\": \"kvtier\", \"tokens\": %d, \"budget\": %d, \"queries\": %d, "
        "\"units\": %zu, \"units_reaching\": %.2f, \"work\": %.4f, "
        "\"work_with_exact_unit_bounds\": %.4f}}\n",
        units.opened / m, units.needed / m, units.opened / std::max(units.needed, 1.0), tokens,
        tokens, budget, queries, index.num_units(), units.reaching / m,
        res["kvtier"].total ? res["kvtier"].scored / res["kvtier"].total : 0.0,
        (double(index.num_units()) + units.clusters_in_needed / m + units.chunks_scored / m) /
            chunks);
  }
  // EVAL's target against Quest at 128K tokens, as the median over queries of each query's
  // kvtier time over its quest time: both measured on that query moments apart, so that the
  // shared machine's drift in speed over a run cancels (the ratio of the medians is beside it).
  if (tokens >= 131072) {
    const Result& k = res["kvtier"];
    const Result& qst = res["quest"];
    std::vector<double> paired;
    for (size_t i = 0; i < k.us.size(); ++i) paired.push_back(k.us[i] / qst.us[i]);
    const double kvtier_us = bench::Median(k.us), quest_us = bench::Median(qst.us);
    std::printf(
        "{\"name\": \"select_vs_quest\", \"value\": %.3f, \"unit\": \"us\", \"baseline\": %.3f, "
        "\"baseline_name\": \"quest\", \"ratio\": %.4f, \"policy\": \"kvtier\", \"tokens\": %d, "
        "\"parameters\": {\"policy\": \"kvtier\", \"tokens\": %d, \"budget\": %d, \"queries\": %d, "
        "\"ratio\": \"median over queries of kvtier us / quest us\", \"ratio_of_medians\": %.4f, "
        "\"paired_p10\": %.4f, \"paired_p90\": %.4f}}\n",
        kvtier_us, quest_us, bench::Median(paired), tokens, tokens, budget, queries,
        kvtier_us / quest_us, bench::Quantile(paired, 0.1), bench::Quantile(paired, 0.9));
  }
  std::fflush(stdout);
}

int Main(int argc, char** argv) {
  if (argc < 2 || std::strcmp(argv[1], "select") != 0) {
    std::fprintf(stderr,
                 "usage: kvtier-bench select [--tokens N[,N...]] [--budget B] "
                 "[--queries Q] [--seed S] [--chunk_tokens N] [--cluster_chunks N] [--json]\n");
    return 2;
  }
  std::vector<int> tokens = {4096, 32768, 131072};
  int budget = 256, queries = 24;
  uint32_t seed = 1;
  for (int i = 2; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "%s needs a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--tokens") {
      tokens.clear();
      std::string v = next();
      for (size_t p = 0; p <= v.size();) {
        size_t e = v.find(',', p);
        if (e == std::string::npos) e = v.size();
        tokens.push_back(std::atoi(v.substr(p, e - p).c_str()));
        p = e + 1;
      }
    } else if (a == "--budget") {
      budget = std::atoi(next().c_str());
    } else if (a == "--queries") {
      queries = std::atoi(next().c_str());
    } else if (a == "--chunk_tokens") {
      chunk_tokens = std::atoi(next().c_str());
    } else if (a == "--cluster_chunks") {
      cluster_chunks = static_cast<uint32_t>(std::atoi(next().c_str()));
    } else if (a == "--seed") {
      seed = static_cast<uint32_t>(std::atoi(next().c_str()));
    } else if (a != "--json") {
      std::fprintf(stderr, "unknown flag %s\n", a.c_str());
      return 2;
    }
  }
  if (chunk_tokens < 1 || chunk_tokens > 64 || cluster_chunks < 1) {
    std::fprintf(stderr, "--chunk_tokens must be in [1, 64] and --cluster_chunks >= 1\n");
    return 2;
  }
  for (int t : tokens) {
    if (t < budget + kSinks + kWindow + 2 * chunk_tokens) {
      std::fprintf(stderr, "--tokens %d: must be above budget + sinks + window + two chunks\n", t);
      return 2;
    }
  }
  if (budget < kSinks + kWindow + chunk_tokens || queries < 1) {
    std::fprintf(stderr, "--budget must be >= %d and --queries >= 1\n",
                 kSinks + kWindow + chunk_tokens);
    return 2;
  }
  std::map<std::string, std::vector<std::pair<double, double>>> growth;
  for (int t : tokens) Run(t, budget, queries, seed, &growth);
  if (tokens.size() >= 2) {
    for (const auto& [name, pts] : growth) {
      if (name == "window") continue;  // nothing scored: no growth to fit
      double mx = 0, my = 0;
      for (auto [x, y] : pts) mx += std::log(x), my += std::log(y);
      mx /= pts.size();
      my /= pts.size();
      double sxy = 0, sxx = 0;
      for (auto [x, y] : pts) {
        sxy += (std::log(x) - mx) * (std::log(y) - my);
        sxx += (std::log(x) - mx) * (std::log(x) - mx);
      }
      std::printf(
          "{\"name\": \"select_growth_exponent\", \"value\": %.3f, \"unit\": \"exponent\", "
          "\"baseline\": 1.0, \"baseline_name\": \"linear\", \"ratio\": %.3f, "
          "\"policy\": \"%s\", \"parameters\": {\"policy\": \"%s\", \"tokens_from\": %d, "
          "\"tokens_to\": %d, \"budget\": %d}}\n",
          sxy / sxx, sxy / sxx, name.c_str(), name.c_str(), tokens.front(), tokens.back(), budget);
    }
  }
  return 0;
}

}  // namespace
}  // namespace kvtier

int main(int argc, char** argv) { return kvtier::Main(argc, argv); }
