// A module's parameters and buffers, and a DistributedDataParallel's bucket order, as Stateful.
#include <algorithm>
#include <map>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>
#include <torch/nn/module.h>

#include "ddp/distributed_data_parallel.h"
#include "parallel/ddp_core.h"  // DdpCore::rebind
#include "state/adapters.h"
#include "state/group_bound.h"

namespace ddp::state {
namespace {

using nlohmann::json;

// Differences listed in a mismatch message before "and N more".
constexpr size_t kMaxListedDifferences = 6;

// One tensor of a module as a checkpoint records it.
struct Sig {
  std::string kind;  // "parameter" or "buffer"
  std::string name;  // e.g. "fc1.weight"
  std::vector<int64_t> shape;
  std::string dtype;  // e.g. "Float"; "undefined" for an undefined buffer
  bool operator==(const Sig&) const = default;
};

Sig sig_of(const char* kind, const std::string& name, const at::Tensor& t) {
  if (!t.defined()) return {kind, name, {}, "undefined"};
  return {kind, name, t.sizes().vec(), std::string(c10::toString(t.scalar_type()))};
}

std::string shape_str(const std::vector<int64_t>& shape) {
  return fmt::format("[{}]", fmt::join(shape, ", "));
}
std::string describe(const Sig& s) { return fmt::format("{} '{}'", s.kind, s.name); }

// The module's parameters then buffers (recursive, registration order): what is saved, and in
// that order what is loaded (optimizer state is matched to parameters by position).
std::vector<Sig> fingerprint(torch::nn::Module& m) {
  std::vector<Sig> out;
  for (const auto& p : m.named_parameters(true)) out.push_back(sig_of("parameter", p.key(), p.value()));
  for (const auto& b : m.named_buffers(true)) out.push_back(sig_of("buffer", b.key(), b.value()));
  return out;
}

// The saved state's tensors as signatures: the first "parameters" of them are parameters.
std::vector<Sig> fingerprint(const StateDict& saved) {
  const json j = json::parse(saved.json, nullptr, /*allow_exceptions=*/false);
  const size_t params = j.is_object() && j.contains("parameters") && j["parameters"].is_number()
                            ? j["parameters"].get<size_t>()
                            : saved.tensors.size();
  std::vector<Sig> out;
  for (size_t i = 0; i < saved.tensors.size(); ++i) {
    out.push_back(sig_of(i < params ? "parameter" : "buffer", saved.tensors[i].first,
                         saved.tensors[i].second));
  }
  return out;
}

// "" when `model` matches `saved` exactly (names, shapes, dtypes, order); else the differences,
// e.g. "checkpoint holds parameter 'fc1.weight' [128, 784] but the model has [256, 784]".
std::string explain_mismatch(const std::vector<Sig>& saved, const std::vector<Sig>& model) {
  std::map<std::string, const Sig*> in_model, in_saved;
  for (const auto& s : model) in_model[s.kind + "/" + s.name] = &s;
  for (const auto& s : saved) in_saved[s.kind + "/" + s.name] = &s;
  // Shape and dtype differences first (the most telling), then tensors present on one side
  // only, alternating sides so that both show up within the listed few.
  std::vector<std::string> diffs, only_saved, only_model;
  for (const auto& s : saved) {
    auto it = in_model.find(s.kind + "/" + s.name);
    if (it == in_model.end()) {
      only_saved.push_back(fmt::format("checkpoint holds {} {} that the model lacks", describe(s),
                                       shape_str(s.shape)));
    } else if (it->second->shape != s.shape) {
      diffs.push_back(fmt::format("checkpoint holds {} {} but the model has {}", describe(s),
                                  shape_str(s.shape), shape_str(it->second->shape)));
    } else if (it->second->dtype != s.dtype) {
      diffs.push_back(fmt::format("checkpoint holds {} as {} but the model has {}", describe(s),
                                  s.dtype, it->second->dtype));
    }
  }
  for (const auto& s : model) {
    if (!in_saved.count(s.kind + "/" + s.name)) {
      only_model.push_back(fmt::format("the model has {} {} that the checkpoint lacks", describe(s),
                                       shape_str(s.shape)));
    }
  }
  for (size_t i = 0; i < std::max(only_saved.size(), only_model.size()); ++i) {
    if (i < only_saved.size()) diffs.push_back(only_saved[i]);
    if (i < only_model.size()) diffs.push_back(only_model[i]);
  }
  if (diffs.empty() && saved != model) {
    // Same tensors, another order: the optimizer state is matched to parameters by position.
    size_t i = 0;
    while (i < saved.size() && saved[i] == model[i]) ++i;
    diffs.push_back(fmt::format(
        "the same tensors are registered in another order (first at #{}: checkpoint {}, model "
        "{}); optimizer state is matched by position, so the order must agree",
        i, describe(saved[i]), describe(model[i])));
  }
  std::string out;
  for (size_t i = 0; i < diffs.size() && i < kMaxListedDifferences; ++i) {
    out += (i ? "; " : "") + diffs[i];
  }
  if (diffs.size() > kMaxListedDifferences) {
    const size_t more = diffs.size() - kMaxListedDifferences;
    out += fmt::format("; and {} more difference{}", more, more == 1 ? "" : "s");
  }
  return out;
}

class ModuleState : public Stateful {
 public:
  explicit ModuleState(torch::nn::Module& m) : m_(m) {}

  StateDict state_dict() override {
    StateDict s;
    size_t params = 0;
    for (const auto& p : m_.named_parameters(true)) {
      s.tensors.emplace_back(p.key(), p.value());
      ++params;
    }
    for (const auto& b : m_.named_buffers(true)) s.tensors.emplace_back(b.key(), b.value());
    s.json = json{{"parameters", params}}.dump();
    return s;
  }

  std::string check(const StateDict& saved, const LoadContext&) override {
    return explain_mismatch(fingerprint(saved), fingerprint(m_));
  }

  void load_state_dict(const StateDict& saved, const LoadContext&) override {
    torch::NoGradGuard no_grad;
    // copy_ keeps each tensor's storage: optimizers, DDP's bucket views and anything else that
    // holds the parameters keep seeing them.
    size_t i = 0;
    auto copy = [&](at::Tensor& target) {
      if (target.defined()) target.copy_(saved.tensors[i].second);
      ++i;
    };
    for (auto& p : m_.named_parameters(true)) copy(p.value());
    for (auto& b : m_.named_buffers(true)) copy(b.value());
  }

  std::string kind() const override { return "model"; }

 private:
  torch::nn::Module& m_;
};

// The module as above, plus the bucket order DDP rebuilt after its first iteration. Under fault
// tolerance, the wrapper follows each new group (a failed step changed nothing to return to).
class DdpState : public ModuleState, public GroupBound {
 public:
  void committed() override {}
  void regroup(const std::shared_ptr<ProcessGroup>& group) override {
    detail::core_of(model_).rebind(group);
  }

  explicit DdpState(DistributedDataParallelBase& model)
      : ModuleState(model.untyped_module()), model_(model) {}

  StateDict state_dict() override {
    StateDict s = ModuleState::state_dict();
    json j = json::parse(s.json);
    j["bucket_order"] = model_.bucket_order();
    s.json = j.dump();
    return s;
  }

  std::string check(const StateDict& saved, const LoadContext& context) override {
    std::string why = ModuleState::check(saved, context);
    if (!why.empty()) return why;
    const std::vector<int64_t> order = saved_order(saved);
    size_t params = 0;
    for (const auto& bucket : model_.bucket_layout()) params += bucket.size();
    if (params == 0) return "";  // world size 1: no buckets, the order is not used
    std::vector<char> seen(params, 0);
    bool permutation = order.empty() || order.size() == params;
    for (int64_t v : order) {
      permutation = permutation && v >= 0 && v < static_cast<int64_t>(params) && !seen[v];
      if (permutation) seen[v] = 1;
    }
    if (!permutation) {
      return fmt::format("its DDP bucket order ({} entries) is not a permutation of this model's {} "
                         "reduced parameters",
                         order.size(), params);
    }
    return "";
  }

  void load_state_dict(const StateDict& saved, const LoadContext& context) override {
    ModuleState::load_state_dict(saved, context);
    // The buckets the saved run had rebuilt, so that the summation order matches from the first
    // step (empty: it had not rebuilt yet, or never does).
    model_.restore_bucket_order(saved_order(saved));
  }

 private:
  static std::vector<int64_t> saved_order(const StateDict& saved) {
    const json j = json::parse(saved.json, nullptr, /*allow_exceptions=*/false);
    if (!j.is_object() || !j.contains("bucket_order") || !j["bucket_order"].is_array()) return {};
    std::vector<int64_t> order;
    for (const json& v : j["bucket_order"]) order.push_back(v.is_number_integer() ? v.get<int64_t>() : -1);
    return order;
  }

  DistributedDataParallelBase& model_;
};

}  // namespace

std::shared_ptr<Stateful> module_state(torch::nn::Module& module) {
  return std::make_shared<ModuleState>(module);
}

std::shared_ptr<Stateful> ddp_state(DistributedDataParallelBase& model) {
  return std::make_shared<DdpState>(model);
}

}  // namespace ddp::state
