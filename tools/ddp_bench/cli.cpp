// ddp-bench's command line (see cli.h).
#include "cli.h"

#include <unistd.h>  // sysconf

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include "comm_hook_flag.h"
#include "ddp/error.h"
#include "models.h"
#include "pattern.h"
#include "sweep.h"

namespace ddp::bench {
namespace {

constexpr const char* kDescription =
    "ddp-bench: measure collectives and training throughput, nccl-tests style.\n"
    "Run alone (world size 1) or as N ranks: ddprun --standalone --nproc-per-node N ddp-bench "
    "...";

void add_collectives(CLI::App& app, CollectivesOptions& c, std::string& backends, std::string& ops,
                     std::string& dtypes, std::string& min_bytes, std::string& max_bytes,
                     std::string& ring) {
  auto* sub = app.add_subcommand(
      "collectives",
      "Sweep sizes (doubling) for each collective and backend; verify every result; report "
      "time, algbw and busbw per size; table on rank 0, CSV and PNG on request.");
  sub->add_option("--backend", backends,
                  "backends to measure, comma-separated: gloo, shm (ordinary tensors, staged "
                  "through the segment), shm-inplace (tensors from ProcessGroup::comm_buffer, "
                  "reduced in place as DDP's buckets are), shm+gloo, auto, tuned (across "
                  "hosts: the hierarchy with its measured route), nccl; each forms its own "
                  "group; one that cannot is reported unavailable and skipped");
  sub->add_option("--ops", ops,
                  "collectives, comma-separated: all_reduce, broadcast, all_gather, "
                  "reduce_scatter, sendrecv (each rank to the next: send and recv)");
  sub->add_option("--dtype", dtypes,
                  "element types, comma-separated: float32, float64, bfloat16, float16, int32, "
                  "int64");
  sub->add_option("--min-bytes", min_bytes, "smallest size (K, M, G suffixes: binary)");
  sub->add_option("--max-bytes", max_bytes, "largest size");
  sub->add_option("--iters", c.iters, "timed iterations per size")->check(CLI::PositiveNumber);
  sub->add_option("--warmup", c.warmup, "untimed iterations before them")
      ->check(CLI::NonNegativeNumber);
  sub->add_option("--ring-bytes", ring,
                  "buffers cycled through per size (more than the last-level cache)");
  sub->add_option("--csv", c.csv, "write every row to this CSV file (rank 0)");
  sub->add_option("--png", c.png, "plot busbw against size with gnuplot (rank 0)");
}

void add_train(CLI::App& app, TrainOptions& t) {
  auto* sub = app.add_subcommand(
      "train",
      "Throughput of a model at this world size with the per-step breakdown (data, forward, "
      "backward compute, exposed communication, optimizer); --compare adds 1 process x 1 "
      "thread and x N threads, and N ranks training without communication (the ceiling).");
  sub->add_option("--model", t.model,
                  "classic-cnn | mlp-1024 (the PyTorch comparison models) | cnn | mlp | resnet "
                  "| mlp-large (ddp-train's)")
      ->check(CLI::IsMember(tools::model_names()));
  sub->add_option("--batch-size", t.global_batch, "global batch, split evenly over the ranks")
      ->check(CLI::PositiveNumber);
  sub->add_option("--steps", t.steps, "timed steps")->check(CLI::PositiveNumber);
  sub->add_option("--warmup", t.warmup, "untimed steps before them")->check(CLI::NonNegativeNumber);
  sub->add_option("--backend", t.backend,
                  "process group backend: gloo | shm | shm+gloo | nccl | auto | tuned "
                  "(default: DDP_BACKEND, else auto)");
  sub->add_option("--device", t.device,
                  "auto (cuda:LOCAL_RANK when CUDA is available, as ddp-train) | cpu | cuda; "
                  "on a GPU machine the auto backend pairs NCCL with the CPU's choice and binds "
                  "a GPU per rank, so CPU training there with more ranks than GPUs needs "
                  "--backend shm or gloo")
      ->check(CLI::IsMember({"auto", "cpu", "cuda"}));
  sub->add_option("--threads", t.threads,
                  "intra-op threads per rank (0: OMP_NUM_THREADS, else cores / local ranks)")
      ->check(CLI::Range(0, 1024));
  sub->add_option("--workers", t.workers,
                  "data loader threads per rank (0: in the training "
                  "thread)")
      ->check(CLI::Range(0, 256));
  sub->add_option("--data-dir", t.data_dir,
                  "Fashion-MNIST folder (default: Debian's dataset-fashion-mnist)");
  sub->add_option("--seed", t.seed, "seed for initialisation, shuffling and dropout");
  sub->add_option("--lr", t.lr, "SGD learning rate")->check(CLI::PositiveNumber);
  sub->add_option("--momentum", t.momentum, "SGD momentum")->check(CLI::Range(0.0, 1.0));
  sub->add_flag("--compare", t.compare,
                "at N ranks, also measure 1 process x 1 thread and 1 process x N threads on "
                "rank 0 (the others wait), and N ranks each training alone without any "
                "gradient exchange (the ceiling of data parallelism on this machine); print the "
                "scaling efficiency and the ratios");
  sub->add_flag("--no-ddp", t.no_ddp,
                "measure only the ceiling: every rank trains its own replica on its shard, no "
                "DDP, no gradient exchange (benchmarks/vs_pytorch/compare.py runs it beside "
                "both DDPs)");
  sub->add_flag("--lockstep", t.lockstep,
                "with --no-ddp: the ranks also meet in a barrier after each backward, as DDP's "
                "all_reduce makes them, moving no gradient: the ceiling of synchronous data "
                "parallelism; with --compare: measure it too and print DDP's share of it");
  sub->add_flag("--gradient-as-bucket-view", t.gradient_as_bucket_view,
                "DDPOptions::gradient_as_bucket_view: gradients are views into the buckets "
                "(no copy in or out)");
  sub->add_option("--bucket-cap-mb", t.bucket_cap_mb, "DDPOptions::bucket_cap_mb")
      ->check(CLI::Range(0.001, 4096.0));
  sub->add_flag("--zero", t.zero,
                "the optimizer as a ddp::ZeroRedundancyOptimizer (ZeRO-1): its state sharded over "
                "the ranks, the updated parameters broadcast (in the optimizer column); prints "
                "the optimizer state's bytes per rank");
  sub->add_flag("--zero-overlap", t.zero_overlap,
                "--zero with ZeroOptions::overlap_with_ddp: each DDP bucket's owner steps it "
                "inside the comm hook (comm_hooks::hook_with_zero_step), no update in the first "
                "two steps");
  sub->add_option("--fsdp", t.fsdp,
                  "zero2 | zero3: ddp::FullyShardedDataParallel instead of DDP, parameters, "
                  "gradients and SGD's state sharded over the ranks (zero2: a unit per child "
                  "module, gathered for forward and backward; zero3: each layer a ddp::Sharded "
                  "unit, whole only inside its own forward and backward); prints the bytes each "
                  "rank holds")
      ->check(CLI::IsMember({"zero2", "zero3"}));
  sub->add_option("--fsdp-precision", t.fsdp_precision,
                  "with --fsdp: bf16 gathers the units and computes in bf16, gradients summed "
                  "in fp32, the fp32 shards stepped (FSDP's MixedPrecision)")
      ->check(CLI::IsMember({"bf16"}));
  sub->add_option("--comm-hook", t.comm_hook,
                  "none | fp16 | bf16 | powersgd[:RANK] (PyTorch's PowerSGD, compressing from "
                  "the third step; prints the compression rate)")
      ->transform(tools::powersgd_rank_transform(&t.powersgd_rank))
      ->check(CLI::IsMember({"none", "fp16", "bf16", "powersgd"}));
  sub->add_option("--repeats", t.repeats,
                  "rounds of every configuration, alternating; medians are reported")
      ->check(CLI::PositiveNumber);
  sub->add_option("--label", t.label, "first CSV column (default: the configuration)");
  sub->add_option("--csv", t.csv, "append the rows to this CSV file (rank 0)");
  sub->add_option("--png", t.png, "stacked bars of the breakdown with gnuplot (rank 0)");
}

// Every rank holds a few buffers of the largest size (input, output, staging): a size above a
// quarter of the machine's memory is a typo (1T for 1G), answered before any allocation.
void fits_in_memory(const char* flag, const std::string& text, int64_t bytes) {
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
  if (pages <= 0 || page <= 0) return;
  const int64_t quarter = static_cast<int64_t>(pages) * page / 4;
  if (bytes > quarter) {
    throw ConfigError(fmt::format(
        "{} {}: more than a quarter of this machine's memory ({}), and every rank holds "
        "several buffers of that size; use at most {}M",
        flag, text, fmt::format("{:.1f} GiB", static_cast<double>(pages) * page / (1 << 30)),
        quarter >> 20));
  }
}

}  // namespace

CommandLine parse_command_line(const std::vector<std::string>& args) {
  CommandLine out;
  CLI::App app{kDescription, "ddp-bench"};
  app.get_formatter()->column_width(30);
  app.option_defaults()->always_capture_default()->multi_option_policy(
      CLI::MultiOptionPolicy::TakeLast);
  app.require_subcommand(0, 1);

  auto& c = out.collectives;
  std::string backends = "gloo,shm,shm-inplace",
              ops = "all_reduce,broadcast,all_gather,reduce_scatter", dtypes = "float32",
              min_bytes = "8", max_bytes = "256M", ring = "64M";
  add_collectives(app, c, backends, ops, dtypes, min_bytes, max_bytes, ring);
  add_train(app, out.train);

  try {
    std::vector<std::string> reversed(args.rbegin(), args.rend());  // CLI11 pops from the back
    app.parse(reversed);
  } catch (const CLI::CallForHelp&) {
    out.help_text = app.help("", CLI::AppFormatMode::All);
    return out;
  } catch (const CLI::ParseError& e) {
    throw ConfigError(fmt::format("{} (see ddp-bench --help)", e.what()));
  }
  if (app.got_subcommand("collectives")) {
    out.mode = CommandLine::Mode::kCollectives;
    c.backends = split_list(backends);
    c.ops = split_list(ops);
    c.dtypes = split_list(dtypes);
    if (c.backends.empty() || c.ops.empty() || c.dtypes.empty()) {
      throw ConfigError("--backend, --ops and --dtype each need at least one name");
    }
    for (const auto& op : c.ops) bus_factor(op, 1);  // an unknown op is a ConfigError
    for (const auto& d : c.dtypes) parse_dtype(d);   // and so is an unknown dtype
    c.min_bytes = parse_bytes("--min-bytes", min_bytes);
    c.max_bytes = parse_bytes("--max-bytes", max_bytes);
    c.ring_bytes = parse_bytes("--ring-bytes", ring);
    doubling_sizes(c.min_bytes, c.max_bytes);  // validates the range
    fits_in_memory("--max-bytes", max_bytes, c.max_bytes);
    fits_in_memory("--ring-bytes", ring, c.ring_bytes);
  } else if (app.got_subcommand("train")) {
    out.mode = CommandLine::Mode::kTrain;
  } else {
    out.help_text = app.help("", CLI::AppFormatMode::All);
  }
  return out;
}

}  // namespace ddp::bench
