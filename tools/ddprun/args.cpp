// ddprun's command line: from raw flags (flags.h) to a LaunchConfig (see args.h).
#include "args.h"

#include <dlfcn.h>     // dlopen: the driver's device count
#include <fcntl.h>     // O_CLOEXEC
#include <poll.h>      // poll
#include <signal.h>    // kill
#include <sys/wait.h>  // waitpid
#include <unistd.h>    // sysconf, fork, pipe2

#include <algorithm>
#include <filesystem>
#include <initializer_list>
#include <sstream>
#include <system_error>

#include <CLI/CLI.hpp>  // option spellings, --help, stopping at PROGRAM
#include <fmt/format.h>

#include "base/parse.h"
#include "flags.h"
#include "etcd.h"  // etcd_options: --rdzv-backend etcd's endpoints and --rdzv-conf, checked early
#include "values.h"

namespace ddp::launcher {
namespace {

// --nproc-per-node: N, or what the host has.
int parse_nproc(const std::string& source, const std::string& value, const HostInfo& host) {
  if (value == "cpu") return host.cpus;
  if (value == "auto") {
    const int gpus = host.visible_gpus();
    return gpus > 0 ? gpus : host.cpus;
  }
  if (value == "gpu") {
    const int gpus = host.visible_gpus();
    if (gpus == 0) {
      bad_value(source, value,
                "no CUDA device is visible (no NVIDIA driver or GPU, or CUDA_VISIBLE_DEVICES "
                "hides them all); give a number of processes or 'cpu'");
    }
    return gpus;
  }
  if (value == "xpu") {
    bad_value(source, value, "XPU devices are not supported; use N, auto, cpu or gpu");
  }
  return parse_int(source, value, 1, 1 << 16, "a number of processes >= 1, or auto, cpu or gpu");
}

// From raw flags to a LaunchConfig, one concern at a time.

void apply_topology(const RawFlags& raw, const HostInfo& host, LaunchConfig& c) {
  if (auto* v = raw.get("nproc_per_node")) c.nproc_per_node = parse_nproc(v->source, v->text, host);
  if (auto* v = raw.get("nnodes")) {
    const NodeRange range = parse_nnodes(v->source, v->text);
    c.min_nodes = range.min;
    c.nnodes = range.max;
  }
  if (auto* v = raw.get("node_rank")) {
    c.node_rank = parse_int(v->source, v->text, 0, 1 << 20, "a node rank >= 0");
    if (c.node_rank >= c.nnodes && c.min_nodes == c.nnodes) {
      bad_value(v->source, v->text,
                fmt::format("the node rank must be below --nnodes ({}); nodes are numbered 0 to {}",
                            c.nnodes, c.nnodes - 1));
    }
  }
  if (auto* v = raw.get("master_addr")) {
    if (v->text.empty()) bad_value(v->source, v->text, "expected a host name or IP address");
    c.master_addr = v->text;
  }
  if (auto* v = raw.get("master_port")) {
    c.master_port = parse_int(v->source, v->text, 0, 65535, "a port number in [0, 65535]");
  }
}

// --rdzv-conf: the keys ddprun reads (the others are accepted and ignored, as by torchrun).
void apply_rdzv_conf(const RawFlags& raw, LaunchConfig& c) {
  auto* v = raw.get("rdzv_conf");
  if (v == nullptr) return;
  c.rdzv_conf = parse_rdzv_conf(v->source, v->text);
  for (const char* key : {"timeout", "join_timeout"}) {  // join_timeout wins: applied last
    if (auto it = c.rdzv_conf.find(key); it != c.rdzv_conf.end()) {
      c.rdzv_timeout = parse_seconds(v->source + " " + key, it->second, false);
    }
  }
  if (auto it = c.rdzv_conf.find("last_call_timeout"); it != c.rdzv_conf.end()) {
    c.last_call_timeout = parse_seconds(v->source + " last_call_timeout", it->second, true);
  }
}

// --standalone: a single node on a free port of 127.0.0.1 with a random run id; false without it.
bool apply_standalone(const RawFlags& raw, CommandLine& out) {
  if (!raw.flag("standalone")) return false;
  LaunchConfig& c = out.config;
  if (c.nnodes != 1) {
    throw UsageError(
        fmt::format("--standalone runs a single node, but --nnodes is {}; drop "
                    "--standalone or use --nnodes 1",
                    c.nnodes));
  }
  for (const char* dest : {"rdzv_backend", "rdzv_endpoint", "rdzv_id"}) {
    if (raw.given(dest))
      out.notes.push_back(fmt::format("--standalone: ignoring {}", raw.get(dest)->source));
  }
  c.rdzv_backend = RdzvBackend::kC10d;
  c.master_addr = "127.0.0.1";
  c.pick_free_port = true;
  c.random_run_id = true;
  c.run_id.clear();
  return true;
}

// Elastic: a range of nodes, or c10d's node ranks given out at each round (Note [Elastic
// rounds] in elastic.h). A fixed --nnodes N with --node-rank is a fixed membership: MIN = MAX,
// ranks given (Note [Membership policy] in membership_policy.h).
void apply_membership(const RawFlags& raw, CommandLine& out) {
  LaunchConfig& c = out.config;
  const bool dynamic = c.rdzv_backend == RdzvBackend::kC10d || c.rdzv_backend == RdzvBackend::kEtcd;
  if (c.min_nodes != c.nnodes) {
    if (!dynamic) {
      throw UsageError(fmt::format(
          "--nnodes {}:{} is an elastic range, which needs the c10d rendezvous: add "
          "--rdzv-backend c10d --rdzv-endpoint HOST:PORT --rdzv-id ID (the same on every node), "
          "or --rdzv-backend etcd --rdzv-endpoint ETCD_HOST:PORT,...",
          c.min_nodes, c.nnodes));
    }
    if (raw.given("node_rank")) {
      out.notes.push_back(fmt::format(
          "--nnodes {}:{}: ignoring {} (node ranks are given out at each round)", c.min_nodes,
          c.nnodes, raw.get("node_rank")->source));
    }
    c.elastic = true;
  } else if (dynamic && c.nnodes > 1 && !raw.given("node_rank")) {
    c.elastic = true;
  }
  if (c.elastic) c.node_rank = 0;
}

void apply_rendezvous(const RawFlags& raw, CommandLine& out) {
  LaunchConfig& c = out.config;
  if (auto* v = raw.get("rdzv_backend")) {
    if (v->text == "c10d") {
      c.rdzv_backend = RdzvBackend::kC10d;
    } else if (v->text == "etcd" || v->text == "etcd-v2") {  // torchrun's two names for it
      c.rdzv_backend = RdzvBackend::kEtcd;
    } else if (v->text != "static") {
      bad_value(v->source, v->text, "expected static, c10d or etcd");
    }
  }
  if (auto* v = raw.get("rdzv_id")) c.run_id = v->text.empty() ? kDefaultRunId : v->text;
  if (auto* v = raw.get("role")) c.role = v->text.empty() ? kDefaultRole : v->text;
  apply_rdzv_conf(raw, c);
  if (apply_standalone(raw, out)) return;
  if (c.rdzv_backend == RdzvBackend::kEtcd) {
    // The etcd cluster's endpoints (Note [etcd backend] in etcd.h); node rank 0 picks where
    // the workers rendezvous, so --master-addr and --master-port are not used.
    auto* v = raw.get("rdzv_endpoint");
    if (v == nullptr || v->text.empty()) {
      throw UsageError(
          "--rdzv-backend etcd needs --rdzv-endpoint: the etcd cluster's client endpoints, "
          "HOST[:PORT] comma-separated (port 2379 when left out)");
    }
    etcd_options(v->text, c.rdzv_conf);  // a bad endpoint, protocol or file: said now
    c.etcd_endpoints = v->text;
  } else if (auto* v = raw.get("rdzv_endpoint"); v != nullptr && !v->text.empty()) {
    Endpoint e = parse_endpoint(v->source, v->text);
    c.master_addr = e.host;
    c.master_port = e.port;
  }
  apply_membership(raw, out);
  if (c.master_port == 0) {
    if (c.nnodes > 1) {
      throw UsageError(
          fmt::format("port 0 (pick a free port) only works on a single node; "
                      "with --nnodes {} every node must be given the same port",
                      c.nnodes));
    }
    c.pick_free_port = true;
  }
}

// Note [ddprun under srun]
// An HPC user runs one ddprun per node of a Slurm step (srun --ntasks-per-node=1 ddprun ...),
// as torchrun users do. ddprun then takes from the step what a multi-node command line would
// otherwise have to spell out: the node rank (SLURM_NODEID) and, without --master-addr or
// --rdzv-endpoint, the first node of the step's node list as the store's host. What cannot work
// is refused before anything starts: several ddprun tasks on one node (each would start the
// node's workers: two jobs on one port), or --nnodes other than the step's node count (each
// node would wait for nodes that never come, or run a job of its own).
// The Slurm step this ddprun runs as a task of; nullopt when it runs outside one (or inside a
// torchrun-style launch, RANK set, where the Slurm variables are the outer job's).
std::optional<DistEnv> slurm_step(const EnvMap& env) {
  if (env.contains("RANK") || env.contains("WORLD_SIZE") || !env.contains("SLURM_PROCID") ||
      !env.contains("SLURM_STEP_NUM_TASKS")) {
    return std::nullopt;
  }
  DistEnv step;
  try {
    step = parse_dist_env(env);
  } catch (const ConfigError& e) {
    throw UsageError(fmt::format("ddprun runs as a task of a Slurm step, whose variables are "
                                 "inconsistent: {}",
                                 e.what()));
  }
  if (step.contract != LaunchContract::kSlurm) return std::nullopt;
  return step;
}

// What the step says the job is, against what the command line says: one ddprun per node, and
// as many nodes as --nnodes (elastic: within its range).
void check_slurm_step(const RawFlags& raw, const EnvMap& env, const DistEnv& step, int nodes,
                      const LaunchConfig& c) {
  if (step.local_world_size > 1) {
    const auto per_node = env.find("SLURM_STEP_TASKS_PER_NODE");
    throw UsageError(fmt::format(
        "Slurm started {} ddprun tasks on this node (task {} of the step; "
        "SLURM_STEP_TASKS_PER_NODE={}), but ddprun starts the node's {} worker(s) itself: run "
        "one ddprun per node (srun --ntasks-per-node=1 ddprun ...), or let srun start the ranks "
        "without ddprun (srun -n N PROGRAM ...)",
        step.local_world_size, step.rank,
        per_node == env.end() ? std::string("(unset)") : per_node->second, c.nproc_per_node));
  }
  if (c.elastic && (nodes < c.min_nodes || nodes > c.nnodes)) {
    throw UsageError(fmt::format(
        "--nnodes {}:{}, but the Slurm step runs ddprun on {} node(s) "
        "(SLURM_STEP_NUM_NODES={}): give a range that includes it",
        c.min_nodes, c.nnodes, nodes, nodes));
  }
  if (!c.elastic && c.nnodes != nodes) {
    throw UsageError(fmt::format(
        "--nnodes {}{}, but the Slurm step runs ddprun on {} node(s) (SLURM_STEP_NUM_NODES={}): "
        "pass --nnodes {} (e.g. --nnodes $SLURM_STEP_NUM_NODES), or srun -N {}",
        c.nnodes, raw.given("nnodes") ? "" : " (the default)", nodes, nodes, nodes, c.nnodes));
  }
}

void apply_slurm(const RawFlags& raw, const EnvMap& env, CommandLine& out) {
  LaunchConfig& c = out.config;
  const std::optional<DistEnv> step = slurm_step(env);
  if (!step) return;
  int nodes = 1;  // parse_dist_env checked it is an integer in range
  if (auto it = env.find("SLURM_STEP_NUM_NODES"); it != env.end()) nodes = std::stoi(it->second);
  check_slurm_step(raw, env, *step, nodes, c);
  if (c.elastic || nodes == 1) return;  // elastic: node ranks are given out at each round
  if (!raw.given("node_rank")) {
    c.node_rank = step->group_rank;
    out.notes.push_back(
        fmt::format("node rank {} from Slurm (SLURM_NODEID; --node-rank sets another)",
                    c.node_rank));
  } else if (c.node_rank != step->group_rank) {
    out.notes.push_back(fmt::format("--node-rank {} differs from Slurm's SLURM_NODEID={}",
                                    c.node_rank, step->group_rank));
  }
  if (!raw.given("master_addr") && !raw.given("rdzv_endpoint") && !step->master_addr.empty() &&
      !step->master_addr_source.empty()) {
    c.master_addr = step->master_addr;
    c.master_addr_source = step->master_addr_source;
    out.notes.push_back(fmt::format("the store's host: {}, {} (--master-addr sets another)",
                                    c.master_addr, c.master_addr_source));
  }
}

void apply_supervision(const RawFlags& raw, LaunchConfig& c) {
  if (auto* v = raw.get("max_restarts")) {
    c.max_restarts = parse_int(v->source, v->text, 0, 1 << 20, "a number of restarts >= 0");
  }
  if (auto* v = raw.get("monitor_interval")) {
    c.monitor_interval = parse_seconds(v->source, v->text, false);
  }
  if (auto* v = raw.get("grace_period")) c.grace_period = parse_seconds(v->source, v->text, true);
  if (auto* v = raw.get("rdzv_timeout")) {
    c.rdzv_timeout = parse_seconds(v->source, v->text, false);
  }
  if (auto* v = raw.get("collective_timeout")) {
    c.collective_timeout = parse_seconds(v->source, v->text, false);
  }
  c.ft = raw.flag("ft");
  if (auto* v = raw.get("start_method")) {
    if (v->text != "spawn" && v->text != "fork" && v->text != "forkserver") {
      bad_value(v->source, v->text, "expected spawn, fork or forkserver (ignored by ddprun)");
    }
  }
}

// A backend's name, or one per device type ("cpu:gloo,cuda:nccl": Note [Backend pairs] in
// src/process_group/transport/paired.cpp; the library says what is wrong in detail).
bool valid_backend(const std::string& text) {
  const auto one_of = [](const std::string& name, std::initializer_list<const char*> names) {
    return std::find(names.begin(), names.end(), name) != names.end();
  };
  if (text.find(':') == std::string::npos) {
    return one_of(text, {"gloo", "shm", "shm+gloo", "nccl", "auto", "tuned"});
  }
  bool cpu = false, cuda = false;
  for (size_t from = 0; from <= text.size();) {
    const size_t comma = std::min(text.find(',', from), text.size());
    const std::string item = text.substr(from, comma - from);
    from = comma + 1;
    if (item.starts_with("cpu:") && !cpu &&
        one_of(item.substr(4), {"gloo", "shm", "shm+gloo", "auto", "tuned"})) {
      cpu = true;
    } else if (item.starts_with("cuda:") && !cuda && one_of(item.substr(5), {"nccl", "gloo"})) {
      cuda = true;
    } else {
      return false;
    }
  }
  return true;
}

// --backend: checked here so a typo stops the launch instead of failing in every worker.
void apply_backend(const RawFlags& raw, LaunchConfig& c) {
  if (auto* v = raw.get("backend")) {
    if (!valid_backend(v->text)) {
      bad_value(v->source, v->text,
                "expected gloo, shm, shm+gloo, nccl, auto or tuned, or one per device type "
                "(cpu:gloo,cuda:nccl)");
    }
    c.backend = v->text;
  }
  if (auto* v = raw.get("cpu_bind")) {
    const std::optional<CpuBind> mode = parse_cpu_bind(v->text);
    if (!mode) bad_value(v->source, v->text, "expected none, cores or numa");
    c.cpu_bind = *mode;
  }
}

void check_ranks_exist(const std::string& source, const std::string& text, const StdSpec& spec,
                       int nproc) {
  for (const auto& [rank, streams] : spec.by_local_rank) {
    if (rank >= nproc) {
      bad_value(source, text,
                fmt::format("there is no local rank {} with --nproc-per-node {}", rank, nproc));
    }
  }
}

void apply_output(const RawFlags& raw, LaunchConfig& c) {
  if (auto* v = raw.get("log_dir")) c.log_dir = v->text;
  if (auto* v = raw.get("redirects")) {
    c.redirects = parse_std_spec(v->source, v->text);
    check_ranks_exist(v->source, v->text, c.redirects, c.nproc_per_node);
  }
  if (auto* v = raw.get("tee")) {
    c.tee = parse_std_spec(v->source, v->text);
    check_ranks_exist(v->source, v->text, c.tee, c.nproc_per_node);
  }
  if (auto* v = raw.get("local_ranks_filter"); v != nullptr && !v->text.empty()) {
    c.local_ranks_filter = parse_rank_list(v->source, v->text, c.nproc_per_node);
  }
}

// PROGRAM and its arguments: what CLI11 left over after the launcher's flags.
void apply_program(const RawFlags& raw, std::vector<std::string> rest, LaunchConfig& c) {
  if (!rest.empty() && rest.front() == "--") rest.erase(rest.begin());
  if (rest.empty()) {
    throw UsageError("missing PROGRAM; usage: ddprun [flags] PROGRAM [program args...]");
  }
  // An unknown flag before PROGRAM is parked by CLI11 in front of it.
  if (rest.front().size() > 1 && rest.front()[0] == '-') {
    std::string flag = rest.front().substr(0, rest.front().find('='));
    throw UsageError(fmt::format("unknown flag {} (ddprun's flags go before PROGRAM)", flag));
  }
  bool module = raw.flag("module");
  bool no_python = raw.flag("no_python");
  if (module && no_python) {
    throw UsageError("--module and --no-python cannot be used together (as in torchrun)");
  }
  c.program = rest.front();
  c.module = module;
  c.via_python = module || (!no_python && ends_with(c.program, ".py"));
  const std::string base = c.program.substr(c.program.find_last_of('/') + 1);
  c.python_worker = c.via_python || base.rfind("python", 0) == 0;
  c.worker_argv.clear();
  if (c.via_python) {
    c.worker_argv = {kPythonInterpreter, "-u"};
    if (module) c.worker_argv.push_back("-m");
  }
  c.worker_argv.insert(c.worker_argv.end(), rest.begin(), rest.end());
}

}  // namespace

int visible_gpus(int physical, const std::optional<std::string>& cuda_visible_devices) {
  if (!cuda_visible_devices) return physical;
  std::set<std::string> seen;
  int visible = 0;
  std::stringstream in(*cuda_visible_devices);
  for (std::string item; std::getline(in, item, ',');) {
    item.erase(0, item.find_first_not_of(" \t"));
    item.erase(item.find_last_not_of(" \t") + 1);
    bool valid = item.starts_with("GPU-") || item.starts_with("MIG-");
    if (!valid && !item.empty() && item.find_first_not_of("0123456789") == std::string::npos) {
      valid = item.size() < 6 && std::stoi(item) < physical;
    }
    if (!valid || !seen.insert(item).second) break;  // CUDA ignores the rest
    ++visible;
  }
  return visible;
}

namespace {

// In the child: the driver's count (it applies CUDA_VISIBLE_DEVICES itself), or -1 without a
// usable libcuda.so.1 (no NVIDIA driver on this host).
int driver_device_count_here() {
  void* lib = ::dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) return -1;
  using InitFn = int (*)(unsigned);
  using CountFn = int (*)(int*);
  auto init = reinterpret_cast<InitFn>(::dlsym(lib, "cuInit"));
  auto count = reinterpret_cast<CountFn>(::dlsym(lib, "cuDeviceGetCount"));
  if (init == nullptr || count == nullptr) return -1;
  const int rc = init(0);
  if (rc == 100) return 0;  // CUDA_ERROR_NO_DEVICE: a driver, no (visible) GPU
  int n = 0;
  return rc == 0 && count(&n) == 0 ? n : -1;
}

// driver_device_count_here() asked in a child process (fork, answer through a pipe, _exit),
// bounded: a driver that does not answer within kDriverWait counts as none.
std::optional<int> driver_device_count() {
  constexpr int kDriverWaitMs = 20000;
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0) return std::nullopt;
  const pid_t pid = ::fork();
  if (pid < 0) {
    ::close(fds[0]);
    ::close(fds[1]);
    return std::nullopt;
  }
  if (pid == 0) {
    ::close(fds[0]);
    const int n = driver_device_count_here();
    [[maybe_unused]] const ssize_t w = ::write(fds[1], &n, sizeof(n));
    ::_exit(0);
  }
  ::close(fds[1]);
  int n = -1;
  pollfd p{.fd = fds[0], .events = POLLIN, .revents = 0};
  if (::poll(&p, 1, kDriverWaitMs) == 1 && ::read(fds[0], &n, sizeof(n)) != sizeof(n)) n = -1;
  ::close(fds[0]);
  ::kill(pid, SIGKILL);  // done already, or stuck in the driver
  ::waitpid(pid, nullptr, 0);
  return n < 0 ? std::nullopt : std::optional<int>(n);
}

}  // namespace

HostInfo probe_host(const EnvMap& env) {
  HostInfo host;
  long cpus = sysconf(_SC_NPROCESSORS_ONLN);
  host.cpus = cpus > 0 ? static_cast<int>(cpus) : 1;
  const auto it = env.find("CUDA_VISIBLE_DEVICES");
  const std::optional<std::string> visible =
      it == env.end() ? std::nullopt : std::optional<std::string>(it->second);
  host.count_gpus = [visible] {
    if (std::optional<int> n = driver_device_count()) return *n;
    int physical = 0;
    std::error_code ec;
    for (const auto& entry : std::filesystem::directory_iterator("/proc/driver/nvidia/gpus", ec)) {
      (void)entry;
      ++physical;
    }
    return visible_gpus(physical, visible);
  };
  return host;
}

std::string help_text() {
  CLI::App app;
  configure_app(app);
  RawFlags raw(app);
  return app.help();
}

CommandLine parse_command_line(const std::vector<std::string>& args, const EnvMap& env,
                               const HostInfo& host) {
  CLI::App app;
  configure_app(app);
  RawFlags raw(app);
  CommandLine out;
  try {
    std::vector<std::string> reversed(args.rbegin(), args.rend());  // CLI11 pops from the back
    app.parse(reversed);
  } catch (const CLI::CallForHelp&) {
    out.help = true;
    out.help_text = app.help();
    return out;
  } catch (const CLI::ParseError& e) {
    throw UsageError(e.what());
  }
  raw.resolve(env);
  apply_topology(raw, host, out.config);
  apply_rendezvous(raw, out);
  apply_slurm(raw, env, out);
  apply_supervision(raw, out.config);
  apply_backend(raw, out.config);
  apply_output(raw, out.config);
  apply_program(raw, app.remaining(), out.config);
  // --ft across nodes: a fixed job on the built-in agent store, which node 0's ddprun hosts for
  // the whole run (the managers' coordination store). An elastic job's store can move, and the
  // quorums' records would not move with it; on etcd the workers' store is a worker's.
  if (out.config.ft && out.config.elastic) {
    throw UsageError(fmt::format(
        "--ft runs a fixed number of nodes for now (--nnodes is {}:{}): give --nnodes N with "
        "--node-rank, or drop --ft for the elastic rounds",
        out.config.min_nodes, out.config.nnodes));
  }
  if (out.config.ft && out.config.rdzv_backend == RdzvBackend::kEtcd) {
    throw UsageError(
        "--ft needs the built-in agent store (--rdzv-backend static or c10d), not etcd: the "
        "replicas' quorums are kept in a store that node 0's ddprun hosts");
  }
  if (out.config.ft && out.config.python_worker) {
    throw UsageError(
        "--ft needs workers built on ddp::ft::Manager (C++); a Python worker "
        "cannot reach ddprun's store");
  }
  if (raw.given("start_method")) {
    out.notes.push_back("--start-method is ignored: ddprun always fork+execs");
  }
  return out;
}

}  // namespace ddp::launcher
