#include "server/session/layer_budget.h"

#include <algorithm>

namespace kvtier {

void LayerNeeds::Record(uint32_t layer, float need) {
  float& n = need_[layer];
  n = n < 0.f ? need : (1.f - kNeedWeight) * n + kNeedWeight * need;
}

double LayerNeeds::Share(uint32_t layer, uint32_t first_selecting) const {
  if (layer < first_selecting || need_[layer] < 0.f) return 1.0;
  std::vector<double> measured;
  double sum = 0;
  for (uint32_t l = first_selecting; l < need_.size(); ++l) {
    if (need_[l] >= 0.f) {
      measured.push_back(need_[l]);
      sum += need_[l];
    }
  }
  if (sum <= 0) return 1.0;  // no layer misses anything: the equal share
  const double mean = sum / static_cast<double>(measured.size());
  auto share = [&](double need, double s) {
    return std::min(kMaxShare, kEqualPart + (1 - kEqualPart) * s * need / mean);
  };
  auto total = [&](double s) {
    double t = 0;
    for (double n : measured) t += share(n, s);
    return t;
  };
  // The least s >= 1 whose shares sum to the measured layers' count (bisection; the sum grows
  // with s). Without the cap s = 1 does; with it, as near as the cap allows.
  const double want = static_cast<double>(measured.size());
  double lo = 1, hi = 1;
  while (total(hi) < want - 1e-9 && hi < 1e6) hi *= 2;
  if (hi > 1) {
    for (int i = 0; i < 60; ++i) {
      const double mid = (lo + hi) / 2;
      (total(mid) < want ? lo : hi) = mid;
    }
  }
  return share(need_[layer], hi);
}

}  // namespace kvtier
