// SyncBatchNorm and convert_sync_batchnorm (see include/ddp/sync_batch_norm.h).
//
// Note [SyncBatchNorm protocol]
// Forward, train mode, W > 1 ranks; x: [N_r, C, *] on rank r, n_r = N_r * prod(*) values per
// channel. On every rank:
//   1. local statistics per channel: mean_r, biased var_r (compute dtype);
//   2. all_gather of one record per rank, in double, of fixed size 2 + 2C with C = num_features:
//        [n_r, channels_r, mean_r[0..C), var_r[0..C)]
//      A rank whose input is invalid still sends its record (n_r = 0, channels_r = what it got,
//      -1 for fewer than 2 dimensions), so every rank raises the error instead of waiting;
//   3. combine (pure, combine_stats): n = sum n_r, mean = sum n_r mean_r / n,
//      var = sum n_r (var_r + (mean_r - mean)^2) / n, the parallel variance of Chan et al.:
//      exact for any row counts, empty ranks included;
//   4. running stats <- (1 - m) running + m (mean, var * n / (n - 1)), identically everywhere;
//   5. y = (x - mean) * invstd * weight + bias with invstd = 1 / sqrt(var + eps).
// Backward (once per forward, driven by the autograd engine), on every rank:
//   1. local per-channel sums: sum_dy = sum dy, sum_dy_xmu = sum dy (x - mean);
//   2. grad_weight = sum_dy_xmu * invstd, grad_bias = sum_dy: this rank's rows only, as for any
//      parameter under DDP, which averages them;
//   3. when x needs a gradient: all_reduce(sum) of [sum_dy, sum_dy_xmu] (in double);
//   4. dx = weight * invstd * (dy - sum_dy / n - (x - mean) * invstd^2 * sum_dy_xmu / n),
//      the gradient of the sum of all ranks' losses with respect to this rank's rows.
// This is what PyTorch's batch_norm_stats / batch_norm_gather_stats_with_counts /
// batch_norm_backward_reduce / batch_norm_backward_elemt do (it gathers invstd instead of var:
// the same statistics). Those kernels are CUDA-only in LibTorch 1.13, so ours are plain tensor
// ops, which work for any device and dtype.
#include "ddp/sync_batch_norm.h"

#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/autograd.h>                 // torch::autograd::Function
#include <torch/nn/functional/batchnorm.h>  // the world-size-1 / eval path
#include <torch/nn/modules/batchnorm.h>     // BatchNorm{1,2,3}dImpl, for the converter

#include "base/check.h"
#include "ddp/distributed.h"  // is_initialized, default_group

namespace ddp {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Reduced-precision inputs are normalised in float, as LibTorch's CPU batch_norm does.
at::ScalarType compute_dtype(const at::Tensor& x) {
  const auto t = x.scalar_type();
  return (t == at::kFloat || t == at::kDouble) ? t : at::kFloat;
}

// The dimensions statistics are taken over: all but 1.
std::vector<int64_t> reduce_dims(const at::Tensor& x) {
  std::vector<int64_t> dims{0};
  for (int64_t d = 2; d < x.dim(); ++d) dims.push_back(d);
  return dims;
}

// [C] -> [1, C, 1, ...] to broadcast against x.
at::Tensor per_channel(const at::Tensor& v, const at::Tensor& x) {
  std::vector<int64_t> shape(x.dim(), 1);
  shape[1] = v.size(0);
  return v.view(shape);
}

std::string shape_of(const at::Tensor& x) {
  return fmt::format("[{}]", fmt::join(x.sizes(), ", "));
}

// What is wrong with x as input to a module with `c` features, or "" when nothing is.
std::string input_problem(const at::Tensor& x, int64_t c) {
  if (!x.defined()) return "the input is an undefined tensor";
  if (x.dim() < 2) {
    return fmt::format("expected an input of shape [N, C, *] with 2 or more dimensions, got {}",
                       shape_of(x));
  }
  if (x.size(1) != c) {
    return fmt::format(
        "expected {} channels (dimension 1 of the input), got {} in an input of "
        "shape {}",
        c, x.size(1), shape_of(x));
  }
  return "";
}

std::string module_name(int64_t c) { return fmt::format("SyncBatchNorm({})", c); }

[[noreturn]] void too_few_values(const std::string& where, int64_t c, double total,
                                 const std::string& detail) {
  throw Error(fmt::format(
      "{}{}: expected more than 1 value per channel when training, got {}{}; use a larger "
      "batch or eval mode",
      where, module_name(c), static_cast<int64_t>(total), detail));
}

// Global statistics from per-rank ones (step 3 of the Note). All double.
struct GlobalStats {
  double count = 0;  // n, values per channel over all ranks
  at::Tensor mean;   // [C]
  at::Tensor var;    // [C], biased (divided by n)
};

GlobalStats combine_stats(const at::Tensor& counts /*[W]*/, const at::Tensor& means /*[W, C]*/,
                          const at::Tensor& vars /*[W, C]*/) {
  GlobalStats g;
  g.count = counts.sum().item<double>();
  const at::Tensor w = (counts / g.count).unsqueeze(1);  // [W, 1]; empty ranks weigh 0
  g.mean = (w * means).sum(0);
  g.var = (w * (vars + (means - g.mean).square())).sum(0);
  return g;
}

// Waits for a collective of this module, adding what the module needs from every rank to the
// error (a rank that skipped a forward or backward is the usual cause).
void wait_for(Work work, const ProcessGroup& pg, int64_t c, const char* phase) {
  try {
    work.wait();
  } catch (const TimeoutError& e) {
    throw TimeoutError(fmt::format(
        "{} (in {} {}: in train mode every rank must run the same forwards and backwards "
        "through each SyncBatchNorm, in the same order)",
        e.what(), module_name(c), phase));
  } catch (const CollectiveError& e) {
    throw CollectiveError(
        fmt::format("{} (in {} {} on rank {})", e.what(), module_name(c), phase, pg.rank()));
  }
}

// Holds the group in the autograd context's saved_data (an IValue capsule).
struct GroupCapsule : torch::CustomClassHolder {
  explicit GroupCapsule(std::shared_ptr<ProcessGroup> g) : group(std::move(g)) {}
  std::shared_ptr<ProcessGroup> group;
};

// Everything the forward needs besides the differentiable inputs.
struct SyncArgs {
  std::shared_ptr<ProcessGroup> group;  // size() > 1
  int64_t num_features = 0;
  double eps = 0;
  double momentum = 0;      // this step's exponential average factor
  at::Tensor running_mean;  // undefined when not tracked
  at::Tensor running_var;
  std::string problem;  // input_problem(x), "" when x is valid
};

// Steps 1-2 of the Note: this rank's record and everyone's, [W, 2 + 2C] double.
at::Tensor gather_records(const at::Tensor& x, const SyncArgs& a) {
  const int64_t c = a.num_features;
  at::Tensor record = at::zeros({2 + 2 * c}, at::kDouble);
  if (a.problem.empty()) {
    const int64_t n = x.numel() / c;
    record[0] = static_cast<double>(n);
    record[1] = static_cast<double>(c);
    if (n > 0) {
      auto [var, mean] = at::var_mean(x.to(compute_dtype(x)), reduce_dims(x), /*unbiased=*/false);
      record.narrow(0, 2, c).copy_(mean);
      record.narrow(0, 2 + c, c).copy_(var);
    }
  } else {
    record[1] = x.defined() && x.dim() >= 2 ? static_cast<double>(x.size(1)) : -1.0;
  }
  ProcessGroup& pg = *a.group;
  std::vector<at::Tensor> all(pg.size());
  for (auto& t : all) t = at::empty_like(record);
  wait_for(pg.all_gather(all, record), pg, c, "forward");
  return at::stack(all);
}

// Every rank raises the same kind of error for an invalid input on any rank.
void check_records(const at::Tensor& records, const SyncArgs& a) {
  const ProcessGroup& pg = *a.group;
  const int64_t c = a.num_features;
  const std::string where = fmt::format("[rank {}] ", pg.rank());
  DDP_CHECK(a.problem.empty(), Error, "{}{}: {}", where, module_name(c), a.problem);
  const at::Tensor channels = records.select(1, 1);
  std::vector<std::string> bad;
  for (int r = 0; r < pg.size(); ++r) {
    const auto got = static_cast<int64_t>(channels[r].item<double>());
    if (got == c) continue;
    bad.push_back(got < 0 ? fmt::format("rank {} (fewer than 2 dimensions)", r)
                          : fmt::format("rank {} ({} channels)", r, got));
  }
  DDP_CHECK(bad.empty(), Error,
            "{}{}: invalid input on {}; every rank's input must be [N, {}, *] (that rank's "
            "error says more)",
            where, module_name(c), fmt::join(bad, ", "), c);
  const at::Tensor counts = records.select(1, 0);
  const double total = counts.sum().item<double>();
  if (total <= 1) {
    std::vector<int64_t> per_rank;
    for (int r = 0; r < pg.size(); ++r) {
      per_rank.push_back(static_cast<int64_t>(counts[r].item<double>()));
    }
    too_few_values(where, c, total,
                   fmt::format(" over {} ranks (per rank: {})", pg.size(),
                               fmt::join(per_rank, ", ")));
  }
}

class SyncBatchNormFunction : public torch::autograd::Function<SyncBatchNormFunction> {
 public:
  // x: [N, C, *]; weight, bias: [C] or both absent (affine = false; an undefined tensor
  // cannot be a Function input). Returns y shaped like x.
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x,
                            const c10::optional<at::Tensor>& weight_opt,
                            const c10::optional<at::Tensor>& bias_opt, const SyncArgs& a) {
    const at::Tensor weight = weight_opt.value_or(at::Tensor());
    const at::Tensor bias = bias_opt.value_or(at::Tensor());
    const int64_t c = a.num_features;
    const at::Tensor records = gather_records(x, a);  // [W, 2 + 2C]
    check_records(records, a);
    const GlobalStats g =
        combine_stats(records.select(1, 0), records.narrow(1, 2, c), records.narrow(1, 2 + c, c));
    const at::Tensor invstd = (g.var + a.eps).rsqrt();  // [C] double

    if (a.running_mean.defined()) {
      const double m = a.momentum;
      const at::Tensor unbiased = g.var * (g.count / (g.count - 1));
      a.running_mean.copy_(a.running_mean.to(at::kDouble) * (1 - m) + g.mean * m);
      a.running_var.copy_(a.running_var.to(at::kDouble) * (1 - m) + unbiased * m);
    }

    const auto dt = compute_dtype(x);
    const at::Tensor mean_c = g.mean.to(dt);
    const at::Tensor invstd_c = invstd.to(dt);
    at::Tensor scale = weight.defined() ? invstd_c * weight.to(dt) : invstd_c;
    at::Tensor y = (x.to(dt) - per_channel(mean_c, x)) * per_channel(scale, x);
    if (bias.defined()) y = y + per_channel(bias.to(dt), x);

    ctx->save_for_backward({x, weight, mean_c, invstd_c});
    ctx->saved_data["count"] = g.count;
    ctx->saved_data["affine"] = weight.defined();
    ctx->saved_data["group"] =
        c10::IValue::make_capsule(c10::make_intrusive<GroupCapsule>(a.group));
    return y.to(x.scalar_type());
  }

  // grads: {dy}. Returns {dx, dweight, dbias, (none for SyncArgs)}; needs_input_grad counts
  // only the inputs that were tensors: x, then weight and bias when affine.
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& x = saved[0];
    const at::Tensor& weight = saved[1];
    const at::Tensor& mean = saved[2];    // [C], compute dtype
    const at::Tensor& invstd = saved[3];  // [C]
    const double count = ctx->saved_data["count"].toDouble();
    const auto capsule = ctx->saved_data["group"].toCapsule();  // keeps the group alive
    ProcessGroup& pg = *static_cast<const GroupCapsule*>(capsule.get())->group;
    const int64_t c = mean.size(0);

    const auto dt = mean.scalar_type();
    const at::Tensor dy = grads[0].to(dt);
    const at::Tensor xmu = x.to(dt) - per_channel(mean, x);
    const auto dims = reduce_dims(x);
    at::Tensor sum_dy = dy.sum(dims);              // [C]
    at::Tensor sum_dy_xmu = (dy * xmu).sum(dims);  // [C]

    at::Tensor grad_input, grad_weight, grad_bias;
    if (ctx->saved_data["affine"].toBool()) {
      if (ctx->needs_input_grad(1)) grad_weight = (sum_dy_xmu * invstd).to(weight.scalar_type());
      if (ctx->needs_input_grad(2)) grad_bias = sum_dy.to(weight.scalar_type());
    }
    if (ctx->needs_input_grad(0)) {
      at::Tensor sums = at::cat({sum_dy, sum_dy_xmu}).to(at::kDouble);  // [2C]
      wait_for(pg.all_reduce(sums, ReduceOp::kSum), pg, c, "backward");
      const at::Tensor mean_dy = (sums.narrow(0, 0, c) / count).to(dt);
      const at::Tensor mean_dy_xmu = (sums.narrow(0, c, c) / count).to(dt);
      const at::Tensor scale = weight.defined() ? invstd * weight.to(dt) : invstd;
      grad_input =
          (dy - per_channel(mean_dy, x) - xmu * per_channel(invstd * invstd * mean_dy_xmu, x)) *
          per_channel(scale, x);
      grad_input = grad_input.to(x.scalar_type());
    }
    return {grad_input, grad_weight, grad_bias, at::Tensor()};
  }
};

// --- converter helpers

// Copies src's values, dtype, device and requires_grad into the registered tensor dst.
void copy_into(const at::Tensor& src, at::Tensor& dst) {
  if (!src.defined() || !dst.defined()) return;
  dst.set_data(src.detach().clone());
  if (dst.is_leaf()) dst.requires_grad_(src.requires_grad());
}

template <typename BatchNormImpl>
std::shared_ptr<SyncBatchNormImpl> from_batch_norm(const BatchNormImpl& bn,
                                                   std::shared_ptr<ProcessGroup> group) {
  const auto& o = bn.options;
  SyncBatchNormOptions so{
      .num_features = o.num_features(),
      .eps = o.eps(),
      .momentum = o.momentum().has_value() ? std::optional<double>(*o.momentum()) : std::nullopt,
      .affine = o.affine(),
      .track_running_stats = o.track_running_stats(),
      .process_group = std::move(group),
  };
  auto sync = std::make_shared<SyncBatchNormImpl>(std::move(so));
  copy_into(bn.weight, sync->weight);
  copy_into(bn.bias, sync->bias);
  copy_into(bn.running_mean, sync->running_mean);
  copy_into(bn.running_var, sync->running_var);
  copy_into(bn.num_batches_tracked, sync->num_batches_tracked);
  sync->train(bn.is_training());
  return sync;
}

// The SyncBatchNorm for `m` when it is exactly a BatchNorm1d/2d/3d, else null.
std::shared_ptr<SyncBatchNormImpl> convert_if_batch_norm(const torch::nn::Module& m,
                                                         const std::shared_ptr<ProcessGroup>& g) {
  const auto& type = typeid(m);
  if (type == typeid(torch::nn::BatchNorm1dImpl)) {
    return from_batch_norm(dynamic_cast<const torch::nn::BatchNorm1dImpl&>(m), g);
  }
  if (type == typeid(torch::nn::BatchNorm2dImpl)) {
    return from_batch_norm(dynamic_cast<const torch::nn::BatchNorm2dImpl&>(m), g);
  }
  if (type == typeid(torch::nn::BatchNorm3dImpl)) {
    return from_batch_norm(dynamic_cast<const torch::nn::BatchNorm3dImpl&>(m), g);
  }
  return nullptr;
}

bool is_batch_norm(const torch::nn::Module& m) {
  return dynamic_cast<const torch::nn::BatchNorm1dImpl*>(&m) != nullptr ||
         dynamic_cast<const torch::nn::BatchNorm2dImpl*>(&m) != nullptr ||
         dynamic_cast<const torch::nn::BatchNorm3dImpl*>(&m) != nullptr;
}

// Rebuilds `seq` (see the header). Children are called through the Sequential's AnyModule
// entries, so replacing an entry is sound; a child with a forward() of its own is user code.
torch::nn::Sequential convert(const torch::nn::SequentialImpl& seq,
                              const std::shared_ptr<ProcessGroup>& group) {
  torch::nn::Sequential out;
  out->train(seq.is_training());  // while `out` is empty: touches no shared child
  const auto children = seq.named_children();
  DDP_ASSERT(children.size() == seq.size(), "Sequential with {} children but {} modules",
             children.size(), seq.size());
  size_t i = 0;
  for (const torch::nn::AnyModule& any : seq) {
    const std::string& name = children[i++].key();
    const std::shared_ptr<torch::nn::Module> child = any.ptr();
    if (auto sync = convert_if_batch_norm(*child, group)) {
      out->push_back(name, sync);
      continue;
    }
    for (const auto& item : child->named_modules(name)) {
      DDP_CHECK(!is_batch_norm(*item.value()), Error,
                "convert_sync_batchnorm: {} is a {} inside {} (a {}), whose forward() is its "
                "own code: the converter cannot rewire it. Construct ddp::SyncBatchNorm there "
                "instead (see Note [Converting a model to SyncBatchNorm] in "
                "ddp/sync_batch_norm.h)",
                item.key(), item.value()->name(), name, child->name());
    }
    out->push_back(name, any);  // the same module object
  }
  return out;
}

}  // namespace

// --- SyncBatchNormImpl

SyncBatchNormImpl::SyncBatchNormImpl(int64_t num_features)
    : SyncBatchNormImpl([&] {
        SyncBatchNormOptions o;
        o.num_features = num_features;
        return o;
      }()) {}

SyncBatchNormImpl::SyncBatchNormImpl(SyncBatchNormOptions options_) : options(std::move(options_)) {
  DDP_CHECK(options.num_features > 0, ConfigError,
            "SyncBatchNorm: num_features must be positive, got {}", options.num_features);
  DDP_CHECK(options.eps >= 0, ConfigError, "SyncBatchNorm: eps must be >= 0, got {}", options.eps);
  reset();
}

// Exactly NormImplBase::reset of LibTorch's BatchNorm: same names, shapes and initial values.
void SyncBatchNormImpl::reset() {
  const int64_t c = options.num_features;
  if (options.affine) {
    weight = register_parameter("weight", torch::empty({c}));
    bias = register_parameter("bias", torch::empty({c}));
  } else {
    weight = register_parameter("weight", at::Tensor(), /*requires_grad=*/false);
    bias = register_parameter("bias", at::Tensor(), /*requires_grad=*/false);
  }
  if (options.track_running_stats) {
    running_mean = register_buffer("running_mean", torch::zeros({c}));
    running_var = register_buffer("running_var", torch::ones({c}));
    num_batches_tracked =
        register_buffer("num_batches_tracked", torch::tensor(0, torch::dtype(torch::kLong)));
  } else {
    running_mean = register_buffer("running_mean", at::Tensor());
    running_var = register_buffer("running_var", at::Tensor());
    num_batches_tracked = register_buffer("num_batches_tracked", at::Tensor());
  }
  reset_parameters();
}

void SyncBatchNormImpl::reset_running_stats() {
  if (!options.track_running_stats) return;
  torch::NoGradGuard no_grad;
  running_mean.zero_();
  running_var.fill_(1);
  num_batches_tracked.zero_();
}

void SyncBatchNormImpl::reset_parameters() {
  reset_running_stats();
  if (!options.affine) return;
  torch::NoGradGuard no_grad;
  weight.fill_(1);
  bias.zero_();
}

void SyncBatchNormImpl::pretty_print(std::ostream& stream) const {
  stream << "ddp::SyncBatchNorm(" << options.num_features << ", eps=" << options.eps
         << ", momentum=";
  if (options.momentum) {
    stream << *options.momentum;
  } else {
    stream << "None";
  }
  stream << ", affine=" << std::boolalpha << options.affine
         << ", track_running_stats=" << options.track_running_stats << ")";
}

std::shared_ptr<ProcessGroup> SyncBatchNormImpl::group() const {
  if (options.process_group) return options.process_group;
  return is_initialized() ? default_group() : nullptr;
}

at::Tensor SyncBatchNormImpl::forward(const at::Tensor& x) {
  const int64_t c = options.num_features;
  // As in torch.nn.SyncBatchNorm: batch statistics in train mode, and in eval mode when there
  // are no running statistics; communication in train mode only.
  const bool batch_stats = is_training() || !options.track_running_stats;
  const bool tracking = is_training() && options.track_running_stats;
  // This step's weight of the batch statistics in the running ones.
  double factor = options.momentum.value_or(0.0);
  if (tracking && !options.momentum) {
    factor = 1.0 / static_cast<double>(num_batches_tracked.item<int64_t>() + 1);
  }
  std::shared_ptr<ProcessGroup> pg = is_training() ? group() : nullptr;
  std::string problem = input_problem(x, c);

  at::Tensor y;
  if (pg && pg->size() > 1) {
    SyncArgs args{
        .group = pg,
        .num_features = c,
        .eps = options.eps,
        .momentum = factor,
        .running_mean = tracking ? running_mean : at::Tensor(),
        .running_var = tracking ? running_var : at::Tensor(),
        .problem = std::move(problem),
    };
    if (!args.problem.empty()) {
      // Not a Function input (it may be undefined); take part in the gather, then raise.
      check_records(gather_records(x, args), args);
      DDP_ASSERT(false, "check_records accepted an invalid input: {}", args.problem);
    }
    const bool affine = weight.defined();
    y = SyncBatchNormFunction::apply(x, affine ? c10::optional<at::Tensor>(weight) : c10::nullopt,
                                     affine ? c10::optional<at::Tensor>(bias) : c10::nullopt, args);
  } else {
    const std::string where = pg ? fmt::format("[rank {}] ", pg->rank()) : "";
    DDP_CHECK(problem.empty(), Error, "{}{}: {}", where, module_name(c), problem);
    const int64_t n = x.numel() / c;
    if (batch_stats && n <= 1) {
      too_few_values(where, c, static_cast<double>(n), " in an input of shape " + shape_of(x));
    }
    // running_mean / running_var are undefined when not tracked.
    y = torch::nn::functional::detail::batch_norm(x, running_mean, running_var, weight, bias,
                                                  batch_stats, factor, options.eps);
  }
  if (tracking) {
    torch::NoGradGuard no_grad;
    num_batches_tracked.add_(1);
  }
  return y;
}

torch::nn::Sequential convert_sync_batchnorm(const torch::nn::Sequential& seq,
                                             std::shared_ptr<ProcessGroup> group) {
  DDP_CHECK(!seq.is_empty(), Error, "convert_sync_batchnorm: the Sequential is null");
  const torch::nn::SequentialImpl& impl = *seq;
  DDP_CHECK(typeid(impl) == typeid(torch::nn::SequentialImpl), Error,
            "convert_sync_batchnorm: the Sequential holds a {}, a subclass whose forward() may "
            "differ from Sequential's; pass a plain torch::nn::Sequential, or construct "
            "ddp::SyncBatchNorm in the subclass (see Note [Converting a model to "
            "SyncBatchNorm] in ddp/sync_batch_norm.h)",
            impl.name());
  return convert(impl, group);
}

}  // namespace ddp
