// FullyShardedDataParallel (include/ddp/fully_sharded_data_parallel.h): flat parameters per
// unit, sharded across ranks; all-gathered for forward and backward, gradients reduce-scattered.
//
// Note [FSDP units]
// A unit's parameters, in registration order, are laid end to end in one flat parameter of
// `numel` elements, padded with zeros to `padded` (a multiple of the world size W) and cut into W
// shards of `padded / W`; rank r keeps shard r as a leaf tensor of its own (`shard`), which is
// what the optimizer steps. The module's parameters stay the autograd leaves the module's code
// uses, but their data moves (set_data, which keeps each one's identity, version counter and
// gradient accumulator; the accumulators are made first, while the parameters have their full
// shapes, since an accumulator checks gradients against the shape it was made with):
//   - between steps, each is a 1-D view of the part of it inside this rank's shard (empty when
//     none is), as FSDP1 with use_orig_params shows them: reading one never touches freed
//     memory, and the optimizer's updates show through;
//   - gathered, each is its full-shaped view of `full` (padded elements), which an all_gather
//     of every rank's shard fills. `full` is one tensor for the unit's life; freeing it frees
//     its storage's bytes in place (the StorageImpl stays, with no memory), and gathering again
//     gives the same storage new bytes, as FSDP1 resizes its flat parameter's storage. That
//     matters for ZeRO-3: the autograd graph keeps views of the parameters made in the forward
//     (a Linear's weight.t()), which share that storage, so they see the values again when the
//     backward gathers the unit, and keep no memory alive while it is freed;
//   - in the backward, a post hook on each parameter's gradient accumulator counts the unit's
//     gradients; a complete unit is flattened into `padded` elements and reduce-scattered (sum,
//     then divided by W: the average, as DDP's), the full-size gradients dropped at once, and a
//     ZeRO-3 unit freed. One reduce-scatter is in flight at a time (FSDP2's choice): launching
//     a unit's first completes the previous one's and drops its flat gradient, so a backward
//     holds at most two units' full gradients (the first ZeRO-3 run under a memory limit held
//     every unit's until the backward ended: the model's whole gradient). Units are launched in reverse unit order only, so that every rank
//     issues the same collectives in the same order whatever order its gradients arrive in; a
//     unit still incomplete when the backward ends (a parameter unused on this rank) is launched
//     then, its missing gradients as zeros, on every rank alike;
//   - when the backward ends (an engine callback), the averaged shard gradients are added to the
//     shards' .grad and every unit is back on its shard (ZeRO-2's free).
// ZeRO-3 (a ddp::Sharded unit under kFullShard): its forward gathers it (the next Sharded unit's
// all_gather started first, so it runs during this unit's compute), then frees it and returns
// its output through PreBackward, an identity whose backward gathers the unit again (the
// previous Sharded unit's all_gather started) before the unit's own backward runs. All of it
// happens in the same order on every rank: the forward's order, and the autograd engine's,
// which is the same for the same graph.
// Unit order is forward order as far as registration order tells it: units sorted by the
// position of their first parameter in module->parameters().
//
// Note [FSDP mixed precision]
// With a param_dtype other than the parameters' own, `shard` keeps the parameters' dtype (the
// optimizer steps it there, as FSDP1 keeps its sharded flat parameter in full precision) and
// `full` is a param_dtype tensor: a gather first casts the shard into `shard_lp` (FSDP1's
// _mp_shard) and all-gathers that. The module's parameters are param_dtype for good: set_data
// with another dtype would drop a parameter's gradient accumulator, and with it our hook, so
// they change dtype once, at construction, before the accumulators are made (at their full
// shapes, as above), and from then on only view `full` (gathered) or `shard_lp` (between
// steps). Their gradients come in param_dtype; launch() copies them into a reduce_dtype flat
// gradient (fp32: the sum of the ranks' low-precision gradients without rounding in between),
// and complete_reduce() adds the average to the shard's .grad in the shard's dtype. A group that
// cannot sum reduce_dtype (Gloo in LibTorch 1.13 has no bfloat16 sum) gets the gradients rounded
// to it, widened to float32 for the wire, and the sum rounded back: what a bfloat16 reduction
// that accumulates in float (ours over shm) gives, at twice the bytes. Whole
// parameters for a checkpoint or for full_parameters() are all-gathered from the shards
// themselves, never from `full`: a model saved under mixed precision loses nothing (FSDP1's
// state_dict gathers at full precision too). Under no_sync the gradients accumulate on the
// parameters, in param_dtype (FSDP1 keeps them there as well).
#include "ddp/fully_sharded_data_parallel.h"

#include <algorithm>
#include <cmath>
#include <exception>  // uncaught_exceptions
#include <map>
#include <numeric>
#include <optional>
#include <unordered_map>
#include <utility>  // exchange

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <fmt/ranges.h>  // fmt::join
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/utils/lambda_post_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/version.h>

#include "base/check.h"
#include "ddp/distributed.h"
#include "ddp/error.h"
#include "ddp/stateful.h"  // IncompatibleStateError
#include "parallel/fsdp_buffers.h"
#include "process_group/transport/tensors.h"    // dtype_of
#include "process_group/transport/transport.h"  // capabilities_of

namespace ddp {
namespace detail {

struct FsdpUnit {
  enum class State { kSharded, kGathering, kGathered };
  std::string name;
  std::vector<std::string> param_names;  // full_parameters()' names (no Sharded "module.")
  std::vector<at::Tensor> params;        // the module's own parameter tensors
  std::vector<std::vector<int64_t>> shapes;
  std::vector<int64_t> offsets;  // into the flat parameter
  int64_t numel = 0;
  int64_t padded = 0;
  int64_t shard_numel = 0;
  ShardedBase* sharded = nullptr;  // a ddp::Sharded unit: gathers itself (ZeRO-3)
  at::Tensor shard;  // [shard_numel], a leaf: this rank's part, stepped by the optimizer
  // Mixed precision: [shard_numel] in param_dtype, the shard as cast for the last gather; what
  // the module's parameters view between steps. Undefined without (they view `shard`).
  at::Tensor shard_lp;
  at::Tensor full;  // [padded], in param_dtype: its storage has bytes only while gathered
  // What the gradients are summed in (Note [FSDP mixed precision]), and what they travel in:
  // the same, or float32 where the group cannot sum it (Gloo in LibTorch 1.13 and bfloat16).
  at::ScalarType reduce_dtype = at::kFloat;
  at::ScalarType wire_dtype = at::kFloat;
  State state = State::kSharded;
  std::optional<Work> gathering;
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
  void before_unit_forward(size_t k);
  at::Tensor after_unit_forward(size_t k, at::Tensor out);
  void unit_forward_failed(size_t k) noexcept;
  void before_unit_backward(size_t k);
  at::Tensor cast_input(const at::Tensor& input) const;
  std::vector<at::Tensor> shards() const;
  void for_each_full_parameter(const FullyShardedDataParallelBase::FullParameterVisitor& each);
  std::vector<FullyShardedDataParallelBase::LocalShard> local_shards();
  const std::vector<std::pair<std::string, at::Tensor>>& buffers() const { return buffers_; }
  std::string check_full(const std::vector<std::pair<std::string, at::Tensor>>& full) const;
  void load_full(const std::vector<std::pair<std::string, at::Tensor>>& full);
  std::vector<std::pair<std::string, size_t>> units() const;
  FSDPMemoryStats memory_stats() const;
  void reset_peak() { peak_gathered_ = gathered_; }
  bool set_no_sync(bool on) { return std::exchange(no_sync_, on); }
  double clip_grad_norm(double max_norm);
  ProcessGroup& group() { return *group_; }

 private:
  // The constructor's part that may fail after units are bound (a broadcast): undone by it.
  void construct();
  void check_mixed_precision() const;
  void form_units(const std::shared_ptr<torch::nn::Module>& module,
                  const std::vector<std::shared_ptr<torch::nn::Module>>& wrapped);
  void shard_unit(FsdpUnit& u, bool sync);
  at::Tensor gather_source(FsdpUnit& u);
  void start_gather(FsdpUnit& u);
  void finish_gather(FsdpUnit& u);
  void reshard(FsdpUnit& u) noexcept;
  bool zero3(const FsdpUnit& u) const {
    return u.sharded != nullptr && options_.sharding_strategy == ShardingStrategy::kFullShard;
  }
  // The Sharded unit after (+1) or before (-1) unit k, in unit order; nullptr at either end.
  FsdpUnit* neighbour(size_t k, int direction);
  void on_gradient(size_t unit);
  void launch(FsdpUnit& u);
  void complete_reduce(FsdpUnit& u);
  void finalize();

  std::shared_ptr<ProcessGroup> group_;
  FSDPOptions options_;
  int world_ = 1;
  int rank_ = 0;
  std::vector<FsdpUnit> units_;
  std::vector<std::pair<std::string, at::Tensor>> buffers_;  // the module's, by clean name
  // The gradient hooks: one per parameter, removed at destruction.
  std::vector<std::shared_ptr<torch::autograd::Node>> accumulators_;
  std::vector<std::pair<size_t, uintptr_t>> hooks_;  // (accumulator, key)
  bool armed_ = false;        // a forward ran with grad mode and its backward has not ended
  bool in_backward_ = false;  // the end-of-backward callback is queued
  int next_launch_ = -1;      // the unit to reduce-scatter next (descending)
  FsdpUnit* in_flight_ = nullptr;  // the unit whose reduce-scatter runs (at most one)
  bool no_sync_ = false;      // FSDPNoSyncGuard: keep the full gradients, reduce nothing
  std::shared_ptr<BufferPool> pool_;  // large CPU flat buffers (Note [FSDP buffers])
  int64_t gathered_ = 0;      // bytes of the units' flat storages that hold bytes now
  int64_t peak_gathered_ = 0;
};

namespace {

int64_t round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

// Whether a flat buffer of `bytes` on `device` comes from the BufferPool (Note [FSDP buffers]).
bool pooled(const c10::Device& device, size_t bytes) {
  return device.is_cpu() && bytes >= BufferPool::kMinBytes;
}

// `t`'s storage without bytes, and with `bytes` again (Note [FSDP units]): in place, so that
// every view of it, the autograd graph's included, follows. The pool's on the CPU (large), else
// the storage's own allocator (CUDA's caching allocator keeps its blocks itself).
void free_storage(const at::Tensor& t) {
  c10::StorageImpl* s = t.storage().unsafeGetStorageImpl();
  s->set_data_ptr_noswap(c10::DataPtr(nullptr, s->device()));
  s->set_nbytes(static_cast<size_t>(0));
}
void allocate_storage(const at::Tensor& t, BufferPool& pool) {
  c10::StorageImpl* s = t.storage().unsafeGetStorageImpl();
  const size_t bytes = static_cast<size_t>(t.numel()) * t.element_size();
  s->set_data_ptr_noswap(pooled(t.device(), bytes) ? pool.take(bytes)
                                                   : s->allocator()->allocate(bytes));
  s->set_nbytes(bytes);
}

// A 1-D tensor of `numel` elements, uninitialised, its storage from the pool when it is large
// and on the CPU; flat_zeros() zeroed.
at::Tensor flat_empty(int64_t numel, const at::TensorOptions& options, BufferPool& pool) {
  const size_t bytes =
      static_cast<size_t>(numel) * c10::elementSize(options.dtype().toScalarType());
  if (!pooled(options.device(), bytes)) return at::empty({numel}, options);
  c10::Storage storage(c10::Storage::use_byte_size_t(), bytes, pool.take(bytes),
                       /*allocator=*/nullptr, /*resizable=*/false);
  return at::empty({0}, options).set_(storage, 0, {numel}, {1});
}
at::Tensor flat_zeros(int64_t numel, const at::TensorOptions& options, BufferPool& pool) {
  return flat_empty(numel, options, pool).zero_();
}

// ZeRO-3's pre-backward hook: an identity on a Sharded unit's output whose backward gathers the
// unit's parameters before the unit's own backward uses them.
struct PreBackward : public torch::autograd::Function<PreBackward> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& out,
                            int64_t core, int64_t unit) {
    ctx->saved_data["core"] = core;
    ctx->saved_data["unit"] = unit;
    return out.view_as(out);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto* core = reinterpret_cast<FsdpCore*>(ctx->saved_data["core"].toInt());
    core->before_unit_backward(static_cast<size_t>(ctx->saved_data["unit"].toInt()));
    return {grads[0], at::Tensor(), at::Tensor()};
  }
};

// `key` without the "module." that each Sharded unit (paths in `sharded`) puts before its
// module's names: "fc1.module.weight" -> "fc1.weight". The innermost first.
std::string clean_name(std::string key, const std::vector<std::string>& sharded) {
  for (const std::string& path : sharded) {
    const std::string prefix = path.empty() ? "module." : path + ".module.";
    if (key.rfind(prefix, 0) == 0) {
      key = (path.empty() ? "" : path + ".") + key.substr(prefix.size());
    }
  }
  return key;
}

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
  check_mixed_precision();
  // Idle buffers kept: a step's working set, so that a steady step maps nothing new: the units
  // gathered for the whole step (every unit under ZeRO-2) plus four of the largest (ZeRO-3's two
  // gathered units, two flat gradients). Bounded by four of the largest alone, ZeRO-2 mapped
  // and faulted in its units every step: mlp-1024 at 0.79x DDP's speed instead of 0.91x.
  size_t largest = 0, whole_step = 0;
  for (const FsdpUnit& u : units_) {
    const size_t bytes =
        static_cast<size_t>(round_up(u.numel, world_)) * u.params.front().element_size();
    largest = std::max(largest, bytes);
    if (!zero3(u)) whole_step += bytes;
  }
  pool_ = std::make_shared<BufferPool>(whole_step + 4 * largest);
  bool any_sharded = false;
  for (const FsdpUnit& u : units_) {
    if (u.sharded == nullptr) continue;
    DDP_CHECK(u.sharded->core_ == nullptr, ConfigError,
              "FullyShardedDataParallel: unit '{}' is already in another "
              "FullyShardedDataParallel",
              u.name);
    any_sharded = true;
  }
  DDP_CHECK(any_sharded || options_.sharding_strategy != ShardingStrategy::kFullShard, ConfigError,
            "FullyShardedDataParallel: ShardingStrategy::kFullShard (ZeRO-3) frees a unit's "
            "parameters when its forward returns, which needs that forward to pass through "
            "ddp::Sharded<M> (LibTorch's modules have no forward hooks); the module has no "
            "Sharded unit. Build its units as ddp::Sharded<M>, or use kShardGradOp");
  try {
    construct();
  } catch (...) {  // a failed construction leaves no unit pointing at it
    for (const FsdpUnit& u : units_) {
      if (u.sharded != nullptr && u.sharded->core_ == this) u.sharded->core_ = nullptr;
    }
    for (const auto& [i, key] : hooks_) accumulators_[i]->del_post_hook(key);
    throw;
  }
}

void FsdpCore::check_mixed_precision() const {
  const MixedPrecision& mp = options_.mixed_precision;
  for (const auto& [what, dtype] :
       {std::pair{"param_dtype", mp.param_dtype}, std::pair{"reduce_dtype", mp.reduce_dtype},
        std::pair{"buffer_dtype", mp.buffer_dtype}}) {
    DDP_CHECK(!dtype || at::isFloatingType(*dtype), ConfigError,
              "FullyShardedDataParallel: mixed_precision.{} is {}; it must be a floating-point "
              "dtype (torch::kBFloat16, torch::kHalf, torch::kFloat)",
              what, c10::toString(*dtype));
  }
  if (!mp.param_dtype) return;
  for (const FsdpUnit& u : units_) {
    const at::Tensor& p = u.params.front();
    DDP_CHECK(p.is_floating_point(), ConfigError,
              "FullyShardedDataParallel: mixed_precision.param_dtype casts parameters, and unit "
              "'{}' holds {} ones ('{}'); leave param_dtype unset",
              u.name, c10::toString(p.scalar_type()), u.param_names.front());
#if TORCH_VERSION_MAJOR < 2
    DDP_CHECK(*mp.param_dtype != at::kHalf || !p.device().is_cpu(), ConfigError,
              "FullyShardedDataParallel: mixed_precision.param_dtype fp16 on the CPU: LibTorch "
              "{} has no fp16 matrix products there ('addmm_impl_cpu_' not implemented for "
              "'Half'); use torch::kBFloat16, or CUDA",
              TORCH_VERSION);
#endif
  }
}

void FsdpCore::construct() {
  for (size_t k = 0; k < units_.size(); ++k) {
    if (units_[k].sharded != nullptr) {
      units_[k].sharded->core_ = this;
      units_[k].sharded->unit_ = k;
    }
  }
  // The collectives first (rank 0's values to every rank), changing nothing of the module, so a
  // failed construction leaves it as it was.
  const bool sync = options_.sync_module_states && world_ > 1;
  for (FsdpUnit& u : units_) shard_unit(u, sync);
  // The buffers too (PyTorch's sync_module_states broadcasts both): every rank starts from rank
  // 0's running statistics; from then on each rank's are its own.
  if (sync) {
    at::NoGradGuard no_grad;
    for (auto& [name, b] : buffers_) group_->broadcast(b, 0).wait();
  }
  if (const auto& dtype = options_.mixed_precision.buffer_dtype) {
    for (auto& [name, b] : buffers_) {
      if (b.is_floating_point()) b.set_data(b.detach().to(*dtype));
    }
  }
  // Every parameter a full-shaped view of its unit's `full` (param_dtype), then the gradient
  // accumulators, while the parameters have their full shapes and final dtype: an accumulator
  // checks incoming gradients against the shape its parameter had when it was made, and
  // set_data with another dtype would drop it (Note [FSDP mixed precision]).
  for (FsdpUnit& u : units_) {
    for (size_t i = 0; i < u.params.size(); ++i) {
      const int64_t n = c10::multiply_integers(u.shapes[i]);
      u.params[i].set_data(u.full.narrow(0, u.offsets[i], n).view(u.shapes[i]));
    }
  }
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
  for (FsdpUnit& u : units_) reshard(u);
  peak_gathered_ = 0;
}

FsdpCore::~FsdpCore() {
  for (const auto& [i, key] : hooks_) accumulators_[i]->del_post_hook(key);
  for (FsdpUnit& u : units_) {
    if (u.sharded != nullptr) u.sharded->core_ = nullptr;
    if (u.gathering) {
      try {
        u.gathering->wait();
      } catch (...) {
      }
    }
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
  // Names from the module tree; every Sharded submodule is a unit.
  std::map<const torch::nn::Module*, std::string> names;
  std::vector<std::string> sharded_paths;
  for (const auto& item : module->named_modules("", /*include_self=*/true)) {
    names.emplace(item.value().get(), item.key());
    if (dynamic_cast<ShardedBase*>(item.value().get()) != nullptr) {
      sharded_paths.push_back(item.key());
      if (item.value() != module) candidates.emplace_back(item.key(), item.value());
    }
  }
  // The innermost first (the longest path), for clean_name.
  std::sort(sharded_paths.begin(), sharded_paths.end(),
            [](const std::string& a, const std::string& b) { return a.size() > b.size(); });
  for (const auto& b : module->named_buffers()) {
    buffers_.emplace_back(clean_name(b.key(), sharded_paths), b.value());
  }
  if (wrapped.empty() && candidates.empty()) {
    for (const auto& child : module->named_children()) {
      if (!child.value()->parameters().empty()) candidates.emplace_back(child.key(), child.value());
    }
  } else {
    for (const auto& m : wrapped) {
      DDP_CHECK(m != nullptr, ConfigError, "FullyShardedDataParallel: a unit is null");
      auto it = names.find(m.get());
      DDP_CHECK(it != names.end() && m != module, ConfigError,
                "FullyShardedDataParallel: a unit ({}) is not a submodule of the wrapped module; "
                "pass submodules of it (or nothing: one unit per child)",
                m->name());
      bool listed = false;
      for (const auto& c : candidates) listed = listed || c.second == m;
      if (!listed) candidates.emplace_back(it->second, m);
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
      if (owner[i] != kRoot) {
        units_.back().sharded = dynamic_cast<ShardedBase*>(candidates[owner[i]].second.get());
      }
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
    u.param_names.push_back(clean_name(named[i].key(), sharded_paths));
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

// u's flat parameter from the module's parameters (rank 0's with `sync`), this rank's shard cut
// from it, and `full` made in param_dtype, gathered (its values the flat parameter's, cast);
// the module's parameters untouched.
void FsdpCore::shard_unit(FsdpUnit& u, bool sync) {
  const at::Tensor& first = u.params.front();
  u.padded = std::max<int64_t>(round_up(u.numel, world_), world_);
  u.shard_numel = u.padded / world_;
  at::Tensor flat = flat_zeros(u.padded, first.options().requires_grad(false), *pool_);
  {
    at::NoGradGuard no_grad;
    for (size_t i = 0; i < u.params.size(); ++i) {
      flat.narrow(0, u.offsets[i], c10::multiply_integers(u.shapes[i]))
          .copy_(u.params[i].reshape({-1}));
    }
  }
  if (sync) group_->broadcast(flat, 0).wait();
  u.shard = flat.narrow(0, rank_ * u.shard_numel, u.shard_numel).clone().set_requires_grad(true);
  const std::optional<at::ScalarType>& dtype = options_.mixed_precision.param_dtype;
  if (dtype && *dtype != first.scalar_type()) {
    u.shard_lp = at::empty({u.shard_numel}, first.options().dtype(*dtype).requires_grad(false));
    u.full = flat_empty(u.padded, u.shard_lp.options(), *pool_);
    u.full.copy_(flat);
  } else {
    u.full = flat;
  }
  u.state = FsdpUnit::State::kGathered;
  gathered_ += static_cast<int64_t>(u.full.nbytes());
  u.reduce_dtype = options_.mixed_precision.reduce_dtype.value_or(u.full.scalar_type());
  const Capabilities& caps = capabilities_of(*group_, first.device().type());
  u.wire_dtype = caps.can_reduce(transport::dtype_of(u.reduce_dtype)) ? u.reduce_dtype : at::kFloat;
}

// What a gather sends of u: its shard, cast to param_dtype first under mixed precision.
at::Tensor FsdpCore::gather_source(FsdpUnit& u) {
  if (!u.shard_lp.defined()) return u.shard.detach();
  at::NoGradGuard no_grad;
  u.shard_lp.copy_(u.shard.detach());
  return u.shard_lp;
}

void FsdpCore::start_gather(FsdpUnit& u) {
  if (u.state != FsdpUnit::State::kSharded) return;
  allocate_storage(u.full, *pool_);
  gathered_ += static_cast<int64_t>(u.full.nbytes());
  peak_gathered_ = std::max(peak_gathered_, gathered_);
  u.gathering = group_->all_gather_into_tensor(u.full, gather_source(u));
  u.state = FsdpUnit::State::kGathering;
}

void FsdpCore::finish_gather(FsdpUnit& u) {
  start_gather(u);
  if (u.state != FsdpUnit::State::kGathering) return;
  u.gathering->wait();
  u.gathering.reset();
  for (size_t i = 0; i < u.params.size(); ++i) {
    const int64_t n = c10::multiply_integers(u.shapes[i]);
    u.params[i].set_data(u.full.narrow(0, u.offsets[i], n).view(u.shapes[i]));
  }
  u.state = FsdpUnit::State::kGathered;
}

void FsdpCore::reshard(FsdpUnit& u) noexcept {
  if (u.state == FsdpUnit::State::kGathering) {
    try {
      u.gathering->wait();
    } catch (...) {  // the group failed: the next collective says so
    }
    u.gathering.reset();
  }
  if (u.state == FsdpUnit::State::kSharded) return;
  const int64_t begin = rank_ * u.shard_numel;
  const int64_t end = begin + u.shard_numel;
  const at::Tensor data = u.shard_lp.defined() ? u.shard_lp : u.shard.detach();
  for (size_t i = 0; i < u.params.size(); ++i) {
    const int64_t a = std::max(begin, u.offsets[i]);
    const int64_t b = std::min(end, u.offsets[i] + c10::multiply_integers(u.shapes[i]));
    u.params[i].set_data(b > a ? data.narrow(0, a - begin, b - a) : data.narrow(0, 0, 0));
  }
  gathered_ -= static_cast<int64_t>(u.full.nbytes());
  free_storage(u.full);
  u.state = FsdpUnit::State::kSharded;
}

FsdpUnit* FsdpCore::neighbour(size_t k, int direction) {
  for (auto j = static_cast<int64_t>(k) + direction;
       j >= 0 && j < static_cast<int64_t>(units_.size()); j += direction) {
    if (units_[static_cast<size_t>(j)].sharded != nullptr) return &units_[static_cast<size_t>(j)];
  }
  return nullptr;
}

void FsdpCore::before_forward() {
  DDP_CHECK(!in_backward_, Error,
            "[rank {}] FullyShardedDataParallel: a forward started inside a backward", rank_);
  // What the forward needs first: every unit (ZeRO-2), or the units that do not gather
  // themselves and the first Sharded one (ZeRO-3); all in flight at once.
  std::vector<FsdpUnit*> now;
  for (FsdpUnit& u : units_) {
    if (!zero3(u)) now.push_back(&u);
  }
  for (FsdpUnit* u : now) start_gather(*u);
  if (FsdpUnit* first = neighbour(static_cast<size_t>(-1), +1); first != nullptr && zero3(*first)) {
    start_gather(*first);
  }
  for (FsdpUnit* u : now) finish_gather(*u);
  for (FsdpUnit& u : units_) {
    u.ready = 0;
    u.launched = false;
    if (u.work) {  // a backward abandoned midway (it threw): its reduction is dropped
      try {
        u.work->wait();
      } catch (...) {  // the group failed: the next collective says so
      }
      u.work.reset();
      u.grad_in = u.grad_out = at::Tensor();
    }
  }
  in_flight_ = nullptr;
  next_launch_ = static_cast<int>(units_.size()) - 1;
  armed_ = at::GradMode::is_enabled();
}

void FsdpCore::after_forward() noexcept {
  if (armed_ && std::uncaught_exceptions() == 0) return;  // the backward frees them
  armed_ = false;
  for (FsdpUnit& u : units_) reshard(u);
}

at::Tensor FsdpCore::cast_input(const at::Tensor& input) const {
  const MixedPrecision& mp = options_.mixed_precision;
  if (!mp.param_dtype || !mp.cast_forward_inputs || !input.defined() ||
      !input.is_floating_point() || input.scalar_type() == *mp.param_dtype) {
    return input;
  }
  return input.to(*mp.param_dtype);
}

void FsdpCore::before_unit_forward(size_t k) {
  FsdpUnit& u = units_[k];
  start_gather(u);
  if (zero3(u)) {
    if (FsdpUnit* next = neighbour(k, +1); next != nullptr) start_gather(*next);  // prefetch
  }
  finish_gather(u);
}

at::Tensor FsdpCore::after_unit_forward(size_t k, at::Tensor out) {
  FsdpUnit& u = units_[k];
  if (!zero3(u)) return out;  // gathered until the backward ends (ZeRO-2)
  if (armed_ && out.requires_grad()) {
    out = PreBackward::apply(out, reinterpret_cast<int64_t>(this), static_cast<int64_t>(k));
  }
  reshard(u);
  return out;
}

void FsdpCore::unit_forward_failed(size_t k) noexcept {
  if (zero3(units_[k])) reshard(units_[k]);
}

void FsdpCore::before_unit_backward(size_t k) {
  FsdpUnit& u = units_[k];
  start_gather(u);
  if (FsdpUnit* previous = neighbour(k, -1); previous != nullptr && zero3(*previous)) {
    start_gather(*previous);  // prefetch: the backward reaches it next
  }
  finish_gather(u);
}

void FsdpCore::on_gradient(size_t unit) {
  if (!armed_) return;  // a backward through parameters not gathered by our forward
  if (!in_backward_) {
    in_backward_ = true;
    torch::autograd::Engine::get_default_engine().queue_callback([this] { finalize(); });
  }
  ++units_[unit].ready;
  if (no_sync_) return;  // finalize() frees the parameters; the gradients stay, summed
  while (next_launch_ >= 0) {
    FsdpUnit& u = units_[static_cast<size_t>(next_launch_)];
    if (u.ready < u.params.size()) break;
    launch(u);
    --next_launch_;
  }
}

void FsdpCore::launch(FsdpUnit& u) {
  // One reduce-scatter in flight (FSDP2's choice): the previous unit's ran during this unit's
  // backward; its full-size gradient goes before this one's is made, so a backward holds at
  // most two units' full gradients, not the model's.
  if (in_flight_ != nullptr) complete_reduce(*in_flight_);
  u.grad_in =
      flat_zeros(u.padded, u.shard.options().dtype(u.wire_dtype).requires_grad(false), *pool_);
  for (size_t i = 0; i < u.params.size(); ++i) {
    at::Tensor& g = u.params[i].mutable_grad();
    if (g.defined()) {
      at::Tensor flat = g.reshape({-1});
      if (flat.scalar_type() != u.reduce_dtype) flat = flat.to(u.reduce_dtype);  // rounded so
      u.grad_in.narrow(0, u.offsets[i], g.numel()).copy_(flat);
      g = at::Tensor();  // the full-size gradient is not kept
    }
  }
  u.grad_out = flat_empty(u.shard_numel, u.grad_in.options(), *pool_);
  u.work = group_->reduce_scatter_tensor(u.grad_out, u.grad_in, ReduceOp::kSum);
  u.launched = true;
  in_flight_ = &u;
  if (zero3(u)) reshard(u);  // its backward is over: every gradient of it has arrived
}

void FsdpCore::finalize() {
  in_backward_ = false;
  armed_ = false;
  if (no_sync_) {
    for (FsdpUnit& u : units_) reshard(u);
    return;
  }
  for (; next_launch_ >= 0; --next_launch_) launch(units_[static_cast<size_t>(next_launch_)]);
  if (in_flight_ != nullptr) complete_reduce(*in_flight_);
  for (FsdpUnit& u : units_) reshard(u);
}

// u's reduce-scatter waited for: the average added to its shard's gradient, the full-size
// gradient dropped.
void FsdpCore::complete_reduce(FsdpUnit& u) {
  in_flight_ = nullptr;
  u.work->wait();
  u.work.reset();
  u.grad_in = at::Tensor();
  if (u.grad_out.scalar_type() != u.reduce_dtype) u.grad_out = u.grad_out.to(u.reduce_dtype);
  if (world_ > 1) u.grad_out.div_(world_);
  at::Tensor& g = u.shard.mutable_grad();
  if (g.defined()) {
    g.add_(u.grad_out);
  } else {
    g = u.grad_out.scalar_type() == u.shard.scalar_type() ? u.grad_out
                                                          : u.grad_out.to(u.shard.scalar_type());
  }
  u.grad_out = at::Tensor();
}

std::vector<at::Tensor> FsdpCore::shards() const {
  std::vector<at::Tensor> out;
  for (const FsdpUnit& u : units_) out.push_back(u.shard);
  return out;
}

void FsdpCore::for_each_full_parameter(
    const FullyShardedDataParallelBase::FullParameterVisitor& each) {
  DDP_CHECK(!armed_, Error,
            "[rank {}] FullyShardedDataParallel::full_parameters() between a forward and its "
            "backward; call it between steps",
            rank_);
  // One unit whole at a time, so the model is never whole twice over (the first GPU run read a
  // ZeRO-3 peak of the whole model here).
  for (FsdpUnit& u : units_) {
    // The shards' own values: under mixed precision `full` holds them cast (Note [FSDP mixed
    // precision]), so they are gathered apart.
    at::Tensor whole;
    if (u.shard_lp.defined()) {
      whole = flat_empty(u.padded, u.shard.options().requires_grad(false), *pool_);
      group_->all_gather_into_tensor(whole, u.shard.detach()).wait();
    } else {
      finish_gather(u);
      whole = u.full;
    }
    try {
      for (size_t i = 0; i < u.params.size(); ++i) {
        const int64_t n = c10::multiply_integers(u.shapes[i]);
        each(u.param_names[i], whole.narrow(0, u.offsets[i], n).view(u.shapes[i]));
      }
    } catch (...) {
      reshard(u);
      throw;
    }
    reshard(u);
  }
}

std::vector<FullyShardedDataParallelBase::LocalShard> FsdpCore::local_shards() {
  DDP_CHECK(!armed_, Error,
            "[rank {}] FullyShardedDataParallel: its shards taken between a forward and its "
            "backward; take them between steps",
            rank_);
  std::vector<FullyShardedDataParallelBase::LocalShard> out;
  for (size_t k = 0; k < units_.size(); ++k) {
    FsdpUnit& u = units_[k];
    const int64_t begin = rank_ * u.shard_numel;
    const int64_t end = begin + u.shard_numel;
    const at::Tensor shard = u.shard.detach();
    for (size_t i = 0; i < u.params.size(); ++i) {
      const int64_t a = std::max(begin, u.offsets[i]);
      const int64_t b = std::min(end, u.offsets[i] + c10::multiply_integers(u.shapes[i]));
      FullyShardedDataParallelBase::LocalShard part{u.param_names[i], u.shapes[i], 0, {}, k, 0};
      if (b > a) {
        part.offset = a - u.offsets[i];
        part.shard_offset = a - begin;
        part.data = shard.narrow(0, a - begin, b - a);
      } else {
        part.data = shard.narrow(0, 0, 0);
      }
      out.push_back(std::move(part));
    }
  }
  return out;
}

std::string FsdpCore::check_full(
    const std::vector<std::pair<std::string, at::Tensor>>& full) const {
  std::map<std::string, const at::Tensor*> by_name;
  for (const auto& [name, t] : full) by_name[name] = &t;
  std::vector<std::string> why;
  size_t mine = 0;
  for (const FsdpUnit& u : units_) {
    for (size_t i = 0; i < u.params.size(); ++i, ++mine) {
      auto it = by_name.find(u.param_names[i]);
      if (it == by_name.end() || !it->second->defined()) {
        why.push_back(fmt::format("'{}' is missing", u.param_names[i]));
      } else if (it->second->sizes().vec() != u.shapes[i] ||
                 it->second->scalar_type() != u.shard.scalar_type()) {
        why.push_back(fmt::format("'{}' is {} {} there, {} {} here", u.param_names[i],
                                  c10::str(it->second->sizes()),
                                  c10::toString(it->second->scalar_type()),
                                  c10::str(c10::IntArrayRef(u.shapes[i])),
                                  c10::toString(u.shard.scalar_type())));
      }
    }
  }
  if (by_name.size() > mine) {
    why.push_back(
        fmt::format("{} parameter(s) there that this model does not have", by_name.size() - mine));
  }
  return why.empty() ? "" : fmt::format("{}", fmt::join(why, "; "));
}

void FsdpCore::load_full(const std::vector<std::pair<std::string, at::Tensor>>& full) {
  DDP_CHECK(!armed_, Error,
            "[rank {}] FullyShardedDataParallel: parameters loaded between a forward and its "
            "backward",
            rank_);
  if (std::string why = check_full(full); !why.empty()) {
    throw IncompatibleStateError(
        fmt::format("[rank {}] FullyShardedDataParallel: the parameters do not fit: {}", rank_,
                    why));
  }
  std::map<std::string, const at::Tensor*> by_name;
  for (const auto& [name, t] : full) by_name[name] = &t;
  at::NoGradGuard no_grad;
  for (FsdpUnit& u : units_) {
    reshard(u);
    const int64_t begin = rank_ * u.shard_numel;
    const int64_t end = begin + u.shard_numel;
    u.shard.detach().zero_();  // the padding stays zero
    for (size_t i = 0; i < u.params.size(); ++i) {
      const int64_t a = std::max(begin, u.offsets[i]);
      const int64_t b = std::min(end, u.offsets[i] + c10::multiply_integers(u.shapes[i]));
      if (b <= a) continue;
      const at::Tensor flat = by_name.at(u.param_names[i])->reshape({-1});
      u.shard.detach().narrow(0, a - begin, b - a).copy_(flat.narrow(0, a - u.offsets[i], b - a));
    }
    if (u.shard_lp.defined()) gather_source(u);  // the module's parameters show what was loaded
  }
}

double FsdpCore::clip_grad_norm(double max_norm) {
  DDP_CHECK(max_norm > 0, ConfigError,
            "[rank {}] FullyShardedDataParallel::clip_grad_norm_: max_norm must be positive, "
            "not {}",
            rank_, max_norm);
  at::Tensor sum = at::zeros({1}, at::kDouble);
  for (const FsdpUnit& u : units_) {
    if (u.shard.grad().defined()) {
      sum += u.shard.grad().to(at::kDouble).pow(2).sum().cpu();  // padding's gradient is 0
    }
  }
  group_->all_reduce(sum, ReduceOp::kSum).wait();
  const double norm = std::sqrt(sum.item<double>());
  const double coefficient = max_norm / (norm + 1e-6);
  if (coefficient < 1) {
    for (FsdpUnit& u : units_) {
      if (u.shard.grad().defined()) u.shard.mutable_grad().mul_(coefficient);
    }
  }
  return norm;
}

FSDPMemoryStats FsdpCore::memory_stats() const {
  FSDPMemoryStats s;
  for (const FsdpUnit& u : units_) {
    s.shard_bytes += static_cast<int64_t>(u.shard.nbytes());
    if (u.shard_lp.defined()) s.shard_bytes += static_cast<int64_t>(u.shard_lp.nbytes());
    s.full_bytes += u.numel * static_cast<int64_t>(u.shard.element_size());
  }
  s.peak_gathered_bytes = peak_gathered_;
  s.cached_bytes = static_cast<int64_t>(pool_->idle_bytes());
  return s;
}

std::vector<std::pair<std::string, size_t>> FsdpCore::units() const {
  std::vector<std::pair<std::string, size_t>> out;
  for (const FsdpUnit& u : units_) out.emplace_back(u.name, u.params.size());
  return out;
}

void ShardedBase::before_unit_forward() {
  if (core_ != nullptr) core_->before_unit_forward(unit_);
}

at::Tensor ShardedBase::after_unit_forward(at::Tensor out) {
  return core_ != nullptr ? core_->after_unit_forward(unit_, std::move(out)) : out;
}

void ShardedBase::unit_forward_failed() noexcept {
  if (core_ != nullptr) core_->unit_forward_failed(unit_);
}

at::Tensor ShardedBase::cast_input(const at::Tensor& input) const {
  return core_ != nullptr ? core_->cast_input(input) : input;
}

}  // namespace detail

FullyShardedDataParallelBase::FullyShardedDataParallelBase(
    const std::shared_ptr<torch::nn::Module>& module, FSDPOptions options)
    : core_(std::make_unique<detail::FsdpCore>(module, std::move(options))) {}

FullyShardedDataParallelBase::~FullyShardedDataParallelBase() = default;

std::vector<at::Tensor> FullyShardedDataParallelBase::parameters() const { return core_->shards(); }

std::vector<std::pair<std::string, at::Tensor>> FullyShardedDataParallelBase::full_parameters() {
  std::vector<std::pair<std::string, at::Tensor>> out;
  core_->for_each_full_parameter([&out](const std::string& name, const at::Tensor& whole) {
    out.emplace_back(name, whole.clone());
  });
  return out;
}

void FullyShardedDataParallelBase::for_each_full_parameter(const FullParameterVisitor& each) {
  core_->for_each_full_parameter(each);
}

std::vector<FullyShardedDataParallelBase::LocalShard> FullyShardedDataParallelBase::local_shards() {
  return core_->local_shards();
}

std::vector<std::pair<std::string, at::Tensor>> FullyShardedDataParallelBase::named_buffers()
    const {
  return core_->buffers();
}

std::vector<std::pair<std::string, size_t>> FullyShardedDataParallelBase::units() const {
  return core_->units();
}

FSDPMemoryStats FullyShardedDataParallelBase::memory_stats() const { return core_->memory_stats(); }

std::string FullyShardedDataParallelBase::check_full_parameters(
    const std::vector<std::pair<std::string, at::Tensor>>& full) const {
  return core_->check_full(full);
}

void FullyShardedDataParallelBase::load_full_parameters(
    const std::vector<std::pair<std::string, at::Tensor>>& full) {
  core_->load_full(full);
}

void FullyShardedDataParallelBase::reset_peak_memory_stats() { core_->reset_peak(); }

FSDPNoSyncGuard FullyShardedDataParallelBase::no_sync(bool enabled) {
  return FSDPNoSyncGuard(*core_, enabled);
}

double FullyShardedDataParallelBase::clip_grad_norm_(double max_norm) {
  return core_->clip_grad_norm(max_norm);
}

FSDPNoSyncGuard::FSDPNoSyncGuard(detail::FsdpCore& core, bool enabled)
    : core_(core), previous_(enabled ? core.set_no_sync(true) : core.set_no_sync(false)) {
  if (!enabled) core.set_no_sync(previous_);  // a disabled guard changes nothing
}

FSDPNoSyncGuard::~FSDPNoSyncGuard() { core_.set_no_sync(previous_); }

ProcessGroup& FullyShardedDataParallelBase::process_group() { return core_->group(); }

void FullyShardedDataParallelBase::before_forward() { core_->before_forward(); }

void FullyShardedDataParallelBase::after_forward() noexcept { core_->after_forward(); }

at::Tensor FullyShardedDataParallelBase::cast_tensor_input(const at::Tensor& input) const {
  return core_->cast_input(input);
}

}  // namespace ddp
