// ddprun's command line and worker environment (tools/ddprun/args.h), its failure summary and
// root-cause rule (summary.h), and PATH lookup (process.h). No processes are started.
#include <sys/wait.h>  // W* macros, to build wait statuses

#include <unistd.h>    // getpid

#include <csignal>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <fmt/format.h>

#include "args.h"
#include "process.h"  // resolve_program, ExecError
#include "summary.h"

// Command lines and worker scripts are laid out by hand (a flag with its value, an action with
// its arguments), which clang-format would put one string per line.
// clang-format off
namespace ddp::launcher {
namespace {

const HostInfo kHost{.cpus = 8, .gpus = 0};
const HostInfo kGpuHost{.cpus = 8, .gpus = 4};

LaunchConfig parse(std::vector<std::string> args, const EnvMap& env = {},
                   const HostInfo& host = kHost) {
  return parse_command_line(args, env, host).config;
}

// The message of the UsageError that parsing `args` throws ("" if none).
std::string usage_error(std::vector<std::string> args, const EnvMap& env = {}) {
  try {
    parse_command_line(args, env, kHost);
  } catch (const UsageError& e) {
    return e.what();
  }
  return "";
}

#define EXPECT_USAGE_ERROR(args, ...)                                         \
  do {                                                                        \
    std::string msg_ = usage_error args;                                      \
    EXPECT_FALSE(msg_.empty()) << "no error for " #args;                      \
    for (const char* part : {__VA_ARGS__}) {                                  \
      EXPECT_NE(msg_.find(part), std::string::npos) << "'" << part << "' not in: " << msg_; \
    }                                                                         \
  } while (0)

TEST(DdprunArgs, Defaults) {
  LaunchConfig c = parse({"prog"});
  EXPECT_EQ(c.nproc_per_node, 1);
  EXPECT_EQ(c.nnodes, 1);
  EXPECT_EQ(c.node_rank, 0);
  EXPECT_EQ(c.master_addr, "127.0.0.1");
  EXPECT_EQ(c.master_port, 29500);
  EXPECT_FALSE(c.pick_free_port);
  EXPECT_EQ(c.run_id, "none");
  EXPECT_EQ(c.rdzv_backend, RdzvBackend::kStatic);
  EXPECT_EQ(c.max_restarts, 0);
  EXPECT_DOUBLE_EQ(c.monitor_interval.count(), 0.1);
  EXPECT_DOUBLE_EQ(c.grace_period.count(), 10.0);
  EXPECT_FALSE(c.rdzv_timeout.has_value());
  EXPECT_FALSE(c.collective_timeout.has_value());
  EXPECT_TRUE(c.log_dir.empty());
  EXPECT_FALSE(c.any_log_files());
  EXPECT_FALSE(c.local_ranks_filter.has_value());
  EXPECT_EQ(c.worker_argv, std::vector<std::string>{"prog"});
}

// Every multi-word flag, in both spellings, with a value that differs from its default.
TEST(DdprunArgs, BothSpellingsOfEveryMultiWordFlag) {
  for (char sep : {'-', '_'}) {
    auto flag = [sep](std::string name) {
      for (char& ch : name) {
        if (ch == '-') ch = sep;
      }
      return "--" + name;
    };
    SCOPED_TRACE(std::string("separator ") + sep);
    LaunchConfig c = parse({flag("nproc-per-node"), "3", "--nnodes", "2", flag("node-rank"), "1",
                            flag("master-addr"), "10.1.2.3", flag("master-port"), "1234",
                            flag("rdzv-id"), "job7", flag("rdzv-conf"), "join_timeout=60",
                            flag("max-restarts"), "2", flag("monitor-interval"), "0.5",
                            flag("log-dir"), "/tmp/logs", flag("local-ranks-filter"), "0,2",
                            flag("rdzv-timeout"), "30", flag("collective-timeout"), "7.5",
                            flag("grace-period"), "1", flag("start-method"), "fork", "prog"});
    EXPECT_EQ(c.nproc_per_node, 3);
    EXPECT_EQ(c.node_rank, 1);
    EXPECT_EQ(c.master_addr, "10.1.2.3");
    EXPECT_EQ(c.master_port, 1234);
    EXPECT_EQ(c.run_id, "job7");
    EXPECT_EQ(c.max_restarts, 2);
    EXPECT_DOUBLE_EQ(c.monitor_interval.count(), 0.5);
    EXPECT_EQ(c.log_dir, "/tmp/logs");
    EXPECT_EQ(c.local_ranks_filter, (std::set<int>{0, 2}));
    EXPECT_EQ(c.rdzv_timeout, Seconds(30.0));
    EXPECT_EQ(c.collective_timeout, Seconds(7.5));
    EXPECT_DOUBLE_EQ(c.grace_period.count(), 1.0);

    LaunchConfig r = parse({flag("rdzv-backend"), "c10d", flag("rdzv-endpoint"), "h:1", "prog"});
    EXPECT_EQ(r.rdzv_backend, RdzvBackend::kC10d);
    EXPECT_EQ(r.master_addr, "h");
    EXPECT_EQ(r.master_port, 1);

    LaunchConfig p = parse({flag("no-python"), "train.py"});
    EXPECT_EQ(p.worker_argv, std::vector<std::string>{"train.py"});
  }
}

TEST(DdprunArgs, ShortFlagsAndEqualsSyntax) {
  LaunchConfig c = parse({"-r", "3", "-t", "0:1", "--nproc-per-node=2", "prog"});
  EXPECT_EQ(c.redirects.all, Std::kAll);
  EXPECT_EQ(c.tee.for_local_rank(0), Std::kOut);
  EXPECT_EQ(c.nproc_per_node, 2);
  EXPECT_EQ(parse({"-m", "pkg.train"}).worker_argv,
            (std::vector<std::string>{"python3", "-u", "-m", "pkg.train"}));
}

TEST(DdprunArgs, PetEnvironmentFallbackAndCommandLinePrecedence) {
  EnvMap env{{"PET_NPROC_PER_NODE", "4"}, {"PET_MASTER_PORT", "4321"},
             {"PET_MAX_RESTARTS", "3"},   {"PET_STANDALONE", "0"},
             {"PET_GRACE_PERIOD", "2"},   {"PET_RDZV_ID", "from-env"}};
  LaunchConfig from_env = parse({"prog"}, env);
  EXPECT_EQ(from_env.nproc_per_node, 4);
  EXPECT_EQ(from_env.master_port, 4321);
  EXPECT_EQ(from_env.max_restarts, 3);
  EXPECT_DOUBLE_EQ(from_env.grace_period.count(), 2.0);
  EXPECT_EQ(from_env.run_id, "from-env");
  EXPECT_FALSE(from_env.pick_free_port);

  LaunchConfig cli_wins = parse({"--nproc_per_node", "2", "--master-port", "1111", "prog"}, env);
  EXPECT_EQ(cli_wins.nproc_per_node, 2);
  EXPECT_EQ(cli_wins.master_port, 1111);
  EXPECT_EQ(cli_wins.max_restarts, 3);  // not on the command line: still from the environment

  EXPECT_TRUE(parse({"prog"}, {{"PET_STANDALONE", "1"}}).pick_free_port);
  // A bad value names the variable it came from.
  EXPECT_USAGE_ERROR(({"prog"}, {{"PET_NPROC_PER_NODE", "many"}}), "PET_NPROC_PER_NODE", "many");
}

// --nproc-per-node gpu counts what the workers will see, as torch.cuda.device_count() does.
TEST(DdprunArgs, VisibleGpusFollowCudaVisibleDevices) {
  EXPECT_EQ(visible_gpus(4, std::nullopt), 4);
  EXPECT_EQ(visible_gpus(4, ""), 0);
  EXPECT_EQ(visible_gpus(4, "-1"), 0);
  EXPECT_EQ(visible_gpus(4, "2"), 1);
  EXPECT_EQ(visible_gpus(4, "0,3"), 2);
  EXPECT_EQ(visible_gpus(4, " 1 , 2 "), 2);
  EXPECT_EQ(visible_gpus(4, "0,7,1"), 1);  // CUDA stops at the first invalid entry
  EXPECT_EQ(visible_gpus(4, "1,1"), 1);    // a duplicate is invalid
  EXPECT_EQ(visible_gpus(2, "GPU-5b7a0c1e,MIG-1f2e"), 2);
  EXPECT_EQ(visible_gpus(0, "0"), 0);
  EXPECT_EQ(visible_gpus(4, "99999999999"), 0);
  // Whatever GPUs this host has: a count, from a child process, with no crash.
  const HostInfo here = probe_host({});
  EXPECT_GE(here.cpus, 1);
  EXPECT_GE(here.visible_gpus(), 0);
}

TEST(DdprunArgs, NprocPerNodeForms) {
  EXPECT_EQ(parse({"--nproc-per-node", "5", "p"}).nproc_per_node, 5);
  EXPECT_EQ(parse({"--nproc-per-node", "cpu", "p"}).nproc_per_node, 8);
  EXPECT_EQ(parse({"--nproc-per-node", "auto", "p"}).nproc_per_node, 8);  // no GPU: CPUs
  EXPECT_EQ(parse({"--nproc-per-node", "auto", "p"}, {}, kGpuHost).nproc_per_node, 4);
  EXPECT_EQ(parse({"--nproc-per-node", "gpu", "p"}, {}, kGpuHost).nproc_per_node, 4);
  EXPECT_USAGE_ERROR(({"--nproc-per-node", "gpu", "p"}), "--nproc-per-node",
                     "no CUDA device is visible");
  EXPECT_USAGE_ERROR(({"--nproc-per-node", "0", "p"}), "--nproc-per-node", "'0'");
  EXPECT_USAGE_ERROR(({"--nproc-per-node", "two", "p"}), "--nproc-per-node", "auto, cpu or gpu");
}

TEST(DdprunArgs, NnodesFixedOnly) {
  EXPECT_EQ(parse({"--nnodes", "3", "p"}).nnodes, 3);
  EXPECT_EQ(parse({"--nnodes", "2:2", "p"}).nnodes, 2);
  EXPECT_USAGE_ERROR(({"--nnodes", "1:4", "p"}), "--nnodes 1:4", "elastic range",
                     "--rdzv-backend c10d");
  EXPECT_USAGE_ERROR(({"--nnodes", "3:2", "p"}), "--nnodes", "MIN (3) is above MAX (2)");
  const LaunchConfig e = parse({"--nnodes", "2:3", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                                "h:1", "--rdzv-conf", "join_timeout=20,last_call_timeout=2", "p"});
  EXPECT_TRUE(e.elastic);
  EXPECT_EQ(e.min_nodes, 2);
  EXPECT_EQ(e.nnodes, 3);
  EXPECT_EQ(e.last_call_timeout.count(), 2.0);
  EXPECT_EQ(e.rdzv_timeout->count(), 20.0);
  EXPECT_EQ(parse({"--nnodes", "2", "p"}).last_call_timeout.count(), 30.0);  // torchrun's
  EXPECT_USAGE_ERROR(({"--nnodes", "0", "p"}), "--nnodes");
  EXPECT_USAGE_ERROR(({"--nnodes", "a:b", "p"}), "--nnodes", "MIN:MAX");
}

TEST(DdprunArgs, NodeRankBelowNnodes) {
  EXPECT_EQ(parse({"--nnodes", "2", "--node-rank", "1", "p"}).node_rank, 1);
  EXPECT_USAGE_ERROR(({"--nnodes", "2", "--node-rank", "2", "p"}), "--node-rank", "below --nnodes");
  EXPECT_USAGE_ERROR(({"--node-rank", "1", "p"}), "--node-rank");  // nnodes defaults to 1
  EXPECT_USAGE_ERROR(({"--node-rank", "-1", "p"}), "--node-rank");
}

TEST(DdprunArgs, RedirectsAndTee) {
  StdSpec all = parse_std_spec("--redirects", "3");
  EXPECT_EQ(all.for_local_rank(0), Std::kAll);
  EXPECT_EQ(all.for_local_rank(7), Std::kAll);
  StdSpec per = parse_std_spec("--tee", "0:1,1:2");
  EXPECT_EQ(per.for_local_rank(0), Std::kOut);
  EXPECT_EQ(per.for_local_rank(1), Std::kErr);
  EXPECT_EQ(per.for_local_rank(2), Std::kNone);
  EXPECT_TRUE(per.any());
  EXPECT_FALSE(parse_std_spec("--tee", "0").any());

  for (const char* bad : {"4", "-1", "x", "0:5", "a:1", "0:", "0:1,", "1:2:3"}) {
    EXPECT_USAGE_ERROR(({"--nproc-per-node", "2", "--redirects", bad, "p"}), "--redirects", bad);
  }
  EXPECT_USAGE_ERROR(({"--nproc-per-node", "2", "--tee", "5:1", "p"}), "--tee", "no local rank 5");

  // Redirect hides a stream from the console; tee shows it; both write files.
  LaunchConfig c = parse({"--nproc-per-node", "2", "-r", "0:3,1:1", "-t", "1:2", "p"});
  EXPECT_FALSE(c.shows_on_console(0, Std::kOut));
  EXPECT_FALSE(c.shows_on_console(0, Std::kErr));
  EXPECT_FALSE(c.shows_on_console(1, Std::kOut));
  EXPECT_TRUE(c.shows_on_console(1, Std::kErr));
  EXPECT_TRUE(c.writes_to_file(1, Std::kErr));
  EXPECT_TRUE(c.any_log_files());
}

TEST(DdprunArgs, LocalRanksFilter) {
  LaunchConfig c = parse({"--nproc-per-node", "3", "--local-ranks-filter", "0,2", "p"});
  EXPECT_EQ(c.local_ranks_filter, (std::set<int>{0, 2}));
  EXPECT_TRUE(c.shows_on_console(0, Std::kOut));
  EXPECT_FALSE(c.shows_on_console(1, Std::kOut));
  EXPECT_FALSE(c.shows_on_console(1, Std::kErr));
  EXPECT_FALSE(parse({"--local-ranks-filter", "", "p"}).local_ranks_filter.has_value());
  EXPECT_USAGE_ERROR(({"--local-ranks-filter", "0,x", "p"}), "--local-ranks-filter", "0,x");
  EXPECT_USAGE_ERROR(({"--nproc-per-node", "2", "--local-ranks-filter", "2", "p"}),
                     "no local rank 2");
}

TEST(DdprunArgs, ProgramArgumentsPassThroughUntouched) {
  LaunchConfig c = parse({"--nproc-per-node", "2", "prog", "--nproc-per-node", "5", "-x", "--",
                          "--help", "-r", "3"});
  EXPECT_EQ(c.nproc_per_node, 2);
  EXPECT_EQ(c.program, "prog");
  EXPECT_EQ(c.worker_argv, (std::vector<std::string>{"prog", "--nproc-per-node", "5", "-x", "--",
                                                     "--help", "-r", "3"}));
  EXPECT_FALSE(c.redirects.any());
  // "--" ends the launcher's flags, as with any getopt tool.
  EXPECT_EQ(parse({"--", "prog", "a"}).worker_argv, (std::vector<std::string>{"prog", "a"}));
  // --help after PROGRAM belongs to PROGRAM.
  EXPECT_FALSE(parse_command_line({"prog", "--help"}, {}, kHost).help);
}

TEST(DdprunArgs, PythonPrograms) {
  EXPECT_EQ(parse({"train.py", "--lr", "1"}).worker_argv,
            (std::vector<std::string>{"python3", "-u", "train.py", "--lr", "1"}));
  EXPECT_TRUE(parse({"train.py"}).via_python);
  EXPECT_EQ(parse({"--no-python", "train.py"}).worker_argv, std::vector<std::string>{"train.py"});
  EXPECT_EQ(parse({"./train"}).worker_argv, std::vector<std::string>{"./train"});
  EXPECT_FALSE(parse({"./train"}).via_python);
  EXPECT_EQ(parse({"--module", "pkg.mod", "x"}).worker_argv,
            (std::vector<std::string>{"python3", "-u", "-m", "pkg.mod", "x"}));
  EXPECT_USAGE_ERROR(({"-m", "--no-python", "pkg"}), "--module", "--no-python");
  // Python workers, however started, get a store their TCPStore can reach.
  EXPECT_TRUE(parse({"train.py"}).python_worker);
  EXPECT_TRUE(parse({"/usr/bin/python3", "train.py"}).python_worker);
  EXPECT_TRUE(parse({"--no-python", "python3.11", "-u", "train.py"}).python_worker);
  EXPECT_FALSE(parse({"./train"}).python_worker);
  EXPECT_FALSE(parse({"/opt/pythonic/train"}).python_worker);
}

TEST(DdprunArgs, RdzvEndpoint) {
  Endpoint e = parse_endpoint("--rdzv-endpoint", "node1");
  EXPECT_EQ(e.host, "node1");
  EXPECT_EQ(e.port, 29400);
  e = parse_endpoint("--rdzv-endpoint", "node1:1234");
  EXPECT_EQ(e.host, "node1");
  EXPECT_EQ(e.port, 1234);
  e = parse_endpoint("--rdzv-endpoint", "[::1]:99");
  EXPECT_EQ(e.host, "::1");
  EXPECT_EQ(e.port, 99);
  EXPECT_USAGE_ERROR(({"--rdzv-endpoint", "host:abc", "p"}), "--rdzv-endpoint",
                     "'abc' is not a port");
  EXPECT_USAGE_ERROR(({"--rdzv-endpoint", "host:70000", "p"}), "--rdzv-endpoint", "70000");
  EXPECT_USAGE_ERROR(({"--rdzv-endpoint", ":80", "p"}), "--rdzv-endpoint", "missing host");

  // c10d: the endpoint is the store; with node ranks given, the static rounds of a fixed job.
  LaunchConfig c = parse({"--rdzv-backend", "c10d", "--rdzv-endpoint", "head", "--nnodes", "2",
                          "--node-rank", "1", "p"});
  EXPECT_EQ(c.master_addr, "head");
  EXPECT_EQ(c.master_port, 29400);
  EXPECT_FALSE(c.elastic);
  // Without node ranks, or with a range: elastic rounds, ranks given out at each round.
  LaunchConfig dyn =
      parse({"--rdzv-backend", "c10d", "--rdzv-endpoint", "head", "--nnodes", "2", "p"});
  EXPECT_TRUE(dyn.elastic);
  EXPECT_EQ(dyn.min_nodes, 2);
  EXPECT_EQ(dyn.nnodes, 2);
  // etcd (Note [etcd backend]): the endpoint lists the cluster's members; the store's own
  // address stays unset, and ranks are given out as with c10d.
  LaunchConfig on_etcd = parse({"--rdzv-backend", "etcd", "--rdzv-endpoint", "e1,e2:2400",
                                "--nnodes", "2:4", "p"});
  EXPECT_EQ(on_etcd.rdzv_backend, RdzvBackend::kEtcd);
  EXPECT_EQ(on_etcd.etcd_endpoints, "e1,e2:2400");
  EXPECT_EQ(on_etcd.master_addr, "127.0.0.1");
  EXPECT_TRUE(on_etcd.elastic);
  EXPECT_EQ(parse({"--rdzv-backend", "etcd-v2", "--rdzv-endpoint", "e1", "--nnodes", "2",
                   "--node-rank", "1", "p"}).rdzv_backend,
            RdzvBackend::kEtcd);
  EXPECT_USAGE_ERROR(({"--rdzv-backend", "etcd", "p"}), "--rdzv-backend etcd needs",
                     "--rdzv-endpoint: the etcd cluster's client endpoints");
  EXPECT_USAGE_ERROR(({"--rdzv-backend", "zookeeper", "p"}), "--rdzv-backend",
                     "expected static, c10d or etcd");
  // Port 0 picks a free port, on one node only.
  EXPECT_TRUE(parse({"--rdzv-endpoint", "localhost:0", "p"}).pick_free_port);
  EXPECT_USAGE_ERROR(({"--nnodes", "2", "--master-port", "0", "p"}), "single node");
}

TEST(DdprunArgs, RdzvConfTimeouts) {
  EXPECT_EQ(parse({"--rdzv-conf", "timeout=20", "p"}).rdzv_timeout, Seconds(20.0));
  EXPECT_EQ(parse({"--rdzv-conf", "timeout=20,join_timeout=60,read_timeout=5", "p"}).rdzv_timeout,
            Seconds(60.0));
  // The explicit flag wins.
  EXPECT_EQ(parse({"--rdzv-conf", "join_timeout=60", "--rdzv-timeout", "9", "p"}).rdzv_timeout,
            Seconds(9.0));
  EXPECT_USAGE_ERROR(({"--rdzv-conf", "join_timeout", "p"}), "--rdzv-conf", "key=value");
  EXPECT_USAGE_ERROR(({"--rdzv-conf", "join_timeout=soon", "p"}), "join_timeout", "seconds");
}

TEST(DdprunArgs, Standalone) {
  CommandLine cl = parse_command_line(
      {"--standalone", "--rdzv-endpoint", "x:1", "--nproc-per-node", "2", "p"}, {}, kHost);
  EXPECT_TRUE(cl.config.pick_free_port);
  EXPECT_TRUE(cl.config.random_run_id);
  EXPECT_EQ(cl.config.master_addr, "127.0.0.1");
  ASSERT_EQ(cl.notes.size(), 1u);
  EXPECT_NE(cl.notes[0].find("ignoring --rdzv-endpoint"), std::string::npos);
  EXPECT_USAGE_ERROR(({"--standalone", "--nnodes", "2", "p"}), "--standalone", "--nnodes");
}

// --ft (Note [Per-step fault tolerance] in ddp/fault_tolerance.h): a fixed number of nodes on
// the built-in store, C++ workers.
TEST(DdprunArgs, FaultTolerance) {
  EXPECT_FALSE(parse({"p"}).ft);
  EXPECT_TRUE(parse({"--ft", "--nproc-per-node", "3", "p"}).ft);
  EXPECT_TRUE(parse({"--ft", "--nnodes", "2", "--node-rank", "1", "--master-addr", "10.0.0.1",
                     "p"})
                  .ft);
  EXPECT_USAGE_ERROR(({"--ft", "--nnodes", "1:3", "--rdzv-backend", "c10d", "p"}),
                     "--ft runs a fixed number of nodes", "--nnodes is 1:3");
  EXPECT_USAGE_ERROR(({"--ft", "--nnodes", "2", "--node-rank", "0", "--rdzv-backend", "etcd",
                       "--rdzv-endpoint", "10.0.0.1:2379", "p"}),
                     "--ft needs the built-in agent store", "not etcd");
  EXPECT_USAGE_ERROR(({"--ft", "train.py"}), "--ft needs workers built on ddp::ft::Manager");
}

TEST(DdprunArgs, SecondsAndCounts) {
  EXPECT_USAGE_ERROR(({"--grace-period", "-1", "p"}), "--grace-period", ">= 0");
  EXPECT_USAGE_ERROR(({"--monitor-interval", "1e300", "p"}), "--monitor-interval", "at most 1e9");
  EXPECT_DOUBLE_EQ(parse({"--grace-period", "0", "p"}).grace_period.count(), 0.0);
  EXPECT_USAGE_ERROR(({"--monitor-interval", "0", "p"}), "--monitor-interval", "> 0");
  EXPECT_USAGE_ERROR(({"--collective-timeout", "nan", "p"}), "--collective-timeout");
  EXPECT_USAGE_ERROR(({"--max-restarts", "-2", "p"}), "--max-restarts");
  EXPECT_USAGE_ERROR(({"--start-method", "thread", "p"}), "--start-method");
}

TEST(DdprunArgs, UsageErrors) {
  EXPECT_USAGE_ERROR(({}), "missing PROGRAM");
  EXPECT_USAGE_ERROR(({"--nproc-per-node", "2"}), "missing PROGRAM");
  EXPECT_USAGE_ERROR(({"--bogus", "prog"}), "unknown flag --bogus");
  EXPECT_USAGE_ERROR(({"--bogus=3", "prog"}), "unknown flag --bogus");
  EXPECT_USAGE_ERROR(({"--nnodes"}), "--nnodes");  // a flag without its value
}

// Note [ddprun under srun]: one ddprun per node of a Slurm step.
EnvMap slurm_task(int node, int nodes, const std::string& tasks_per_node, int local = 0) {
  return {{"SLURM_PROCID", std::to_string(node)},
          {"SLURM_STEP_NUM_TASKS", std::to_string(nodes)},
          {"SLURM_STEP_NUM_NODES", std::to_string(nodes)},
          {"SLURM_NODEID", std::to_string(node)},
          {"SLURM_LOCALID", std::to_string(local)},
          {"SLURM_STEP_TASKS_PER_NODE", tasks_per_node},
          {"SLURM_STEP_NODELIST", "gpu[07-08]"},
          {"SLURM_JOB_ID", "77"}};
}

TEST(DdprunArgs, UnderSrunOneDdprunPerNode) {
  // One node: nothing to take from Slurm.
  LaunchConfig c = parse({"--nproc-per-node", "2", "prog"}, slurm_task(0, 1, "1"));
  EXPECT_EQ(c.nnodes, 1);
  EXPECT_EQ(c.master_addr, kDefaultMasterAddr);
  EXPECT_EQ(c.master_addr_source, "");

  // Two nodes: the node rank and the store's host come from the step.
  CommandLine cl = parse_command_line({"--nnodes", "2", "--nproc-per-node", "2", "prog"},
                                      slurm_task(1, 2, "1(x2)"), kHost);
  EXPECT_EQ(cl.config.node_rank, 1);
  EXPECT_EQ(cl.config.master_addr, "gpu07");
  EXPECT_EQ(cl.config.master_addr_source, "the first node of SLURM_STEP_NODELIST='gpu[07-08]'");
  EXPECT_FALSE(cl.config.elastic);
  ASSERT_EQ(cl.notes.size(), 2u);
  EXPECT_NE(cl.notes[0].find("node rank 1 from Slurm (SLURM_NODEID"), std::string::npos);
  // The flags win.
  c = parse({"--nnodes", "2", "--node-rank", "0", "--master-addr", "head", "prog"},
            slurm_task(1, 2, "1(x2)"));
  EXPECT_EQ(c.node_rank, 0);
  EXPECT_EQ(c.master_addr, "head");
  EXPECT_EQ(c.master_addr_source, "");
  // Inside a torchrun-style launch the Slurm variables are the outer job's: not ours to read.
  EnvMap inner = slurm_task(0, 2, "2,1");
  inner["RANK"] = "0";
  inner["WORLD_SIZE"] = "1";
  EXPECT_EQ(parse({"prog"}, inner).nnodes, 1);
  // Elastic: a range that includes the step's nodes; ranks given out at each round.
  c = parse({"--nnodes", "1:3", "--rdzv-backend", "c10d", "--rdzv-endpoint", "h:1", "prog"},
            slurm_task(1, 2, "1(x2)"));
  EXPECT_TRUE(c.elastic);
}

TEST(DdprunArgs, UnderSrunWhatCannotWorkIsRefused) {
  EnvMap two_on_one = slurm_task(0, 1, "2", 1);  // srun -n 2 ddprun on one node
  two_on_one["SLURM_PROCID"] = "1";
  two_on_one["SLURM_STEP_NUM_TASKS"] = "2";
  EXPECT_USAGE_ERROR(({"--nproc-per-node", "2", "prog"}, two_on_one),
                     "Slurm started 2 ddprun tasks on this node",
                     "SLURM_STEP_TASKS_PER_NODE=2", "srun --ntasks-per-node=1 ddprun");
  EXPECT_USAGE_ERROR(({"prog"}, slurm_task(1, 2, "1(x2)")), "--nnodes 1 (the default)",
                     "SLURM_STEP_NUM_NODES=2", "pass --nnodes 2");
  EXPECT_USAGE_ERROR(({"--nnodes", "3", "prog"}, slurm_task(1, 2, "1(x2)")), "--nnodes 3,",
                     "runs ddprun on 2 node(s)");
  EXPECT_USAGE_ERROR(({"--nnodes", "3:4", "--rdzv-backend", "c10d", "--rdzv-endpoint", "h:1",
                       "prog"},
                      slurm_task(1, 2, "1(x2)")),
                     "--nnodes 3:4", "SLURM_STEP_NUM_NODES=2");
  EXPECT_USAGE_ERROR(({"prog"}, slurm_task(0, 2, "2(x3)")), "inconsistent",
                     "SLURM_STEP_TASKS_PER_NODE='2(x3)'");
}

TEST(DdprunArgs, HelpDocumentsEveryFlagAndDefault) {
  CommandLine cl = parse_command_line({"--help"}, {}, kHost);
  ASSERT_TRUE(cl.help);
  for (const char* s : {"--nproc-per-node", "--nproc_per_node", "--nnodes", "--node-rank",
                        "--master-addr", "--master-port", "--standalone", "--rdzv-backend",
                        "--rdzv-endpoint", "--rdzv-id", "--rdzv-conf", "--max-restarts",
                        "--monitor-interval", "--log-dir", "--redirects", "--tee",
                        "--local-ranks-filter", "--no-python", "--module", "--rdzv-timeout",
                        "--collective-timeout", "--grace-period", "--backend", "DDP_BACKEND",
                        "[default: 29500]",
                        "[default: 10]", "PET_", "Exit codes"}) {
    EXPECT_NE(cl.help_text.find(s), std::string::npos) << s;
  }
  EXPECT_EQ(help_text(), cl.help_text);
}

// nnodes 2, node-rank 1, nproc 3: this node holds global ranks 3, 4, 5 of 6.
TEST(DdprunArgs, WorkerEnvironmentMultiNode) {
  LaunchConfig c = parse({"--nnodes", "2", "--node-rank", "1", "--nproc-per-node", "3",
                          "--max-restarts", "4", "--rdzv-timeout", "30", "p"});
  GroupSpec g{.node_rank = 1, .nnodes = 2, .master_addr = "10.0.0.1", .master_port = 29501,
              .run_id = "job", .restart_count = 2, .lineage = "3fa2"};
  EnvMap base{{"PATH", "/bin"}, {"NCCL_ASYNC_ERROR_HANDLING", "0"}};
  for (int lr = 0; lr < 3; ++lr) {
    SCOPED_TRACE("local rank " + std::to_string(lr));
    EnvMap env = worker_environment(c, g, lr, "/tmp/err.json", base);
    EXPECT_EQ(env["LOCAL_RANK"], std::to_string(lr));
    EXPECT_EQ(env["RANK"], std::to_string(3 + lr));
    EXPECT_EQ(env["ROLE_RANK"], std::to_string(3 + lr));
    EXPECT_EQ(env["GROUP_RANK"], "1");
    EXPECT_EQ(env["LOCAL_WORLD_SIZE"], "3");
    EXPECT_EQ(env["WORLD_SIZE"], "6");
    EXPECT_EQ(env["ROLE_WORLD_SIZE"], "6");
    EXPECT_EQ(env["GROUP_WORLD_SIZE"], "2");
    EXPECT_EQ(env["ROLE_NAME"], "default");
    EXPECT_EQ(env["MASTER_ADDR"], "10.0.0.1");
    EXPECT_EQ(env["MASTER_PORT"], "29501");
    EXPECT_EQ(env["TORCHELASTIC_RESTART_COUNT"], "2");
    EXPECT_EQ(env["TORCHELASTIC_MAX_RESTARTS"], "4");
    EXPECT_EQ(env["TORCHELASTIC_RUN_ID"], "job");
    EXPECT_EQ(env["DDP_RUN_LINEAGE"], "3fa2");
    EXPECT_EQ(env["TORCHELASTIC_USE_AGENT_STORE"], "False");
    EXPECT_EQ(env["TORCHELASTIC_ERROR_FILE"], "/tmp/err.json");
    EXPECT_EQ(env["TORCH_NCCL_ASYNC_ERROR_HANDLING"], "1");
    EXPECT_EQ(env["NCCL_ASYNC_ERROR_HANDLING"], "0");  // the user's value is kept
    EXPECT_EQ(env["DDP_RDZV_TIMEOUT"], "30");
    EXPECT_EQ(env.count("DDP_COLLECTIVE_TIMEOUT"), 0u);
    EXPECT_EQ(env["PATH"], "/bin");  // the base environment is inherited
    EXPECT_EQ(env["OMP_NUM_THREADS"], "1");
  }
}

// --backend is ddprun's own (torchrun has none): the workers get DDP_BACKEND.
TEST(DdprunArgs, BackendIsExportedAsDdpBackend) {
  GroupSpec g{.master_addr = "127.0.0.1", .master_port = 1, .run_id = "r", .restart_count = 0};
  for (const char* name : {"gloo", "shm", "shm+gloo", "nccl", "auto", "tuned",
                           "cpu:gloo,cuda:nccl", "cuda:nccl,cpu:shm+gloo", "cpu:auto"}) {
    SCOPED_TRACE(name);
    LaunchConfig c = parse({"--nproc-per-node", "2", "--backend", name, "p"});
    EXPECT_EQ(c.backend, name);
    for (int lr = 0; lr < 2; ++lr) {
      EXPECT_EQ(worker_environment(c, g, lr, "e", {})["DDP_BACKEND"], name);
    }
  }
  // Unset: nothing exported, and a DDP_BACKEND the user exported reaches the workers as it is.
  LaunchConfig none = parse({"p"});
  EXPECT_TRUE(none.backend.empty());
  EXPECT_EQ(worker_environment(none, g, 0, "e", {}).count("DDP_BACKEND"), 0u);
  EXPECT_EQ(worker_environment(none, g, 0, "e", {{"DDP_BACKEND", "gloo"}})["DDP_BACKEND"], "gloo");
  // The flag wins over the inherited variable; PET_BACKEND is the usual fallback.
  LaunchConfig shm = parse({"--backend=shm", "p"});
  EXPECT_EQ(worker_environment(shm, g, 0, "e", {{"DDP_BACKEND", "gloo"}})["DDP_BACKEND"], "shm");
  EXPECT_EQ(parse({"p"}, {{"PET_BACKEND", "gloo"}}).backend, "gloo");
  EXPECT_USAGE_ERROR(({"--backend", "mpi", "p"}), "--backend='mpi'",
                     "gloo, shm, shm+gloo, nccl, auto or tuned, or one per device type "
                     "(cpu:gloo,cuda:nccl)");
  // A backend per device type: each device once, each with a backend it can have.
  for (const char* bad : {"cpu:nccl", "cuda:shm", "gpu:nccl", "cpu:gloo,cpu:shm", "cpu:gloo,",
                          "cpu:"}) {
    SCOPED_TRACE(bad);
    const std::string named = fmt::format("--backend='{}'", bad);
    EXPECT_USAGE_ERROR(({"--backend", bad, "p"}), named.c_str());
  }
  EXPECT_USAGE_ERROR(({"p"}, {{"PET_BACKEND", "tcp"}}), "PET_BACKEND='tcp'");
}

TEST(DdprunArgs, OmpNumThreadsOnlyWhenSeveralWorkersAndUnset) {
  GroupSpec g{.master_addr = "127.0.0.1", .master_port = 1, .run_id = "r", .restart_count = 0};
  LaunchConfig one = parse({"p"});
  LaunchConfig two = parse({"--nproc-per-node", "2", "p"});
  EXPECT_FALSE(sets_omp_num_threads(one, {}));
  EXPECT_EQ(worker_environment(one, g, 0, "e", {}).count("OMP_NUM_THREADS"), 0u);
  EXPECT_TRUE(sets_omp_num_threads(two, {}));
  EXPECT_EQ(worker_environment(two, g, 1, "e", {})["OMP_NUM_THREADS"], "1");
  EnvMap user{{"OMP_NUM_THREADS", "6"}};
  EXPECT_FALSE(sets_omp_num_threads(two, user));
  EXPECT_EQ(worker_environment(two, g, 1, "e", user)["OMP_NUM_THREADS"], "6");
}

// --- summary.h: wait statuses, error files, the root cause, the report

// waitpid() statuses, built the way the kernel encodes them.
int exited(int code) { return (code & 0xff) << 8; }
int killed_by(int signal) { return signal & 0x7f; }

TEST(DdprunSummary, DescribeWaitStatus) {
  EXPECT_EQ(describe_wait_status(exited(3)), "exit code 3");
  EXPECT_EQ(describe_wait_status(killed_by(SIGKILL)), "SIGKILL (signal 9)");
  EXPECT_EQ(describe_wait_status(killed_by(SIGTERM)), "SIGTERM (signal 15)");
  EXPECT_EQ(signal_name(11), "SIGSEGV");
  EXPECT_EQ(signal_name(99), "signal 99");
}

constexpr std::int64_t kUs = 1'000'000;

TEST(DdprunSummary, ParseTorchrunErrorFile) {
  // What torchrun's @record writes: the timestamp in whole seconds, as a string.
  ErrorFileReport r = parse_error_file(
      R"({"message": {"message": "RuntimeError: boom\nat x", )"
      R"("extraInfo": {"py_callstack": "Traceback ...", "timestamp": "1717171717"}}})");
  EXPECT_EQ(r.message, "RuntimeError: boom\nat x");
  EXPECT_EQ(r.timestamp_us, 1717171717 * kUs);
}

TEST(DdprunSummary, ParseRecordErrorFile) {
  // What ddp::record_error writes (src/base/error_file.cpp): timestamp_us wins over timestamp.
  ErrorFileReport r = parse_error_file(R"({
  "message": {
    "message": "[rank 1] allreduce #3: Connection closed by peer",
    "extraInfo": {"py_callstack": "", "timestamp": "1717171717", "timestamp_us": "1717171717123456"}
  }
})");
  EXPECT_EQ(r.message, "[rank 1] allreduce #3: Connection closed by peer");
  EXPECT_EQ(r.timestamp_us, 1717171717123456);
  // JSON numbers are accepted too; garbage timestamps are ignored, not guessed.
  EXPECT_EQ(parse_error_file(R"({"message": {"message": "m", "extraInfo": {"timestamp": 5}}})")
                .timestamp_us,
            5 * kUs);
  EXPECT_EQ(parse_error_file(R"({"message": {"message": "m", "extraInfo": {"timestamp_us": "x",)"
                             R"( "timestamp": "7"}}})")
                .timestamp_us,
            7 * kUs);
  for (const char* bad : {R"("soon")", R"("-5")", R"("12abc")", R"("")", "-3", "1.5", "null",
                          "99999999999999999999"}) {
    EXPECT_EQ(parse_error_file(std::string(R"({"message": {"message": "m", "extraInfo": )"
                                           R"({"timestamp": )") +
                               bad + "}}}")
                  .timestamp_us,
              std::nullopt)
        << bad;
  }
  EXPECT_EQ(parse_error_file(R"({"message": {"message": "m"}})").timestamp_us, std::nullopt);
}

TEST(DdprunSummary, ParseRelayedErrorFile) {
  // What ddp::record_error writes for a Relayed error (ddp/relayed_error.h).
  ErrorFileReport r = parse_error_file(
      R"({"message": {"message": "m", "extraInfo": {"timestamp_us": "5", "relayed_from": 3}}})");
  EXPECT_EQ(r.relayed_from, 3);
  EXPECT_EQ(parse_error_file(R"({"message": {"message": "m", "extraInfo": {}}})").relayed_from,
            std::nullopt);
  EXPECT_EQ(parse_error_file(R"({"message": {"message": "m", "extraInfo": {"relayed_from": -1}}})")
                .relayed_from,
            std::nullopt);
}

TEST(DdprunSummary, ParsePlainMessageErrorFile) {
  ErrorFileReport r = parse_error_file(R"({"message": "plain \"quoted\" text\u00e9"})");
  EXPECT_EQ(r.message, "plain \"quoted\" text\u00e9");  // decoded to UTF-8
  EXPECT_EQ(r.timestamp_us, std::nullopt);
  // torchrun reads a top-level timestamp for this shape.
  EXPECT_EQ(parse_error_file(R"({"message": "plain", "timestamp": "12"})").timestamp_us, 12 * kUs);
}

TEST(DdprunSummary, ParseMalformedErrorFileShowsTheRawText) {
  EXPECT_EQ(parse_error_file("not json at all\n").message, "not json at all");
  EXPECT_EQ(parse_error_file(R"({"message": {"message": "cut)").message,
            R"({"message": {"message": "cut)");
  EXPECT_EQ(parse_error_file(R"({"message": {"message": "cut)").timestamp_us, std::nullopt);
  EXPECT_EQ(parse_error_file(R"({"other": 1})").message, R"({"other": 1})");
  EXPECT_EQ(parse_error_file(R"({"message": {"text": "x"}})").message,
            R"({"message": {"text": "x"}})");
  EXPECT_EQ(parse_error_file(R"([1, 2])").message, "[1, 2]");
  EXPECT_EQ(parse_error_file(std::string(5000, 'x'), 10).message, "xxxxxxxxxx [...]");
  EXPECT_EQ(parse_error_file(R"({"message": ")" + std::string(50, 'y') + R"("})", 4).message,
            "yyyy [...]");
  EXPECT_EQ(parse_error_file("").message, "");
}

// A worker for the root-cause rule: `reap_order` is when ddprun reaped it.
WorkerEnd end_of(int rank, int wait_status, int reap_order, int signal_sent = 0,
                 std::optional<std::int64_t> error_time_us = std::nullopt,
                 const std::string& error_message = "") {
  WorkerEnd w;
  w.rank = rank;
  w.local_rank = rank;
  w.pid = 1000 + rank;
  w.wait_status = wait_status;
  w.reap_order = reap_order;
  w.signal_sent = signal_sent;
  w.reaped_at_us = 1717171717 * kUs + reap_order;
  if (error_time_us || !error_message.empty()) {
    w.error_file = ErrorFileReport{error_message, error_time_us};
  }
  return w;
}

TEST(DdprunRootCause, WhoFailed) {
  EXPECT_FALSE(failed(end_of(0, exited(0), 0)));
  EXPECT_TRUE(failed(end_of(0, exited(1), 0)));
  EXPECT_TRUE(failed(end_of(0, killed_by(SIGSEGV), 0)));
  // Died of ddprun's own signal: only stopped, unless it had written an error file.
  EXPECT_FALSE(failed(end_of(0, killed_by(SIGTERM), 0, SIGTERM)));
  EXPECT_FALSE(failed(end_of(0, killed_by(SIGKILL), 0, SIGKILL)));
  EXPECT_FALSE(failed(end_of(0, killed_by(SIGINT), 0, SIGINT)));
  EXPECT_TRUE(failed(end_of(0, killed_by(SIGTERM), 0, SIGTERM, 5 * kUs, "boom")));
  // Failed during the teardown, in its own way.
  EXPECT_TRUE(failed(end_of(0, exited(1), 0, SIGTERM)));
  EXPECT_TRUE(failed(end_of(0, killed_by(SIGABRT), 0, SIGTERM)));
  WorkerEnd running = end_of(0, 0, -1);
  running.reaped = false;
  EXPECT_FALSE(failed(running));
}

TEST(DdprunRootCause, FirstObservedFailureWithoutErrorFiles) {
  // Rank 2 was reaped first; rank 0 only stopped; rank 1 failed later.
  std::vector<WorkerEnd> w = {end_of(0, killed_by(SIGTERM), 2, SIGTERM),
                              end_of(1, exited(1), 1), end_of(2, killed_by(SIGKILL), 0)};
  auto root = pick_root_cause(w);
  ASSERT_TRUE(root);
  EXPECT_EQ(root->index, 2u);
  EXPECT_FALSE(root->by_error_file);
}

TEST(DdprunRootCause, EarliestErrorFileWinsOverFirstObserved) {
  // Rank 1 recorded its error first but was reaped last (slow teardown); rank 0 noticed, wrote
  // "Connection closed by peer" 2 ms later and exited at once.
  std::vector<WorkerEnd> w = {end_of(0, exited(1), 0, 0, 1002, "Connection closed by peer"),
                              end_of(1, exited(1), 1, SIGTERM, 1000, "ValueError: bad lr")};
  auto root = pick_root_cause(w);
  ASSERT_TRUE(root);
  EXPECT_EQ(root->index, 1u);
  EXPECT_TRUE(root->by_error_file);

  // Still so when ddprun's SIGTERM killed it after it wrote the file.
  w[1] = end_of(1, killed_by(SIGTERM), 1, SIGTERM, 1000, "ValueError: bad lr");
  EXPECT_EQ(pick_root_cause(w)->index, 1u);

  // An error file beats an earlier-observed failure that wrote none (the documented rule).
  w = {end_of(0, killed_by(SIGSEGV), 0), end_of(1, exited(1), 1, SIGTERM, 1000, "lost rank 0")};
  EXPECT_EQ(pick_root_cause(w)->index, 1u);

  // A worker only stopped by ddprun does not count, whatever else it did.
  w = {end_of(0, exited(1), 1, 0, 2000, "late"), end_of(1, killed_by(SIGTERM), 0, SIGTERM)};
  EXPECT_EQ(pick_root_cause(w)->index, 0u);

  // A worker that exited 0 does not count, even with an error file.
  w = {end_of(0, exited(0), 0, 0, 1, "stale"), end_of(1, exited(2), 1, 0, 1000, "real")};
  EXPECT_EQ(pick_root_cause(w)->index, 1u);
}

TEST(DdprunRootCause, TimestampTiesAndFilesWithoutTimestamps) {
  // torchrun's whole seconds tie easily: the one reaped first wins.
  std::vector<WorkerEnd> w = {end_of(0, exited(1), 1, 0, 7 * kUs, "a"),
                              end_of(1, exited(1), 0, 0, 7 * kUs, "b")};
  EXPECT_EQ(pick_root_cause(w)->index, 1u);
  // An error file without a usable timestamp is ordered like no error file.
  w = {end_of(0, exited(1), 0, 0, std::nullopt, "no time"),
       end_of(1, exited(1), 1, 0, 9 * kUs, "timed")};
  EXPECT_EQ(pick_root_cause(w)->index, 1u);
  w = {end_of(0, exited(1), 1, 0, std::nullopt, "no time"),
       end_of(1, exited(1), 0, 0, std::nullopt, "no time either")};
  EXPECT_EQ(pick_root_cause(w)->index, 1u);
  EXPECT_FALSE(pick_root_cause(w)->by_error_file);
}

// Note [Root cause], relayed records: one counts for the rank it names, at its own time.
TEST(DdprunRootCause, RelayedRecordBlamesItsOrigin) {
  auto relayed = [](WorkerEnd w, int origin) {
    w.error_file->relayed_from = origin;
    return w;
  };
  // Rank 1 relays rank 0's failure before rank 0 records it; rank 2's own error comes later.
  std::vector<WorkerEnd> w = {end_of(0, exited(1), 2, SIGTERM, 1010, "cannot write"),
                              relayed(end_of(1, exited(1), 0, 0, 1000, "rank 0 failed"), 0),
                              end_of(2, exited(1), 1, 0, 1005, "Connection closed by peer")};
  auto root = pick_root_cause(w);
  ASSERT_TRUE(root);
  EXPECT_EQ(root->index, 0u);
  EXPECT_EQ(root->relayed_by, 1u);
  EXPECT_EQ(root->time_us, 1000);
  std::string s = format_failure_summary({1, 1, "h", ""}, w, root);
  EXPECT_NE(s.find("Root cause (earliest error file, relayed by rank 1):\n"), std::string::npos)
      << s;
  EXPECT_NE(s.find("  rank      : 0 (local_rank 0) on host h\n"), std::string::npos) << s;
  EXPECT_NE(s.find("  error file of rank 1 (relayed from rank 0): rank 0 failed\n"),
            std::string::npos)
      << s;
  // An own record earlier than every relay still wins.
  w[2].error_file->timestamp_us = 900;
  EXPECT_EQ(pick_root_cause(w)->index, 2u);
  EXPECT_EQ(pick_root_cause(w)->relayed_by, std::nullopt);
  // The origin runs on another node: the relaying worker stands in for it and says so.
  w = {relayed(end_of(4, exited(1), 0, 0, 1000, "rank 0 failed"), 0),
       end_of(5, killed_by(SIGTERM), 1, SIGTERM)};
  root = pick_root_cause(w);
  ASSERT_TRUE(root);
  EXPECT_EQ(root->index, 0u);
  EXPECT_EQ(root->relayed_by, 0u);
  s = format_failure_summary({1, 1, "h", ""}, w, root);
  EXPECT_NE(s.find("Root cause (earliest error file, relayed from rank 0 on another node: its "
                   "own summary names the cause):\n"),
            std::string::npos)
      << s;
}

TEST(DdprunSummary, WorkerThatLeftEarlyIsNamed) {
  // Rank 1 exited 0 first; rank 0 then failed ("Connection closed by peer"); rank 2 was stopped.
  std::vector<WorkerEnd> w = {end_of(0, exited(1), 1, 0, 1000, "Connection closed by peer"),
                              end_of(1, exited(0), 0), end_of(2, killed_by(SIGTERM), 2, SIGTERM)};
  std::string s = format_failure_summary({1, 1, "h", ""}, w, pick_root_cause(w));
  EXPECT_NE(s.find("Left early: rank 1 exited with code 0 before any worker failed"),
            std::string::npos)
      << s;
  // A worker that finished after the failure did not leave early.
  w[1].reap_order = 3;
  s = format_failure_summary({1, 1, "h", ""}, w, pick_root_cause(w));
  EXPECT_EQ(s.find("Left early"), std::string::npos) << s;
}

TEST(DdprunRootCause, NoFailureNoRootCause) {
  EXPECT_FALSE(pick_root_cause({}));
  EXPECT_FALSE(pick_root_cause({end_of(0, exited(0), 0), end_of(1, killed_by(SIGINT), 1, SIGINT)}));
}

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

TEST(DdprunSummary, ReportNamesTheRootCauseAndListsTheOthers) {
  constexpr std::int64_t t = 1717171717 * kUs;
  std::vector<WorkerEnd> w = {
      end_of(0, exited(1), 0, 0, t + 2000, "RuntimeError: Connection closed by peer"),
      end_of(1, exited(1), 1, SIGTERM, t, "ValueError: lr must be > 0\nline 2"),
      end_of(2, killed_by(SIGTERM), 2, SIGTERM), end_of(3, killed_by(SIGKILL), 3, SIGKILL)};
  w[1].stderr_tail = {"warming up", "ValueError: lr must be > 0"};
  SummaryContext context{2, 3, "node7", "after the 1s grace period"};
  std::string s = format_failure_summary(context, w, pick_root_cause(w));
  EXPECT_TRUE(contains(s, "ddprun: worker group failed (attempt 2 of 3)\n"
                          "Root cause (earliest error file):\n  time      : "))
      << s;
  EXPECT_TRUE(contains(s, "  rank      : 1 (local_rank 1) on host node7\n"
                          "  pid       : 1001\n"
                          "  exit      : exit code 1\n"
                          "  error file: ValueError: lr must be > 0\n"
                          "              line 2\n"
                          "  last stderr lines of rank 1:\n"
                          "    warming up\n"
                          "    ValueError: lr must be > 0\n"))
      << s;
  EXPECT_TRUE(contains(s, "Other workers: rank 0 also failed (exit code 1); rank 2 stopped by "
                          "ddprun (SIGTERM); rank 3 killed by ddprun (SIGKILL after the 1s grace "
                          "period)\n"
                          "  error file of rank 0: RuntimeError: Connection closed by peer\n"))
      << s;

  // Without error files: the first observed failure, and no error lines.
  w = {end_of(0, killed_by(SIGTERM), 1, SIGTERM), end_of(1, killed_by(SIGSEGV), 0),
       end_of(2, killed_by(SIGTERM), 2, SIGTERM)};
  s = format_failure_summary(context, w, pick_root_cause(w));
  EXPECT_TRUE(contains(s, "Root cause (first observed failure):\n")) << s;
  EXPECT_TRUE(contains(s, "  exit      : SIGSEGV (signal 11)\n  error file: (none)\n"
                          "  last stderr lines of rank 1: (none)\n"
                          "Other workers: ranks 0,2 stopped by ddprun (SIGTERM)\n"))
      << s;
  EXPECT_FALSE(contains(s, "error file of")) << s;

  // No root cause (ddprun was interrupted): the first line only.
  EXPECT_EQ(format_failure_summary(context, w, std::nullopt),
            "ddprun: worker group failed (attempt 2 of 3)\n");
}

TEST(DdprunSummary, Fate) {
  EXPECT_EQ(describe_fate(end_of(0, exited(0), 0), ""), "finished (exit code 0)");
  EXPECT_EQ(describe_fate(end_of(0, exited(143), 0, SIGTERM), ""),
            "ended with exit code 143 after ddprun sent SIGTERM");
  WorkerEnd running = end_of(0, 0, -1);
  running.reaped = false;
  EXPECT_EQ(describe_fate(running, ""), "could not be stopped");
  WorkerEnd frozen = end_of(1, killed_by(SIGTERM), 0, SIGTERM);
  frozen.was_stopped = true;
  EXPECT_EQ(describe_fate(frozen, ""),
            "was stopped (process state T: SIGSTOP or a debugger); ddprun resumed it: stopped by "
            "ddprun (SIGTERM)");
}

TEST(DdprunSummary, RankList) {
  EXPECT_EQ(format_rank_list({0}), "0");
  EXPECT_EQ(format_rank_list({0, 1, 2, 5, 7, 8}), "0-2,5,7-8");
  EXPECT_EQ(format_rank_list({}), "");
}

TEST(DdprunSummary, ResolveProgram) {
  EXPECT_EQ(resolve_program("sh", "/nonexistent:/bin:/usr/bin"), "/bin/sh");
  EXPECT_EQ(resolve_program("/bin/sh", ""), "/bin/sh");
  try {
    resolve_program("no-such-program-xyz", "/bin:/usr/bin");
    ADD_FAILURE() << "no error";
  } catch (const ExecError& e) {
    EXPECT_EQ(e.exit_code(), 127);
    EXPECT_NE(std::string(e.what()).find("cannot execute 'no-such-program-xyz'"),
              std::string::npos);
  }
  try {
    resolve_program("/etc/passwd", "");  // exists, not executable
    ADD_FAILURE() << "no error";
  } catch (const ExecError& e) {
    EXPECT_EQ(e.exit_code(), 126);
  }
}


// Note [CPU binding]: --cpu-bind's plans on made-up machines, and sysfs read as the kernel
// lays it out.
namespace cpu_binding {

// `nodes` NUMA nodes x `cores` cores each x `smt` hardware threads, numbered as Linux does on
// x86 (sibling threads of core c are c and c + all cores).
std::vector<Cpu> machine(int nodes, int cores, int smt) {
  std::vector<Cpu> out;
  const int total_cores = nodes * cores;
  for (int t = 0; t < smt; ++t) {
    for (int c = 0; c < total_cores; ++c) {
      out.push_back({.id = t * total_cores + c, .package = c / cores, .core = c % cores,
                     .numa = c / cores});
    }
  }
  return out;
}

TEST(DdprunCpuBind, FlagAndNone) {
  EXPECT_EQ(parse({"prog"}).cpu_bind, CpuBind::kNone);
  EXPECT_EQ(parse({"--cpu-bind", "cores", "prog"}).cpu_bind, CpuBind::kCores);
  EXPECT_EQ(parse({"--cpu_bind=numa", "prog"}).cpu_bind, CpuBind::kNuma);
  EXPECT_EQ(parse({"prog"}, {{"PET_CPU_BIND", "cores"}}).cpu_bind, CpuBind::kCores);
  EXPECT_USAGE_ERROR(({"--cpu-bind", "socket", "prog"}), "--cpu-bind", "expected none, cores or numa");
  EXPECT_TRUE(plan_cpu_binding(CpuBind::kNone, machine(2, 4, 2), 4).workers.empty());
}

TEST(DdprunCpuBind, CoresGivesWholeCoresInEqualBlocks) {
  // 2 nodes x 4 cores x 2 threads = CPUs 0-15; core c's siblings are c and c + 8.
  BindingPlan p = plan_cpu_binding(CpuBind::kCores, machine(2, 4, 2), 4);
  ASSERT_EQ(p.workers.size(), 4u);
  EXPECT_EQ(p.workers[0].cpus, (std::vector<int>{0, 1, 8, 9}));
  EXPECT_EQ(p.workers[1].cpus, (std::vector<int>{2, 3, 10, 11}));
  EXPECT_EQ(p.workers[3].cpus, (std::vector<int>{6, 7, 14, 15}));
  EXPECT_EQ(p.workers[3].threads, 4);
  EXPECT_NE(p.note.find("whole cores"), std::string::npos) << p.note;
  EXPECT_NE(p.note.find("local rank 1 on CPUs 2-3,10-11,"), std::string::npos) << p.note;
  // 3 workers on 8 cores: blocks of 2, 3, 3 cores, none split.
  p = plan_cpu_binding(CpuBind::kCores, machine(2, 4, 2), 3);
  EXPECT_EQ(p.workers[0].cpus, (std::vector<int>{0, 1, 8, 9}));
  EXPECT_EQ(p.workers[1].threads, 6);
  EXPECT_EQ(p.workers[2].threads, 6);
  // This project's machine: 2 cores, no SMT; 2 workers get one each.
  p = plan_cpu_binding(CpuBind::kCores, machine(1, 2, 1), 2);
  EXPECT_EQ(p.workers[0].cpus, std::vector<int>{0});
  EXPECT_EQ(p.workers[1].cpus, std::vector<int>{1});
  EXPECT_EQ(p.workers[1].threads, 1);
}

TEST(DdprunCpuBind, FewerCoresOrCpusThanWorkers) {
  // 2 cores x 2 threads, 4 workers: one hardware thread each.
  BindingPlan p = plan_cpu_binding(CpuBind::kCores, machine(1, 2, 2), 4);
  EXPECT_EQ(p.workers[0].cpus, std::vector<int>{0});
  EXPECT_EQ(p.workers[1].cpus, std::vector<int>{2});  // core 0's sibling
  EXPECT_EQ(p.workers[2].cpus, std::vector<int>{1});
  EXPECT_NE(p.note.find("single hardware threads"), std::string::npos) << p.note;
  // 2 CPUs, 3 workers: they share, round-robin, one thread each.
  p = plan_cpu_binding(CpuBind::kCores, machine(1, 2, 1), 3);
  EXPECT_EQ(p.workers[2].cpus, std::vector<int>{0});
  EXPECT_EQ(p.workers[2].threads, 1);
  EXPECT_NE(p.note.find("workers share CPUs"), std::string::npos) << p.note;
}

TEST(DdprunCpuBind, NumaSpreadsWorkersOverNodes) {
  BindingPlan p = plan_cpu_binding(CpuBind::kNuma, machine(2, 4, 2), 4);
  EXPECT_EQ(p.workers[0].cpus, (std::vector<int>{0, 1, 2, 3, 8, 9, 10, 11}));
  EXPECT_EQ(p.workers[1].cpus, p.workers[0].cpus);
  EXPECT_EQ(p.workers[2].cpus, (std::vector<int>{4, 5, 6, 7, 12, 13, 14, 15}));
  EXPECT_EQ(p.workers[2].threads, 4);  // 8 CPUs of node 1 shared by 2 workers
  EXPECT_NE(p.note.find("node 1 (CPUs 4-7,12-15): 2 worker(s)"), std::string::npos) << p.note;
  p = plan_cpu_binding(CpuBind::kNuma, machine(1, 2, 1), 2);
  EXPECT_EQ(p.workers[1].cpus, (std::vector<int>{0, 1}));
  EXPECT_EQ(p.workers[1].threads, 1);
  EXPECT_NE(p.note.find("one NUMA node"), std::string::npos) << p.note;
}

TEST(DdprunCpuBind, ReadsTheTopologyFromSysfsAndTheAffinityMask) {
  namespace fs = std::filesystem;
  const fs::path root = fs::temp_directory_path() / fmt::format("ddprun_sysfs_{}", ::getpid());
  auto put = [](const fs::path& file, const std::string& text) {
    fs::create_directories(file.parent_path());
    std::ofstream(file) << text << "\n";
  };
  for (int id : {0, 1, 2, 3}) {
    const fs::path cpu = root / fmt::format("cpu{}", id);
    put(cpu / "topology" / "physical_package_id", std::to_string(id / 2));
    put(cpu / "topology" / "core_id", std::to_string(id % 2));
    fs::create_directories(cpu / fmt::format("node{}", id / 2));
  }
  fs::create_directories(root / "cpu9");  // no topology files: a core of its own, node 0
  std::vector<Cpu> cpus = read_cpus({1, 2, 9}, root.string());
  ASSERT_EQ(cpus.size(), 3u);
  EXPECT_EQ(cpus[0].id, 1);
  EXPECT_EQ(cpus[0].core, 1);
  EXPECT_EQ(cpus[1].package, 1);
  EXPECT_EQ(cpus[1].numa, 1);
  EXPECT_EQ(cpus[2].numa, 0);
  fs::remove_all(root);
  // This machine: the real mask and sysfs give one entry per allowed CPU.
  const std::vector<int> allowed = allowed_cpus();
  ASSERT_FALSE(allowed.empty());
  EXPECT_EQ(read_cpus(allowed).size(), allowed.size());
  EXPECT_EQ(format_cpu_list({5, 0, 1, 2, 7, 8}), "0-2,5,7-8");
}

}  // namespace cpu_binding

}  // namespace
}  // namespace ddp::launcher
// clang-format on
