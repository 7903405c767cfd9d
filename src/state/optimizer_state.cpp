// Optimizers as Stateful: any torch::optim optimizer, and ZeroRedundancyOptimizer.
#include <algorithm>
#include <functional>
#include <map>
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

// Note [Optimizer archives across LibTorch versions]
// Optimizer::save names each parameter's state after the address of its TensorImpl, and
// Optimizer::load matches those names with the ones its param groups list. LibTorch 1.13 prints
// the address as a pointer ("0x55d0c2a1b3f0") and compares names as strings; 2.x prints it as a
// decimal integer and parses names with std::stoull, which reads every "0x..." name as 0: a 1.13
// archive loaded by 2.x gives the parameters one state, or another's, or none. A checkpoint
// outlives the LibTorch that wrote it, so before a load the names of an archive that are not all
// decimal are replaced by 1, 2, ... (the same number wherever a name appears), which both versions
// read. The archive is copied for that (tensors by reference, then serialised once): a load-time
// cost for archives that 1.13 wrote, the same on every version so the path is always tested.

bool decimal(const std::string& s) {
  return !s.empty() && std::all_of(s.begin(), s.end(), [](char c) { return c >= '0' && c <= '9'; });
}

// Every entry of `in` into `out`: sub-archives recursively, tensors and other values as
// attributes (InputArchive reads a tensor whatever way it was written); `edit`, where given,
// may replace any value, at any depth.
using Edit = std::function<c10::IValue(const std::string& key, c10::IValue value)>;
void copy_archive(torch::serialize::InputArchive& in, torch::serialize::OutputArchive& out,
                  const Edit& edit = nullptr) {
  for (const std::string& key : in.keys()) {
    c10::IValue value;
    in.read(key, value);
    if (value.isObject()) {
      torch::serialize::InputArchive sub;
      in.read(key, sub);
      torch::serialize::OutputArchive sub_out(out.compilation_unit());
      copy_archive(sub, sub_out, edit);
      out.write(key, sub_out);
    } else {
      out.write(key, edit ? edit(key, std::move(value)) : value);
    }
  }
}

// `optimizer` (what Optimizer::save wrote) with its state names decimal; false when they were.
bool number_state_names(torch::serialize::InputArchive& optimizer) {
  torch::serialize::InputArchive state, groups;
  optimizer.read("state", state);
  optimizer.read("param_groups", groups);
  const std::vector<std::string> names = state.keys();
  if (std::all_of(names.begin(), names.end(), decimal)) return false;
  std::map<std::string, std::string> number;
  auto renamed = [&](const std::string& name) {
    return number.emplace(name, std::to_string(number.size() + 1)).first->second;
  };
  torch::serialize::OutputArchive out;
  c10::IValue version;
  optimizer.read("pytorch_version", version);
  out.write("pytorch_version", version);
  torch::serialize::OutputArchive state_out(out.compilation_unit());
  for (const std::string& name : names) {
    torch::serialize::InputArchive one;
    state.read(name, one);
    torch::serialize::OutputArchive one_out(out.compilation_unit());
    copy_archive(one, one_out);
    state_out.write(renamed(name), one_out);
  }
  out.write("state", state_out);
  // param_groups: "param_groups/<i>" holds "params/<j>", a state's name.
  torch::serialize::OutputArchive groups_out(out.compilation_unit());
  copy_archive(groups, groups_out, [&](const std::string& entry, c10::IValue value) {
    return entry.starts_with("params/") && value.isString()
               ? c10::IValue(renamed(value.toStringRef()))
               : value;
  });
  out.write("param_groups", groups_out);
  std::ostringstream os;
  out.save_to(os);
  const std::string bytes = std::move(os).str();
  optimizer = torch::serialize::InputArchive();
  optimizer.load_from(bytes.data(), bytes.size());
  return true;
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
      number_state_names(p.optimizer);  // Note [Optimizer archives across LibTorch versions]
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

std::string group_options_bytes(const torch::optim::Optimizer& optimizer) {
  torch::serialize::OutputArchive ar;
  const auto& groups = optimizer.param_groups();
  for (size_t g = 0; g < groups.size(); ++g) {
    torch::serialize::OutputArchive group_ar(ar.compilation_unit());
    groups[g].options().serialize(group_ar);
    ar.write(fmt::format("group/{}", g), group_ar);
  }
  std::ostringstream os;
  ar.save_to(os);
  return std::move(os).str();
}

std::string load_group_options(torch::optim::Optimizer& optimizer, const std::string& bytes,
                               bool apply) {
  try {
    torch::serialize::InputArchive ar;
    ar.load_from(bytes.data(), bytes.size());
    auto& groups = optimizer.param_groups();
    for (size_t g = 0; g < groups.size(); ++g) {
      torch::serialize::InputArchive group_ar;
      if (!ar.try_read(fmt::format("group/{}", g), group_ar)) {
        return fmt::format("it lacks param group {}'s options", g);
      }
      if (apply) groups[g].options().serialize(group_ar);
    }
  } catch (const c10::Error& e) {
    return fmt::format("LibTorch cannot read its param groups' options ({})",
                       e.what_without_backtrace());
  }
  return "";
}

std::shared_ptr<Stateful> optimizer_state(torch::optim::Optimizer& optimizer) {
  return std::make_shared<OptimizerState>(optimizer);
}

std::shared_ptr<Stateful> zero_state(ZeroRedundancyOptimizer& optimizer) {
  return std::make_shared<ZeroState>(optimizer);
}

}  // namespace ddp::state
