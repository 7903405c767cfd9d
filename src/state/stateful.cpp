// The small parts of ddp/stateful.h.
#include "ddp/stateful.h"

#include "ddp/training_state.h"  // json_state

namespace ddp {
namespace {

class JsonState : public Stateful {
 public:
  JsonState(std::function<std::string()> save, std::function<void(const std::string&)> load)
      : save_(std::move(save)), load_(std::move(load)) {}
  StateDict state_dict() override { return {.json = save_()}; }
  void load_state_dict(const StateDict& saved, const LoadContext&) override { load_(saved.json); }

 private:
  std::function<std::string()> save_;
  std::function<void(const std::string&)> load_;
};

}  // namespace

const at::Tensor* StateDict::find(std::string_view name) const {
  for (const auto& [n, t] : tensors) {
    if (n == name) return &t;
  }
  return nullptr;
}

const ShardPlacement* StateDict::shard(std::string_view name) const {
  for (const auto& [n, p] : shards) {
    if (n == name) return &p;
  }
  return nullptr;
}

std::string Stateful::check(const StateDict&, const LoadContext&) { return ""; }

std::optional<ElementRange> Stateful::wanted(const std::string&,
                                             const std::vector<int64_t>&) const {
  return std::nullopt;
}

const char* to_string(StateScope scope) {
  switch (scope) {
    case StateScope::kReplicated:
      return "replicated";
    case StateScope::kPerRank:
      return "per-rank";
    case StateScope::kCollective:
      return "collective";
    case StateScope::kSharded: return "sharded";
  }
  return "?";
}

std::shared_ptr<Stateful> json_state(std::function<std::string()> save,
                                     std::function<void(const std::string&)> load) {
  return std::make_shared<JsonState>(std::move(save), std::move(load));
}

}  // namespace ddp
