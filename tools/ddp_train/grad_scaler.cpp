#include "grad_scaler.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>  // at::NoGradGuard: ATen.h stops including it in 2.x

namespace ddp::train {

at::Tensor GradScaler::scale(const at::Tensor& loss) const { return loss.mul(scale_); }

bool GradScaler::unscale_and_check(const std::vector<at::Tensor>& params, ProcessGroup& group) {
  at::NoGradGuard no_grad;
  bool finite = true;
  for (const auto& p : params) {
    const at::Tensor& g = p.grad();
    if (!g.defined()) continue;
    g.div_(scale_);
    if (finite && !at::isfinite(g).all().item<bool>()) finite = false;
  }
  // One rank's overflow skips the step everywhere.
  at::Tensor bad = at::full({1}, finite ? 0 : 1, at::kInt);
  group.all_reduce(bad, ReduceOp::kMax).wait();
  return bad.item<int>() == 0;
}

void GradScaler::update(bool finite) {
  if (!finite) {
    scale_ *= options_.backoff_factor;
    good_steps_ = 0;
  } else if (++good_steps_ >= options_.growth_interval) {
    scale_ *= options_.growth_factor;
    good_steps_ = 0;
  }
}

}  // namespace ddp::train
