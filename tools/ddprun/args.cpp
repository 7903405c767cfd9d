// ddprun's command line and the workers' environment (see args.h).
#include "args.h"

#include <unistd.h>  // sysconf

#include <algorithm>  // std::ranges::any_of
#include <cctype>     // std::toupper
#include <filesystem>
#include <system_error>

#include <CLI/CLI.hpp>  // option spellings, --help, stopping at PROGRAM
#include <fmt/format.h>

#include "base/parse.h"  // the number and switch readers the library's env contract uses

namespace ddp::launcher {
namespace {

// ---------------------------------------------------------------------------------------------
// Small parsers. `source` is how the value was given ("--nnodes" or "PET_NNODES"), so that the
// message points at the right place.

[[noreturn]] void bad_value(const std::string& source, const std::string& value,
                            const std::string& why) {
  throw UsageError(fmt::format("{}='{}': {}", source, value, why));
}

int parse_int(const std::string& source, const std::string& value, long long lo, long long hi,
              const std::string& expected) {
  auto v = parse::integer(value);
  if (!v || *v < lo || *v > hi) bad_value(source, value, "expected " + expected);
  return static_cast<int>(*v);
}

// Seconds as a decimal number; `allow_zero` for the grace period.
double parse_seconds(const std::string& source, const std::string& value, bool allow_zero) {
  auto s = parse::seconds(value, allow_zero);
  if (!s) {
    bad_value(source, value,
              allow_zero ? "expected a number of seconds >= 0, e.g. 10 or 0.5"
                         : "expected a number of seconds > 0, e.g. 30 or 0.5");
  }
  return *s;
}

bool parse_bool(const std::string& source, const std::string& value) {
  auto b = parse::boolean(value);
  if (!b) bad_value(source, value, "expected 1/0 or true/false");
  return *b;
}

std::vector<std::string> split(const std::string& text, char sep) {
  std::vector<std::string> parts;
  std::string::size_type start = 0;
  while (true) {
    auto pos = text.find(sep, start);
    parts.push_back(text.substr(start, pos - start));
    if (pos == std::string::npos) return parts;
    start = pos + 1;
  }
}

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() &&
         s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// --nproc-per-node: N, or what the host has.
int parse_nproc(const std::string& source, const std::string& value, const HostInfo& host) {
  if (value == "cpu") return host.cpus;
  if (value == "auto") return host.gpus > 0 ? host.gpus : host.cpus;
  if (value == "gpu") {
    if (host.gpus == 0) {
      bad_value(source, value,
                "no NVIDIA GPU found (/proc/driver/nvidia/gpus is empty or missing); give a "
                "number of processes or 'cpu'");
    }
    return host.gpus;
  }
  if (value == "xpu") {
    bad_value(source, value, "XPU devices are not supported; use N, auto, cpu or gpu");
  }
  return parse_int(source, value, 1, 1 << 16, "a number of processes >= 1, or auto, cpu or gpu");
}

// --nnodes: N or MIN:MAX with MIN == MAX.
int parse_nnodes(const std::string& source, const std::string& value) {
  auto colon = value.find(':');
  if (colon == std::string::npos) {
    return parse_int(source, value, 1, 1 << 20, "a number of nodes >= 1");
  }
  auto lo = parse::integer(value.substr(0, colon));
  auto hi = parse::integer(value.substr(colon + 1));
  if (!lo || !hi || *lo < 1 || *hi < 1 || *lo > (1 << 20) || *hi > (1 << 20)) {
    bad_value(source, value, "expected N or MIN:MAX with numbers >= 1");
  }
  if (*lo != *hi) {
    bad_value(source, value,
              fmt::format("elastic ranges (MIN:MAX) are not supported yet; use a fixed number of "
                          "nodes, e.g. --nnodes {}",
                          *hi));
  }
  return static_cast<int>(*lo);
}

// --rdzv-conf k=v,k2=v2
std::map<std::string, std::string> parse_rdzv_conf(const std::string& source,
                                                   const std::string& value) {
  std::map<std::string, std::string> conf;
  if (value.empty()) return conf;
  for (const std::string& item : split(value, ',')) {
    auto eq = item.find('=');
    if (eq == std::string::npos || eq == 0) {
      bad_value(source, value, fmt::format("'{}' is not key=value; expected k=v,k2=v2", item));
    }
    conf[item.substr(0, eq)] = item.substr(eq + 1);
  }
  return conf;
}

// --local-ranks-filter 0,1
std::set<int> parse_rank_list(const std::string& source, const std::string& value, int nproc) {
  std::set<int> ranks;
  for (const std::string& item : split(value, ',')) {
    auto r = parse::integer(item);
    if (!r || *r < 0) {
      bad_value(source, value, "expected a comma-separated list of local ranks, e.g. 0,1");
    }
    if (*r >= nproc) {
      bad_value(source, value,
                fmt::format("there is no local rank {} with --nproc-per-node {}", *r, nproc));
    }
    ranks.insert(static_cast<int>(*r));
  }
  return ranks;
}

// ---------------------------------------------------------------------------------------------
// The flags. Each is registered with CLI11 under both spellings and bound to a raw string;
// conversion and validation happen afterwards, in one place, with the PET_* fallback applied.

struct FlagDef {
  const char* dest;     // torchrun's argparse dest: nproc_per_node
  const char* short_name;  // "" or "r"
  const char* metavar;  // "" for boolean flags
  const char* group;
  const char* help;  // ends with the default
};

constexpr const char* kTopology = "Topology";
constexpr const char* kRendezvous = "Rendezvous";
constexpr const char* kSupervision = "Supervision";
constexpr const char* kOutput = "Output";
constexpr const char* kProgram = "Program";
constexpr const char* kExtensions = "ddprun extensions (not in torchrun)";

// Every flag ddprun accepts. The help text is generated from this table.
constexpr FlagDef kFlags[] = {
    {"nproc_per_node", "", "N|auto|cpu|gpu", kTopology,
     "Workers on this node. cpu: one per online CPU; gpu: one per NVIDIA GPU; auto: gpu if "
     "there are GPUs, else cpu. [default: 1]"},
    {"nnodes", "", "N", kTopology,
     "Number of nodes. MIN:MAX is accepted only with MIN == MAX (no elastic ranges yet). "
     "[default: 1]"},
    {"node_rank", "", "K", kTopology,
     "This node's rank in [0, nnodes); worker RANK = K * nproc_per_node + LOCAL_RANK. "
     "[default: 0]"},
    {"master_addr", "", "ADDR", kTopology,
     "Address of the node whose local rank 0 (global rank 0) hosts the store. "
     "[default: 127.0.0.1]"},
    {"master_port", "", "PORT", kTopology,
     "Port of that store; 0 picks a free one (single node only). [default: 29500]"},
    {"standalone", "", "", kRendezvous,
     "Single-node job: free port on 127.0.0.1, random run id; rdzv flags are ignored. "
     "[default: off]"},
    {"rdzv_backend", "", "static|c10d", kRendezvous,
     "static: MASTER_ADDR/PORT and --node-rank; c10d: the store at --rdzv-endpoint (node "
     "ranks must still be given). [default: static]"},
    {"rdzv_endpoint", "", "HOST[:PORT]", kRendezvous,
     "Store address; wins over --master-addr/--master-port. PORT defaults to 29400; 0 picks "
     "a free one. [default: none]"},
    {"rdzv_id", "", "ID", kRendezvous,
     "Run id shared by all nodes (TORCHELASTIC_RUN_ID, log dir name). [default: none]"},
    {"rdzv_conf", "", "K=V,...", kRendezvous,
     "Rendezvous options; join_timeout (or timeout) sets the rendezvous timeout in seconds, "
     "other keys are accepted and ignored. [default: none]"},
    {"role", "", "NAME", kRendezvous, "Worker role (ROLE_NAME). [default: default]"},
    {"max_restarts", "", "N", kSupervision,
     "On a failure, stop the whole group and start it again, at most N times; "
     "TORCHELASTIC_RESTART_COUNT counts them. [default: 0]"},
    {"monitor_interval", "", "SECONDS", kSupervision,
     "Longest wait between checks of the workers (exits are seen at once anyway). "
     "[default: 0.1]"},
    {"start_method", "", "spawn|fork|forkserver", kSupervision,
     "Accepted for torchrun compatibility and ignored: ddprun always fork+execs. "
     "[default: spawn]"},
    {"log_dir", "", "DIR", kOutput,
     "Per-run directory DIR/<run_id>_<random>/attempt_<k>/<local_rank>/ for stdout.log, "
     "stderr.log and error.json. [default: a temporary directory]"},
    {"redirects", "r", "0-3|LR:S,...", kOutput,
     "Send streams to the log files only: 1=stdout, 2=stderr, 3=both, 0=none; per local "
     "rank as 0:1,1:2. [default: 0]"},
    {"tee", "t", "0-3|LR:S,...", kOutput,
     "Show streams on the console and also write them to the log files; same values as "
     "--redirects. [default: 0]"},
    {"local_ranks_filter", "", "LR,...", kOutput,
     "Show only these local ranks' output on the console (log files are still written). "
     "[default: all]"},
    {"no_python", "", "", kProgram,
     "Run PROGRAM as an executable even if it ends in .py. [default: off]"},
    {"module", "m", "", kProgram,
     "Run 'python3 -u -m PROGRAM' (PROGRAM is a Python module). [default: off]"},
    {"rdzv_timeout", "", "SECONDS", kExtensions,
     "Rendezvous timeout given to the workers as DDP_RDZV_TIMEOUT. [default: the library's]"},
    {"collective_timeout", "", "SECONDS", kExtensions,
     "Collective timeout given to the workers as DDP_COLLECTIVE_TIMEOUT. "
     "[default: the library's]"},
    {"backend", "", "gloo|shm|nccl|auto", kExtensions,
     "Collective backend of the workers' process groups, given to them as DDP_BACKEND. auto: "
     "shared memory (shm) for CPU tensors when every rank is on one host, NCCL for CUDA, else "
     "Gloo. [default: the library's (auto)]"},
    {"grace_period", "", "SECONDS", kExtensions,
     "Time a worker gets between SIGTERM and SIGKILL when the group is stopped. "
     "[default: 10]"},
};

constexpr const char* kDescription =
    "ddprun: start PROGRAM once per worker, like torchrun, and supervise the group.\n"
    "Usage: ddprun [flags] PROGRAM [program args...]\n"
    "Everything from PROGRAM on is passed to PROGRAM untouched. A PROGRAM ending in .py (or\n"
    "with -m) runs with python3 -u; anything else is executed directly.";

constexpr const char* kFooter =
    "Every flag has a dash and an underscore spelling (--nproc-per-node, --nproc_per_node) and "
    "can also be set\nwith PET_<FLAG_IN_CAPITALS> (PET_NPROC_PER_NODE=2); the command line "
    "wins.\n\n"
    "Each worker gets the torchrun environment: RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,\n"
    "GROUP_RANK, GROUP_WORLD_SIZE, ROLE_RANK, ROLE_NAME, ROLE_WORLD_SIZE, MASTER_ADDR, "
    "MASTER_PORT,\nTORCHELASTIC_RESTART_COUNT, TORCHELASTIC_MAX_RESTARTS, TORCHELASTIC_RUN_ID,\n"
    "TORCHELASTIC_USE_AGENT_STORE=False (global rank 0 hosts the store), TORCHELASTIC_ERROR_FILE;"
    "\nOMP_NUM_THREADS=1 when unset and nproc-per-node > 1; (TORCH_)NCCL_ASYNC_ERROR_HANDLING=1 "
    "when unset;\nDDP_STORE_SECRET, the secret the rendezvous store requires: the one ddprun "
    "inherited, else a\nrandom one per job when --nnodes is 1 (with several nodes, export the "
    "same one on each).\n\n"
    "Output lines are prefixed '[rank N]: '. On the first worker failure ddprun stops the others "
    "(SIGTERM,\nthen SIGKILL after --grace-period), prints the root cause and exits 1 (or "
    "restarts the group).\nSIGINT/SIGTERM/SIGHUP/SIGQUIT are forwarded to the workers; ddprun then "
    "ends with the same signal.\n\n"
    "Exit codes: 0 all workers succeeded; 1 the group failed; 2 bad command line; 126/127 "
    "PROGRAM\ncannot be executed / not found; 128+N (or death by signal N) ddprun was stopped "
    "by signal N.";

std::string long_name(const FlagDef& f, char sep) {
  std::string s = f.dest;
  std::replace(s.begin(), s.end(), '_', sep);
  return "--" + s;
}

std::string env_name(const FlagDef& f) {
  std::string s = "PET_";
  for (const char* c = f.dest; *c != '\0'; ++c) s += static_cast<char>(std::toupper(*c));
  return s;
}

// The flags' raw values, after the command line and the PET_* fallback.
class RawFlags {
 public:
  struct Value {
    std::string text;
    std::string source;  // "--nproc-per-node" or "PET_NPROC_PER_NODE"
  };

  // Registers every flag of kFlags with `app`.
  explicit RawFlags(CLI::App& app) {
    for (const FlagDef& f : kFlags) {
      std::string names = long_name(f, '-');
      if (long_name(f, '_') != names) names += "," + long_name(f, '_');
      if (f.short_name[0] != '\0') names = std::string("-") + f.short_name + "," + names;
      CLI::Option* opt = nullptr;
      if (f.metavar[0] == '\0') {
        opt = app.add_flag(names, f.help);
      } else {
        opt = app.add_option(names, cli_values_[f.dest], f.help)->option_text(f.metavar);
        opt->type_name(f.metavar);  // CLI11's own errors: "--nnodes: 1 required N missing"
      }
      opt->group(f.group);
      options_[f.dest] = opt;
    }
  }

  // Applies the PET_* fallback to every flag the command line did not give.
  void resolve(const EnvMap& env) {
    for (const FlagDef& f : kFlags) {
      if (options_.at(f.dest)->count() > 0) {
        std::string text = f.metavar[0] == '\0' ? "1" : cli_values_[f.dest];
        values_[f.dest] = Value{text, long_name(f, '-')};
      } else if (auto it = env.find(env_name(f)); it != env.end()) {
        values_[f.dest] = Value{it->second, env_name(f)};
      }
    }
  }

  const Value* get(const std::string& dest) const {
    auto it = values_.find(dest);
    return it == values_.end() ? nullptr : &it->second;
  }
  bool given(const std::string& dest) const { return get(dest) != nullptr; }
  bool flag(const std::string& dest) const {
    const Value* v = get(dest);
    return v != nullptr && parse_bool(v->source, v->text);
  }

 private:
  std::map<std::string, CLI::Option*> options_;
  std::map<std::string, std::string> cli_values_;  // what CLI11 stored
  std::map<std::string, Value> values_;            // given flags only
};

// CLI11's layout, with descriptions wrapped under their column and the usage line in the
// description.
class HelpFormatter : public CLI::Formatter {
 public:
  static constexpr std::size_t kNameColumn = 34;
  static constexpr std::size_t kWidth = 100;

  std::string make_usage(const CLI::App*, std::string) const override { return "\n"; }

  std::string make_option(const CLI::Option* opt, bool is_positional) const override {
    std::string left = "  " + make_option_name(opt, is_positional) + make_option_opts(opt);
    std::string out = left;
    std::size_t col = left.size();
    if (col + 1 >= kNameColumn) {  // name too long: the description starts on the next line
      out += "\n";
      col = 0;
    }
    bool first_word = true;
    for (const std::string& word : split(make_option_desc(opt), ' ')) {
      if (col < kNameColumn || (!first_word && col + 1 + word.size() > kWidth)) {
        if (col >= kNameColumn) out += "\n", col = 0;
        out.append(kNameColumn - col, ' ');
        col = kNameColumn;
        first_word = true;
      }
      if (!first_word) out += ' ', ++col;
      out += word;
      col += word.size();
      first_word = false;
    }
    return out + "\n";
  }
};

void configure_app(CLI::App& app) {
  app.name("ddprun");
  app.description(kDescription);
  app.footer(kFooter);
  app.prefix_command();  // stop at PROGRAM; it and its args land in remaining()
  app.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);  // as argparse
  app.formatter(std::make_shared<HelpFormatter>());
  app.set_help_flag("-h,--help", "Print this help and exit.");
}

// ---------------------------------------------------------------------------------------------
// From raw flags to a LaunchConfig, one concern at a time.

void apply_topology(const RawFlags& raw, const HostInfo& host, LaunchConfig& c) {
  if (auto* v = raw.get("nproc_per_node")) c.nproc_per_node = parse_nproc(v->source, v->text, host);
  if (auto* v = raw.get("nnodes")) c.nnodes = parse_nnodes(v->source, v->text);
  if (auto* v = raw.get("node_rank")) {
    c.node_rank = parse_int(v->source, v->text, 0, 1 << 20, "a node rank >= 0");
    if (c.node_rank >= c.nnodes) {
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

void apply_rendezvous(const RawFlags& raw, CommandLine& out) {
  LaunchConfig& c = out.config;
  if (auto* v = raw.get("rdzv_backend")) {
    if (v->text == "c10d") {
      c.rdzv_backend = RdzvBackend::kC10d;
    } else if (v->text != "static") {
      bad_value(v->source, v->text, "expected static or c10d (etcd backends are not supported)");
    }
  }
  if (auto* v = raw.get("rdzv_id")) c.run_id = v->text.empty() ? kDefaultRunId : v->text;
  if (auto* v = raw.get("role")) c.role = v->text.empty() ? kDefaultRole : v->text;
  if (auto* v = raw.get("rdzv_conf")) {
    c.rdzv_conf = parse_rdzv_conf(v->source, v->text);
    for (const char* key : {"timeout", "join_timeout"}) {  // join_timeout wins: applied last
      if (auto it = c.rdzv_conf.find(key); it != c.rdzv_conf.end()) {
        c.rdzv_timeout_s = parse_seconds(v->source + " " + key, it->second, false);
      }
    }
  }

  if (raw.flag("standalone")) {
    if (c.nnodes != 1) {
      throw UsageError(fmt::format("--standalone runs a single node, but --nnodes is {}; drop "
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
    return;
  }

  if (auto* v = raw.get("rdzv_endpoint"); v != nullptr && !v->text.empty()) {
    Endpoint e = parse_endpoint(v->source, v->text);
    c.master_addr = e.host;
    c.master_port = e.port;
  }
  if (c.rdzv_backend == RdzvBackend::kC10d && c.nnodes > 1 && !raw.given("node_rank")) {
    throw UsageError(fmt::format(
        "--rdzv-backend c10d with --nnodes {}: dynamic node ranks are not supported yet; give "
        "each node its --node-rank (0 to {})",
        c.nnodes, c.nnodes - 1));
  }
  if (c.master_port == 0) {
    if (c.nnodes > 1) {
      throw UsageError(fmt::format("port 0 (pick a free port) only works on a single node; "
                                   "with --nnodes {} every node must be given the same port",
                                   c.nnodes));
    }
    c.pick_free_port = true;
  }
}

void apply_supervision(const RawFlags& raw, LaunchConfig& c) {
  if (auto* v = raw.get("max_restarts")) {
    c.max_restarts = parse_int(v->source, v->text, 0, 1 << 20, "a number of restarts >= 0");
  }
  if (auto* v = raw.get("monitor_interval")) {
    c.monitor_interval_s = parse_seconds(v->source, v->text, false);
  }
  if (auto* v = raw.get("grace_period")) c.grace_period_s = parse_seconds(v->source, v->text, true);
  if (auto* v = raw.get("rdzv_timeout")) {
    c.rdzv_timeout_s = parse_seconds(v->source, v->text, false);
  }
  if (auto* v = raw.get("collective_timeout")) {
    c.collective_timeout_s = parse_seconds(v->source, v->text, false);
  }
  if (auto* v = raw.get("start_method")) {
    if (v->text != "spawn" && v->text != "fork" && v->text != "forkserver") {
      bad_value(v->source, v->text, "expected spawn, fork or forkserver (ignored by ddprun)");
    }
  }
}

// --backend: checked here so a typo stops the launch instead of failing in every worker.
void apply_backend(const RawFlags& raw, LaunchConfig& c) {
  if (auto* v = raw.get("backend")) {
    if (v->text != "gloo" && v->text != "shm" && v->text != "nccl" && v->text != "auto") {
      bad_value(v->source, v->text, "expected gloo, shm, nccl or auto");
    }
    c.backend = v->text;
  }
}

void check_ranks_exist(const std::string& source, const std::string& text, const StdSpec& spec,
                       int nproc) {
  for (const auto& [rank, streams] : spec.by_local_rank) {
    if (rank >= nproc) {
      bad_value(source, text, fmt::format("there is no local rank {} with --nproc-per-node {}",
                                          rank, nproc));
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
  c.worker_argv.clear();
  if (c.via_python) {
    c.worker_argv = {kPythonInterpreter, "-u"};
    if (module) c.worker_argv.push_back("-m");
  }
  c.worker_argv.insert(c.worker_argv.end(), rest.begin(), rest.end());
}

// Note [Worker environment]
// torchrun's contract (run.py docstring; local_elastic_agent_test.py _check_env_function), with
// one deliberate difference: TORCHELASTIC_USE_AGENT_STORE=False, because ddprun hosts no store;
// the worker with global rank 0 does (ddp-cpp, and PyTorch's env:// init, both handle that).
// Knobs the user set win where torchrun lets them (OMP_NUM_THREADS, NCCL error handling).
void set_default(EnvMap& env, const std::string& key, const std::string& value) {
  if (env.find(key) == env.end()) env[key] = value;
}

}  // namespace

// ---------------------------------------------------------------------------------------------

Std StdSpec::for_local_rank(int local_rank) const {
  if (by_local_rank.empty()) return all;
  auto it = by_local_rank.find(local_rank);
  return it == by_local_rank.end() ? Std::kNone : it->second;
}

bool StdSpec::any() const {
  if (all != Std::kNone) return true;
  return std::ranges::any_of(by_local_rank, [](const auto& kv) { return kv.second != Std::kNone; });
}

bool LaunchConfig::shows_on_console(int local_rank, Std stream) const {
  if (local_ranks_filter && local_ranks_filter->count(local_rank) == 0) return false;
  if (has(tee.for_local_rank(local_rank), stream)) return true;
  return !has(redirects.for_local_rank(local_rank), stream);
}

bool LaunchConfig::writes_to_file(int local_rank, Std stream) const {
  return has(tee.for_local_rank(local_rank), stream) ||
         has(redirects.for_local_rank(local_rank), stream);
}

HostInfo probe_host() {
  HostInfo host;
  long cpus = sysconf(_SC_NPROCESSORS_ONLN);
  host.cpus = cpus > 0 ? static_cast<int>(cpus) : 1;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator("/proc/driver/nvidia/gpus", ec)) {
    (void)entry;
    ++host.gpus;
  }
  return host;
}

StdSpec parse_std_spec(const std::string& flag, const std::string& value) {
  const std::string expected =
      "expected 0-3 (1=stdout, 2=stderr, 3=both) for every rank, or LOCAL_RANK:0-3 pairs such "
      "as 0:1,1:2";
  StdSpec spec;
  if (value.find(':') == std::string::npos) {
    spec.all = static_cast<Std>(parse_int(flag, value, 0, 3, expected));
    return spec;
  }
  for (const std::string& item : split(value, ',')) {
    auto colon = item.find(':');
    if (colon == std::string::npos) bad_value(flag, value, expected);
    auto rank = parse::integer(item.substr(0, colon));
    auto streams = parse::integer(item.substr(colon + 1));
    if (!rank || *rank < 0 || *rank > (1 << 16) || !streams || *streams < 0 || *streams > 3) {
      bad_value(flag, value, expected);
    }
    spec.by_local_rank[static_cast<int>(*rank)] = static_cast<Std>(*streams);
  }
  return spec;
}

Endpoint parse_endpoint(const std::string& flag, const std::string& value) {
  Endpoint e;
  std::string port_text;
  bool has_port = false;
  if (!value.empty() && value.front() == '[') {  // [v6addr] or [v6addr]:port
    auto close = value.find(']');
    if (close == std::string::npos) bad_value(flag, value, "missing ']' after an IPv6 address");
    e.host = value.substr(1, close - 1);
    if (close + 1 < value.size()) {
      if (value[close + 1] != ':') bad_value(flag, value, "expected [ADDRESS]:PORT");
      port_text = value.substr(close + 2);
      has_port = true;
    }
  } else if (auto colon = value.rfind(':'); colon != std::string::npos) {
    if (value.find(':') != colon) {
      bad_value(flag, value, "an IPv6 address needs brackets: [ADDRESS]:PORT");
    }
    e.host = value.substr(0, colon);
    port_text = value.substr(colon + 1);
    has_port = true;
  } else {
    e.host = value;
  }
  if (e.host.empty()) bad_value(flag, value, "missing host; expected HOST[:PORT]");
  if (has_port) {
    auto port = parse::integer(port_text);
    if (!port || *port < 0 || *port > 65535) {
      bad_value(flag, value,
                fmt::format("'{}' is not a port number; expected HOST[:PORT] with PORT in [0, "
                            "65535]",
                            port_text));
    }
    e.port = static_cast<int>(*port);
  }
  return e;
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
  apply_supervision(raw, out.config);
  apply_backend(raw, out.config);
  apply_output(raw, out.config);
  apply_program(raw, app.remaining(), out.config);
  if (raw.given("start_method")) {
    out.notes.push_back("--start-method is ignored: ddprun always fork+execs");
  }
  return out;
}

EnvMap worker_environment(const LaunchConfig& config, const GroupSpec& group, int local_rank,
                          const std::string& error_file, const EnvMap& base) {
  EnvMap env = base;
  const std::string rank = std::to_string(config.global_rank(local_rank));
  const std::string world = std::to_string(config.world_size());
  env["LOCAL_RANK"] = std::to_string(local_rank);
  env["RANK"] = rank;
  env["GROUP_RANK"] = std::to_string(config.node_rank);
  env["ROLE_RANK"] = rank;
  env["ROLE_NAME"] = config.role;
  env["LOCAL_WORLD_SIZE"] = std::to_string(config.nproc_per_node);
  env["WORLD_SIZE"] = world;
  env["GROUP_WORLD_SIZE"] = std::to_string(config.nnodes);
  env["ROLE_WORLD_SIZE"] = world;
  env["MASTER_ADDR"] = group.master_addr;
  env["MASTER_PORT"] = std::to_string(group.master_port);
  env["TORCHELASTIC_RESTART_COUNT"] = std::to_string(group.restart_count);
  env["TORCHELASTIC_MAX_RESTARTS"] = std::to_string(config.max_restarts);
  env["TORCHELASTIC_RUN_ID"] = group.run_id;
  env["TORCHELASTIC_USE_AGENT_STORE"] = "False";
  env["TORCHELASTIC_ERROR_FILE"] = error_file;
  if (!group.store_secret.empty()) env["DDP_STORE_SECRET"] = group.store_secret;
  if (config.rdzv_timeout_s) env["DDP_RDZV_TIMEOUT"] = fmt::format("{}", *config.rdzv_timeout_s);
  if (config.collective_timeout_s) {
    env["DDP_COLLECTIVE_TIMEOUT"] = fmt::format("{}", *config.collective_timeout_s);
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
