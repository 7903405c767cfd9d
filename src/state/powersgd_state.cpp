// PowerSGD's hook state as Stateful: each rank's own ("state": PowerSGDState::state_dict()).
#include "base/tensor_bytes.h"
#include "ddp/comm_hooks.h"
#include "state/adapters.h"

namespace ddp::state {
namespace {

class PowerSGDStateful : public Stateful {
 public:
  explicit PowerSGDStateful(comm_hooks::PowerSGDState& s) : s_(s) {}

  // The error feedback is each rank's own; P, Q, the iteration and the generator are every
  // rank's. At another world size a rank takes another rank's state without its error feedback.
  StateScope scope() const override { return StateScope::kPerRank; }

  StateDict state_dict() override {
    StateDict s;
    s.tensors.emplace_back("state", bytes_tensor(s_.state_dict()));
    return s;
  }

  std::string check(const StateDict& saved, const LoadContext& context) override {
    const at::Tensor* state = saved.find("state");
    if (!state || !state->defined()) return "it lacks the PowerSGD state";
    try {
      comm_hooks::PowerSGDState dry_run(s_.options());
      dry_run.load_state_dict(tensor_bytes(*state), context.own);
    } catch (const Error& e) {
      return e.what();
    }
    return "";
  }

  void load_state_dict(const StateDict& saved, const LoadContext& context) override {
    s_.load_state_dict(tensor_bytes(*saved.find("state")), context.own);
  }

  std::string kind() const override { return "PowerSGD"; }

 private:
  comm_hooks::PowerSGDState& s_;
};

}  // namespace

std::shared_ptr<Stateful> powersgd_state(comm_hooks::PowerSGDState& state) {
  return std::make_shared<PowerSGDStateful>(state);
}

}  // namespace ddp::state
