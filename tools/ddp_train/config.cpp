// ddp-train's command line (see config.h).
#include "config.h"

#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <limits>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include "comm_hook_flag.h"
#include "ddp/error.h"

namespace ddp::train {
namespace {

// Number checks with short messages ("must be a positive integer, got -1"; CLI11 prefixes the
// flag). They run on the text before CLI11 converts it, so "abc" gets the same message. The
// description is what --help shows after the type (INT:POSITIVE).
// `max`: the largest value that makes sense (a thread count of a million is a typo, not a
// plan); unset, the type's largest.
template <typename Int>
CLI::Validator integer_at_least(Int min, Int max = std::numeric_limits<Int>::max()) {
  const std::string what = min == 1   ? "a positive integer"
                           : min == 0 ? "a non-negative integer"
                                      : fmt::format("an integer of at least {}", min);
  return CLI::Validator(
      [min, max, what](std::string& text) -> std::string {
        errno = 0;
        char* end = nullptr;
        const long long v = std::strtoll(text.c_str(), &end, 10);
        const bool whole = !text.empty() && end == text.c_str() + text.size() && errno == 0;
        if (whole && v >= min && v <= max) return "";
        if ((whole && v > max) || (errno == ERANGE && text[0] != '-')) {
          return fmt::format("must be {} no larger than {}, got {}", what, max, text);
        }
        return fmt::format("must be {}, got {}", what, text);
      },
      min > 0 ? "POSITIVE" : "NONNEGATIVE");
}

constexpr int64_t kMaxEpochs = 1'000'000;
constexpr int kMaxThreads = 1024;  // per rank
constexpr int kMaxWorkers = 256;   // loader threads per rank
constexpr int kMaxGradAccum = 1'000'000;

// A finite number in [min, max]; `min_open`: min itself is excluded ("positive").
CLI::Validator number_in(double min, bool min_open, double max = HUGE_VAL) {
  std::string what = min == 0 && min_open          ? "a positive number"
                     : min == 0 && std::isinf(max) ? "a non-negative number"
                                                   : fmt::format("a number in [{}, {}]", min, max);
  std::string desc = min == 0 && min_open          ? "POSITIVE"
                     : min == 0 && std::isinf(max) ? "NONNEGATIVE"
                                                   : fmt::format("[{}, {}]", min, max);
  return CLI::Validator(
      [=](std::string& text) -> std::string {
        char* end = nullptr;
        const double v = std::strtod(text.c_str(), &end);
        const bool whole = !text.empty() && end == text.c_str() + text.size();
        if (whole && std::isfinite(v) && (min_open ? v > min : v >= min) && v <= max) return "";
        return fmt::format("must be {}, got {}", what, text);
      },
      desc);
}

template <typename E, size_t N>
std::string_view name_of(const std::array<std::pair<std::string_view, E>, N>& names, E v) {
  for (const auto& [name, value] : names) {
    if (value == v) return name;
  }
  return "?";
}

// A flag whose value is one of `names`: parsed as text (CLI11's message lists the names), then
// turned into the enum once parsing is done.
template <typename E, size_t N>
struct Choice {
  const std::array<std::pair<std::string_view, E>, N>& names;
  E& target;
  std::string text;

  Choice(const std::array<std::pair<std::string_view, E>, N>& n, E& t)
      : names(n), target(t), text(name_of(n, t)) {}
  std::vector<std::string> allowed() const {
    std::vector<std::string> out;
    for (const auto& [name, value] : names) out.emplace_back(name);
    return out;
  }
  void apply() const {
    for (const auto& [name, value] : names) {
      if (name == text) target = value;
    }
  }
};

}  // namespace

std::string_view to_string(Optimizer v) { return name_of(kOptimizerNames, v); }
std::string_view to_string(Precision v) { return name_of(kPrecisionNames, v); }
std::string_view to_string(Device v) { return name_of(kDeviceNames, v); }
std::string_view to_string(CommHook v) { return name_of(kCommHookNames, v); }

nlohmann::json TrainConfig::to_json() const {
  return {{"model", model},
          {"data_dir", data_dir},
          {"train_subset", train_subset},
          {"test_subset", test_subset},
          {"epochs", epochs},
          {"batch_size", batch_size},
          {"grad_accum", grad_accum},
          {"optimizer", to_string(optimizer)},
          {"lr", lr},
          {"momentum", momentum},
          {"weight_decay", weight_decay},
          {"warmup_epochs", warmup_epochs},
          {"scale_lr", scale_lr},
          {"precision", to_string(precision)},
          {"sync_bn", sync_bn},
          {"zero", zero},
          {"fsdp", fsdp},
          {"seed", seed},
          {"max_steps", max_steps},
          {"min_step_ms", min_step_ms},
          {"device", to_string(device)},
          {"threads", threads},
          {"workers", workers},
          {"comm_hook", comm_hook == CommHook::kPowerSGD ? fmt::format("powersgd:{}", powersgd_rank)
                                                         : std::string(to_string(comm_hook))},
          {"powersgd_start", powersgd_start},
          {"output_dir", output_dir},
          {"name", name},
          {"resume", resume},
          {"checkpoint_every", checkpoint_every},
          {"checkpoint_format", checkpoint_format},
          {"keep", keep},
          {"log_every", log_every},
          {"plots", plots},
          {"sample_log", sample_log},
          {"ft", ft},
          {"ft_min_replicas", ft_min_replicas}};
}

bool parse_args(int argc, char** argv, TrainConfig& c) {
  CLI::App app{
      "ddp-train: train a model on Fashion-MNIST with DistributedDataParallel.\n"
      "Launch with: ddprun --standalone --nproc-per-node N ddp-train [flags]\n"
      "(also torchrun --no-python, mpirun, srun, or alone as one process)"};
  app.get_formatter()->column_width(34);
  // Defaults shown as "=value"; a repeated flag takes its last value (as argparse does).
  app.option_defaults()->always_capture_default()->multi_option_policy(
      CLI::MultiOptionPolicy::TakeLast);

  app.add_option("--model", c.model,
                 "mlp | cnn (classic small CNN, BatchNorm) | resnet (small) | mlp-large (18.4 M "
                 "parameters, for --fsdp)")
      ->check(CLI::IsMember({"mlp", "cnn", "resnet", "mlp-large"}));
  app.add_option("--data-dir", c.data_dir,
                 "Fashion-MNIST folder (default: Debian's dataset-fashion-mnist)");
  app.add_option("--train-subset", c.train_subset, "use the first N training images (0: all)")
      ->check(integer_at_least<int64_t>(0));
  app.add_option("--test-subset", c.test_subset, "evaluate on the first N test images (0: all)")
      ->check(integer_at_least<int64_t>(0));
  app.add_option("--epochs", c.epochs, "passes over the training set")
      ->check(integer_at_least<int64_t>(1, kMaxEpochs));
  app.add_option("--batch-size", c.batch_size, "samples per rank per micro-batch")
      ->check(integer_at_least<int64_t>(1));
  app.add_option("--grad-accum", c.grad_accum, "micro-batches per optimizer step (no_sync between)")
      ->check(integer_at_least<int>(1, kMaxGradAccum));
  Choice optimizer(kOptimizerNames, c.optimizer);
  Choice precision(kPrecisionNames, c.precision);
  Choice device(kDeviceNames, c.device);
  Choice comm_hook(kCommHookNames, c.comm_hook);
  app.add_option("--optimizer", optimizer.text, "adamw | sgd (with momentum)")
      ->check(CLI::IsMember(optimizer.allowed()));
  app.add_option("--lr", c.lr, "peak learning rate")->check(number_in(0, true));
  app.add_option("--momentum", c.momentum, "SGD momentum")->check(number_in(0, false, 1));
  app.add_option("--weight-decay", c.weight_decay, "L2 (sgd) / decoupled (adamw) weight decay")
      ->check(number_in(0, false));
  app.add_option("--warmup-epochs", c.warmup_epochs, "linear warmup length, then cosine decay")
      ->check(number_in(0, false));
  app.add_flag("--scale-lr", c.scale_lr, "multiply the learning rate by the world size");
  app.add_option("--precision", precision.text,
                 "fp32 | bf16 (autocast; CPU or CUDA) | fp16 (CUDA only, with a gradient "
                 "scaler). With --fsdp also its mixed precision: the units gathered in it, the "
                 "gradients summed in fp32, the shards stepped in fp32")
      ->check(CLI::IsMember(precision.allowed()));
  app.add_flag("--sync-bn", c.sync_bn, "BatchNorm statistics over all ranks (ddp::SyncBatchNorm)");
  app.add_flag("--zero", c.zero,
               "shard the optimizer state over the ranks (ddp::ZeroRedundancyOptimizer, ZeRO-1); "
               "its checkpoints resume at any world size");
  app.add_option("--fsdp", c.fsdp,
                 "zero2 | zero3: ddp::FullyShardedDataParallel instead of DDP, parameters, "
                 "gradients and optimizer state sharded over the ranks (zero2: a unit per child "
                 "module; zero3: each Linear/Conv2d layer, or resnet's residual block, a unit, "
                 "whole only inside its own forward and backward). Checkpoints: sharded (each "
                 "rank writes its part of the model and the optimizer's state), loadable at any "
                 "world size")
      ->check(CLI::IsMember({"zero2", "zero3"}));
  app.add_option("--seed", c.seed, "seed for initialisation, shuffling and dropout")
      ->check(integer_at_least<int64_t>(0));
  app.add_option("--max-steps", c.max_steps, "stop after N optimizer steps (0: all epochs)")
      ->check(integer_at_least<int64_t>(0));
  app.add_option("--min-step-ms", c.min_step_ms,
                 "each optimizer step lasts at least MS ms, the rank sleeping out the rest (0: "
                 "none): a slow job that leaves the CPUs idle, for failure drills and demos")
      ->check(integer_at_least<int>(0, 60'000));
  app.add_option("--device", device.text,
                 "auto (cuda:LOCAL_RANK if CUDA is available) | cpu | cuda")
      ->check(CLI::IsMember(device.allowed()));
  app.add_option("--threads", c.threads,
                 "intra-op threads per rank (0: OMP_NUM_THREADS, else cores / local ranks)")
      ->check(integer_at_least<int>(0, kMaxThreads));
  app.add_option("--workers", c.workers, "data loader threads per rank")
      ->check(integer_at_least<int>(0, kMaxWorkers));
  app.add_option("--comm-hook", comm_hook.text,
                 "none | fp16 | bf16: all-reduce gradients in half precision (half the bytes) | "
                 "powersgd[:RANK]: low-rank compression of each weight matrix (PyTorch's "
                 "PowerSGD, matrix_approximation_rank RANK, default 1)")
      ->transform(tools::powersgd_rank_transform(&c.powersgd_rank))
      ->check(CLI::IsMember(comm_hook.allowed()));
  CLI::Option* powersgd_start = app.add_option("--powersgd-start", c.powersgd_start,
                 "with --comm-hook powersgd: plain all-reduce for the first N optimizer steps "
                 "(PyTorch's start_powerSGD_iter; at least 2)")
      ->check(integer_at_least<int64_t>(2));
  app.add_option("--output-dir", c.output_dir,
                 "run folder (default: runs/<name>/version_N, the next free N)");
  app.add_option("--name", c.name, "run name under runs/");
  app.add_option("--resume", c.resume,
                 "auto (newest valid checkpoint of the run folder, if any) | a checkpoint path");
  app.add_option("--checkpoint-every", c.checkpoint_every,
                 "optimizer steps between checkpoints (0: at the end of each epoch only)")
      ->check(integer_at_least<int64_t>(0));
  app.add_option("--checkpoint-format", c.checkpoint_format,
                 "full (one file, rank 0 writes the whole state) | sharded (a directory, each "
                 "rank writes its own part: what a model that fits no single process needs); "
                 "default: sharded with --fsdp, full otherwise. Either resumes from either")
      ->check(CLI::IsMember({"full", "sharded"}));
  app.add_option("--keep", c.keep, "step checkpoints kept besides last.ckpt")
      ->check(integer_at_least<int>(1));
  app.add_option("--log-every", c.log_every, "optimizer steps between progress lines")
      ->check(integer_at_least<int64_t>(1));
  bool no_plots = false;
  app.add_flag("--no-plots", no_plots, "skip the PNG plots at the end");
  app.add_option("--sample-log", c.sample_log,
                 "a folder: each rank appends the dataset indices of every optimizer step it "
                 "trains (checks that restarts and resizes use each sample once; Note [Sample "
                 "log])");
  app.add_flag("--ft", c.ft,
               "per-step fault tolerance under ddprun --ft: a failed replica costs the step in "
               "flight, the others go on in their own processes and heal it live when it returns "
               "(ddp::ft::Manager; CPU; not with --zero, --sync-bn, --comm-hook powersgd or "
               "--precision fp16)");
  app.add_option("--ft-min-replicas", c.ft_min_replicas,
                 "with --ft: the fewest replicas that may train")
      ->check(integer_at_least<int>(1));

  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp&) {
    std::printf("%s", app.help().c_str());
    return false;
  } catch (const CLI::ParseError& e) {
    throw ConfigError(fmt::format("{} (see ddp-train --help)", e.what()));
  }
  c.plots = !no_plots;
  optimizer.apply();
  precision.apply();
  device.apply();
  comm_hook.apply();
  if (powersgd_start->count() > 0 && c.comm_hook != CommHook::kPowerSGD) {
    throw ConfigError(
        "--powersgd-start applies to --comm-hook powersgd[:RANK] only (see ddp-train --help)");
  }
  if (c.checkpoint_format.empty()) c.checkpoint_format = c.fsdp.empty() ? "full" : "sharded";
  if (!c.fsdp.empty()) {
    const char* refused = c.zero                           ? "--zero"
                          : c.ft                           ? "--ft"
                          : c.comm_hook != CommHook::kNone ? "--comm-hook"
                                                           : nullptr;
    if (refused != nullptr) {
      throw ConfigError(fmt::format(
          "--fsdp with {}: FullyShardedDataParallel shards the optimizer state itself and has "
          "no comm hooks or fault-tolerance manager yet; leave one of them out",
          refused));
    }
  }
  if (c.ft) {
    // What does not follow a re-formed group yet (Note [Per-step fault tolerance]).
    const char* refused = c.zero                               ? "--zero"
                          : c.sync_bn                          ? "--sync-bn"
                          : c.comm_hook == CommHook::kPowerSGD ? "--comm-hook powersgd"
                          : c.precision == Precision::kFp16    ? "--precision fp16"
                                                               : nullptr;
    if (refused != nullptr) {
      throw ConfigError(fmt::format(
          "--ft with {}: its state does not follow a re-formed group yet (ZeRO's shards, "
          "SyncBatchNorm's group, PowerSGD's error feedback, the gradient scaler's agreement); "
          "leave one of them out",
          refused));
    }
  }
  return true;
}

}  // namespace ddp::train
