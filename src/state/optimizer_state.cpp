// Optimizers as Stateful: any torch::optim optimizer, and ZeroRedundancyOptimizer.
#include <optional>
#include <sstream>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>
#include <torch/optim/optimizer.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include "base/demangle.h"
#include "base/tensor_bytes.h"
#include "ddp/zero_redundancy_optimizer.h"
#include "state/adapters.h"

namespace ddp::state {
namespace {

using nlohmann::json;

// The optimizer type a saved state names ("" when it names none).
std::string saved_type(const StateDict& saved) {
  const json j = json::parse(saved.json, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object() || !j.contains(kOptimizerTypeField) || !j[kOptimizerTypeField].is_string()) {
    return "";
  }
  return j[kOptimizerTypeField].get<std::string>();
}

std::string other_type(const std::string& saved, const std::string& mine) {
  if (saved.empty()) return "it holds no optimizer type: it is not an optimizer's state";
  if (saved == mine) return "";
  return fmt::format("it holds {} state but this run's optimizer is {}", saved, mine);
}

// Parameters per param group.
std::vector<int64_t> group_sizes(const torch::optim::Optimizer& o) {
  std::vector<int64_t> out;
  for (const auto& g : o.param_groups()) out.push_back(static_cast<int64_t>(g.params().size()));
  return out;
}

// The device the optimizer's parameters live on (its state is mapped there); none for the CPU.
c10::optional<c10::Device> device_of(const torch::optim::Optimizer& o) {
  for (const auto& g : o.param_groups()) {
    for (const auto& p : g.params()) {
      if (p.defined() && !p.device().is_cpu()) return p.device();
    }
  }
  return c10::nullopt;
}

// The state is one LibTorch archive ("archive": its bytes) holding "optimizer" (what
// Optimizer::save writes: per-parameter state) and "optimizer_groups" ("group/<i>": each param
// group's options, which Optimizer::load does not restore but a scheduler may have changed);
// JSON {"type", "group_sizes"}. The archive is parsed in check() and kept for the load that
// follows, so that a state LibTorch cannot read is refused before anything changes.
class OptimizerState : public Stateful {
 public:
  explicit OptimizerState(torch::optim::Optimizer& o) : o_(o), type_(type_name_of(o)) {}

  StateDict state_dict() override {
    torch::serialize::OutputArchive ar;
    torch::serialize::OutputArchive opt_ar(ar.compilation_unit());
    o_.save(opt_ar);
    ar.write("optimizer", opt_ar);
    torch::serialize::OutputArchive groups_ar(ar.compilation_unit());
    const auto& groups = o_.param_groups();
    for (size_t g = 0; g < groups.size(); ++g) {
      torch::serialize::OutputArchive group_ar(ar.compilation_unit());
      groups[g].options().serialize(group_ar);
      groups_ar.write(fmt::format("group/{}", g), group_ar);
    }
    ar.write("optimizer_groups", groups_ar);
    std::ostringstream os;
    ar.save_to(os);
    StateDict s;
    s.tensors.emplace_back("archive", bytes_tensor(std::move(os).str()));
    s.json = json{{kOptimizerTypeField, type_}, {"group_sizes", group_sizes(o_)}}.dump();
    return s;
  }

  std::string check(const StateDict& saved, const LoadContext&) override {
    parsed_.reset();
    if (std::string why = other_type(saved_type(saved), type_); !why.empty()) return why;
    const json j = json::parse(saved.json, nullptr, false);
    const auto sizes = group_sizes(o_);
    const auto saved_sizes = j.value("group_sizes", std::vector<int64_t>{});
    if (saved_sizes != sizes) {
      return fmt::format("its optimizer has param groups of [{}] parameters, this run's has [{}]",
                         fmt::join(saved_sizes, ", "), fmt::join(sizes, ", "));
    }
    const at::Tensor* archive = saved.find("archive");
    if (!archive || !archive->defined()) return "it lacks the optimizer's archive";
    Parsed p;
    try {
      const std::string bytes = tensor_bytes(*archive);
      p.whole.load_from(bytes.data(), bytes.size(), device_of(o_));
      if (!p.whole.try_read("optimizer", p.optimizer) ||
          !p.whole.try_read("optimizer_groups", p.groups)) {
        return "its archive lacks the optimizer state or the param groups' options";
      }
    } catch (const c10::Error& e) {
      return fmt::format("LibTorch cannot read its optimizer archive ({})",
                         e.what_without_backtrace());
    }
    parsed_.emplace(std::move(p));
    return "";
  }

  void load_state_dict(const StateDict& saved, const LoadContext& context) override {
    if (!parsed_) {
      const std::string why = check(saved, context);
      if (!why.empty()) throw IncompatibleStateError(why);
    }
    Parsed p = std::move(*parsed_);
    parsed_.reset();
    try {
      // Clear first: a parameter without saved state (no gradient yet when saved) must not keep
      // state from this run.
      o_.state().clear();
      o_.load(p.optimizer);
      auto& groups = o_.param_groups();
      for (size_t g = 0; g < groups.size(); ++g) {
        torch::serialize::InputArchive group_ar;
        p.groups.read(fmt::format("group/{}", g), group_ar);
        groups[g].options().serialize(group_ar);
      }
    } catch (const c10::Error& e) {
      throw Error(fmt::format("LibTorch could not restore the optimizer state ({})",
                              e.what_without_backtrace()));
    }
  }

  std::string kind() const override { return "optimizer"; }

 private:
  struct Parsed {
    torch::serialize::InputArchive whole, optimizer, groups;
  };
  torch::optim::Optimizer& o_;
  const std::string type_;
  std::optional<Parsed> parsed_;  // check()'s, for the load_state_dict() that follows
};

// ZeroRedundancyOptimizer: consolidated on rank 0 (every rank calls state_dict()), loaded at
// any world size (each rank takes its part); "state": the consolidated bytes, JSON {"type"}.
class ZeroState : public Stateful {
 public:
  explicit ZeroState(ZeroRedundancyOptimizer& o) : o_(o) {}

  StateScope scope() const override { return StateScope::kCollective; }

  StateDict state_dict() override {
    o_.consolidate_state_dict(0);
    StateDict s;
    s.json = json{{kOptimizerTypeField, o_.type_name()}}.dump();
    if (o_.rank() == 0) s.tensors.emplace_back("state", bytes_tensor(o_.state_dict()));
    return s;
  }

  std::string check(const StateDict& saved, const LoadContext&) override {
    if (std::string why = other_type(saved_type(saved), o_.type_name()); !why.empty()) return why;
    const at::Tensor* state = saved.find("state");
    return state && state->defined() ? "" : "it lacks the sharded optimizer's consolidated state";
  }

  void load_state_dict(const StateDict& saved, const LoadContext&) override {
    o_.load_state_dict(tensor_bytes(*saved.find("state")));
  }

  std::string kind() const override { return "optimizer"; }

 private:
  ZeroRedundancyOptimizer& o_;
};

}  // namespace

std::shared_ptr<Stateful> optimizer_state(torch::optim::Optimizer& optimizer) {
  return std::make_shared<OptimizerState>(optimizer);
}

std::shared_ptr<Stateful> zero_state(ZeroRedundancyOptimizer& optimizer) {
  return std::make_shared<ZeroState>(optimizer);
}

}  // namespace ddp::state
