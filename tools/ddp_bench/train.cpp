// ddp-bench train (see train.h).
#include "train.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <optional>
#include <thread>

#include <fmt/format.h>
#include <torch/cuda.h>  // is_available, synchronize
#include <torch/torch.h>

#include "ddp/datasets.h"  // FashionMnist
#include "ddp/ddp.h"
#include "ddp/runtime.h"  // set_num_threads, threads_per_rank
#include "models.h"
#include "report.h"
#include "sweep.h"

namespace ddp::bench {
namespace {

using Clock = std::chrono::steady_clock;
using tools::ModelImpl;

double seconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

// Threads per rank: the flag, else threads_per_rank (OMP_NUM_THREADS, else the cores shared
// among this host's ranks), as init_process_group and ddp-train choose.
int default_threads(const TrainOptions& o, const ProcessGroup& pg) {
  return o.threads > 0 ? o.threads : threads_per_rank(pg.local_size());
}

// --device: whether this rank trains on CUDA; auto: when CUDA is available (as ddp-train
// chooses). Decided before the group forms, which then binds the rank's device (Note [Device
// binding]: cuda:LOCAL_RANK, whatever the backend).
bool wants_cuda(const TrainOptions& o) {
  const bool available = torch::cuda::is_available();
  if (o.device == "cuda" && !available) {
    throw ConfigError("--device cuda: no CUDA device is available to this process");
  }
  return o.device == "cuda" || (o.device == "auto" && available);
}

// Batches forever: a new epoch (reshuffled) whenever the loader's pass ends. On a CUDA device
// the loader pins each batch and copies it there (non_blocking).
class BatchStream {
 public:
  BatchStream(std::shared_ptr<const Dataset> data, const ProcessGroup& pg, int64_t batch,
              const TrainOptions& o, c10::Device device)
      : sampler_(data->size(), {.num_replicas = pg.size(),
                                .rank = pg.rank(),
                                .shuffle = true,
                                .seed = o.seed,
                                .drop_last = true}),
        loader_(data, sampler_,
                {.batch_size = batch,
                 .drop_last = true,
                 .num_workers = o.workers,
                 .device = device.is_cuda() ? std::optional<c10::Device>(device) : std::nullopt}) {}

  Batch& next() {
    if (it_) {
      ++*it_;
      if (*it_ == DataLoader::Sentinel{}) it_.reset();
    }
    if (!it_) {
      sampler_.set_epoch(epoch_++);  // the loader shares the sampler's cursor
      it_.emplace(loader_.begin());
    }
    return **it_;
  }

 private:
  DistributedSampler sampler_;
  DataLoader loader_;
  std::optional<DataLoader::Iterator> it_;
  int64_t epoch_ = 0;
};

// One line: each bucket's bytes in reduction order and when its communication started (ms after
// backward's first gradient, mean over the timed steps), and when the last gradient was ready.
// benchmarks/perf_model.py reads it (the bucket ready times of its step model).
void print_bucket_profile(const std::string& label, DistributedDataParallel<ModelImpl>& ddp,
                          ModelImpl& net, const std::vector<double>& launch_sum,
                          double last_gradient_sum, int steps) {
  std::map<std::string, int64_t> bytes_of;
  for (const auto& p : net.named_parameters()) {
    bytes_of[p.key()] = static_cast<int64_t>(p.value().numel() * p.value().element_size());
  }
  std::string bytes, launched;
  const auto layout = ddp.bucket_layout();
  for (size_t b = 0; b < layout.size(); ++b) {
    int64_t sum = 0;
    for (const auto& name : layout[b]) sum += bytes_of[name];
    const double at = b < launch_sum.size() ? launch_sum[b] / steps * 1e3 : -1.0;
    bytes += fmt::format("{}{}", b ? "," : "", sum);
    launched += fmt::format("{}{:.3f}", b ? "," : "", at);
  }
  std::printf("# %s: buckets %s bytes; launched at %s ms; last gradient at %.3f ms\n",
              label.c_str(), bytes.c_str(), launched.c_str(),
              last_gradient_sum / steps * 1e3);
}

// Trains `o.warmup + o.steps` steps of `o.model` on `pg` with `threads` intra-op threads per
// rank and returns the timed steps' row. Collective over `pg`. `local`: every rank trains its
// own replica on its shard without DDP (no gradient communication at all): the ceiling any
// data-parallel implementation can reach on this machine, cores and memory shared as they are.
// `lockstep` (with `local`): the ranks meet in a barrier after each backward, where DDP's last
// all_reduce makes them wait for each other, and nothing else: the ceiling of *synchronous* data
// parallelism (Note [The lockstep ceiling]).
// On a CUDA device every phase ends with a device synchronize, so that each phase is charged
// its own kernels (benchmarks/vs_pytorch/torch_ddp.py --device cuda does the same).
TrainRow measure(ProcessGroup& pg, std::shared_ptr<const Dataset> data, const TrainOptions& o,
                 int threads, const std::string& label, c10::Device device, bool local = false,
                 bool lockstep = false) {
  set_num_threads(threads);  // LibTorch and the BLAS
  const int n = pg.size();
  const int64_t per_rank = o.global_batch / n;
  torch::manual_seed(o.seed);
  auto net = tools::make_model(o.model, /*sync_bn=*/false,
                               /*sharded=*/!local && o.fsdp == "zero3");
  net->to(device);
  auto sync = [&] {
    if (device.is_cuda()) torch::cuda::synchronize(device.index());
  };
  // pg is ours to keep alive; DDP needs a shared_ptr, so wrap it without ownership.
  std::shared_ptr<ProcessGroup> group(std::shared_ptr<ProcessGroup>{}, &pg);
  std::optional<DistributedDataParallel<ModelImpl>> ddp;
  std::optional<FullyShardedDataParallel<ModelImpl>> fsdp;
  if (!local && !o.fsdp.empty()) {
    MixedPrecision mixed;
    if (o.fsdp_precision == "bf16") {
      mixed = {.param_dtype = at::kBFloat16, .reduce_dtype = at::kFloat};
    }
    fsdp.emplace(net, FSDPOptions{.process_group = group,
                                  .sharding_strategy = o.fsdp == "zero3"
                                                           ? ShardingStrategy::kFullShard
                                                           : ShardingStrategy::kShardGradOp,
                                  .mixed_precision = mixed});
  } else if (!local) {
    ddp.emplace(net, DDPOptions{.process_group = group,
                                .bucket_cap_mb = o.bucket_cap_mb,
                                .gradient_as_bucket_view = o.gradient_as_bucket_view});
  }
  std::shared_ptr<comm_hooks::PowerSGDState> powersgd;
  CommHook hook;
  if (o.comm_hook == "fp16") hook = comm_hooks::fp16_compress();
  if (o.comm_hook == "bf16") hook = comm_hooks::bf16_compress();
  if (o.comm_hook == "powersgd") {
    powersgd = std::make_shared<comm_hooks::PowerSGDState>(comm_hooks::PowerSGDOptions{
        .matrix_approximation_rank = o.powersgd_rank, .start_powerSGD_iter = 2});
    hook = comm_hooks::powerSGD_hook(powersgd);
  }
  auto model = [&](const torch::Tensor& x) {
    return ddp ? (*ddp)(x) : fsdp ? (*fsdp)(x) : net->forward(x);
  };
  const auto sgd = torch::optim::SGDOptions(o.lr).momentum(o.momentum);
  std::optional<torch::optim::SGD> opt;
  // --zero, with DDP (Note [ZeRO-1]); --zero-overlap steps it in the hook (Note [ZeRO
  // overlapped with DDP]).
  std::shared_ptr<ZeroRedundancyOptimizer> zero;
  if ((o.zero || o.zero_overlap) && ddp) {
    zero = std::make_shared<ZeroRedundancyOptimizer>(
        ZeroRedundancyOptimizer::make<torch::optim::SGD>(
            net->parameters(), sgd, group, ZeroOptions{.overlap_with_ddp = o.zero_overlap}));
    if (o.zero_overlap) {
      hook = comm_hooks::hook_with_zero_step(hook ? hook : comm_hooks::allreduce(), zero);
    }
  } else {
    opt.emplace(fsdp ? fsdp->parameters() : net->parameters(), sgd);
  }
  if (ddp && hook) ddp->register_comm_hook(hook);
  BatchStream batches(std::move(data), pg, per_rank, o, device);

  // Sums over the timed steps, on this rank.
  double data_s = 0, forward_s = 0, backward_s = 0, comm_s = 0, optimizer_s = 0;
  // Rank 0's bucket profile (what benchmarks/perf_model.py takes): when each bucket's
  // communication started and when the last gradient was ready, summed over the timed steps.
  std::vector<double> launch_sum;
  double last_gradient_sum = 0;
  Clock::time_point timed_start;
  for (int step = 0; step < o.warmup + o.steps; ++step) {
    if (step == o.warmup) {
      sync();
      pg.barrier().wait();  // the ranks start the timed steps together
      timed_start = Clock::now();
    }
    const auto t0 = Clock::now();
    Batch& batch = batches.next();
    sync();
    const auto t1 = Clock::now();
    auto loss = torch::cross_entropy_loss(model(batch.data), batch.target);
    sync();
    const auto t2 = Clock::now();
    loss.backward();
    if (lockstep && n > 1) pg.barrier().wait();  // charged to backward, as DDP's wait is
    sync();
    const auto t3 = Clock::now();
    if (zero) {
      zero->step();
      zero->zero_grad();
    } else {
      opt->step();
      opt->zero_grad();
    }
    sync();
    const auto t4 = Clock::now();
    if (step < o.warmup) continue;
    double comm = 0;
    if (ddp && n > 1) {
      const IterationStats& s = ddp->last_iteration_stats();
      comm = s.finalize_end_s - s.finalize_start_s;
      launch_sum.resize(s.bucket_launch_s.size());
      for (size_t b = 0; b < launch_sum.size(); ++b) launch_sum[b] += s.bucket_launch_s[b];
      last_gradient_sum += s.last_gradient_s;
    }
    data_s += seconds(t0, t1);
    forward_s += seconds(t1, t2);
    backward_s += seconds(t2, t3) - comm;
    comm_s += comm;
    optimizer_s += seconds(t3, t4);
  }
  const double wall_s = seconds(timed_start, Clock::now());

  // Means over ranks of the breakdown; the slowest rank's wall time for the throughput. On the
  // training device: an NCCL group reduces CUDA tensors only.
  at::Tensor sums =
      at::tensor({data_s, forward_s, backward_s, comm_s, optimizer_s}, at::kDouble).to(device);
  pg.all_reduce(sums, ReduceOp::kSum).wait();
  at::Tensor wall = at::full({1}, wall_s, at::kDouble).to(device);
  pg.all_reduce(wall, ReduceOp::kMax).wait();
  sums = sums.cpu();
  const double w = wall.item<double>();
  if (ddp || fsdp) {  // the state this rank holds: with --zero or --fsdp about 1/world of it
    int64_t bytes = 0;
    if (zero) {
      bytes = zero->state_bytes();
    } else {
      for (const auto& [key, state] : opt->state()) {
        for (const at::Tensor& t : ZeroOptimizerTraits<torch::optim::SGD>::tensors(*state)) {
          if (t.defined()) bytes += static_cast<int64_t>(t.nbytes());
        }
      }
    }
    at::Tensor total = at::full({1}, static_cast<double>(bytes), at::kDouble).to(device);
    at::Tensor most = total.clone();
    pg.all_reduce(total, ReduceOp::kSum).wait();
    pg.all_reduce(most, ReduceOp::kMax).wait();
    // Parameters and gradients held between steps: whole under DDP, a shard under FSDP.
    int64_t held = fsdp ? fsdp->memory_stats().shard_bytes : 0;  // with bf16 copies
    for (const at::Tensor& p : fsdp ? fsdp->parameters() : net->parameters()) {
      if (!fsdp) held += static_cast<int64_t>(p.nbytes());
      if (p.grad().defined()) held += static_cast<int64_t>(p.grad().nbytes());
    }
    at::Tensor held_most = at::full({1}, static_cast<double>(held), at::kDouble).to(device);
    pg.all_reduce(held_most, ReduceOp::kMax).wait();
    // The most parameter bytes whole at once during the steps: the model under DDP.
    const double peak = fsdp ? static_cast<double>(fsdp->memory_stats().peak_gathered_bytes)
                             : static_cast<double>(held) / 2;  // DDP: parameters, always whole
    at::Tensor peak_most = at::full({1}, peak, at::kDouble).to(device);
    pg.all_reduce(peak_most, ReduceOp::kMax).wait();
    if (pg.rank() == 0) {
      std::printf("# %s: optimizer state %.3f MB on the fullest rank, %.3f MB over %d rank%s%s\n",
                  label.c_str(), most.item<double>() / 1e6, total.item<double>() / 1e6, n,
                  n > 1 ? "s" : "",
                  zero   ? " (ZeRO-1)"
                  : fsdp ? (o.fsdp == "zero3" ? " (FSDP, ZeRO-3)" : " (FSDP, ZeRO-2)")
                         : "");
      std::printf(
          "# %s: parameters and gradients %.3f MB on the fullest rank between steps; "
          "parameters whole at once at most %.3f MB\n",
          label.c_str(), held_most.item<double>() / 1e6, peak_most.item<double>() / 1e6);
    }
  }
  if (ddp && n > 1 && pg.rank() == 0) print_bucket_profile(label, *ddp, *net, launch_sum,
                                                           last_gradient_sum, o.steps);
  if (powersgd && pg.rank() == 0) {
    const auto stats = powersgd->compression_stats();
    std::printf("# %s: PowerSGD rank %d sends %.1fx fewer gradient values (%lld of %lld a step)\n",
                label.c_str(), o.powersgd_rank, stats.rate,
                static_cast<long long>(stats.numel_after / std::max<int64_t>(1, powersgd->iter() - 2)),
                static_cast<long long>(stats.numel_before / std::max<int64_t>(1, powersgd->iter() - 2)));
  }
  auto ms = [&](int i) { return sums[i].item<double>() / n / o.steps * 1e3; };
  return {.label = label,
          .model = o.model,
          .backend = pg.backend(),
          .world_size = n,
          .threads = threads,
          .global_batch = o.global_batch,
          .steps = o.steps,
          .samples_per_s = o.steps * static_cast<double>(o.global_batch) / w,
          .step_ms = w / o.steps * 1e3,
          .data_ms = ms(0),
          .forward_ms = ms(1),
          .backward_ms = ms(2),
          .comm_ms = ms(3),
          .optimizer_ms = ms(4)};
}

std::string config_label(int world, int threads, const std::string& backend) {
  if (world == 1) {
    return fmt::format("1 process x {} thread{}", threads, threads > 1 ? "s" : "");
  }
  return fmt::format("{} ranks x {} thread{} ({})", world, threads, threads > 1 ? "s" : "",
                     backend);
}

constexpr const char* kNoCommunication = "no comm";  // the backend column of the ceiling
constexpr const char* kLockstep = "lockstep";        // ... and of the lockstep ceiling

// Note [The lockstep ceiling]
// The ceiling (--no-ddp) lets every rank run free: on a machine whose ranks fill its cores, one
// rank's optimizer (memory-bound) then tends to run beside the other's matrix products
// (compute-bound), and a rank that the machine delays costs only itself. Synchronous data
// parallelism cannot have either: every step ends with the same all_reduce on every rank, so
// the ranks run each phase together and the slowest rank sets the pace. --lockstep measures
// that cost alone: the ceiling with one barrier per step, after backward, and no gradient
// moved. The gap from the ceiling to the lockstep ceiling is what any synchronous DDP pays on
// this machine; the gap from the lockstep ceiling to DDP is what moving the gradients costs.
// Measured on the 2-core VM (mlp-1024, 2 ranks, four runs): the lockstep ceiling at 94.1-99.1% of
// the ceiling (the VM's own swings are as large); in one, optimizer 1.74 -> 2.30 ms, wait 0.6 ms.

// The row whose throughput is the median of `rows` (one configuration over the repeats).
TrainRow median_row(std::vector<TrainRow> rows) {
  std::sort(rows.begin(), rows.end(),
            [](const TrainRow& a, const TrainRow& b) { return a.samples_per_s < b.samples_per_s; });
  return rows[rows.size() / 2];
}

}  // namespace

int run_train(const TrainOptions& o) {
  if (o.steps < 1 || o.warmup < 0 || o.repeats < 1) {
    throw ConfigError("--steps and --repeats must be >= 1, --warmup >= 0");
  }
  tools::make_model(o.model);  // an unknown name fails before any process group forms
  InitOptions init;
  if (!o.backend.empty()) init.backend = o.backend;
  const bool cuda = wants_cuda(o);
  if (cuda) init.device_id = parse_dist_env(current_environment()).local_rank;
  auto pg = make_process_group(init);
  const int n = pg->size();
  const bool main = pg->rank() == 0;
  if (o.global_batch % n != 0) {
    throw ConfigError(
        fmt::format("--batch-size {} (global) must be a multiple of the world size "
                    "{}",
                    o.global_batch, n));
  }
  if (o.compare && o.no_ddp) throw ConfigError("--compare and --no-ddp exclude each other");
  if (!o.fsdp.empty() && (o.zero || o.zero_overlap || o.comm_hook != "none" || o.no_ddp ||
                          o.gradient_as_bucket_view)) {
    throw ConfigError(
        "--fsdp shards parameters, gradients and optimizer state itself: it takes none of "
        "--zero, --zero-overlap, --comm-hook, --no-ddp or --gradient-as-bucket-view");
  }
  if (!o.fsdp_precision.empty() && o.fsdp.empty()) {
    throw ConfigError("--fsdp-precision is FSDP's mixed precision: give it with --fsdp");
  }
  if (o.lockstep && !o.no_ddp && !o.compare) {
    throw ConfigError("--lockstep is a ceiling: give it with --no-ddp (or --compare, which adds it)");
  }
  const c10::Device device =
      cuda ? c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(*pg->bound_device_id()))
           : c10::Device(c10::kCPU);
  if (o.compare && device.is_cuda()) {
    throw ConfigError(
        "--compare measures CPU configurations (1 process x N threads); use --device cpu with "
        "it, or compare CUDA runs with and without --no-ddp");
  }
  if (o.compare && n == 1) {
    throw ConfigError(
        "--compare measures N ranks against 1 process: run it under "
        "ddprun --nproc-per-node N (N > 1)");
  }
  auto data = std::make_shared<FashionMnist>(Split::kTrain, FashionMnistOptions{.dir = o.data_dir,
                                                                                .normalize = true});
  // Batches drop the last short one: a batch above a rank's shard would give none, ever.
  if (o.global_batch / n > data->size() / n) {
    throw ConfigError(fmt::format(
        "--batch-size {} (global) is more than the training set's {} images; use at most {}",
        o.global_batch, data->size(), data->size() / n * n));
  }
  const int threads = default_threads(o, *pg);
  auto say = [&](const std::string& text) {
    if (!main) return;
    std::printf("%s\n", text.c_str());
    std::fflush(stdout);
  };
  const std::string fsdp_precision =
      o.fsdp_precision.empty() ? "" : ", gathered in " + o.fsdp_precision + ", summed in fp32";
  say(
      fmt::format("# ddp-bench train: {} on Fashion-MNIST, global batch {} ({} per rank), {} "
                  "rank{} x {} thread{} on {}, backend {}, SGD lr {} momentum {}, {} steps after "
                  "{} warm-up{}{}{}{}{}",
                  o.model, o.global_batch, o.global_batch / n, n, n > 1 ? "s" : "", threads,
                  threads > 1 ? "s" : "", device.str(), pg->backend(), o.lr, o.momentum, o.steps,
                  o.warmup, o.repeats > 1 ? fmt::format(", median of {} rounds", o.repeats) : "",
                  !o.fsdp.empty() ? "" : fmt::format("; DDP buckets of {} MB", o.bucket_cap_mb),
                  o.gradient_as_bucket_view ? ", gradients as bucket views" : "",
                  o.zero_overlap ? "; optimizer: ZeroRedundancyOptimizer(SGD) stepped in DDP's hook"
                  : o.zero       ? "; optimizer: ZeroRedundancyOptimizer(SGD)"
                  : o.fsdp == "zero2"
                      ? "; FullyShardedDataParallel (ZeRO-2) instead of DDP" + fsdp_precision
                  : o.fsdp == "zero3"
                      ? "; FullyShardedDataParallel (ZeRO-3) instead of DDP" + fsdp_precision
                      : std::string(),
                  o.comm_hook == "none" ? ""
                  : o.comm_hook == "powersgd"
                      ? fmt::format("; comm hook powersgd:{}", o.powersgd_rank)
                      : "; comm hook " + o.comm_hook));
  say("# ms per step: data, forward, backward compute, exposed communication (DDP's wait after "
      "backward), optimizer");
  say(train_table_header());

  // One 1-rank group for the single-process baselines (an in-process store, no sockets).
  std::shared_ptr<ProcessGroup> alone;
  if (o.compare && main) {
    InitOptions one;
    one.rank = 0;
    one.world_size = 1;
    one.backend = "gloo";
    alone = make_process_group(one);
  }
  // Per configuration, one row per repeat: DDP (or a ceiling); with --compare, 1 x 1 thread,
  // 1 x N threads, N ranks without communication, and with --lockstep the lockstep ceiling.
  std::vector<std::vector<TrainRow>> rounds(5);
  // Adds one round of a configuration to `runs`, saying it when there are several rounds.
  auto add = [&](std::vector<TrainRow>& runs, TrainRow row, int r) {
    runs.push_back(std::move(row));
    if (o.repeats > 1) say(train_table_line(runs.back()) + fmt::format("  (round {})", r + 1));
  };
  // N ranks without communication: the ceiling, or with `lockstep` the lockstep ceiling.
  auto ceiling = [&](bool lockstep) {
    const char* what = lockstep ? kLockstep : kNoCommunication;
    TrainRow row = measure(*pg, data, o, threads, config_label(n, threads, what), device,
                           /*local=*/true, lockstep);
    row.backend = what;
    return row;
  };
  for (int r = 0; r < o.repeats; ++r) {
    add(rounds[0],
        o.no_ddp
            ? ceiling(o.lockstep)
            : measure(*pg, data, o, threads,
                      config_label(n, threads,
                                   o.fsdp.empty() ? pg->backend() : pg->backend() + ", " + o.fsdp),
                      device),
        r);
    if (!o.compare) continue;
    add(rounds[3], ceiling(false), r);
    if (o.lockstep) add(rounds[4], ceiling(true), r);
    if (main) {  // the others wait in the barrier below, blocked, not spinning
      add(rounds[1], measure(*alone, data, o, 1, config_label(1, 1, ""), device), r);
      add(rounds[2], measure(*alone, data, o, n, config_label(1, n, ""), device), r);
    }
    pg->barrier().wait();
  }

  std::vector<TrainRow> rows;
  for (const auto& runs : rounds) {
    if (!runs.empty()) rows.push_back(median_row(runs));
  }
  if (!o.label.empty()) {
    for (auto& row : rows) row.label = o.label + (rows.size() > 1 ? ": " + row.label : "");
  }
  if (o.repeats > 1) say("# medians:");
  for (const auto& row : rows) say(train_table_line(row));
  if (main && o.compare) {
    const double ddp = rows[0].samples_per_s, one = rows[1].samples_per_s,
                 threaded = rows[2].samples_per_s;
    say(fmt::format("# scaling efficiency at {} ranks: {:.2f} = {:.1f} / ({} x {:.1f}) samples/s",
                    n, ddp / (n * one), ddp, n, one));
    say(
        fmt::format("# {} ranks x {} thread{} vs 1 process x {} threads: {:.2f}x ({:.1f} vs "
                    "{:.1f} samples/s)",
                    n, threads, threads > 1 ? "s" : "", n, ddp / threaded, ddp, threaded));
    const double ceiling = rows[3].samples_per_s;
    say(
        fmt::format("# DDP reaches {:.1f}% of the communication-free ceiling ({} ranks training "
                    "alone, no gradient exchange: {:.1f} samples/s)",
                    100.0 * ddp / ceiling, n, ceiling));
    if (o.lockstep) {
      const double lockstep = rows[4].samples_per_s;
      say(fmt::format(
          "# the lockstep ceiling (the same, one barrier per step) is {:.1f}% of the ceiling; DDP "
          "reaches {:.1f}% of it ({:.1f} samples/s)",
          100.0 * lockstep / ceiling, 100.0 * ddp / lockstep, lockstep));
    }
  }
  if (main && !o.csv.empty()) {
    append_train_csv(o.csv, rows);
    say("# csv: " + o.csv + " (appended)");
  }
  if (main && !o.png.empty()) say("# " + plot_train(o.png, rows));
  pg->barrier().wait();
  return 0;
}

}  // namespace ddp::bench
