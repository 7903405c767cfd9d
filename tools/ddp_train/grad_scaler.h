// Dynamic loss scaling for fp16 training (PyTorch's torch.cuda.amp.GradScaler, which LibTorch
// 1.13's C++ API lacks). The loss is multiplied by `scale` before backward so small fp16
// gradients do not flush to zero; before the step the gradients are divided back. If any rank
// found an inf/nan the step is skipped on every rank (the flag is all-reduced, so replicas
// never diverge) and the scale shrinks; after `growth_interval` good steps it grows.
#pragma once

#include <cstdint>
#include <vector>

#include <ATen/core/Tensor.h>

#include "ddp/process_group.h"

namespace ddp::train {

struct GradScalerOptions {
  double init_scale = 65536.0;  // 2^16, PyTorch's default
  double growth_factor = 2.0;
  double backoff_factor = 0.5;
  int64_t growth_interval = 2000;
};

class GradScaler {
 public:
  explicit GradScaler(GradScalerOptions options = {})
      : options_(options), scale_(options.init_scale) {}

  at::Tensor scale(const at::Tensor& loss) const;
  // Divides every defined gradient by the scale and reports (agreed across `group`) whether
  // all of them are finite. Call once per optimizer step, after backward.
  bool unscale_and_check(const std::vector<at::Tensor>& params, ProcessGroup& group);
  // After the step decision: backs off on overflow, grows after enough good steps.
  void update(bool finite);
  double current() const { return scale_; }

 private:
  GradScalerOptions options_;
  double scale_;
  int64_t good_steps_ = 0;
};

}  // namespace ddp::train
