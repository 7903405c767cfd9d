// DistributedSampler's cursor as Stateful: JSON of SamplerState's fields.
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <optional>

#include "ddp/process_group.h"
#include "ddp/sampler.h"
#include "state/adapters.h"
#include "state/group_bound.h"

namespace ddp::state {
namespace {

using nlohmann::json;

json to_json(const SamplerState& s) {
  return {{"epoch", s.epoch},
          {"position", s.position},
          {"num_replicas", s.num_replicas},
          {"offset", s.offset},
          {"dataset_size", s.dataset_size},
          {"seed", s.seed},
          {"shuffle", s.shuffle},
          {"drop_last", s.drop_last},
          {"pad", s.pad}};
}

// Throws json::exception when a field is missing or of another type.
SamplerState from_json(const json& j) {
  SamplerState s;
  j.at("epoch").get_to(s.epoch);
  j.at("position").get_to(s.position);
  j.at("num_replicas").get_to(s.num_replicas);
  j.at("offset").get_to(s.offset);
  j.at("dataset_size").get_to(s.dataset_size);
  j.at("seed").get_to(s.seed);
  j.at("shuffle").get_to(s.shuffle);
  j.at("drop_last").get_to(s.drop_last);
  j.at("pad").get_to(s.pad);
  return s;
}

// Under fault tolerance: a dropped step's batch returns to the sampler (the cursor goes back to
// the last commit), and the new group splits the rest of the epoch (reshard).
class SamplerStateful : public Stateful, public GroupBound {
 public:
  explicit SamplerStateful(DistributedSampler& s) : s_(s) {}

  void committed() override { committed_ = s_.state(); }
  void regroup(const std::shared_ptr<ProcessGroup>& group) override {
    if (committed_) s_.load_state(*committed_);
    s_.reshard(group->size(), group->rank());
  }

  // Every rank consumes in lockstep, so rank 0's cursor describes all ranks (Note [Sampler
  // position and resume]).
  StateDict state_dict() override { return {.json = to_json(s_.state()).dump()}; }

  std::string check(const StateDict& saved, const LoadContext&) override {
    try {
      s_.clone().load_state(from_json(json::parse(saved.json)));  // a dry run on a copy
    } catch (const json::exception& e) {
      return fmt::format("its sampler state is malformed ({})", e.what());
    } catch (const ConfigError& e) {
      return fmt::format("its sampler state does not fit this run's sampler: {}", e.what());
    }
    return "";
  }

  // A loaded state is a committed point too: a checkpoint is written between steps, and a
  // step dropped after a resume must go back to it, not to the cursor before the load.
  void load_state_dict(const StateDict& saved, const LoadContext&) override {
    s_.load_state(from_json(json::parse(saved.json)));
    committed_ = s_.state();
  }

  std::string kind() const override { return "sampler"; }

 private:
  DistributedSampler& s_;
  std::optional<SamplerState> committed_;  // at the last committed step (fault tolerance)
};

}  // namespace

std::shared_ptr<Stateful> sampler_state(DistributedSampler& sampler) {
  return std::make_shared<SamplerStateful>(sampler);
}

}  // namespace ddp::state
