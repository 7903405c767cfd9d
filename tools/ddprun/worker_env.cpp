// Each worker's environment: torchrun's contract (see args.h).
#include <fmt/format.h>

#include "args.h"

namespace ddp::launcher {
namespace {

// Note [Worker environment]
// torchrun's contract (run.py docstring; local_elastic_agent_test.py _check_env_function), with
// one deliberate difference for a single node: TORCHELASTIC_USE_AGENT_STORE=False, because
// ddprun hosts no store there; the worker with global rank 0 does (ddp-cpp, and PyTorch's env://
// init, both handle that). With several nodes node 0's ddprun hosts the store (Note [Restart
// rounds] in rounds.h), as torchrun's agent does: TORCHELASTIC_USE_AGENT_STORE=True, and
// DDP_AGENT_STORE=ddp tells ddp-cpp workers that it is a ddp-cpp store, not a TCPStore.
// Knobs the user set win where torchrun lets them (OMP_NUM_THREADS, NCCL error handling).
void set_default(EnvMap& env, const std::string& key, const std::string& value) {
  if (env.find(key) == env.end()) env[key] = value;
}

}  // namespace

EnvMap worker_environment(const LaunchConfig& config, const GroupSpec& group, int local_rank,
                          const std::string& error_file, const EnvMap& base) {
  EnvMap env = base;
  const std::string rank = std::to_string(group.node_rank * config.nproc_per_node + local_rank);
  const std::string world = std::to_string(group.nnodes * config.nproc_per_node);
  env["LOCAL_RANK"] = std::to_string(local_rank);
  env["RANK"] = rank;
  env["GROUP_RANK"] = std::to_string(group.node_rank);
  env["ROLE_RANK"] = rank;
  env["ROLE_NAME"] = config.role;
  env["LOCAL_WORLD_SIZE"] = std::to_string(config.nproc_per_node);
  env["WORLD_SIZE"] = world;
  env["GROUP_WORLD_SIZE"] = std::to_string(group.nnodes);
  env["ROLE_WORLD_SIZE"] = world;
  env["MASTER_ADDR"] = group.master_addr;
  env["MASTER_PORT"] = std::to_string(group.master_port);
  env["TORCHELASTIC_RESTART_COUNT"] = std::to_string(group.restart_count);
  env["TORCHELASTIC_MAX_RESTARTS"] = std::to_string(config.max_restarts);
  env["TORCHELASTIC_RUN_ID"] = group.run_id;
  if (!group.lineage.empty()) env["DDP_RUN_LINEAGE"] = group.lineage;
  env["TORCHELASTIC_USE_AGENT_STORE"] = group.agent_store ? "True" : "False";
  if (group.agent_store) env["DDP_AGENT_STORE"] = "ddp";
  env["TORCHELASTIC_ERROR_FILE"] = error_file;
  if (!group.store_secret.empty()) env["DDP_STORE_SECRET"] = group.store_secret;
  if (config.rdzv_timeout)
    env["DDP_RDZV_TIMEOUT"] = fmt::format("{}", config.rdzv_timeout->count());
  if (config.collective_timeout) {
    env["DDP_COLLECTIVE_TIMEOUT"] = fmt::format("{}", config.collective_timeout->count());
  }
  if (!config.backend.empty()) env["DDP_BACKEND"] = config.backend;
  set_default(env, "TORCH_NCCL_ASYNC_ERROR_HANDLING", "1");
  set_default(env, "NCCL_ASYNC_ERROR_HANDLING", "1");
  if (sets_omp_num_threads(config, base)) env["OMP_NUM_THREADS"] = "1";
  return env;
}

bool sets_omp_num_threads(const LaunchConfig& config, const EnvMap& base) {
  return config.nproc_per_node > 1 && base.find("OMP_NUM_THREADS") == base.end();
}

}  // namespace ddp::launcher
