// The per-stream work of one Select's ranking (the interim linear scan: one score per 16-token
// chunk, max over a GQA group of 3; the mean score and the default LSE-peak score) against
// an exact scan of every key, at 4K, 32K and 128K tokens; and a Select's token-level
// refinement's pool by the chunk ranking (select_pool_us) and its rows' exact scores
// (refine_rows_us), each against the exact scan at 4K; a whole-chunk Select's greedy fill
// (fill_greedy_us) against a full sort's; and semantic chunking's regrouping of
// one span (regroup_span_us) against a copy of its K and V. Timed with Google Benchmark;
// printed as JSON figures.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <random>

#include "bench/bench_util.h"
#include "benchmark/benchmark.h"
#include "server/common/fp16.h"
#include "server/common/vec.h"
#include "server/index/chunk_ranker.h"
#include "server/index/chunk_stats.h"
#include "server/index/chunking.h"
#include "server/index/stream_ranker.h"
#include "server/index/token_refine.h"

namespace kvtier {
namespace {

constexpr int kD = 64, kGroup = 3, kChunk = 16;

struct Data {
  std::vector<float> q, keys, means, peaks;
  std::vector<uint16_t> half_keys;  // the keys as fp16, as the daemon stores them
  std::vector<ChunkCandidate> cands;
};

const Data& Get(int tokens) {
  static std::map<int, Data> cache;
  auto [it, inserted] = cache.try_emplace(tokens);
  Data& d = it->second;
  if (inserted) {
    std::mt19937 rng(tokens);
    std::normal_distribution<float> n(0, 1);
    d.q.resize(kGroup * kD);
    for (auto& x : d.q) x = n(rng);
    d.keys.resize(size_t(tokens) * kD);
    for (auto& x : d.keys) x = n(rng);
    for (float x : d.keys) d.half_keys.push_back(FloatToHalf(x));
    const int chunks = tokens / kChunk;
    d.means.assign(size_t(chunks) * kD, 0.f);
    d.peaks.assign(size_t(chunks) * kD, 0.f);
    for (int c = 0; c < chunks; ++c) {
      for (int t = 0; t < kChunk; ++t) {
        for (int j = 0; j < kD; ++j)
          d.means[c * kD + j] += d.keys[(c * kChunk + t) * kD + j] / kChunk;
      }
      const float* peak =
          FarthestRow(&d.keys[size_t(c) * kChunk * kD], kChunk, kD, &d.means[size_t(c) * kD]);
      std::copy(peak, peak + kD, &d.peaks[size_t(c) * kD]);
      d.cands.push_back(
          {uint32_t(c), kChunk, &d.means[size_t(c) * kD], 1.f, &d.peaks[size_t(c) * kD]});
    }
  }
  return d;
}

void BM_MeanScoreSelect(benchmark::State& state) {
  const Data& d = Get(state.range(0));
  for (auto _ : state) {
    auto out = SelectByMeanScore(d.q, kGroup, kD, d.cands, 256);
    benchmark::DoNotOptimize(out.data());
  }
}

void BM_LsePeakSelect(benchmark::State& state) {
  const Data& d = Get(state.range(0));
  for (auto _ : state) {
    auto out = SelectChunks(v1::RANKING_LSE_PEAK, d.q, kGroup, kD, d.cands, 256);
    benchmark::DoNotOptimize(out.data());
  }
}

// One KV head's share of a whole-chunk Select's ranking on a settled session at 4K tokens, as
// Session::Choose runs it: the stream's statistics compact (aged) but for its last chunks,
// the first chunk (16 sinks) and the last four (a 64-token window) returned anyway, budget
// 256 and a prefetch guess 25% wider; too few chunks for the index, so the scan.
void BM_RankStream(benchmark::State& state) {
  const Data& d = Get(state.range(0));
  const uint32_t chunks = static_cast<uint32_t>(state.range(0) / kChunk);
  ChunkStats stats(kD);
  for (uint32_t c = 0; c < chunks; ++c) {
    stats.AddRows(c, HalfKind::kFp16, &d.half_keys[size_t(c) * kChunk * kD], kChunk);
  }
  stats.MarkFinal(chunks - 8);
  std::vector<bool> must(chunks, false);
  must[0] = true;
  for (uint32_t c = chunks - 4; c < chunks; ++c) must[c] = true;
  const RankQuery q{.ranking = v1::RANKING_LSE_PEAK,
                    .queries = d.q,
                    .group = kGroup,
                    .budget = 256,
                    .must = &must,
                    .chunk_tokens = kChunk,
                    .extra_budget = 64};
  for (auto _ : state) {
    RankResult r = RankStream(stats, nullptr, q);
    benchmark::DoNotOptimize(r.chunks.data());
  }
}

// A refined Select at 4K tokens with the default policy: 16 sinks and a 64-token window leave
// 176 of a 256 budget; the pool is 8x that, 88 chunks of 16; the fixed rows are 5 chunks.
constexpr int kRefineChunks = 88, kFixedChunks = 5, kRefineRows = 176;

// The chunk ranking's part of a refined Select: the pool (1408 rows) by the LSE-peak score,
// linear over every chunk.
void BM_LsePeakPool(benchmark::State& state) {
  const Data& d = Get(state.range(0));
  for (auto _ : state) {
    auto out = SelectChunks(v1::RANKING_LSE_PEAK, d.q, kGroup, kD, d.cands, 8 * kRefineRows);
    benchmark::DoNotOptimize(out.data());
  }
}

// Baseline: score every key for every query head of the group (what full attention reads),
// with the same vectorized dot product the ranker uses.
void BM_ExactKeyScan(benchmark::State& state) {
  const Data& d = Get(state.range(0));
  std::vector<float> scores(d.keys.size() / kD);
  for (auto _ : state) {
    for (size_t t = 0; t < scores.size(); ++t) {
      float best = -1e30f;
      for (int h = 0; h < kGroup; ++h) {
        best = std::max(best, Dot(&d.q[h * kD], &d.keys[t * kD], kD));
      }
      scores[t] = best;
    }
    benchmark::DoNotOptimize(scores.data());
  }
}

// The refinement's part: the pool's 1408 rows and the 80 fixed ones scored exactly on their
// fp16 keys by the group's mean softmax mass (the default), the best 176 taken.
void BM_RefineRows(benchmark::State& state) {
  const Data& d = Get(state.range(0));
  std::vector<RefineChunk> pool, fixed;
  for (int c = 0; c < kRefineChunks + kFixedChunks; ++c) {
    // Every other chunk, as a ranking's choice would spread them.
    const RefineChunk rc{uint32_t(2 * c), &d.half_keys[size_t(2 * c) * kChunk * kD], kChunk};
    (c < kRefineChunks ? pool : fixed).push_back(rc);
  }
  for (auto _ : state) {
    auto out = RefineRows(v1::REFINE_SCORE_MEAN_MASS, HalfKind::kFp16, d.q, kGroup, kD, pool,
                          kRefineRows, fixed);
    benchmark::DoNotOptimize(out.data());
  }
}

// Semantic chunking's regrouping of one span (8 chunks of 16 rows, one KV head) into 8
// balanced groups, as the aging pool runs it for every span of every head: each iteration
// the next of the context's 32 spans (one span over and over would let the branch predictor
// learn its every branch, which no span of the daemon's gives it).
constexpr int kSpanRows = 8 * kChunk;

void BM_BalancedGroups(benchmark::State& state) {
  const Data& d = Get(4096);
  const size_t spans = d.keys.size() / (size_t{kSpanRows} * kD);
  size_t i = 0;
  for (auto _ : state) {
    const float* span = d.keys.data() + (i++ % spans) * kSpanRows * kD;
    auto groups = BalancedGroups(span, kSpanRows, kD, kChunk);
    benchmark::DoNotOptimize(groups.data());
  }
}

// Baseline: a copy of the same span's K and V rows in fp16 (what ingest does with them).
void BM_SpanCopy(benchmark::State& state) {
  const Data& d = Get(4096);
  std::vector<uint16_t> dst(2 * kSpanRows * kD);
  for (auto _ : state) {
    std::memcpy(dst.data(), d.half_keys.data(), dst.size() * 2);
    benchmark::DoNotOptimize(dst.data());
    benchmark::ClobberMemory();
  }
}

// A whole-chunk Select's greedy fill of one KV head at 4K tokens: 240 candidates of 16 tokens
// (the sinks' and the window's chunks left out), 176 tokens and a guess 25% wider (15 picks),
// each iteration the next of 4096 sets of random scores (one set over and over would let the
// branch predictor learn every branch, which a decode loop's queries never give it). The
// baseline is FillGreedy's definition: every candidate sorted, then the greedy fill.
constexpr int kFillSets = 4096, kFillCandidates = 240;
constexpr uint64_t kFillBudget = 176, kFillExtra = 64;

const std::vector<std::vector<ScoredChunk>>& FillSets() {
  static const std::vector<std::vector<ScoredChunk>> sets = [] {
    std::mt19937 rng(29);
    std::normal_distribution<float> n(0, 1);
    std::vector<std::vector<ScoredChunk>> s(kFillSets);
    for (auto& set : s) {
      for (uint32_t c = 0; c < kFillCandidates; ++c) set.push_back({n(rng), c + 1, kChunk});
    }
    return s;
  }();
  return sets;
}

using FillFn = std::vector<uint32_t> (*)(std::vector<ScoredChunk>, uint64_t, uint64_t,
                                         std::vector<uint32_t>*);
std::vector<uint32_t> FillBestFirst(std::vector<ScoredChunk> s, uint64_t budget, uint64_t extra,
                                    std::vector<uint32_t>* out) {
  return FillGreedy(std::move(s), budget, extra, out);
}
std::vector<uint32_t> FillAnyOrder(std::vector<ScoredChunk> s, uint64_t budget, uint64_t extra,
                                   std::vector<uint32_t>* out) {
  return FillGreedy(std::move(s), budget, extra, out, FillOrder::kAny);
}

// `fill` (FillGreedy, or FillGreedyBySort for the baseline) over the sets in turn, with a
// budget of `scale` times a whole-chunk Select's: 8 is a refined Select's pool (the default
// refine_factor: 88 picks and a guess of 32 more).
void BM_Fill(benchmark::State& state, FillFn fill, uint64_t scale) {
  const auto& sets = FillSets();
  std::vector<uint32_t> extra;
  size_t i = 0;
  for (auto _ : state) {
    extra.clear();
    auto picked = fill(sets[i++ % sets.size()], scale * kFillBudget, scale * kFillExtra, &extra);
    benchmark::DoNotOptimize(picked.data());
  }
}

BENCHMARK(BM_MeanScoreSelect)->Arg(4096)->Arg(32768)->Arg(131072);
BENCHMARK(BM_LsePeakSelect)->Arg(4096)->Arg(32768)->Arg(131072);
BENCHMARK(BM_ExactKeyScan)->Arg(4096)->Arg(32768)->Arg(131072);
BENCHMARK(BM_RefineRows)->Arg(4096);
BENCHMARK(BM_RankStream)->Arg(4096);
BENCHMARK_CAPTURE(BM_Fill, greedy, &FillBestFirst, 1);
BENCHMARK_CAPTURE(BM_Fill, by_sort, &FillGreedyBySort, 1);
BENCHMARK_CAPTURE(BM_Fill, pool_any_order, &FillAnyOrder, 8);
BENCHMARK_CAPTURE(BM_Fill, pool_best_first, &FillBestFirst, 8);
BENCHMARK(BM_LsePeakPool)->Arg(4096);
BENCHMARK(BM_BalancedGroups);
BENCHMARK(BM_SpanCopy);

// Keeps each run's time per iteration (us), by benchmark name.
class CollectingReporter : public benchmark::BenchmarkReporter {
 public:
  bool ReportContext(const Context&) override { return true; }
  void ReportRuns(const std::vector<Run>& runs) override {
    for (const Run& r : runs) {
      if (r.run_type != Run::RT_Iteration || r.iterations == 0) continue;
      times_[r.benchmark_name()].push_back(
          r.GetAdjustedRealTime() * benchmark::GetTimeUnitMultiplier(benchmark::kMicrosecond) /
          benchmark::GetTimeUnitMultiplier(r.time_unit));
    }
  }
  // NaN for a benchmark that did not run (left out by --benchmark_filter).
  double Median(const std::string& name) const {
    auto it = times_.find(name);
    return it == times_.end() ? std::nan("") : bench::Median(it->second);
  }

 private:
  std::map<std::string, std::vector<double>> times_;
};

}  // namespace
}  // namespace kvtier

int main(int argc, char** argv) {
  std::vector<char*> args(argv, argv + argc);
  std::string reps = "--benchmark_repetitions=5";
  args.push_back(reps.data());
  int n = static_cast<int>(args.size());
  benchmark::Initialize(&n, args.data());
  kvtier::CollectingReporter reporter;
  benchmark::RunSpecifiedBenchmarks(&reporter);
  for (const char* tokens : {"4096", "32768", "131072"}) {
    double exact = reporter.Median(std::string("BM_ExactKeyScan/") + tokens);
    for (const auto& [bm, rule] :
         {std::pair<std::string, std::string>{"BM_MeanScoreSelect/", "mean score"},
          {"BM_LsePeakSelect/", "LSE-peak score"}}) {
      kvtier::bench::Print({"select_compute_interim_rule",
                            reporter.Median(bm + tokens),
                            "us",
                            exact,
                            "exact_key_scan",
                            {{"context_tokens", tokens},
                             {"head_dim", "64"},
                             {"gqa_group", "3"},
                             {"budget_tokens", "256"},
                             {"reps", "5"},
                             {"rule", rule + " over every chunk, linear (cluster index pending)"},
                             {"target_ratio", "0.1 at 128K, with the cluster index"}}});
    }
  }
  // A refined Select's two steps for one KV head at 4K, against the exact scan of its keys.
  const std::string pool_rows = std::to_string(kvtier::kRefineChunks * kvtier::kChunk);
  auto refined_step = [&](const std::string& name, const std::string& bm,
                          std::map<std::string, std::string> params) {
    params.insert({{"context_tokens", "4096"},
                   {"head_dim", "64"},
                   {"gqa_group", "3"},
                   {"pool_rows", pool_rows},
                   {"reps", "5"}});
    kvtier::bench::Print({name, reporter.Median(bm), "us", reporter.Median("BM_ExactKeyScan/4096"),
                          "exact_key_scan", params});
  };
  refined_step("select_pool_us", "BM_LsePeakPool/4096",
               {{"rule", "LSE-peak score over every chunk, linear"}});
  refined_step("refine_rows_us", "BM_RefineRows/4096",
               {{"fixed_rows", std::to_string(kvtier::kFixedChunks * kvtier::kChunk)},
                {"rows_taken", std::to_string(kvtier::kRefineRows)},
                {"score", "group mean softmax mass, fp16 keys"}});
  kvtier::bench::Print({"rank_stream_us",
                        reporter.Median("BM_RankStream/4096"),
                        "us",
                        reporter.Median("BM_ExactKeyScan/4096"),
                        "exact_key_scan",
                        {{"context_tokens", "4096"},
                         {"head_dim", "64"},
                         {"gqa_group", "3"},
                         {"budget_tokens", "256 (a guess 25% wider)"},
                         {"reps", "5"},
                         {"rule",
                          "one KV head of a whole-chunk Select: LSE-peak score over "
                          "compact statistics, linear"}}});
  kvtier::bench::Print({"fill_greedy_us",
                        reporter.Median("BM_Fill/greedy"),
                        "us",
                        reporter.Median("BM_Fill/by_sort"),
                        "full_sort_fill",
                        {{"candidates", std::to_string(kvtier::kFillCandidates)},
                         {"budget_tokens", "176 (a guess 64 wider)"},
                         {"chunk_tokens", "16"},
                         {"reps", "5"},
                         {"sets", "4096 of random scores, in turn"}}});
  kvtier::bench::Print({"fill_pool_us",
                        reporter.Median("BM_Fill/pool_any_order"),
                        "us",
                        reporter.Median("BM_Fill/pool_best_first"),
                        "best_first_fill",
                        {{"candidates", std::to_string(kvtier::kFillCandidates)},
                         {"budget_tokens", "1408 (a guess 512 wider)"},
                         {"chunk_tokens", "16"},
                         {"reps", "5"},
                         {"sets", "4096 of random scores, in turn"},
                         {"rule",
                          "a refined Select's pool (8x), the chunks in any order (RankStream's "
                          "fill) against best first"}}});
  kvtier::bench::Print({"regroup_span_us",
                        reporter.Median("BM_BalancedGroups"),
                        "us",
                        reporter.Median("BM_SpanCopy"),
                        "span_kv_copy",
                        {{"span_rows", std::to_string(kvtier::kSpanRows)},
                         {"groups", "8"},
                         {"head_dim", "64"},
                         {"reps", "5"},
                         {"spans", "32 of a 4096-token context, in turn"},
                         {"rule", "balanced k-means, farthest-point seeds, 4 rounds"}}});
  return 0;
}
