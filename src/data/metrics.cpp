// EvalStats and its exact reduction across ranks (see include/ddp/metrics.h).
#include "ddp/metrics.h"

#include <ATen/ops/tensor.h>  // at::tensor: the sums as a tiny tensor for the collective

#include "base/check.h"
#include "ddp/distributed.h"  // is_initialized, default_group

namespace ddp {

void EvalStats::add(const at::Tensor& output, const at::Tensor& target,
                    const at::Tensor& per_sample_loss) {
  DDP_CHECK(output.dim() == 2 && target.dim() == 1 && output.size(0) == target.size(0), ConfigError,
            "EvalStats::add: expected output [B, C] and target [B], got {}-D output with {} "
            "rows and {}-D target with {} entries",
            output.dim(), output.dim() ? output.size(0) : 0, target.dim(),
            target.dim() ? target.size(0) : 0);
  const int64_t b = target.size(0);
  DDP_CHECK(!per_sample_loss.defined() || per_sample_loss.numel() == b, ConfigError,
            "EvalStats::add: per_sample_loss has {} values for a batch of {}; compute it with "
            "reduction 'none' (a mean or sum loss cannot be reduced exactly)",
            per_sample_loss.numel(), b);
  // All checks passed: only now change the sums (a failed add leaves them as they were).
  if (per_sample_loss.defined()) {
    // In double: exact for float losses (see metrics.h), so the order does not matter.
    loss_sum += per_sample_loss.detach().to(at::kDouble).sum().item<double>();
  }
  correct += output.argmax(1).eq(target).sum().item<int64_t>();
  count += b;
}

EvalStats& EvalStats::operator+=(const EvalStats& other) {
  loss_sum += other.loss_sum;
  correct += other.correct;
  count += other.count;
  return *this;
}

double EvalStats::accuracy() const {
  return count ? static_cast<double>(correct) / static_cast<double>(count) : 0.0;
}

double EvalStats::mean_loss() const { return count ? loss_sum / static_cast<double>(count) : 0.0; }

EvalStats all_reduce(const EvalStats& local, ProcessGroup& pg) {
  at::Tensor sums = at::tensor({local.loss_sum}, at::TensorOptions().dtype(at::kDouble));
  at::Tensor counts =
      at::tensor({local.correct, local.count}, at::TensorOptions().dtype(at::kLong));
  Work a = pg.all_reduce(sums, ReduceOp::kSum);
  Work c = pg.all_reduce(counts, ReduceOp::kSum);
  a.wait();
  c.wait();
  EvalStats out;
  out.loss_sum = sums.item<double>();
  out.correct = counts[0].item<int64_t>();
  out.count = counts[1].item<int64_t>();
  return out;
}

EvalStats all_reduce(const EvalStats& local) {
  if (!is_initialized()) return local;
  return all_reduce(local, *default_group());
}

}  // namespace ddp
