// ddprun's flag table, its help layout and the raw flag values (see flags.h).
#include "flags.h"

#include <algorithm>  // std::replace
#include <cctype>     // std::toupper

#include "values.h"

namespace ddp::launcher {
namespace {

// The flags. Each is registered with CLI11 under both spellings and bound to a raw string;
// conversion and validation happen afterwards, in one place, with the PET_* fallback applied.

struct FlagDef {
  const char* dest;        // torchrun's argparse dest: nproc_per_node
  const char* short_name;  // "" or "r"
  const char* metavar;     // "" for boolean flags
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
    {"nnodes", "", "N|MIN:MAX", kTopology,
     "Number of nodes. MIN:MAX (with --rdzv-backend c10d): an elastic job, which runs on "
     "whichever nodes are present, MIN to MAX, re-forming when one leaves or arrives. A round "
     "needs a majority of the last round's nodes (those that left with SIGTERM not counted), "
     "so that a job cut in two never trains twice: 3 nodes survive the loss of 1, 5 of 2, and 2 "
     "of none (the side without a majority waits, then fails at the join timeout). "
     "[default: 1]"},
    {"node_rank", "", "K", kTopology,
     "This node's rank in [0, nnodes); worker RANK = K * nproc_per_node + LOCAL_RANK. Not "
     "needed with c10d (given out at each round). [default: 0]"},
    {"master_addr", "", "ADDR", kTopology,
     "Address of the node whose local rank 0 (global rank 0) hosts the store. "
     "[default: 127.0.0.1]"},
    {"master_port", "", "PORT", kTopology,
     "Port of that store; 0 picks a free one (single node only). [default: 29500]"},
    {"standalone", "", "", kRendezvous,
     "Single-node job: free port on 127.0.0.1, random run id; rdzv flags are ignored. "
     "[default: off]"},
    {"rdzv_backend", "", "static|c10d|etcd", kRendezvous,
     "static: MASTER_ADDR/PORT and --node-rank; c10d: the store at --rdzv-endpoint, hosted by "
     "the ddprun on that host; etcd (or etcd-v2): the rounds kept in the etcd cluster at "
     "--rdzv-endpoint, hosted by no node. c10d and etcd give node ranks out at each round "
     "unless --node-rank is given. [default: static]"},
    {"rdzv_endpoint", "", "HOST[:PORT]", kRendezvous,
     "Store address; wins over --master-addr/--master-port. PORT defaults to 29400; 0 picks "
     "a free one. etcd: the cluster's members, HOST[:PORT],... (PORT 2379). [default: none]"},
    {"rdzv_id", "", "ID", kRendezvous,
     "Run id shared by all nodes (TORCHELASTIC_RUN_ID, log dir name). [default: none]"},
    {"rdzv_conf", "", "K=V,...", kRendezvous,
     "Rendezvous options: join_timeout (or timeout): the rendezvous timeout in seconds; "
     "last_call_timeout: how long an elastic job's first round waits for more nodes once MIN "
     "are in [30] (a later round closes once the last round's live nodes are in); etcd: "
     "protocol=https, cacert, cert, key (PEM files), user=NAME:PASSWORD or user=NAME with "
     "password_file=PATH; other keys are accepted and ignored. [default: none]"},
    {"role", "", "NAME", kRendezvous, "Worker role (ROLE_NAME). [default: default]"},
    {"max_restarts", "", "N", kSupervision,
     "On a failure, stop the whole group and start it again, at most N times; "
     "TORCHELASTIC_RESTART_COUNT counts them. With several nodes every node restarts in the "
     "same round, and a node whose ddprun is started again rejoins. Elastic jobs count "
     "failures only, not nodes leaving or joining. [default: 0]"},
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
     "Rendezvous timeout given to the workers as DDP_RDZV_TIMEOUT; with several nodes also how "
     "long ddprun waits for the other nodes to join a round. [default: the library's, 300]"},
    {"collective_timeout", "", "SECONDS", kExtensions,
     "Collective timeout given to the workers as DDP_COLLECTIVE_TIMEOUT. "
     "[default: the library's]"},
    {"backend", "", "gloo|shm|shm+gloo|nccl|auto|tuned|cpu:X,cuda:Y", kExtensions,
     "Collective backend of the workers' process groups, given to them as DDP_BACKEND. auto: "
     "shared memory (shm) for CPU tensors when every rank is on one host, NCCL for CUDA, "
     "shm+gloo (shm inside hosts, Gloo between) with the same number of ranks on every host, "
     "else Gloo. tuned: auto, with shm+gloo's large all_reduces over flat Gloo where that "
     "measures faster as the group forms (not reproducible bit for bit). cpu:X,cuda:Y: a "
     "backend per device type, as PyTorch's cpu:gloo,cuda:nccl. "
     "[default: the library's (auto)]"},
    {"grace_period", "", "SECONDS", kExtensions,
     "Time a worker gets between SIGTERM and SIGKILL when the group is stopped. "
     "[default: 10]"},
    {"ft", "", "", kExtensions,
     "Per-step fault tolerance, one node: ddprun hosts the workers' store, and a worker that "
     "fails is started again alone, at most --max-restarts times in all, while the others go on "
     "(workers built on ddp::ft::Manager re-form without it and heal it when it is back). "
     "[default: off]"},
    {"cpu_bind", "", "none|cores|numa", kExtensions,
     "Pin each worker to its share of ddprun's CPUs: cores, a block of whole physical cores; "
     "numa, the CPUs of one NUMA node (workers spread over the nodes). OMP_NUM_THREADS, unless "
     "exported, is then the CPUs the worker has. [default: none]"},
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
    "TORCHELASTIC_USE_AGENT_STORE (False: global rank 0 hosts the store; with several nodes\n"
    "True and DDP_AGENT_STORE=ddp: node 0's ddprun hosts it), TORCHELASTIC_ERROR_FILE;"
    "\nOMP_NUM_THREADS=1 when unset and nproc-per-node > 1; (TORCH_)NCCL_ASYNC_ERROR_HANDLING=1 "
    "when unset;\nOPENBLAS_CORETYPE, OMP_WAIT_POLICY, OPENBLAS_THREAD_TIMEOUT (each where unset) "
    "when ddp::ensure_fast_blas\nwould re-execute the worker to set them (the CPU's best OpenBLAS "
    "core; idle threads that sleep);\nDDP_STORE_SECRET, the secret the rendezvous store requires: "
    "the one ddprun "
    "inherited, else a\nrandom one per job when --nnodes is 1 (with several nodes, export the "
    "same one on each);\nDDP_RUN_LINEAGE, which instance of the job the workers belong to "
    "(with the round, it decides\nwhich group may write into a run folder: ddp-train's "
    "run.lease).\n\n"
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

}  // namespace

RawFlags::RawFlags(CLI::App& app) {
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

void RawFlags::resolve(const EnvMap& env) {
  for (const FlagDef& f : kFlags) {
    if (options_.at(f.dest)->count() > 0) {
      std::string text = f.metavar[0] == '\0' ? "1" : cli_values_[f.dest];
      values_[f.dest] = Value{text, long_name(f, '-')};
    } else if (auto it = env.find(env_name(f)); it != env.end()) {
      values_[f.dest] = Value{it->second, env_name(f)};
    }
  }
}

bool RawFlags::flag(const std::string& dest) const {
  const Value* v = get(dest);
  return v != nullptr && parse_bool(v->source, v->text);
}

void configure_app(CLI::App& app) {
  app.name("ddprun");
  app.description(kDescription);
  app.footer(kFooter);
  app.prefix_command();  // stop at PROGRAM; it and its args land in remaining()
  app.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);  // as argparse
  app.formatter(std::make_shared<HelpFormatter>());
  app.set_help_flag("-h,--help", "Print this help and exit.");
}

}  // namespace ddp::launcher
