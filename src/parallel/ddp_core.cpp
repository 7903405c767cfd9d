// DistributedDataParallel's non-template part: construction, forward, no_sync.
#include <cstdlib>
#include <unordered_set>

#include <fmt/format.h>
#include <torch/nn/module.h>

#include "parallel/ddp_core.h"

#include "base/check.h"
#include "ddp/distributed.h"
#include "ddp/join.h"
#include "parallel/reducer.h"
#include "parallel/replica_sync.h"

namespace ddp {

NoSyncGuard::NoSyncGuard(detail::DdpCore& core, bool enabled)
    : core_(core), previous_(core.require_sync()) {
  if (enabled) core_.set_require_sync(false);
}
NoSyncGuard::~NoSyncGuard() { core_.set_require_sync(previous_); }

DistributedDataParallelBase::DistributedDataParallelBase(std::shared_ptr<torch::nn::Module> module,
                                                         DDPOptions options)
    : input_device_(options.device_ids.empty()
                        ? std::nullopt
                        : std::optional<c10::Device>(
                              c10::Device(c10::kCUDA,
                                          static_cast<c10::DeviceIndex>(options.device_ids[0])))) {
  core_ = std::make_unique<detail::DdpCore>(std::move(module), std::move(options));
}
DistributedDataParallelBase::~DistributedDataParallelBase() = default;
DistributedDataParallelBase::DistributedDataParallelBase(DistributedDataParallelBase&&) noexcept =
    default;
DistributedDataParallelBase& DistributedDataParallelBase::operator=(
    DistributedDataParallelBase&&) noexcept = default;

void DistributedDataParallelBase::before_forward() {
  moved_inputs_.clear();
  core_->before_forward();
}

at::Tensor* DistributedDataParallelBase::to_input_device(const at::Tensor& t) {
  if (!input_device_ || !t.defined() || t.device() == *input_device_) return nullptr;
  return &moved_inputs_.emplace_back(t.to(*input_device_, /*non_blocking=*/true));
}
NoSyncGuard DistributedDataParallelBase::no_sync(bool enabled) { return {*core_, enabled}; }
void DistributedDataParallelBase::register_comm_hook(CommHook hook) {
  core_->register_comm_hook(std::move(hook));
}
ProcessGroup& DistributedDataParallelBase::process_group() { return core_->process_group(); }
detail::DdpCore& detail::core_of(DistributedDataParallelBase& model) { return *model.core_; }
const IterationStats& DistributedDataParallelBase::last_iteration_stats() const {
  return core_->last_iteration_stats();
}
std::vector<std::vector<std::string>> DistributedDataParallelBase::bucket_layout() const {
  return core_->bucket_layout();
}
torch::nn::Module& DistributedDataParallelBase::untyped_module() const { return core_->module(); }

std::vector<int64_t> DistributedDataParallelBase::bucket_order() const {
  return core_->bucket_order();
}
void DistributedDataParallelBase::restore_bucket_order(const std::vector<int64_t>& order) {
  core_->restore_bucket_order(order);
}

namespace detail {
namespace {

int64_t megabytes(double mb) { return ReducerOptions::megabytes(mb); }

DebugLevel debug_level(const DDPOptions& o) { return o.debug ? *o.debug : debug_level_from_env(); }

// Named tensors, each once (a tensor registered under two names is the same parameter).
void collect(const torch::OrderedDict<std::string, at::Tensor>& named, bool trainable_only,
             std::vector<at::Tensor>& tensors, std::vector<std::string>& names) {
  std::unordered_set<const void*> seen;
  for (const auto& item : named) {
    const at::Tensor& t = item.value();
    if (!t.defined() || (trainable_only && !t.requires_grad())) continue;
    if (!seen.insert(t.unsafeGetTensorImpl()).second) continue;
    tensors.push_back(t);
    names.push_back(item.key());
  }
}

}  // namespace

struct DdpCore::State {
  // Constant after construction, but for `group` (rebind()).
  std::shared_ptr<torch::nn::Module> module;
  DDPOptions options;
  std::shared_ptr<ProcessGroup> group;
  std::vector<at::Tensor> params;
  std::vector<std::string> param_names;
  std::vector<at::Tensor> buffers;
  std::vector<std::string> buffer_names;
  std::unique_ptr<Reducer> reducer;

  // While a ddp::Join is attached.
  const JoinOptions* join = nullptr;
  std::vector<int> last_active;  // ranks training in the last round where any was
};

namespace {

// DDPOptions::device_ids, as PyTorch checks it: one device, and the module already on it.
void check_device_ids(const std::vector<int>& ids, int rank, const std::vector<at::Tensor>& params,
                      const std::vector<std::string>& param_names,
                      const std::vector<at::Tensor>& buffers,
                      const std::vector<std::string>& buffer_names) {
  if (ids.empty()) return;
  DDP_CHECK(ids.size() == 1, ConfigError,
            "[rank {}] DistributedDataParallel: device_ids has {} entries; give the one device "
            "of this rank's module ({{LOCAL_RANK}}): one process per device",
            rank, ids.size());
  const c10::Device want(c10::kCUDA, static_cast<c10::DeviceIndex>(ids[0]));
  auto check = [&](const std::vector<at::Tensor>& ts, const std::vector<std::string>& names,
                   const char* what) {
    for (size_t i = 0; i < ts.size(); ++i) {
      DDP_CHECK(ts[i].device() == want, ConfigError,
                "[rank {}] DistributedDataParallel: device_ids {{{}}}, but {} '{}' is on {}; "
                "move the module first (module->to(torch::Device(\"{}\")))",
                rank, ids[0], what, names[i], ts[i].device().str(), want.str());
    }
  };
  check(params, param_names, "parameter");
  check(buffers, buffer_names, "buffer");
}

}  // namespace

DdpCore::DdpCore(std::shared_ptr<torch::nn::Module> module, DDPOptions options)
    : state_(std::make_unique<State>()) {
  State& s = *state_;
  DDP_CHECK(module != nullptr, ConfigError, "DistributedDataParallel: the module is null");
  DDP_CHECK(options.bucket_cap_mb > 0 && options.first_bucket_mb > 0, ConfigError,
            "DistributedDataParallel: bucket_cap_mb ({}) and first_bucket_mb ({}) must be > 0",
            options.bucket_cap_mb, options.first_bucket_mb);
  s.module = std::move(module);
  s.group = options.process_group ? options.process_group : default_group();
  s.options = std::move(options);
  collect(s.module->named_parameters(/*recurse=*/true), true, s.params, s.param_names);
  collect(s.module->named_buffers(/*recurse=*/true), false, s.buffers, s.buffer_names);
  check_device_ids(s.options.device_ids, s.group->rank(), s.params, s.param_names, s.buffers,
                   s.buffer_names);

  if (s.options.init_sync) {
    verify_same_parameters(*s.group, s.params, s.param_names);
    std::vector<at::Tensor> state = s.params;
    state.insert(state.end(), s.buffers.begin(), s.buffers.end());
    broadcast_coalesced(*s.group, state, 0, megabytes(kDefaultBroadcastChunkMb));
  }

  s.reducer =
      std::make_unique<Reducer>(s.params, s.param_names, *s.group,
                                ReducerOptions{.ddp = s.options, .debug = debug_level(s.options)});
}

DdpCore::~DdpCore() = default;

void DdpCore::before_forward() {
  State& s = *state_;
  int buffer_root = 0;
  if (s.join != nullptr) {
    DDP_CHECK(require_sync_, Error,
              "[rank {}] no_sync() is not supported under ddp::Join: every forward through the "
              "wrapper must be a synced training step",
              s.group->rank());
    const std::vector<int> active = join_round(true);
    DDP_CHECK(!s.join->throw_on_early_termination ||
                  static_cast<int>(active.size()) == s.group->size(),
              Error,
              "[rank {}] ddp::Join(throw_on_early_termination): another rank ran out of data; "
              "{} of {} ranks are still training",
              s.group->rank(), active.size(), s.group->size());
    s.reducer->set_divisor(s.join->divide_by_initial_world_size ? s.group->size()
                                                                : static_cast<int>(active.size()));
    buffer_root = active.back();  // the highest rank still training (this one is)
  }
  s.reducer->prepare_for_forward(require_sync_);
  if (s.options.broadcast_buffers && !s.buffers.empty()) {
    broadcast_coalesced(*s.group, s.buffers, buffer_root, megabytes(kDefaultBroadcastChunkMb));
  }
}

void DdpCore::attach_join(const JoinOptions* options) {
  State& s = *state_;
  s.join = options;
  s.last_active.clear();
  for (int r = 0; r < s.group->size(); ++r) s.last_active.push_back(r);
  if (options == nullptr) s.reducer->set_divisor(s.group->size());
}

std::vector<int> DdpCore::join_round(bool active) {
  State& s = *state_;
  at::Tensor mine = at::full({1}, active ? 1 : 0, at::kInt);
  std::vector<at::Tensor> all(s.group->size());
  for (auto& t : all) t = at::empty_like(mine);
  s.group->all_gather(all, mine).wait();
  std::vector<int> ranks;
  for (int r = 0; r < s.group->size(); ++r) {
    if (all[r].item<int>() != 0) ranks.push_back(r);
  }
  if (!ranks.empty()) s.last_active = ranks;
  return ranks;
}

void DdpCore::shadow_iteration(const std::vector<int>& active) {
  State& s = *state_;
  s.reducer->set_divisor(s.join->divide_by_initial_world_size ? s.group->size()
                                                              : static_cast<int>(active.size()));
  // The same collectives, in the same order, as before_forward + backward on the others.
  s.reducer->prepare_for_forward(/*sync=*/true);
  if (s.options.broadcast_buffers && !s.buffers.empty()) {
    broadcast_coalesced(*s.group, s.buffers, active.back(), megabytes(kDefaultBroadcastChunkMb));
  }
  s.reducer->shadow_backward();
}

void DdpCore::sync_model_from(int root) {
  State& s = *state_;
  std::vector<at::Tensor> state = s.params;
  state.insert(state.end(), s.buffers.begin(), s.buffers.end());
  broadcast_coalesced(*s.group, state, root, megabytes(kDefaultBroadcastChunkMb));
}

int DdpCore::last_active_rank() const { return state_->last_active.back(); }

void DdpCore::register_comm_hook(CommHook hook) {
  state_->reducer->register_comm_hook(std::move(hook));
}

ProcessGroup& DdpCore::process_group() { return *state_->group; }

void DdpCore::rebind(std::shared_ptr<ProcessGroup> group) {
  State& s = *state_;
  DDP_CHECK(s.join == nullptr, ConfigError,
            "[rank {}] ddp::Join and fault tolerance (ddp::ft::Manager) do not combine: the "
            "manager drops a failed step on every replica instead of shadowing it",
            s.group->rank());
  s.reducer->rebind(*group);
  s.group = std::move(group);
}

const IterationStats& DdpCore::last_iteration_stats() const {
  return state_->reducer->last_stats();
}

std::vector<std::vector<std::string>> DdpCore::bucket_layout() const {
  return state_->reducer->layout();
}

torch::nn::Module& DdpCore::module() const { return *state_->module; }

std::vector<int64_t> DdpCore::bucket_order() const { return state_->reducer->bucket_order(); }

void DdpCore::restore_bucket_order(const std::vector<int64_t>& order) {
  state_->reducer->restore_bucket_order(order);
}

}  // namespace detail
}  // namespace ddp
