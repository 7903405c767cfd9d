// Forming the measured groups over the control group's store (see groups.h).
#include "groups.h"

#include <cstdlib>  // setenv, unsetenv, getenv
#include <optional>

#include <ATen/ATen.h>
#include <fmt/format.h>

namespace ddp::bench {
namespace {

constexpr const char* kAgentStore = "TORCHELASTIC_USE_AGENT_STORE";
constexpr const char* kAgentStoreProtocol = "DDP_AGENT_STORE";
constexpr const char* kControlGroup = "ddp-bench";

// Sets an environment variable for this scope and restores the previous value after.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;  // restored below; not a knob
    setenv(name, value, 1);
  }
  ~ScopedEnv() {
    if (old_)
      setenv(name_, old_->c_str(), 1);
    else
      unsetenv(name_);
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  const char* name_;
  std::optional<std::string> old_;
};

}  // namespace

Groups::Groups() {
  InitOptions o;
  o.backend = "gloo";
  o.group_name = kControlGroup;
  control_ = make_process_group(o);
}

std::shared_ptr<ProcessGroup> Groups::form(const std::string& backend, std::string& why) {
  std::shared_ptr<ProcessGroup> group;
  try {
    // Clients of the store the control group uses: rank 0's own (a ddp-cpp store), unless the
    // control group is itself a client of a launcher's agent (then that one, as it is).
    std::optional<ScopedEnv> client, protocol;
    if (size() > 1 && !control_->env().use_agent_store) {
      client.emplace(kAgentStore, "True");
      protocol.emplace(kAgentStoreProtocol, "ddp");
    }
    InitOptions o;
    o.backend = transport_of(backend);
    o.group_name = backend;
    group = make_process_group(o);
  } catch (const std::exception& e) {
    why = e.what();
  }
  // Every rank must agree, or the ranks that formed it would wait for the others forever.
  at::Tensor formed = at::full({1}, group ? 1 : 0, at::kInt);
  control_->all_reduce(formed, ReduceOp::kMin).wait();
  if (formed.item<int>() == 1) return group;
  if (why.empty()) why = "another rank could not form it (see that rank's output)";
  return nullptr;
}

}  // namespace ddp::bench
