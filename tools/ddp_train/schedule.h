// Learning-rate schedule: linear warmup from 0 to the peak, then cosine decay to 0. Pure: the
// rate is a function of the optimizer step, so a resumed run needs no scheduler state.
#pragma once

#include <cstdint>

namespace ddp::train {

struct WarmupCosine {
  double peak = 0;
  int64_t warmup_steps = 0;
  int64_t total_steps = 1;

  // Rate for optimizer step `step` (0-based): step < warmup: peak * (step + 1) / warmup; then
  // peak * (1 + cos(pi * t)) / 2 with t the fraction of the decay phase done.
  double at(int64_t step) const;
};

}  // namespace ddp::train
