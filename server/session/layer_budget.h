// A step's budget shared among the selecting layers by their measured need
// (SessionPolicy.layer_budget = LAYER_BUDGET_BY_NEED).
//
// A layer's need is the estimated attention mass its selection misses (RefineRows' `missed`:
// the share of the mass over the sinks, the window and the candidate pool that the rows
// returned do not hold), averaged over its KV heads, then over its recent Selects (an
// exponential average, weight kNeedWeight for the newest). A Select's budget_tokens is then
// the average over the selecting layers: of the rows it leaves after the sinks and the window,
// a layer gets the multiple
//   share = min(kMaxShare, kEqualPart + (1 - kEqualPart) * s * need / mean need),
// the mean over the measured selecting layers, s >= 1 the least that makes the shares average
// 1 (s = 1 unless the cap binds: what a capped layer cannot take goes to the others by their
// need). A layer not yet measured gets 1. So the rows per head average what the budget asks
// (a step's total is split, not grown), and rows move to the layers that miss the most.
//
// Not thread-safe: the session's lock serializes access.
#ifndef KVTIER_SERVER_SESSION_LAYER_BUDGET_H_
#define KVTIER_SERVER_SESSION_LAYER_BUDGET_H_

#include <cstdint>
#include <vector>

namespace kvtier {

class LayerNeeds {
 public:
  static constexpr float kNeedWeight = 0.2f;
  static constexpr double kEqualPart = 0.25;
  static constexpr double kMaxShare = 4.0;

  explicit LayerNeeds(uint32_t layers) : need_(layers, -1.f) {}

  // Folds one Select's need (in [0, 1]) into the layer's average.
  void Record(uint32_t layer, float need);
  // The layer's average need, -1 before its first.
  float need(uint32_t layer) const { return need_[layer]; }
  // The multiple of the equal share of rows the layer gets now, the layers from
  // `first_selecting` on selecting.
  double Share(uint32_t layer, uint32_t first_selecting) const;

 private:
  std::vector<float> need_;
};

}  // namespace kvtier

#endif  // KVTIER_SERVER_SESSION_LAYER_BUDGET_H_
