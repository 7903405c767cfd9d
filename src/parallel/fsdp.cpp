// FullyShardedDataParallel (include/ddp/fully_sharded_data_parallel.h): flat parameters per
// unit, sharded across ranks; all-gathered for forward and backward, gradients reduce-scattered.
//
// Note [FSDP units]
// A unit's parameters, in registration order, are laid end to end in one flat parameter of
// `numel` elements, padded with zeros to `padded` (a multiple of the world size W) and cut into W
// shards of `padded / W`; rank r keeps shard r as a leaf tensor of its own (`shard`), which is
// what the optimizer steps. The module's parameters stay the autograd leaves the module's code
// uses, but their data moves (set_data, which keeps each one's identity, version counter and
// gradient accumulator):
//   - between steps, each is a 1-D view of the part of it inside this rank's shard (empty when
//     none is), as FSDP1 with use_orig_params shows them: reading one never touches freed
//     memory, and the optimizer's updates show through;
//   - before a forward, `full` (padded elements) receives every rank's shard (all_gather, every
//     unit's in flight at once), and each parameter becomes its full-shaped view of `full`;
//   - in the backward, a post hook on each parameter's gradient accumulator counts the unit's
//     gradients; a complete unit is flattened into `padded` elements and reduce-scattered (sum,
//     then divided by W: the average, as DDP's), the full-size gradients dropped at once. Units
//     are launched in reverse unit order only, so that every rank issues the same collectives in
//     the same order whatever order its gradients arrive in; a unit still incomplete when the
//     backward ends (a parameter unused on this rank) is launched then, its missing gradients as
//     zeros, on every rank alike;
//   - when the backward ends (an engine callback), the averaged shard gradients are added to the
//     shards' .grad and the parameters return to their sharded views, which frees `full` once the
//     autograd graph has released it (ZeRO-2).
// Unit order is forward order as far as registration order tells it: units sorted by the
// position of their first parameter in module->parameters().
#include "ddp/fully_sharded_data_parallel.h"

#include <algorithm>
#include <exception>  // uncaught_exceptions
#include <map>
#include <numeric>
#include <optional>
#include <unordered_map>

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/utils/lambda_post_hook.h>
#include <torch/csrc/autograd/variable.h>

#include "base/check.h"
#include "ddp/distributed.h"
#include "ddp/error.h"

namespace ddp {
namespace detail {

struct FsdpUnit {
  std::string name;
  std::vector<std::string> param_names;  // as module->named_parameters() names them
  std::vector<at::Tensor> params;        // the module's own parameter tensors
  std::vector<std::vector<int64_t>> shapes;
  std::vector<int64_t> offsets;  // into the flat parameter
  int64_t numel = 0;
  int64_t padded = 0;
  int64_t shard_numel = 0;
  at::Tensor shard;  // [shard_numel], a leaf: this rank's part, stepped by the optimizer
  at::Tensor full;   // [padded] while gathered, else undefined
  // This backward's state.
  size_t ready = 0;
  bool launched = false;
  std::optional<Work> work;
  at::Tensor grad_in;   // [padded]
  at::Tensor grad_out;  // [shard_numel]
};

class FsdpCore {
 public:
  FsdpCore(const std::shared_ptr<torch::nn::Module>& module, FSDPOptions options);
  ~FsdpCore();

  void before_forward();
  void after_forward() noexcept;
  std::vector<at::Tensor> shards() const;
  std::vector<std::pair<std::string, at::Tensor>> full_parameters();
  std::vector<std::pair<std::string, size_t>> units() const;
  ProcessGroup& group() { return *group_; }

 private:
  void form_units(const std::shared_ptr<torch::nn::Module>& module,
                  const std::vector<std::shared_ptr<torch::nn::Module>>& wrapped);
  void shard_unit(FsdpUnit& u, bool sync);
  void gather();  // every unit's full parameters, in place
  void use_sharded_views(FsdpUnit& u);
  void on_gradient(size_t unit);
  void launch(FsdpUnit& u);
  void finalize();

  std::shared_ptr<ProcessGroup> group_;
  FSDPOptions options_;
  int world_ = 1;
  int rank_ = 0;
  std::vector<FsdpUnit> units_;
  // The gradient hooks: one per parameter, removed at destruction.
  std::vector<std::shared_ptr<torch::autograd::Node>> accumulators_;
  std::vector<std::pair<size_t, uintptr_t>> hooks_;  // (accumulator, key)
  bool armed_ = false;                               // a forward ran and its backward has not ended
  bool in_backward_ = false;                         // the end-of-backward callback is queued
  int next_launch_ = -1;                             // the unit to reduce-scatter next (descending)
};

namespace {

int64_t round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

// The parameters `m` holds (recursively), keyed by TensorImpl.
std::unordered_map<const void*, size_t> count_of(const torch::nn::Module& m) {
  std::unordered_map<const void*, size_t> held;
  for (const at::Tensor& p : m.parameters(/*recurse=*/true)) held[p.unsafeGetTensorImpl()] = 0;
  return held;
}

}  // namespace

FsdpCore::FsdpCore(const std::shared_ptr<torch::nn::Module>& module, FSDPOptions options)
    : group_(options.process_group ? options.process_group : default_group()),
      options_(std::move(options)) {
  DDP_CHECK(module != nullptr, ConfigError, "FullyShardedDataParallel: the module is null");
  world_ = group_->size();
  rank_ = group_->rank();
  form_units(module, options_.units);
  // The gradient accumulators first, while every parameter has its full shape: an accumulator
  // checks incoming gradients against the shape its parameter had when it was made.
  for (size_t k = 0; k < units_.size(); ++k) {
    for (const at::Tensor& p : units_[k].params) {
      auto acc = torch::autograd::impl::grad_accumulator(p);
      DDP_ASSERT(acc != nullptr, "a parameter of unit {} has no gradient accumulator",
                 units_[k].name);
      auto key = acc->add_post_hook(std::make_unique<torch::autograd::utils::LambdaPostHook>(
          [this, k](const torch::autograd::variable_list& outputs,
                    const torch::autograd::variable_list&) {
            on_gradient(k);
            return outputs;
          }));
      hooks_.emplace_back(accumulators_.size(), key);
      accumulators_.push_back(std::move(acc));
    }
  }
  for (FsdpUnit& u : units_) shard_unit(u, options_.sync_module_states && world_ > 1);
}

FsdpCore::~FsdpCore() {
  for (const auto& [i, key] : hooks_) accumulators_[i]->del_post_hook(key);
  for (FsdpUnit& u : units_) {
    if (u.work) {
      try {
        u.work->wait();
      } catch (...) {  // an abandoned backward: the buffers must outlive the collective
      }
    }
  }
}

void FsdpCore::form_units(const std::shared_ptr<torch::nn::Module>& module,
                          const std::vector<std::shared_ptr<torch::nn::Module>>& wrapped) {
  std::vector<std::pair<std::string, std::shared_ptr<torch::nn::Module>>> candidates;
  if (wrapped.empty()) {
    for (const auto& child : module->named_children()) {
      if (!child.value()->parameters().empty()) candidates.emplace_back(child.key(), child.value());
    }
  } else {
    // Names from the module tree; a unit outside it is a mistake.
    std::map<const torch::nn::Module*, std::string> names;
    for (const auto& item : module->named_modules("", /*include_self=*/false)) {
      names.emplace(item.value().get(), item.key());
    }
    for (const auto& m : wrapped) {
      DDP_CHECK(m != nullptr, ConfigError, "FullyShardedDataParallel: a unit is null");
      auto it = names.find(m.get());
      DDP_CHECK(it != names.end(), ConfigError,
                "FullyShardedDataParallel: a unit ({}) is not a submodule of the wrapped module; "
                "pass submodules of it (or nothing: one unit per child)",
                m->name());
      candidates.emplace_back(it->second, m);
    }
  }
  // Each parameter goes to the smallest unit holding it: the innermost of nested units.
  const auto named = module->named_parameters(/*recurse=*/true);
  std::vector<size_t> sizes;
  std::vector<std::unordered_map<const void*, size_t>> held;
  for (const auto& c : candidates) {
    held.push_back(count_of(*c.second));
    sizes.push_back(held.back().size());
  }
  constexpr size_t kRoot = static_cast<size_t>(-1);
  std::map<size_t, size_t> unit_of_first;  // candidate (or kRoot) -> its unit index
  std::vector<size_t> owner(named.size(), kRoot);
  for (size_t i = 0; i < named.size(); ++i) {
    const void* key = named[i].value().unsafeGetTensorImpl();
    for (size_t c = 0; c < candidates.size(); ++c) {
      if (held[c].count(key) && (owner[i] == kRoot || sizes[c] < sizes[owner[i]])) owner[i] = c;
    }
  }
  // Units in the order of their first parameter.
  for (size_t i = 0; i < named.size(); ++i) {
    auto [it, fresh] = unit_of_first.emplace(owner[i], units_.size());
    if (fresh) {
      units_.emplace_back();
      units_.back().name = owner[i] == kRoot ? "(root)" : candidates[owner[i]].first;
    }
    FsdpUnit& u = units_[it->second];
    const at::Tensor& p = named[i].value();
    if (!u.params.empty()) {
      const at::Tensor& first = u.params.front();
      DDP_CHECK(p.scalar_type() == first.scalar_type() && p.device() == first.device(), ConfigError,
                "FullyShardedDataParallel: unit '{}' mixes {} on {} ('{}') with {} on {} ('{}'); "
                "a unit's parameters are flattened into one tensor, so they need one dtype and "
                "device: make '{}' a unit of its own",
                u.name, c10::toString(first.scalar_type()), first.device().str(),
                u.param_names.front(), c10::toString(p.scalar_type()), p.device().str(),
                named[i].key(), named[i].key());
    }
    u.param_names.push_back(named[i].key());
    u.params.push_back(p);
    u.shapes.push_back(p.sizes().vec());
    u.offsets.push_back(u.numel);
    u.numel += p.numel();
  }
  for (const auto& c : candidates) {
    bool used = false;
    for (const FsdpUnit& u : units_) used = used || u.name == c.first;
    DDP_CHECK(used, ConfigError,
              "FullyShardedDataParallel: unit '{}' holds no parameter of its own (every one "
              "belongs to a unit inside it); leave it out",
              c.first);
  }
}

void FsdpCore::shard_unit(FsdpUnit& u, bool sync) {
  const at::Tensor& first = u.params.front();
  u.padded = std::max<int64_t>(round_up(u.numel, world_), world_);
  u.shard_numel = u.padded / world_;
  at::Tensor flat = at::zeros({u.padded}, first.options().requires_grad(false));
  {
    at::NoGradGuard no_grad;
    for (size_t i = 0; i < u.params.size(); ++i) {
      flat.narrow(0, u.offsets[i], c10::multiply_integers(u.shapes[i]))
          .copy_(u.params[i].reshape({-1}));
    }
  }
  if (sync) group_->broadcast(flat, 0).wait();
  u.shard = flat.narrow(0, rank_ * u.shard_numel, u.shard_numel).clone().set_requires_grad(true);
  use_sharded_views(u);
}

void FsdpCore::use_sharded_views(FsdpUnit& u) {
  const int64_t begin = rank_ * u.shard_numel;
  const int64_t end = begin + u.shard_numel;
  const at::Tensor data = u.shard.detach();
  for (size_t i = 0; i < u.params.size(); ++i) {
    const int64_t a = std::max(begin, u.offsets[i]);
    const int64_t b = std::min(end, u.offsets[i] + c10::multiply_integers(u.shapes[i]));
    u.params[i].set_data(b > a ? data.narrow(0, a - begin, b - a) : data.narrow(0, 0, 0));
  }
  u.full = at::Tensor();
}

void FsdpCore::gather() {
  std::vector<Work> works;
  for (FsdpUnit& u : units_) {
    u.full = at::empty({u.padded}, u.shard.options().requires_grad(false));
    works.push_back(group_->all_gather_into_tensor(u.full, u.shard.detach()));
  }
  for (Work& w : works) w.wait();
  for (FsdpUnit& u : units_) {
    for (size_t i = 0; i < u.params.size(); ++i) {
      const int64_t n = c10::multiply_integers(u.shapes[i]);
      u.params[i].set_data(u.full.narrow(0, u.offsets[i], n).view(u.shapes[i]));
    }
  }
}

void FsdpCore::before_forward() {
  DDP_CHECK(!in_backward_, Error,
            "[rank {}] FullyShardedDataParallel: a forward started inside a backward", rank_);
  gather();
  for (FsdpUnit& u : units_) {
    u.ready = 0;
    u.launched = false;
  }
  next_launch_ = static_cast<int>(units_.size()) - 1;
  armed_ = at::GradMode::is_enabled();
}

void FsdpCore::after_forward() noexcept {
  if (armed_ && std::uncaught_exceptions() == 0) return;  // the backward frees them (ZeRO-2)
  armed_ = false;
  for (FsdpUnit& u : units_) use_sharded_views(u);
}

void FsdpCore::on_gradient(size_t unit) {
  if (!armed_) return;  // a backward through parameters not gathered by our forward
  if (!in_backward_) {
    in_backward_ = true;
    torch::autograd::Engine::get_default_engine().queue_callback([this] { finalize(); });
  }
  ++units_[unit].ready;
  while (next_launch_ >= 0) {
    FsdpUnit& u = units_[static_cast<size_t>(next_launch_)];
    if (u.ready < u.params.size()) break;
    launch(u);
    --next_launch_;
  }
}

void FsdpCore::launch(FsdpUnit& u) {
  u.grad_in = at::zeros({u.padded}, u.shard.options().requires_grad(false));
  for (size_t i = 0; i < u.params.size(); ++i) {
    at::Tensor& g = u.params[i].mutable_grad();
    if (g.defined()) {
      u.grad_in.narrow(0, u.offsets[i], g.numel()).copy_(g.reshape({-1}));
      g = at::Tensor();  // the full-size gradient is not kept (ZeRO-2)
    }
  }
  u.grad_out = at::empty({u.shard_numel}, u.grad_in.options());
  u.work = group_->reduce_scatter_tensor(u.grad_out, u.grad_in, ReduceOp::kSum);
  u.launched = true;
}

void FsdpCore::finalize() {
  in_backward_ = false;
  armed_ = false;
  for (; next_launch_ >= 0; --next_launch_) launch(units_[static_cast<size_t>(next_launch_)]);
  for (FsdpUnit& u : units_) {
    u.work->wait();
    u.work.reset();
    u.grad_in = at::Tensor();
    if (world_ > 1) u.grad_out.div_(world_);
    at::Tensor& g = u.shard.mutable_grad();
    if (g.defined()) {
      g.add_(u.grad_out);
    } else {
      g = u.grad_out;
    }
    u.grad_out = at::Tensor();
    use_sharded_views(u);
  }
}

std::vector<at::Tensor> FsdpCore::shards() const {
  std::vector<at::Tensor> out;
  for (const FsdpUnit& u : units_) out.push_back(u.shard);
  return out;
}

std::vector<std::pair<std::string, at::Tensor>> FsdpCore::full_parameters() {
  DDP_CHECK(!armed_, Error,
            "[rank {}] FullyShardedDataParallel::full_parameters() between a forward and its "
            "backward; call it between steps",
            rank_);
  gather();
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (FsdpUnit& u : units_) {
    for (size_t i = 0; i < u.params.size(); ++i) {
      out.emplace_back(u.param_names[i], u.params[i].detach().clone());
    }
    use_sharded_views(u);
  }
  return out;
}

std::vector<std::pair<std::string, size_t>> FsdpCore::units() const {
  std::vector<std::pair<std::string, size_t>> out;
  for (const FsdpUnit& u : units_) out.emplace_back(u.name, u.params.size());
  return out;
}

}  // namespace detail

FullyShardedDataParallelBase::FullyShardedDataParallelBase(
    const std::shared_ptr<torch::nn::Module>& module, FSDPOptions options)
    : core_(std::make_unique<detail::FsdpCore>(module, std::move(options))) {}

FullyShardedDataParallelBase::~FullyShardedDataParallelBase() = default;

std::vector<at::Tensor> FullyShardedDataParallelBase::parameters() const { return core_->shards(); }

std::vector<std::pair<std::string, at::Tensor>> FullyShardedDataParallelBase::full_parameters() {
  return core_->full_parameters();
}

std::vector<std::pair<std::string, size_t>> FullyShardedDataParallelBase::units() const {
  return core_->units();
}

ProcessGroup& FullyShardedDataParallelBase::process_group() { return core_->group(); }

void FullyShardedDataParallelBase::before_forward() { core_->before_forward(); }

void FullyShardedDataParallelBase::after_forward() noexcept { core_->after_forward(); }

}  // namespace ddp
