// ddp::ZeroRedundancyOptimizer: Notes [ZeRO-1] and [ZeRO checkpoints] in the header.
#include "ddp/zero_redundancy_optimizer.h"

#include <algorithm>
#include <cmath>  // isnan
#include <cstring>  // memcpy
#include <limits>
#include <map>
#include <numeric>  // iota
#include <sstream>
#include <type_traits>
#include <unordered_map>

#include <fmt/format.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include "base/check.h"
#include "base/demangle.h"  // the optimizer's type name
#include "base/tensor_bytes.h"
#include "ddp/distributed.h"  // default_group
#include "ddp/error.h"

namespace ddp {
namespace {

using StateMap = std::decay_t<decltype(std::declval<torch::optim::Optimizer&>().state())>;

// LibTorch keys an optimizer's state by the parameter's TensorImpl: its address as a string in
// 1.x, the pointer itself in 2.x.
template <class Key = StateMap::key_type>
Key state_key(const at::Tensor& p) {
  if constexpr (std::is_same_v<Key, std::string>) {
    std::ostringstream address;  // what c10::guts::to_string of the pointer printed in 1.x
    address << static_cast<const void*>(p.unsafeGetTensorImpl());
    return address.str();
  } else {
    return static_cast<Key>(p.unsafeGetTensorImpl());
  }
}

// PyTorch's _partition_parameters: largest first (a stable sort), each to the rank holding the
// fewest elements so far (the first such rank).
std::vector<int> partition(const std::vector<at::Tensor>& params, int world) {
  std::vector<size_t> order(params.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return params[a].numel() > params[b].numel(); });
  std::vector<int64_t> load(static_cast<size_t>(world), 0);
  std::vector<int> owner(params.size(), 0);
  for (size_t i : order) {
    const auto least = std::min_element(load.begin(), load.end());
    owner[i] = static_cast<int>(least - load.begin());
    *least += params[i].numel();
  }
  return owner;
}

constexpr int64_t kFormatVersion = 1;

int64_t read_int(torch::serialize::InputArchive& a, const std::string& key) {
  c10::IValue v;
  if (!a.try_read(key, v) || !v.isInt()) {
    throw Error(fmt::format("ZeroRedundancyOptimizer::load_state_dict: not a ZeRO state (no "
                            "'{}'): pass what state_dict() or shard_state() returned",
                            key));
  }
  return v.toInt();
}

}  // namespace

struct ZeroRedundancyOptimizer::Impl {
  std::vector<at::Tensor> params;
  std::shared_ptr<ProcessGroup> group;
  int rank = 0;
  int world = 1;
  std::vector<int> owner;      // of each parameter
  std::vector<size_t> owned;   // this rank's, ascending
  std::unique_ptr<torch::optim::Optimizer> optimizer;  // over `owned`; null if none
  StateFactory make_state;
  StateTensors state_tensors;
  double lr = std::numeric_limits<double>::quiet_NaN();  // set_lr's, for a rank without params

  // One broadcast buffer per owner and dtype/device: its parameters flattened.
  struct Bucket {
    int owner = 0;
    std::vector<size_t> members;
    at::Tensor buffer;
  };
  std::vector<Bucket> buckets;

  std::string type_name;
  std::string consolidated;  // on rank `to` after consolidate_state_dict
  int consolidated_on = -1;

  // Note [ZeRO overlapped with DDP]: owners given out per DDP bucket, an optimizer per owned
  // bucket, stepped inside the hook.
  bool overlap_requested = false;
  bool overlap = false;  // requested, at a world size above 1
  bool hooked = false;   // hook_with_zero_step was made for it
  OptimizerFactory make_optimizer;
  std::unordered_map<const c10::TensorImpl*, size_t> index_of;  // param -> index in params
  struct OverlapBucket {
    int owner = -1;
    std::vector<size_t> members;  // in the bucket's order
    std::unique_ptr<torch::optim::Optimizer> optimizer;  // the owner's
    at::Tensor flat;                                       // the members, for the broadcast
  };
  std::vector<OverlapBucket> overlap_buckets;  // by DDP bucket index
  std::vector<int64_t> owned_elements;         // per rank, as buckets are given out
  int64_t iteration = 0;                       // DDP iterations the hook saw
  // This iteration's broadcasts so far: bucket index, its broadcast.
  std::vector<std::pair<size_t, Work>> broadcasts;
  std::vector<int> bucket_of;  // of each parameter, once given out (-1 before)
  // Loaded before the parameter's bucket was given out: applied by give_out to the owner's
  // optimizer (others drop theirs then).
  std::map<size_t, std::unique_ptr<torch::optim::OptimizerParamState>> stashed;
  std::unique_ptr<torch::optim::OptimizerOptions> loaded_options;  // for later buckets

  torch::optim::Optimizer* optimizer_of(size_t i) const;
  void take_state(size_t i, std::unique_ptr<torch::optim::OptimizerParamState> state);

  void load_part(torch::serialize::InputArchive& part, std::vector<bool>& covered);
  OverlapBucket& give_out(size_t index, const std::vector<at::Tensor>& bucket_params);
  Future step_bucket(size_t index, bool last, at::Tensor averaged);
};

torch::optim::Optimizer* ZeroRedundancyOptimizer::Impl::optimizer_of(size_t i) const {
  if (!overlap) return owner[i] == rank ? optimizer.get() : nullptr;
  if (bucket_of[i] < 0) return nullptr;
  return overlap_buckets[static_cast<size_t>(bucket_of[i])].optimizer.get();
}

// A loaded state for parameter i: to its optimizer if this rank owns it, kept for give_out if
// nobody does yet, dropped if another rank does.
void ZeroRedundancyOptimizer::Impl::take_state(
    size_t i, std::unique_ptr<torch::optim::OptimizerParamState> state) {
  if (torch::optim::Optimizer* o = optimizer_of(i)) {
    if (state) {
      o->state()[state_key(params[i])] = std::move(state);
    } else {
      o->state().erase(state_key(params[i]));  // it had none: neither has it now
    }
  } else if (overlap && owner[i] < 0) {
    stashed[i] = std::move(state);
  }
}

ZeroRedundancyOptimizer::Impl::OverlapBucket& ZeroRedundancyOptimizer::Impl::give_out(
    size_t index, const std::vector<at::Tensor>& bucket_params) {
  std::vector<size_t> members;
  int64_t elements = 0;
  for (const at::Tensor& p : bucket_params) {
    auto it = index_of.find(p.unsafeGetTensorImpl());
    if (it == index_of.end()) {
      throw ConfigError(
          "hook_with_zero_step: DDP's bucket holds a parameter the ZeroRedundancyOptimizer was "
          "not made with: make it over the DDP model's parameters");
    }
    members.push_back(it->second);
    elements += p.numel();
  }
  if (index >= overlap_buckets.size()) overlap_buckets.resize(index + 1);
  OverlapBucket& b = overlap_buckets[index];
  if (b.owner >= 0) {
    DDP_CHECK(b.members == members, ConfigError,
              "hook_with_zero_step: DDP's bucket {} changed after its owner was chosen (its "
              "parameters differ): the buckets must stay as they are after the first iteration",
              index);
    return b;
  }
  // PyTorch's rule: the rank owning the fewest elements so far (the first of equals).
  b.owner = static_cast<int>(std::min_element(owned_elements.begin(), owned_elements.end()) -
                             owned_elements.begin());
  owned_elements[b.owner] += elements;
  b.members = std::move(members);
  for (size_t i : b.members) {
    owner[i] = b.owner;
    bucket_of[i] = static_cast<int>(index);
  }
  b.flat = at::empty({elements}, params[b.members.front()].options().requires_grad(false));
  if (b.owner == rank) {
    std::vector<at::Tensor> shard;
    for (size_t i : b.members) {
      shard.push_back(params[i]);
      owned.push_back(i);
    }
    std::sort(owned.begin(), owned.end());
    b.optimizer = make_optimizer(std::move(shard));
    if (loaded_options) {
      for (auto& g : b.optimizer->param_groups()) g.set_options(loaded_options->clone());
    }
    if (!std::isnan(lr)) {
      for (auto& g : b.optimizer->param_groups()) g.options().set_lr(lr);
    } else if (!b.optimizer->param_groups().empty()) {
      lr = b.optimizer->param_groups().front().options().get_lr();
    }
  }
  for (size_t i : b.members) {
    auto it = stashed.find(i);
    if (it == stashed.end()) continue;
    if (b.owner == rank && it->second) {
      b.optimizer->state()[state_key(params[i])] = std::move(it->second);
    }
    stashed.erase(it);
  }
  return b;
}

// The owner steps the bucket's parameters with the averaged gradients (as their grads for this
// step only: DDP writes the grads itself when backward ends), then broadcasts them. Nobody waits
// for a broadcast before the next bucket (its owner may be stepping meanwhile): the last
// bucket's stage waits for them all and copies in what other ranks updated, so every parameter
// is current when backward returns. Every rank issues the broadcasts in bucket order.
Future ZeroRedundancyOptimizer::Impl::step_bucket(size_t index, bool last, at::Tensor averaged) {
  OverlapBucket& b = overlap_buckets.at(index);
  torch::NoGradGuard no_grad;
  if (b.owner == rank) {
    const at::Tensor flat_grads = averaged.reshape({-1});
    std::vector<at::Tensor> saved;
    int64_t at = 0;
    for (size_t i : b.members) {
      at::Tensor& p = params[i];
      saved.push_back(p.mutable_grad());
      p.mutable_grad() = flat_grads.narrow(0, at, p.numel()).view(p.sizes());
      at += p.numel();
    }
    b.optimizer->step();
    at = 0;
    for (size_t k = 0; k < b.members.size(); ++k) {
      at::Tensor& p = params[b.members[k]];
      p.mutable_grad() = saved[k];
      b.flat.narrow(0, at, p.numel()).copy_(p.detach().reshape({-1}));
      at += p.numel();
    }
  }
  broadcasts.emplace_back(index, group->broadcast(b.flat, b.owner));
  if (!last) return Future::completed(std::move(averaged));
  Work work = broadcasts.back().second;
  return Future(std::move(work), std::move(averaged), [this](at::Tensor value) {
    std::vector<std::pair<size_t, Work>> sent;
    sent.swap(broadcasts);
    torch::NoGradGuard no_grad;
    for (auto& [i, w] : sent) {
      w.wait();
      const OverlapBucket& done = overlap_buckets.at(i);
      if (done.owner == rank) continue;
      int64_t at = 0;
      for (size_t m : done.members) {
        at::Tensor& p = params[m];
        p.detach().copy_(done.flat.narrow(0, at, p.numel()).view(p.sizes()));
        at += p.numel();
      }
    }
    return value;
  });
}

ZeroRedundancyOptimizer::ZeroRedundancyOptimizer(std::vector<at::Tensor> params,
                                                 OptimizerFactory make_optimizer,
                                                 StateFactory make_state,
                                                 StateTensors state_tensors,
                                                 std::shared_ptr<ProcessGroup> group,
                                                 const std::type_info* type,
                                                 ZeroOptions zero_options)
    : impl_(std::make_unique<Impl>()) {
  Impl& m = *impl_;
  if (params.empty()) {
    throw ConfigError("ZeroRedundancyOptimizer: no parameters to optimize");
  }
  for (size_t i = 0; i < params.size(); ++i) {
    if (!params[i].defined()) {
      throw ConfigError(fmt::format("ZeroRedundancyOptimizer: parameter {} is undefined", i));
    }
  }
  if (!make_optimizer || !make_state) {
    throw ConfigError("ZeroRedundancyOptimizer: the optimizer and state factories are required");
  }
  m.group = group ? std::move(group) : default_group();
  if (!m.group) {
    throw ConfigError(
        "ZeroRedundancyOptimizer: no process group: call ddp::init_process_group() first, or "
        "pass a group");
  }
  m.params = std::move(params);
  m.rank = m.group->rank();
  m.world = m.group->size();
  m.overlap_requested = zero_options.overlap_with_ddp;
  // At world size 1 DDP reduces nothing and calls no hook: step() steps as without the option.
  m.overlap = m.overlap_requested && m.world > 1;
  if (m.overlap) {
    m.owner.assign(m.params.size(), -1);
    m.bucket_of.assign(m.params.size(), -1);
    m.owned_elements.assign(static_cast<size_t>(m.world), 0);
    for (size_t i = 0; i < m.params.size(); ++i) m.index_of[m.params[i].unsafeGetTensorImpl()] = i;
    m.make_optimizer = std::move(make_optimizer);
    m.make_state = std::move(make_state);
    m.state_tensors = std::move(state_tensors);
    m.type_name = fmt::format("ddp::ZeroRedundancyOptimizer({})",
                              type != nullptr ? demangle(type->name()) : "?");
    return;
  }
  m.owner = partition(m.params, m.world);
  std::vector<at::Tensor> shard;
  for (size_t i = 0; i < m.params.size(); ++i) {
    if (m.owner[i] == m.rank) {
      m.owned.push_back(i);
      shard.push_back(m.params[i]);
    }
  }
  if (!shard.empty()) m.optimizer = make_optimizer(std::move(shard));
  if (m.optimizer && !m.optimizer->param_groups().empty()) {
    m.lr = m.optimizer->param_groups().front().options().get_lr();
  }
  m.make_state = std::move(make_state);
  m.state_tensors = std::move(state_tensors);
  if (type == nullptr && m.optimizer) type = &typeid(*m.optimizer);
  m.type_name = fmt::format("ddp::ZeroRedundancyOptimizer({})",
                            type != nullptr ? demangle(type->name()) : "?");

  // Buckets in a fixed order every rank agrees on: by owner, then dtype and device.
  std::map<std::tuple<int, int, std::string>, Impl::Bucket> by_key;
  for (size_t i = 0; i < m.params.size(); ++i) {
    const at::Tensor& p = m.params[i];
    auto& b = by_key[{m.owner[i], static_cast<int>(p.scalar_type()), p.device().str()}];
    b.owner = m.owner[i];
    b.members.push_back(i);
  }
  for (auto& [key, b] : by_key) {
    int64_t n = 0;
    for (size_t i : b.members) n += m.params[i].numel();
    const at::Tensor& first = m.params[b.members.front()];
    b.buffer = at::empty({n}, first.options().requires_grad(false));
    m.buckets.push_back(std::move(b));
  }
}

ZeroRedundancyOptimizer::~ZeroRedundancyOptimizer() = default;
ZeroRedundancyOptimizer::ZeroRedundancyOptimizer(ZeroRedundancyOptimizer&&) noexcept = default;
ZeroRedundancyOptimizer& ZeroRedundancyOptimizer::operator=(ZeroRedundancyOptimizer&&) noexcept =
    default;

void ZeroRedundancyOptimizer::step() {
  Impl& m = *impl_;
  // The consolidated state is a copy of every rank's: kept until training goes on, not beyond
  // (rank `to` would otherwise hold the whole state ZeRO exists to split).
  m.consolidated = std::string();
  m.consolidated_on = -1;
  if (m.overlap) {
    DDP_CHECK(m.hooked, ConfigError,
              "ZeroRedundancyOptimizer::step: made with overlap_with_ddp, the step runs in DDP's "
              "comm hook: register comm_hooks::hook_with_zero_step(comm_hooks::allreduce(), "
              "zero) on the model before its first forward");
    return;  // the hook stepped every bucket when backward ended
  }
  torch::NoGradGuard no_grad;
  if (m.optimizer) m.optimizer->step();
  if (m.world == 1) return;
  std::vector<Work> pending;
  pending.reserve(m.buckets.size());
  for (Impl::Bucket& b : m.buckets) {
    if (b.owner == m.rank) {
      int64_t at = 0;
      for (size_t i : b.members) {
        const at::Tensor& p = m.params[i];
        b.buffer.narrow(0, at, p.numel()).copy_(p.detach().reshape({-1}));
        at += p.numel();
      }
    }
    pending.push_back(m.group->broadcast(b.buffer, b.owner));
  }
  for (Work& w : pending) w.wait();
  for (Impl::Bucket& b : m.buckets) {
    if (b.owner == m.rank) continue;
    int64_t at = 0;
    for (size_t i : b.members) {
      at::Tensor& p = m.params[i];
      p.detach().copy_(b.buffer.narrow(0, at, p.numel()).view(p.sizes()));
      at += p.numel();
    }
  }
}

void ZeroRedundancyOptimizer::zero_grad(bool set_to_none) {
  for (at::Tensor& p : impl_->params) {
    at::Tensor& g = p.mutable_grad();
    if (!g.defined()) continue;
    if (set_to_none) {
      g.reset();
    } else {
      g.detach_();
      g.zero_();
    }
  }
}

void ZeroRedundancyOptimizer::set_lr(double lr) {
  impl_->lr = lr;
  for (auto& b : impl_->overlap_buckets) {
    if (!b.optimizer) continue;
    for (auto& g : b.optimizer->param_groups()) g.options().set_lr(lr);
  }
  if (!impl_->optimizer) return;
  for (auto& g : impl_->optimizer->param_groups()) g.options().set_lr(lr);
}

double ZeroRedundancyOptimizer::lr() const { return impl_->lr; }

const std::string& ZeroRedundancyOptimizer::type_name() const { return impl_->type_name; }
int ZeroRedundancyOptimizer::rank() const { return impl_->rank; }

int ZeroRedundancyOptimizer::owner(size_t index) const { return impl_->owner.at(index); }
const std::vector<size_t>& ZeroRedundancyOptimizer::owned() const { return impl_->owned; }
torch::optim::Optimizer* ZeroRedundancyOptimizer::optimizer() { return impl_->optimizer.get(); }

int64_t ZeroRedundancyOptimizer::state_bytes() const {
  const Impl& m = *impl_;
  if (!m.state_tensors) return 0;
  std::vector<const torch::optim::Optimizer*> optimizers;
  if (m.optimizer) optimizers.push_back(m.optimizer.get());
  for (const auto& b : m.overlap_buckets) {
    if (b.optimizer) optimizers.push_back(b.optimizer.get());
  }
  int64_t bytes = 0;
  for (const torch::optim::Optimizer* o : optimizers) {
    for (const auto& [key, state] : o->state()) {
      for (const at::Tensor& t : m.state_tensors(*state)) {
        if (t.defined()) bytes += static_cast<int64_t>(t.nbytes());
      }
    }
  }
  return bytes;
}

std::string ZeroRedundancyOptimizer::shard_state() const {
  const Impl& m = *impl_;
  torch::serialize::OutputArchive a;
  a.write("zero_version", c10::IValue(kFormatVersion));
  a.write("world_size", c10::IValue(static_cast<int64_t>(m.world)));
  a.write("rank", c10::IValue(static_cast<int64_t>(m.rank)));
  a.write("count", c10::IValue(static_cast<int64_t>(m.params.size())));
  std::vector<int64_t> owned(m.owned.begin(), m.owned.end());
  std::vector<int64_t> numels;
  for (size_t i : m.owned) numels.push_back(m.params[i].numel());
  a.write("owned", at::tensor(owned, at::kLong), /*is_buffer=*/true);
  a.write("numels", at::tensor(numels, at::kLong), /*is_buffer=*/true);
  // With overlap_with_ddp, the iterations the hook saw (a resume must not skip updates again).
  if (m.overlap) a.write("overlap_iteration", c10::IValue(m.iteration));
  bool options_written = false;
  for (size_t i : m.owned) {
    const torch::optim::Optimizer* o = m.optimizer_of(i);
    if (o == nullptr || o->param_groups().empty()) continue;
    if (!options_written) {
      torch::serialize::OutputArchive options;
      o->param_groups().front().options().serialize(options);
      a.write("options", options);
      options_written = true;
    }
    const auto& states = o->state();
    auto it = states.find(state_key(m.params[i]));
    if (it == states.end()) continue;  // never stepped (no gradient yet)
    torch::serialize::OutputArchive s;
    it->second->serialize(s);
    a.write(fmt::format("state_{}", i), s);
  }
  std::ostringstream out;
  a.save_to(out);
  return out.str();
}

void ZeroRedundancyOptimizer::consolidate_state_dict(int to) {
  Impl& m = *impl_;
  if (to < 0 || to >= m.world) {
    throw ConfigError(fmt::format(
        "ZeroRedundancyOptimizer::consolidate_state_dict: rank {} is not in the group (world "
        "size {})",
        to, m.world));
  }
  // As PyTorch: each rank's part broadcast in turn (rank `to` keeps them, the others drop each
  // at once), so no rank but `to` ever holds more than one other rank's state.
  const std::string mine = shard_state();
  torch::serialize::OutputArchive bundle;
  bundle.write("zero_bundle", c10::IValue(static_cast<int64_t>(m.world)));
  for (int r = 0; r < m.world; ++r) {
    std::string part;
    if (r == m.rank) {
      part = mine;
    }
    if (m.world > 1) {
      at::Tensor size = at::tensor({static_cast<int64_t>(mine.size())}, at::kLong);
      m.group->broadcast(size, r).wait();
      const int64_t n = size.item<int64_t>();
      // Bytes travel as int64 words: every transport reduces and moves those.
      at::Tensor words = at::zeros({(n + 7) / 8}, at::kLong);
      if (r == m.rank && n > 0) std::memcpy(words.data_ptr(), mine.data(), mine.size());
      m.group->broadcast(words, r).wait();
      if (m.rank == to && r != m.rank) {
        part.assign(static_cast<const char*>(words.data_ptr()), static_cast<size_t>(n));
      }
    }
    if (m.rank == to) bundle.write(fmt::format("part_{}", r), bytes_tensor(part), true);
  }
  if (m.rank == to) {
    std::ostringstream out;
    bundle.save_to(out);
    m.consolidated = out.str();
    m.consolidated_on = to;
  } else {
    m.consolidated.clear();
    m.consolidated_on = to;
  }
}

std::string ZeroRedundancyOptimizer::state_dict() const {
  const Impl& m = *impl_;
  if (m.consolidated_on < 0) {
    throw Error(
        "ZeroRedundancyOptimizer::state_dict: call consolidate_state_dict(to) on every rank "
        "first (a collective); the consolidated state is then on rank `to` until the next "
        "step()");
  }
  if (m.consolidated_on != m.rank) {
    throw Error(fmt::format(
        "ZeroRedundancyOptimizer::state_dict: the state was consolidated on rank {}, not on "
        "this rank ({})",
        m.consolidated_on, m.rank));
  }
  return m.consolidated;
}

void ZeroRedundancyOptimizer::Impl::load_part(torch::serialize::InputArchive& part,
                                              std::vector<bool>& covered) {
  const int64_t version = read_int(part, "zero_version");
  if (version != kFormatVersion) {
    throw Error(fmt::format(
        "ZeroRedundancyOptimizer::load_state_dict: state format {} (this build reads {})",
        version, kFormatVersion));
  }
  const int64_t count = read_int(part, "count");
  if (count != static_cast<int64_t>(params.size())) {
    throw Error(fmt::format(
        "ZeroRedundancyOptimizer::load_state_dict: the state is of {} parameters, this "
        "optimizer has {}: not the same model",
        count, params.size()));
  }
  at::Tensor owned_t, numels_t;
  part.read("owned", owned_t, true);
  part.read("numels", numels_t, true);
  const auto owned_in = owned_t.accessor<int64_t, 1>();
  const auto numels_in = numels_t.accessor<int64_t, 1>();
  torch::serialize::InputArchive options;
  const bool has_options = part.try_read("options", options);
  bool options_read = false;
  c10::IValue saved_iteration;
  if (overlap && part.try_read("overlap_iteration", saved_iteration) && saved_iteration.isInt()) {
    iteration = std::max(iteration, saved_iteration.toInt());
  }
  for (int64_t k = 0; k < owned_t.numel(); ++k) {
    const int64_t i = owned_in[k];
    if (i < 0 || i >= count) {
      throw Error(fmt::format("ZeroRedundancyOptimizer::load_state_dict: parameter index {} "
                              "out of range",
                              i));
    }
    const auto idx = static_cast<size_t>(i);
    if (numels_in[k] != params[idx].numel()) {
      throw Error(fmt::format(
          "ZeroRedundancyOptimizer::load_state_dict: parameter {} has {} elements in the "
          "state but {} here: not the same model",
          i, numels_in[k], params[idx].numel()));
    }
    // Without overlap every owner is known; with it, a parameter whose bucket was not given
    // out yet keeps its state for give_out.
    if (owner[idx] != rank && !(overlap && owner[idx] < 0)) continue;
    covered[idx] = true;
    if (has_options && !options_read) {
      if (overlap) {
        // Read by a throwaway optimizer of the kind, kept for the buckets' optimizers.
        auto reader = make_optimizer({at::zeros({1})});
        auto& g = reader->param_groups().front();
        g.options().serialize(options);
        loaded_options = g.options().clone();
        lr = loaded_options->get_lr();
        for (auto& b : overlap_buckets) {
          if (!b.optimizer) continue;
          for (auto& bg : b.optimizer->param_groups()) bg.set_options(loaded_options->clone());
        }
        options_read = true;
      } else if (optimizer) {
        for (auto& g : optimizer->param_groups()) g.options().serialize(options);
        lr = optimizer->param_groups().front().options().get_lr();
        options_read = true;
      }
    }
    torch::serialize::InputArchive s;
    std::unique_ptr<torch::optim::OptimizerParamState> state;
    if (part.try_read(fmt::format("state_{}", i), s)) {
      state = make_state();
      state->serialize(s);
    }
    if (!overlap) {
      if (state) {
        optimizer->state()[state_key(params[idx])] = std::move(state);
      } else {
        optimizer->state().erase(state_key(params[idx]));  // it had none: neither has it now
      }
      continue;
    }
    take_state(idx, std::move(state));
  }
}

void ZeroRedundancyOptimizer::load_state_dict(const std::string& state) {
  Impl& m = *impl_;
  const c10::optional<torch::Device> device =
      m.params.front().device().is_cpu() ? c10::nullopt
                                         : c10::optional<torch::Device>(m.params.front().device());
  torch::serialize::InputArchive top;
  top.load_from(state.data(), state.size(), device);
  std::vector<bool> covered(m.params.size(), false);
  c10::IValue parts;
  if (top.try_read("zero_bundle", parts) && parts.isInt()) {
    for (int64_t r = 0; r < parts.toInt(); ++r) {
      at::Tensor bytes;
      top.read(fmt::format("part_{}", r), bytes, true);
      const std::string blob = tensor_bytes(bytes);
      torch::serialize::InputArchive part;
      part.load_from(blob.data(), blob.size(), device);
      m.load_part(part, covered);
    }
  } else {
    m.load_part(top, covered);
  }
  for (size_t i : m.owned) {
    if (!covered[i]) {
      throw Error(fmt::format(
          "ZeroRedundancyOptimizer::load_state_dict: the state does not cover parameter {}, "
          "which rank {} of {} owns: a shard is only loadable at the world size it was saved "
          "at; load the consolidated state (consolidate_state_dict, then state_dict on that "
          "rank) to resume at another size",
          i, m.rank, m.world));
    }
  }
}

namespace comm_hooks {

CommHook hook_with_zero_step(CommHook hook, std::shared_ptr<ZeroRedundancyOptimizer> zero) {
  DDP_CHECK(hook && zero, ConfigError, "hook_with_zero_step: needs a hook and an optimizer");
  auto* m = zero->impl_.get();
  DDP_CHECK(m->overlap_requested, ConfigError,
            "hook_with_zero_step: the ZeroRedundancyOptimizer was made without "
            "ZeroOptions{{.overlap_with_ddp = true}}: make it with it, or step it after backward "
            "without this hook");
  m->hooked = true;
  if (!m->overlap) return hook;  // world size 1: step() steps
  // As PyTorch (static_graph false): no update in the first two iterations; DDP's buckets are
  // rebuilt after the first.
  constexpr int64_t kIterationsWithoutUpdate = 2;
  return [hook = std::move(hook), zero = std::move(zero), m](GradBucket& bucket) -> Future {
    DDP_CHECK(&bucket.process_group() == m->group.get(), ConfigError,
              "hook_with_zero_step: DDP and the ZeroRedundancyOptimizer use different process "
              "groups: make the optimizer on the model's group");
    Future reduced = hook(bucket);
    const int64_t iteration = m->iteration;
    if (bucket.is_last()) ++m->iteration;
    if (iteration < kIterationsWithoutUpdate) return reduced;
    m->give_out(bucket.index(), bucket.parameters());
    return reduced.then([m, index = bucket.index(), last = bucket.is_last()](at::Tensor averaged) {
      return m->step_bucket(index, last, std::move(averaged));
    });
  };
}

}  // namespace comm_hooks
}  // namespace ddp
