// The launch environment contract: each launcher's variables, each malformed value.
#include <gtest/gtest.h>

#include <string>

#include "ddp/env.h"
#include "ddp/error.h"
#include "process_group/flight_recorder.h"  // kDefaultEntries
#include "process_group/shm/group.h"        // kDefaultChunkBytes
#include "store/server.h"                   // ServerOptions::max_stored_bytes

namespace ddp {
namespace {

EnvMap torchrun(int rank, int world) {
  return {{"RANK", std::to_string(rank)},       {"WORLD_SIZE", std::to_string(world)},
          {"LOCAL_RANK", std::to_string(rank)}, {"LOCAL_WORLD_SIZE", std::to_string(world)},
          {"MASTER_ADDR", "127.0.0.1"},         {"MASTER_PORT", "29500"}};
}

// Expects parse_dist_env(env) to throw ConfigError whose message contains every `needles`.
void expect_config_error(const EnvMap& env, std::initializer_list<std::string> needles) {
  try {
    parse_dist_env(env);
    FAIL() << "expected ConfigError";
  } catch (const ConfigError& e) {
    for (const auto& n : needles)
      EXPECT_NE(std::string(e.what()).find(n), std::string::npos)
          << "message lacks '" << n << "': " << e.what();
  }
}

// Each default is stated once, in code; the knob table (and so docs/errors-and-environment.md's)
// shows its text, which must agree with the constant the code uses.
TEST(Env, KnobTableDefaultsAgreeWithTheConstants) {
  auto row = [](std::string_view name) {
    for (const EnvKnob& k : kEnvKnobs) {
      if (k.name == name) return std::string(k.default_value);
    }
    ADD_FAILURE() << name << " is not a row of kEnvKnobs";
    return std::string();
  };
  EXPECT_EQ(row("DDP_RDZV_TIMEOUT"), std::to_string(kDefaultRendezvousTimeout.count()));
  EXPECT_EQ(row("DDP_COLLECTIVE_TIMEOUT"), std::to_string(kDefaultCollectiveTimeout.count()));
  EXPECT_EQ(row("DDP_SHM_CHUNK_BYTES"), std::to_string(shm::kDefaultChunkBytes));
  EXPECT_EQ(row("DDP_STORE_MAX_BYTES"), std::to_string(store::ServerOptions{}.max_stored_bytes));
  EXPECT_EQ(row("DDP_FLIGHT_RECORDER"), std::to_string(flight::kDefaultEntries));
}

TEST(Env, EmptyIsSingleProcessWithNoStore) {
  DistEnv e = parse_dist_env({});
  EXPECT_EQ(e.contract, LaunchContract::kSingleProcess);
  EXPECT_EQ(e.rank, 0);
  EXPECT_EQ(e.world_size, 1);
  EXPECT_EQ(e.master_port, 0);
  EXPECT_FALSE(e.rdzv_timeout.has_value());
}

TEST(Env, Torchrun) {
  EnvMap env = torchrun(3, 4);
  env["LOCAL_RANK"] = "1";
  env["LOCAL_WORLD_SIZE"] = "2";
  env["GROUP_RANK"] = "1";
  env["TORCHELASTIC_RESTART_COUNT"] = "2";
  env["TORCHELASTIC_RUN_ID"] = "job7";
  DistEnv e = parse_dist_env(env);
  EXPECT_EQ(e.contract, LaunchContract::kTorchrun);
  EXPECT_EQ(e.rank, 3);
  EXPECT_EQ(e.world_size, 4);
  EXPECT_EQ(e.local_rank, 1);
  EXPECT_EQ(e.local_world_size, 2);
  EXPECT_EQ(e.group_rank, 1);
  EXPECT_EQ(e.master_addr, "127.0.0.1");
  EXPECT_EQ(e.master_port, 29500);
  EXPECT_EQ(e.restart_count, 2);
  EXPECT_EQ(e.run_id, "job7");
  EXPECT_FALSE(e.use_agent_store);
  EXPECT_NE(e.describe().find("rank 3/4"), std::string::npos);
}

TEST(Env, TorchrunAgentStoreAndDefaultsForLocalPlacement) {
  EnvMap env = {{"RANK", "1"},
                {"WORLD_SIZE", "2"},
                {"MASTER_ADDR", "h"},
                {"MASTER_PORT", "5"},
                {"TORCHELASTIC_USE_AGENT_STORE", "True"}};
  DistEnv e = parse_dist_env(env);
  EXPECT_TRUE(e.use_agent_store);
  EXPECT_EQ(e.local_rank, 1);  // no LOCAL_*: a single node is assumed
  EXPECT_EQ(e.local_world_size, 2);
  env["TORCHELASTIC_USE_AGENT_STORE"] = "False";
  EXPECT_FALSE(parse_dist_env(env).use_agent_store);
  env["TORCHELASTIC_USE_AGENT_STORE"] = "maybe";
  expect_config_error(env, {"TORCHELASTIC_USE_AGENT_STORE", "maybe"});
}

TEST(Env, RendezvousStoreKnobs) {
  EnvMap env = {{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "h"}, {"MASTER_PORT", "5"}};
  DistEnv e = parse_dist_env(env);
  EXPECT_FALSE(e.agent_store_is_ddp);
  EXPECT_EQ(e.store_secret, "");
  EXPECT_FALSE(e.store_max_bytes.has_value());
  env["DDP_AGENT_STORE"] = "ddp";
  env["DDP_STORE_SECRET"] = "s3cret";
  env["DDP_STORE_BIND"] = "10.0.0.1";
  env["DDP_STORE_MAX_BYTES"] = "64M";
  e = parse_dist_env(env);
  EXPECT_TRUE(e.agent_store_is_ddp);
  EXPECT_EQ(e.store_secret, "s3cret");
  EXPECT_EQ(e.store_bind, "10.0.0.1");
  EXPECT_EQ(e.store_max_bytes, uint64_t{64} << 20);
  EXPECT_EQ(e.describe().find("s3cret"), std::string::npos);  // never printed
  env["DDP_AGENT_STORE"] = "tcpstore";
  env["DDP_STORE_MAX_BYTES"] = "1000";
  e = parse_dist_env(env);
  EXPECT_FALSE(e.agent_store_is_ddp);
  EXPECT_EQ(e.store_max_bytes, 1000u);
  env["DDP_AGENT_STORE"] = "etcd";
  expect_config_error(env, {"DDP_AGENT_STORE", "etcd", "tcpstore"});
  env["DDP_AGENT_STORE"] = "ddp";
  for (const char* bad : {"0", "-5", "12X", "lots"}) {
    env["DDP_STORE_MAX_BYTES"] = bad;
    expect_config_error(env, {"DDP_STORE_MAX_BYTES", bad});
  }
}

TEST(Env, TorchrunWorldSizeOneNeedsNoStore) {
  DistEnv e = parse_dist_env({{"RANK", "0"}, {"WORLD_SIZE", "1"}});
  EXPECT_EQ(e.world_size, 1);
  EXPECT_TRUE(e.master_addr.empty());
}

TEST(Env, MalformedTorchrunValues) {
  auto with = [](std::string k, std::string v) {
    EnvMap env = torchrun(0, 2);
    env[k] = v;
    return env;
  };
  expect_config_error(with("RANK", "abc"), {"RANK='abc'", "not an integer"});
  expect_config_error(with("RANK", "1x"), {"RANK='1x'"});
  expect_config_error(with("RANK", ""), {"RANK=''"});
  expect_config_error(with("RANK", "-1"), {"RANK=-1", "out of range"});
  expect_config_error(with("RANK", "2"), {"RANK=2", "WORLD_SIZE=2", "0..1"});
  expect_config_error(with("WORLD_SIZE", "0"), {"WORLD_SIZE=0", "out of range"});
  expect_config_error(with("WORLD_SIZE", "two"), {"WORLD_SIZE='two'"});
  expect_config_error(with("MASTER_PORT", "70000"), {"MASTER_PORT=70000", "out of range"});
  expect_config_error(with("MASTER_PORT", "http"), {"MASTER_PORT='http'"});
  expect_config_error(with("LOCAL_RANK", "5"), {"LOCAL_RANK=5", "LOCAL_WORLD_SIZE=2"});
  expect_config_error(with("LOCAL_WORLD_SIZE", "3"), {"LOCAL_WORLD_SIZE=3", "WORLD_SIZE=2"});
  expect_config_error(with("TORCHELASTIC_RESTART_COUNT", "x"), {"TORCHELASTIC_RESTART_COUNT"});
}

TEST(Env, MissingTorchrunVariables) {
  EnvMap env = torchrun(0, 2);
  env.erase("WORLD_SIZE");
  expect_config_error(env, {"WORLD_SIZE is not set"});
  env = torchrun(0, 2);
  env.erase("RANK");
  expect_config_error(env, {"RANK is not set"});
  env = torchrun(0, 2);
  env.erase("MASTER_ADDR");
  expect_config_error(env, {"MASTER_ADDR is not set"});
  env = torchrun(0, 2);
  env.erase("MASTER_PORT");
  expect_config_error(env, {"MASTER_PORT is not set", "--standalone"});
}

TEST(Env, Timeouts) {
  EnvMap env = {{"DDP_RDZV_TIMEOUT", "2.5"}, {"DDP_COLLECTIVE_TIMEOUT", "30"}};
  DistEnv e = parse_dist_env(env);
  EXPECT_EQ(*e.rdzv_timeout, std::chrono::milliseconds(2500));
  EXPECT_EQ(*e.collective_timeout, std::chrono::seconds(30));
  EXPECT_EQ(*parse_dist_env({{"DDP_RDZV_TIMEOUT", "0.0001"}}).rdzv_timeout,
            std::chrono::milliseconds(1));  // positive stays positive
  expect_config_error({{"DDP_RDZV_TIMEOUT", "soon"}}, {"DDP_RDZV_TIMEOUT='soon'", "seconds"});
  expect_config_error({{"DDP_COLLECTIVE_TIMEOUT", "0"}}, {"DDP_COLLECTIVE_TIMEOUT='0'"});
  expect_config_error({{"DDP_COLLECTIVE_TIMEOUT", "-3"}}, {"DDP_COLLECTIVE_TIMEOUT"});
  expect_config_error({{"DDP_COLLECTIVE_TIMEOUT", "inf"}}, {"DDP_COLLECTIVE_TIMEOUT"});
  // Finite but past any use (and past a count of milliseconds): a typo, said so.
  expect_config_error({{"DDP_COLLECTIVE_TIMEOUT", "1e300"}}, {"DDP_COLLECTIVE_TIMEOUT", "1e9"});
  EXPECT_EQ(*parse_dist_env({{"DDP_RDZV_TIMEOUT", "1e9"}}).rdzv_timeout,
            std::chrono::seconds(1'000'000'000));
}

TEST(Env, OpenMpiSingleNodeNeedsNoExtraVariables) {
  EnvMap env = {{"OMPI_COMM_WORLD_RANK", "2"},
                {"OMPI_COMM_WORLD_SIZE", "4"},
                {"OMPI_COMM_WORLD_LOCAL_RANK", "2"},
                {"OMPI_COMM_WORLD_LOCAL_SIZE", "4"},
                {"OMPI_MCA_ess_base_jobid", "12345"}};
  DistEnv e = parse_dist_env(env);
  EXPECT_EQ(e.contract, LaunchContract::kOpenMpi);
  EXPECT_EQ(e.rank, 2);
  EXPECT_EQ(e.world_size, 4);
  EXPECT_EQ(e.local_rank, 2);
  EXPECT_EQ(e.master_addr, "127.0.0.1");
  EXPECT_GE(e.master_port, kDerivedPortBase);
  EXPECT_LT(e.master_port, kDerivedPortBase + kDerivedPortSpan);
  // Every rank of the job derives the same port.
  env["OMPI_COMM_WORLD_RANK"] = "0";
  EXPECT_EQ(parse_dist_env(env).master_port, e.master_port);
  // Another job, another port (for this pair of ids).
  env["OMPI_MCA_ess_base_jobid"] = "12346";
  EXPECT_NE(parse_dist_env(env).master_port, e.master_port);
  // An explicit endpoint wins.
  env["MASTER_PORT"] = "4242";
  EXPECT_EQ(parse_dist_env(env).master_port, 4242);
}

TEST(Env, OpenMpiMultiNodeNeedsMasterAddr) {
  EnvMap env = {{"OMPI_COMM_WORLD_RANK", "0"},
                {"OMPI_COMM_WORLD_SIZE", "4"},
                {"OMPI_COMM_WORLD_LOCAL_RANK", "0"},
                {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}};
  expect_config_error(env, {"several nodes", "MASTER_ADDR", "-x MASTER_ADDR"});
  env["MASTER_ADDR"] = "10.1.2.3";
  EXPECT_EQ(parse_dist_env(env).master_addr, "10.1.2.3");
  EXPECT_EQ(parse_dist_env(env).group_rank, 0);
  env["OMPI_COMM_WORLD_RANK"] = "3";
  EXPECT_EQ(parse_dist_env(env).group_rank, 1);
  env["OMPI_COMM_WORLD_RANK"] = "4";
  expect_config_error(env, {"OMPI_COMM_WORLD_RANK=4", "out of range"});
}

TEST(Env, Pmi) {
  // Without MPI_LOCALNRANKS we cannot know that ranks share a node: MASTER_ADDR is needed.
  EnvMap env = {{"PMI_RANK", "1"}, {"PMI_SIZE", "2"}};
  expect_config_error(env, {"PMI", "several nodes", "MASTER_ADDR"});
  env["MASTER_ADDR"] = "head";
  DistEnv e = parse_dist_env(env);
  EXPECT_EQ(e.contract, LaunchContract::kPmi);
  EXPECT_EQ(e.rank, 1);
  EXPECT_EQ(e.world_size, 2);
  EXPECT_EQ(e.local_world_size, 1);
  EXPECT_EQ(e.master_addr, "head");
  env = {{"PMI_RANK", "1"}, {"PMI_SIZE", "2"}, {"MPI_LOCALRANKID", "1"}, {"MPI_LOCALNRANKS", "2"}};
  e = parse_dist_env(env);
  EXPECT_EQ(e.local_rank, 1);
  EXPECT_EQ(e.master_addr, "127.0.0.1");
  EXPECT_EQ(e.master_port, kDefaultMasterPort);
  expect_config_error({{"PMI_RANK", "x"}, {"PMI_SIZE", "2"}}, {"PMI_RANK='x'"});
}

TEST(Env, SlurmStep) {
  EnvMap env = {{"SLURM_PROCID", "5"},
                {"SLURM_STEP_NUM_TASKS", "8"},
                {"SLURM_STEP_NUM_NODES", "2"},
                {"SLURM_LOCALID", "1"},
                {"SLURM_NODEID", "1"},
                {"SLURM_JOB_ID", "991"},
                {"SLURM_STEP_NODELIST", "gpu[07-08]"}};
  DistEnv e = parse_dist_env(env);
  EXPECT_EQ(e.contract, LaunchContract::kSlurm);
  EXPECT_EQ(e.rank, 5);
  EXPECT_EQ(e.world_size, 8);
  EXPECT_EQ(e.local_rank, 1);
  EXPECT_EQ(e.local_world_size, 4);
  EXPECT_EQ(e.group_rank, 1);
  EXPECT_EQ(e.master_addr, "gpu07");  // first host of the step
  EXPECT_EQ(e.run_id, "991");
  env["SLURM_STEP_NODELIST"] = "alpha,beta";
  EXPECT_EQ(parse_dist_env(env).master_addr, "alpha");
}

// The step's own task list decides the tasks on this node: an sbatch job's
// SLURM_NTASKS_PER_NODE reaches a smaller step unchanged and must not count.
TEST(Env, SlurmTasksOnThisNodeComeFromTheStep) {
  EnvMap env = {{"SLURM_PROCID", "6"},           {"SLURM_STEP_NUM_TASKS", "7"},
                {"SLURM_STEP_NUM_NODES", "4"},   {"SLURM_NODEID", "3"},
                {"SLURM_LOCALID", "0"},          {"SLURM_STEP_TASKS_PER_NODE", "2(x3),1"},
                {"SLURM_NTASKS_PER_NODE", "4"},  {"SLURM_STEP_NODELIST", "n[1-4]"},
                {"SLURM_JOB_ID", "12"}};
  DistEnv e = parse_dist_env(env);
  EXPECT_EQ(e.local_world_size, 1);
  EXPECT_EQ(e.group_rank, 3);
  EXPECT_EQ(e.master_addr, "n1");
  EXPECT_EQ(e.master_addr_source, "the first node of SLURM_STEP_NODELIST='n[1-4]'");
  env["SLURM_NODEID"] = "1";
  env["SLURM_LOCALID"] = "1";
  EXPECT_EQ(parse_dist_env(env).local_world_size, 2);
  env["MASTER_ADDR"] = "head";  // given: no node list involved
  EXPECT_EQ(parse_dist_env(env).master_addr, "head");
  EXPECT_EQ(parse_dist_env(env).master_addr_source, "");
  env.erase("MASTER_ADDR");

  // A one-node step: loopback, no node name to resolve.
  EnvMap one = {{"SLURM_PROCID", "1"},         {"SLURM_STEP_NUM_TASKS", "2"},
                {"SLURM_STEP_NUM_NODES", "1"}, {"SLURM_LOCALID", "1"},
                {"SLURM_NTASKS_PER_NODE", "4"}, {"SLURM_STEP_TASKS_PER_NODE", "2"},
                {"SLURM_STEP_NODELIST", "vm"}};
  e = parse_dist_env(one);
  EXPECT_EQ(e.local_world_size, 2);
  EXPECT_EQ(e.master_addr, "127.0.0.1");
  EXPECT_EQ(e.master_addr_source, "");

  // Variables of different steps, or a task list that is not one.
  env["SLURM_STEP_TASKS_PER_NODE"] = "2(x4)";
  expect_config_error(env, {"SLURM_STEP_TASKS_PER_NODE='2(x4)'", "8 task(s) on 4 node(s)",
                            "SLURM_STEP_NUM_TASKS=7"});
  for (const char* bad : {"", "2(x", "2(x0)", "0", "2,,1", "2,", "x", "2(y3)", "99999999"}) {
    env["SLURM_STEP_TASKS_PER_NODE"] = bad;
    expect_config_error(env, {"is not a Slurm task list"});
  }
  env["SLURM_STEP_TASKS_PER_NODE"] = "2(x3),1";
  env["SLURM_NODEID"] = "3";
  env["SLURM_LOCALID"] = "1";
  expect_config_error(env, {"SLURM_LOCALID=1", "runs 1 task(s)"});
  env["SLURM_LOCALID"] = "0";
  env["SLURM_NODEID"] = "4";
  expect_config_error(env, {"SLURM_NODEID=4", "out of range"});
  env["SLURM_NODEID"] = "0";
  env["SLURM_STEP_NUM_NODES"] = "8";
  expect_config_error(env, {"SLURM_STEP_NUM_NODES=8 exceeds SLURM_STEP_NUM_TASKS=7"});
}

TEST(Env, SlurmBatchScriptIsASingleProcess) {
  // sbatch sets SLURM_PROCID for the batch script itself; only srun makes a step.
  DistEnv e = parse_dist_env({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "4"}});
  EXPECT_EQ(e.contract, LaunchContract::kSingleProcess);
  EXPECT_EQ(e.world_size, 1);
}

TEST(Env, TorchrunWinsOverOuterLaunchers) {
  EnvMap env = torchrun(1, 2);
  env["OMPI_COMM_WORLD_RANK"] = "0";
  env["OMPI_COMM_WORLD_SIZE"] = "1";
  env["SLURM_PROCID"] = "0";
  env["SLURM_STEP_NUM_TASKS"] = "1";
  DistEnv e = parse_dist_env(env);
  EXPECT_EQ(e.contract, LaunchContract::kTorchrun);
  EXPECT_EQ(e.rank, 1);
}

TEST(Env, CurrentEnvironmentReadsProcessEnv) {
  setenv("DDP_TEST_ENV_PROBE", "a=b", 1);
  EnvMap env = current_environment();
  ASSERT_EQ(env.count("DDP_TEST_ENV_PROBE"), 1u);
  EXPECT_EQ(env["DDP_TEST_ENV_PROBE"], "a=b");  // only the first '=' splits
}

// Note [Environment knobs]: only table rows are read; empty means unset; DDP_DEBUG's values.
TEST(Env, KnobsAreReadOnlyFromTheTable) {
  EXPECT_THROW(env_knob("DDP_NOT_A_KNOB"), Error);
  setenv("DDP_SHM_CHUNK_BYTES", "", 1);
  EXPECT_FALSE(env_knob("DDP_SHM_CHUNK_BYTES").has_value());
  setenv("DDP_SHM_CHUNK_BYTES", "4096", 1);
  EXPECT_EQ(env_knob("DDP_SHM_CHUNK_BYTES"), "4096");
  unsetenv("DDP_SHM_CHUNK_BYTES");

  unsetenv("DDP_DEBUG");
  unsetenv("TORCH_DISTRIBUTED_DEBUG");
  EXPECT_EQ(debug_level_from_env(), DebugLevel::kOff);
  setenv("TORCH_DISTRIBUTED_DEBUG", "DETAIL", 1);
  EXPECT_EQ(debug_level_from_env(), DebugLevel::kDetail);
  setenv("DDP_DEBUG", "info", 1);  // ours wins over PyTorch's name
  EXPECT_EQ(debug_level_from_env(), DebugLevel::kInfo);
  setenv("DDP_DEBUG", "verbose", 1);
  try {
    debug_level_from_env();
    ADD_FAILURE() << "DDP_DEBUG=verbose accepted";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("'verbose' for DDP_DEBUG"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("use off, info or detail"), std::string::npos) << e.what();
  }
  unsetenv("DDP_DEBUG");
  unsetenv("TORCH_DISTRIBUTED_DEBUG");
}

}  // namespace
}  // namespace ddp
