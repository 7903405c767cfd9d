// FullyShardedDataParallel's saved state (see include/ddp/training_state.h): the model's
// parameters as each rank holds them, and the optimizer's state over its shards, both as pieces
// of the model's parameters (kSharded: any world size).
#include <algorithm>
#include <functional>
#include <map>
#include <optional>
#include <sstream>
#include <type_traits>

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>  // NoGradGuard
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>
#include <torch/optim.h>

#include "ddp/fully_sharded_data_parallel.h"
#include "base/check.h"
#include "base/demangle.h"  // type_name_of
#include "base/tensor_bytes.h"
#include "state/adapters.h"
#include "state/shards.h"  // numel_of

namespace ddp::state {
namespace {

// Where this rank's part of each parameter lies, and each buffer's size, by name: what wanted()
// looks up for every saved piece (a load asks for each piece twice). Fixed for the wrapper's
// life, so taken once, on first use.
struct Geometry {
  struct Part {
    std::vector<int64_t> shape;
    ElementRange range;
  };
  std::map<std::string, Part, std::less<>> parts;
  std::map<std::string, int64_t, std::less<>> buffer_numel;
};

const Geometry& geometry_of(FullyShardedDataParallelBase& model, std::optional<Geometry>& cache) {
  if (!cache) {
    cache.emplace();
    for (const auto& part : model.local_shards()) {
      cache->parts[part.name] = {part.shape, {part.offset, part.data.numel()}};
    }
    for (const auto& [name, b] : model.named_buffers()) cache->buffer_numel[name] = b.numel();
  }
  return *cache;
}

// The parameters as each rank holds them (kSharded, Note [Sharded states] in shards.h): every
// parameter's part in this rank's shard, placed in the whole parameter. Loaded at any world
// size, each rank taking its new part; the shards' padding stays zero. A collective snapshot
// joins the parts into whole parameters (a one-file checkpoint holds the model whole, as
// before, and one saved that way loads here too).
// The buffers (BatchNorm's running statistics) are each rank's own, not synchronised: rank r's
// buffer of n elements is saved as row r of a whole [world, n] tensor, so that a rank loads its
// own row at the saving world size and row r % W at another (kPerRank's rule). A checkpoint
// without buffers (before they were saved) leaves them as they are.
class FsdpModelState : public Stateful {
 public:
  explicit FsdpModelState(FullyShardedDataParallelBase& model) : model_(model) {}

  StateDict state_dict() override {
    StateDict out;
    for (auto& part : model_.local_shards()) {
      out.shards.emplace_back(part.name, ShardPlacement{part.shape, part.offset});
      out.tensors.emplace_back(std::move(part.name), std::move(part.data));
    }
    const int64_t rank = model_.process_group().rank(), world = model_.process_group().size();
    for (const auto& [name, b] : model_.named_buffers()) {
      out.shards.emplace_back(name, ShardPlacement{{world, b.numel()}, rank * b.numel()});
      out.tensors.emplace_back(name, b.detach().reshape({-1}));
    }
    return out;
  }

  std::optional<ElementRange> wanted(const std::string& name,
                                     const std::vector<int64_t>& whole_shape) const override {
    const Geometry& g = geometry_of(model_, geometry_);
    if (const auto part = g.parts.find(name); part != g.parts.end()) {
      if (part->second.shape != whole_shape) return std::nullopt;  // check() says so
      return part->second.range;
    }
    if (const auto b = g.buffer_numel.find(name); b != g.buffer_numel.end()) {
      const int64_t n = b->second;
      if (whole_shape.size() != 2 || whole_shape[0] < 1 || whole_shape[1] != n) {
        return std::nullopt;  // check() says so
      }
      return ElementRange{model_.process_group().rank() % whole_shape[0] * n, n};
    }
    return std::nullopt;
  }

  std::string check(const StateDict& saved, const LoadContext&) override {
    std::vector<std::string> why;
    size_t known = 0;
    const auto differs = [&](const std::string& name, const ShardPlacement& p, const at::Tensor& t,
                             const std::string& want_shape, c10::ScalarType dtype) {
      why.push_back(fmt::format("'{}' is {} {} there, {} {} here", name,
                                c10::str(c10::IntArrayRef(p.whole_shape)),
                                t.defined() ? c10::toString(t.scalar_type()) : "undefined",
                                want_shape, c10::toString(dtype)));
    };
    for (const auto& part : model_.local_shards()) {
      const ShardPlacement* p = saved.shard(part.name);
      const at::Tensor* t = saved.find(part.name);
      if (p == nullptr || t == nullptr) {
        why.push_back(fmt::format("'{}' is missing", part.name));
        continue;
      }
      ++known;
      if (p->whole_shape != part.shape || !t->defined() ||
          t->scalar_type() != part.data.scalar_type()) {
        differs(part.name, *p, *t, c10::str(c10::IntArrayRef(part.shape)), part.data.scalar_type());
      }
    }
    const auto buffers = model_.named_buffers();
    const bool with_buffers = std::any_of(buffers.begin(), buffers.end(), [&](const auto& b) {
      return saved.shard(b.first) != nullptr;
    });
    for (const auto& [name, b] : with_buffers ? buffers : decltype(buffers){}) {
      const ShardPlacement* p = saved.shard(name);
      const at::Tensor* t = saved.find(name);
      if (p == nullptr || t == nullptr) {
        why.push_back(fmt::format("buffer '{}' is missing", name));
        continue;
      }
      ++known;
      if (!t->defined() || t->numel() != b.numel() || t->scalar_type() != b.scalar_type()) {
        differs(name, *p, *t, fmt::format("[world, {}]", b.numel()), b.scalar_type());
      }
    }
    if (saved.shards.size() > known) {
      why.push_back(fmt::format("{} parameter(s) or buffer(s) there that this model does not have",
                                saved.shards.size() - known));
    }
    return why.empty() ? "" : fmt::format("{}", fmt::join(why, "; "));
  }

  void load_state_dict(const StateDict& saved, const LoadContext&) override {
    c10::NoGradGuard no_grad;
    for (auto& part : model_.local_shards()) part.data.copy_(*saved.find(part.name));
    for (auto& [name, b] : model_.named_buffers()) {
      if (const at::Tensor* t = saved.find(name)) b.copy_(t->view_as(b));
    }
  }

  StateScope scope() const override { return StateScope::kSharded; }
  std::string kind() const override { return "FullyShardedDataParallel model"; }

 private:
  FullyShardedDataParallelBase& model_;
  mutable std::optional<Geometry> geometry_;  // wanted()'s, taken on first use
};

// The per-rank form: an optimizer over a FullyShardedDataParallel's shards whose type has no
// field table below (each rank's own state, loaded only where it was saved: the same world
// size, the same rank; another world size shards differently and the message says what to do);
// also what reads an optimizer state saved per rank by the ddp-cpp of 2026-11-30.
class FsdpOptimizerState : public Stateful {
 public:
  explicit FsdpOptimizerState(torch::optim::Optimizer& optimizer)
      : inner_(optimizer_state(optimizer)) {}
  StateDict state_dict() override { return inner_->state_dict(); }
  std::string check(const StateDict& saved, const LoadContext& context) override {
    if (!context.own) {
      return fmt::format(
          "the optimizer state of a FullyShardedDataParallel is each rank's own and was saved "
          "at world size {}, not {}: resume at {} ranks, or restore the model alone (add the "
          "optimizer with AddOptions{{.optional = true}} under another key)",
          context.saved_world_size, context.world_size, context.saved_world_size);
    }
    return inner_->check(saved, context);
  }
  void load_state_dict(const StateDict& saved, const LoadContext& context) override {
    inner_->load_state_dict(saved, context);
  }
  StateScope scope() const override { return StateScope::kPerRank; }
  std::string kind() const override { return "optimizer"; }

 private:
  std::shared_ptr<Stateful> inner_;
};

// Note [Sharded optimizer state]
// The state of an optimizer over a FullyShardedDataParallel's shards, as pieces (kSharded) that
// load at any world size: each per-parameter state tensor of a unit's shard (Adam's exp_avg,
// SGD's momentum_buffer, ...) is cut at the bounds of the model's parameters, as the parameters
// themselves are (local_shards()), and saved as "<field>/<parameter>" placed in the parameter's
// whole shape; the shard's padding holds no state (its gradient and value are always zero, so
// is every moment) and is not saved. The step counts (one per unit, every rank's alike) and the
// param groups' options are rank 0's. Loading rebuilds each unit's state at this rank's new
// shard from the pieces. The tensors saved are the optimizer's own (no archive, no copy), so a
// rank's save holds nothing but its own state once. PyTorch's FSDP does the same with
// FSDP.optim_state_dict (its per-parameter ShardedTensors). Optimizer types: those the table
// below knows (Adam, AdamW, SGD, Adagrad, RMSprop); another falls back to FsdpOptimizerState.
using ParamState = torch::optim::OptimizerParamState;
struct Field {
  std::string name;
  std::function<at::Tensor(const ParamState&)> get;
  std::function<void(ParamState&, at::Tensor)> set;
};
struct OptimizerKind {
  std::function<std::unique_ptr<ParamState>()> make;
  std::vector<Field> fields;
  std::function<int64_t(const ParamState&)> get_step;  // null: the type keeps no step count
  std::function<void(ParamState&, int64_t)> set_step;
};

#define DDP_FIELD(S, f)                                                                       \
  Field {                                                                                     \
#f, [](const ParamState& s) { return static_cast<const S&>(s).f(); },                       \
        [](ParamState& s, at::Tensor t) { static_cast<S&>(s).f(std::move(t)); } \
  }
#define DDP_STEP(S)                                                    \
  [](const ParamState& s) { return static_cast<const S&>(s).step(); }, \
      [](ParamState& s, int64_t v) { static_cast<S&>(s).step(v); }

template <typename S>
std::unique_ptr<ParamState> make_state() {
  return std::make_unique<S>();
}

// Adam's and AdamW's states have the same fields.
template <typename S>
OptimizerKind adam_kind() {
  return {make_state<S>,
          {DDP_FIELD(S, exp_avg), DDP_FIELD(S, exp_avg_sq), DDP_FIELD(S, max_exp_avg_sq)},
          DDP_STEP(S)};
}

// The kinds the sharded form knows, or null.
const OptimizerKind* kind_of(const torch::optim::Optimizer& o) {
  using namespace torch::optim;
  static const OptimizerKind adam = adam_kind<AdamParamState>();
  static const OptimizerKind adamw = adam_kind<AdamWParamState>();
  static const OptimizerKind sgd{make_state<SGDParamState>,
                                 {DDP_FIELD(SGDParamState, momentum_buffer)},
                                 nullptr,
                                 nullptr};
  static const OptimizerKind adagrad{make_state<AdagradParamState>,
                                     {DDP_FIELD(AdagradParamState, sum)},
                                     DDP_STEP(AdagradParamState)};
  static const OptimizerKind rmsprop{make_state<RMSpropParamState>,
                                     {DDP_FIELD(RMSpropParamState, square_avg),
                                      DDP_FIELD(RMSpropParamState, momentum_buffer),
                                      DDP_FIELD(RMSpropParamState, grad_avg)},
                                     DDP_STEP(RMSpropParamState)};
  if (dynamic_cast<const AdamW*>(&o)) return &adamw;
  if (dynamic_cast<const Adam*>(&o)) return &adam;
  if (dynamic_cast<const SGD*>(&o)) return &sgd;
  if (dynamic_cast<const Adagrad*>(&o)) return &adagrad;
  if (dynamic_cast<const RMSprop*>(&o)) return &rmsprop;
  return nullptr;
}
#undef DDP_FIELD
#undef DDP_STEP

// The key the optimizer's state map files a parameter under: LibTorch 1.13 the address printed
// (as its Optimizer does), 2.x the address itself.
template <typename Map>
typename Map::key_type state_key(const Map&, const at::Tensor& p) {
  using Key = typename Map::key_type;
  if constexpr (std::is_same_v<Key, std::string>) {
    std::ostringstream os;
    os << static_cast<const void*>(p.unsafeGetTensorImpl());
    return os.str();
  } else {
    return static_cast<Key>(p.unsafeGetTensorImpl());
  }
}

class FsdpShardedOptimizerState : public Stateful {
 public:
  FsdpShardedOptimizerState(torch::optim::Optimizer& o, FullyShardedDataParallelBase& model,
                            const OptimizerKind& kind)
      : o_(o), model_(model), kind_(kind), type_(type_name_of(o)) {
    const auto shards = model_.parameters();
    for (const auto& group : o_.param_groups()) {
      for (const at::Tensor& p : group.params()) {
        const auto it = std::find_if(shards.begin(), shards.end(), [&](const at::Tensor& s) {
          return s.unsafeGetTensorImpl() == p.unsafeGetTensorImpl();
        });
        DDP_CHECK(it != shards.end(), ConfigError,
                  "TrainingState::add(key, optimizer, model): the optimizer steps a tensor that "
                  "is not one of the model's shards (model.parameters())");
      }
    }
  }

  StateDict state_dict() override {
    StateDict out;
    const auto shards = model_.parameters();
    const auto parts = model_.local_shards();
    nlohmann::json steps = nlohmann::json::array();
    for (size_t u = 0; u < shards.size(); ++u) {
      const ParamState* st = find(shards[u]);
      if (st == nullptr) {
        steps.push_back(nullptr);
        continue;
      }
      steps.push_back(kind_.get_step ? kind_.get_step(*st) : 0);
      for (const Field& f : kind_.fields) {
        const at::Tensor t = f.get(*st);
        if (!t.defined()) continue;
        for (const auto& part : parts) {
          if (part.unit != u) continue;
          const std::string name = f.name + "/" + part.name;
          out.tensors.emplace_back(name, t.narrow(0, part.shard_offset, part.data.numel()));
          out.shards.emplace_back(name, ShardPlacement{part.shape, part.offset});
        }
      }
    }
    out.tensors.emplace_back("groups", bytes_tensor(group_options_bytes(o_)));
    out.json = nlohmann::json{{kOptimizerTypeField, type_}, {"steps", steps}}.dump();
    return out;
  }

  std::optional<ElementRange> wanted(const std::string& name,
                                     const std::vector<int64_t>& whole_shape) const override {
    const size_t slash = name.find('/');
    // Not a field of a parameter: a tensor of a per-rank save (its archive), taken whole.
    if (slash == std::string::npos) return ElementRange{0, numel_of(whole_shape)};
    const Geometry& g = geometry_of(model_, geometry_);
    const auto part = g.parts.find(std::string_view(name).substr(slash + 1));
    if (part == g.parts.end() || part->second.shape != whole_shape) return std::nullopt;
    return part->second.range;
  }

  std::string check(const StateDict& saved, const LoadContext& context) override {
    const nlohmann::json j = nlohmann::json::parse(saved.json, nullptr, false);
    if (!j.is_object() || j.value(kOptimizerTypeField, "") != type_) {
      return fmt::format("it holds {} state but this run's optimizer is {}",
                         j.is_object() ? j.value(kOptimizerTypeField, "no optimizer's") : "no",
                         type_);
    }
    if (!j.contains("steps")) {  // saved per rank, before the sharded form
      per_rank_ = std::make_unique<FsdpOptimizerState>(o_);
      return per_rank_->check(saved, context);
    }
    per_rank_.reset();
    const auto shards = model_.parameters();
    if (!j["steps"].is_array() || j["steps"].size() != shards.size()) {
      return fmt::format("it holds the state of {} units, this model has {}",
                         j["steps"].is_array() ? j["steps"].size() : 0, shards.size());
    }
    const at::Tensor* groups = saved.find("groups");
    if (groups == nullptr || !groups->defined()) return "it lacks the param groups' options";
    if (std::string why = load_group_options(o_, tensor_bytes(*groups), /*apply=*/false);
        !why.empty()) {
      return why;
    }
    // Every field a unit has state in must be there for every parameter of the unit, whole.
    const auto parts = model_.local_shards();
    std::vector<std::string> why;
    size_t matched = 0;
    for (size_t u = 0; u < shards.size(); ++u) {
      for (const Field& f : kind_.fields) {
        size_t present = 0, in_unit = 0;
        for (const auto& part : parts) {
          if (part.unit != u) continue;
          ++in_unit;
          const at::Tensor* t = saved.find(f.name + "/" + part.name);
          const ShardPlacement* p = saved.shard(f.name + "/" + part.name);
          if (t == nullptr || p == nullptr) continue;
          ++present;
          if (p->whole_shape != part.shape || !t->defined() || t->numel() != part.data.numel()) {
            why.push_back(fmt::format("its {} of '{}' is {} there, {} here", f.name, part.name,
                                      c10::str(c10::IntArrayRef(p->whole_shape)),
                                      c10::str(c10::IntArrayRef(part.shape))));
          }
        }
        matched += present;
        if (present != 0 && (present != in_unit || j["steps"][u].is_null())) {
          why.push_back(fmt::format("its {} covers {} of unit {}'s {} parameters", f.name, present,
                                    u, in_unit));
        }
      }
    }
    if (saved.shards.size() > matched) {
      why.push_back(fmt::format("{} state tensor(s) there for parameters this model does not have",
                                saved.shards.size() - matched));
    }
    return why.empty() ? "" : fmt::format("{}", fmt::join(why, "; "));
  }

  void load_state_dict(const StateDict& saved, const LoadContext& context) override {
    if (per_rank_) {
      per_rank_->load_state_dict(saved, context);
      return;
    }
    c10::NoGradGuard no_grad;
    const nlohmann::json steps = nlohmann::json::parse(saved.json)["steps"];
    const auto shards = model_.parameters();
    const auto parts = model_.local_shards();
    auto& state = o_.state();
    state.clear();  // a unit without saved state must not keep this run's
    for (size_t u = 0; u < shards.size(); ++u) {
      if (steps[u].is_null()) continue;
      std::unique_ptr<ParamState> st = kind_.make();
      if (kind_.set_step) kind_.set_step(*st, steps[u].get<int64_t>());
      for (const Field& f : kind_.fields) {
        at::Tensor whole;  // this rank's shard of the field, its padding zero
        for (const auto& part : parts) {
          if (part.unit != u) continue;
          const at::Tensor* t = saved.find(f.name + "/" + part.name);
          if (t == nullptr) break;
          if (!whole.defined()) whole = at::zeros_like(shards[u]).detach();
          whole.narrow(0, part.shard_offset, part.data.numel()).copy_(*t);
        }
        if (whole.defined()) f.set(*st, std::move(whole));
      }
      state[state_key(state, shards[u])] = std::move(st);
    }
    load_group_options(o_, tensor_bytes(*saved.find("groups")), /*apply=*/true);
  }

  StateScope scope() const override { return StateScope::kSharded; }
  std::string kind() const override { return "optimizer"; }

 private:
  const ParamState* find(const at::Tensor& shard) const {
    const auto& state = o_.state();
    const auto it = state.find(state_key(state, shard));
    return it == state.end() ? nullptr : it->second.get();
  }

  torch::optim::Optimizer& o_;
  FullyShardedDataParallelBase& model_;
  const OptimizerKind& kind_;
  const std::string type_;
  std::unique_ptr<FsdpOptimizerState> per_rank_;  // check()'s choice for a per-rank save
  mutable std::optional<Geometry> geometry_;      // wanted()'s, taken on first use
};

}  // namespace

std::shared_ptr<Stateful> fsdp_state(FullyShardedDataParallelBase& model) {
  return std::make_shared<FsdpModelState>(model);
}

std::shared_ptr<Stateful> fsdp_optimizer_state(torch::optim::Optimizer& optimizer,
                                               FullyShardedDataParallelBase& model) {
  if (const OptimizerKind* kind = kind_of(optimizer)) {
    return std::make_shared<FsdpShardedOptimizerState>(optimizer, model, *kind);
  }
  return std::make_shared<FsdpOptimizerState>(optimizer);
}

}  // namespace ddp::state
