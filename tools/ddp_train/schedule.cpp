#include "schedule.h"

#include <algorithm>
#include <cmath>

namespace ddp::train {

double WarmupCosine::at(int64_t step) const {
  if (step < warmup_steps) return peak * static_cast<double>(step + 1) / warmup_steps;
  const int64_t decay = std::max<int64_t>(total_steps - warmup_steps, 1);
  const double t = std::min(1.0, static_cast<double>(step - warmup_steps) / decay);
  return peak * 0.5 * (1.0 + std::cos(M_PI * t));
}

}  // namespace ddp::train
