#include "server/config/policy.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace kvtier {

v1::SessionPolicy BuiltinPolicy() {
  v1::SessionPolicy p;
  p.set_sink_tokens(16);
  p.set_recent_window(64);
  p.set_default_budget(256);
  p.set_dense_layers(2);
  p.set_lossless(false);
  p.set_cold_precision(v1::PRECISION_INT4);
  p.set_chunking(v1::CHUNKING_SEMANTIC);
  p.set_chunk_tokens(16);
  p.set_ranking(v1::RANKING_LSE_PEAK);
  p.set_refine_factor(8);
  p.set_refine_score(v1::REFINE_SCORE_MEAN_MASS);
  p.set_layer_budget(v1::LAYER_BUDGET_EQUAL);
  return p;
}

absl::StatusOr<v1::SessionPolicy> ResolvePolicy(const v1::SessionPolicy& requested,
                                                const v1::SessionPolicy& defaults,
                                                absl::string_view field) {
  v1::SessionPolicy p = requested;
  if (p.sink_tokens() == 0) p.set_sink_tokens(defaults.sink_tokens());
  if (p.recent_window() == 0) p.set_recent_window(defaults.recent_window());
  if (p.default_budget() == 0) p.set_default_budget(defaults.default_budget());
  if (p.dense_layers() == 0) p.set_dense_layers(defaults.dense_layers());
  if (!p.lossless()) p.set_lossless(defaults.lossless());
  if (p.cold_precision() == v1::PRECISION_UNSPECIFIED) {
    p.set_cold_precision(defaults.cold_precision());
  }
  if (p.chunking() == v1::CHUNKING_UNSPECIFIED) p.set_chunking(defaults.chunking());
  if (p.chunk_tokens() == 0) p.set_chunk_tokens(defaults.chunk_tokens());
  if (p.ranking() == v1::RANKING_UNSPECIFIED) p.set_ranking(defaults.ranking());
  if (p.refine_factor() == 0) p.set_refine_factor(defaults.refine_factor());
  if (p.refine_score() == v1::REFINE_SCORE_UNSPECIFIED) p.set_refine_score(defaults.refine_score());
  if (p.mass_target() == 0.f) p.set_mass_target(defaults.mass_target());
  if (p.layer_budget() == v1::LAYER_BUDGET_UNSPECIFIED) p.set_layer_budget(defaults.layer_budget());
  if (p.delimiter_token_ids().empty()) {
    *p.mutable_delimiter_token_ids() = defaults.delimiter_token_ids();
  }

  auto bad = [&](absl::string_view name, const auto& value, absl::string_view why) {
    return absl::InvalidArgumentError(absl::StrCat(field, ".", name, ": ", value, " ", why));
  };
  if (p.chunk_tokens() < 1 || p.chunk_tokens() > kMaxChunkTokens) {
    return bad("chunk_tokens", p.chunk_tokens(),
               absl::StrFormat("is outside [1, %d]", kMaxChunkTokens));
  }
  if (p.sink_tokens() > (1u << 20)) return bad("sink_tokens", p.sink_tokens(), "is above 2^20");
  if (p.recent_window() > (1u << 20)) {
    return bad("recent_window", p.recent_window(), "is above 2^20");
  }
  if (p.default_budget() > (1u << 30)) {
    return bad("default_budget", p.default_budget(), "is above 2^30");
  }
  switch (p.cold_precision()) {
    case v1::PRECISION_FP16:
    case v1::PRECISION_INT8:
    case v1::PRECISION_INT4:
      break;
    default:
      return bad("cold_precision", v1::Precision_Name(p.cold_precision()),
                 "is not one of PRECISION_FP16, PRECISION_INT8, PRECISION_INT4");
  }
  if (p.ranking() != v1::RANKING_MEAN && p.ranking() != v1::RANKING_LSE_PEAK) {
    return bad("ranking", v1::Ranking_Name(p.ranking()),
               "is not one of RANKING_MEAN, RANKING_LSE_PEAK");
  }
  if (p.refine_factor() > kMaxRefineFactor) {
    return bad("refine_factor", p.refine_factor(),
               absl::StrFormat("is above %d (1: whole chunks)", kMaxRefineFactor));
  }
  if (!(p.mass_target() >= 0.f && p.mass_target() <= 1.f)) {  // NaN fails too
    return bad("mass_target", p.mass_target(), "is outside [0, 1] (0: off)");
  }
  if (p.refine_score() != v1::REFINE_SCORE_MAX && p.refine_score() != v1::REFINE_SCORE_MEAN_MASS) {
    return bad("refine_score", v1::RefineScore_Name(p.refine_score()),
               "is not one of REFINE_SCORE_MAX, REFINE_SCORE_MEAN_MASS");
  }
  switch (p.layer_budget()) {
    case v1::LAYER_BUDGET_EQUAL:
      break;
    case v1::LAYER_BUDGET_BY_NEED:
      // The need is measured by the refinement; whole chunks leave nothing to measure.
      if (p.refine_factor() <= 1 && p.mass_target() == 0.f) {
        return bad("layer_budget", v1::LayerBudget_Name(p.layer_budget()),
                   "needs refinement (refine_factor above 1 or a mass_target)");
      }
      break;
    default:
      return bad("layer_budget", static_cast<int>(p.layer_budget()),
                 "is not one of LAYER_BUDGET_EQUAL, LAYER_BUDGET_BY_NEED");
  }
  switch (p.chunking()) {
    case v1::CHUNKING_CONTIGUOUS:
    case v1::CHUNKING_SEMANTIC:
      break;
    case v1::CHUNKING_BOUNDARY:
      if (p.chunk_tokens() > kMaxChunkTokens / 2) {
        return bad("chunk_tokens", p.chunk_tokens(),
                   absl::StrFormat("is above %d: boundary chunks grow to twice chunk_tokens, "
                                   "at most %d",
                                   kMaxChunkTokens / 2, kMaxChunkTokens));
      }
      if (p.delimiter_token_ids().empty()) {
        return bad("delimiter_token_ids", "[]",
                   "is empty; CHUNKING_BOUNDARY cuts chunks after these token ids");
      }
      break;
    default:
      return bad("chunking", v1::Chunking_Name(p.chunking()),
                 "is not one of CHUNKING_CONTIGUOUS, CHUNKING_BOUNDARY, CHUNKING_SEMANTIC");
  }
  return p;
}

}  // namespace kvtier
