// The library's objects as ddp::Stateful (what TrainingState::add wraps them in; the list of
// what each saves is in include/ddp/training_state.h). Each adapter holds a reference to its
// object, which must outlive it.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "ddp/stateful.h"

namespace torch::nn {
class Module;
}
namespace torch::optim {
class Optimizer;
}

namespace ddp {

class DistributedDataParallelBase;
class FullyShardedDataParallelBase;
class DistributedSampler;
class ZeroRedundancyOptimizer;
namespace comm_hooks {
class PowerSGDState;
}

namespace state {

std::shared_ptr<Stateful> module_state(torch::nn::Module& module);
std::shared_ptr<Stateful> ddp_state(DistributedDataParallelBase& model);
std::shared_ptr<Stateful> optimizer_state(torch::optim::Optimizer& optimizer);
std::shared_ptr<Stateful> zero_state(ZeroRedundancyOptimizer& optimizer);
std::shared_ptr<Stateful> fsdp_state(FullyShardedDataParallelBase& model);
std::shared_ptr<Stateful> fsdp_optimizer_state(torch::optim::Optimizer& optimizer,
                                               FullyShardedDataParallelBase& model);
std::shared_ptr<Stateful> sampler_state(DistributedSampler& sampler);
std::shared_ptr<Stateful> powersgd_state(comm_hooks::PowerSGDState& state);

// Each param group's options (lr, momentum, ... as a scheduler left them) as the bytes of a
// LibTorch archive; and back: "" or why they do not fit, applied only when `apply`.
std::string group_options_bytes(const torch::optim::Optimizer& optimizer);
std::string load_group_options(torch::optim::Optimizer& optimizer, const std::string& bytes,
                               bool apply);

// The JSON of an optimizer's state names its type ("type"), what loading compares first.
inline constexpr const char* kOptimizerTypeField = "type";

}  // namespace state
}  // namespace ddp
