// ddp-train's training run (see Note [Training loop] in trainer.h).
#include "trainer.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <optional>
#include <thread>

#include <ATen/autocast_mode.h>
#include <fmt/format.h>
#include <torch/csrc/jit/serialization/pickle.h>
#include <torch/torch.h>

#include "ddp/ddp.h"
#include "grad_scaler.h"
#include "models.h"
#include "progress.h"
#include "run_log.h"
#include "schedule.h"

namespace ddp::train {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

// The run folder: --output-dir, or runs/<name>/version_N (rank 0 picks N: the next free one,
// or with --resume auto the newest existing one) agreed by broadcast.
fs::path run_dir(const TrainConfig& c, ProcessGroup& pg) {
  if (!c.output_dir.empty()) return c.output_dir;
  const fs::path base = fs::path("runs") / c.name;
  at::Tensor version = at::zeros({1}, at::kLong);
  if (pg.rank() == 0) {
    int64_t newest = -1;
    if (fs::exists(base)) {
      for (const auto& e : fs::directory_iterator(base)) {
        const std::string n = e.path().filename().string();
        if (n.rfind("version_", 0) == 0) newest = std::max<int64_t>(newest, std::atoll(n.c_str() + 8));
      }
    }
    version[0] = c.resume == "auto" && newest >= 0 ? newest : newest + 1;
  }
  pg.broadcast(version, 0).wait();
  return base / fmt::format("version_{}", version.item<int64_t>());
}

std::shared_ptr<Dataset> load_split(Split split, const TrainConfig& c, int64_t subset) {
  auto full = std::make_shared<FashionMnist>(split, FashionMnistOptions{.dir = c.data_dir,
                                                                        .normalize = true});
  if (subset <= 0 || subset >= full->size()) return full;
  return std::make_shared<TensorDataset>(full->data().narrow(0, 0, subset),
                                         full->targets().narrow(0, 0, subset));
}

std::unique_ptr<torch::optim::Optimizer> make_optimizer(const TrainConfig& c,
                                                        std::vector<torch::Tensor> params) {
  if (c.optimizer == "adamw") {
    return std::make_unique<torch::optim::AdamW>(
        params, torch::optim::AdamWOptions(c.lr).weight_decay(c.weight_decay));
  }
  return std::make_unique<torch::optim::SGD>(
      params, torch::optim::SGDOptions(c.lr).momentum(c.momentum).weight_decay(c.weight_decay));
}

void set_lr(torch::optim::Optimizer& opt, double lr) {
  for (auto& group : opt.param_groups()) group.options().set_lr(lr);
}

// bf16 autocast for the forward pass (CPU or CUDA), restored on scope exit.
class Autocast {
 public:
  Autocast(bool on, bool cuda) : on_(on), cuda_(cuda) {
    if (!on_) return;
    if (cuda_) {
      at::autocast::set_enabled(true);
    } else {
      at::autocast::set_cpu_enabled(true);
      at::autocast::set_autocast_cpu_dtype(at::kBFloat16);
    }
  }
  ~Autocast() {
    if (!on_) return;
    if (cuda_) at::autocast::set_enabled(false);
    else at::autocast::set_cpu_enabled(false);
    at::autocast::clear_cache();
  }

 private:
  bool on_, cuda_;
};

// Threads per rank: the flag, else OMP_NUM_THREADS (ddprun sets 1 when it starts several
// workers), else the cores shared among this node's ranks.
int choose_threads(const TrainConfig& c, const ProcessGroup& pg) {
  if (c.threads > 0) return c.threads;
  if (const char* omp = std::getenv("OMP_NUM_THREADS")) return std::max(1, std::atoi(omp));
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  return std::max(1, cores / std::max(1, pg.local_size()));
}

EvalStats evaluate(ModelImpl& model, const Dataset& test, ProcessGroup& pg, c10::Device device,
                   int64_t batch_size) {
  // Each test sample exactly once across ranks: no padding, no shuffling.
  DistributedSampler sampler(test.size(), {.num_replicas = pg.size(), .rank = pg.rank(),
                                           .shuffle = false, .pad = false});
  // A non-owning pointer: `test` outlives the loader.
  DataLoader loader(std::shared_ptr<const Dataset>(&test, [](const Dataset*) {}), sampler,
                    {.batch_size = batch_size, .device = device});
  torch::NoGradGuard no_grad;
  model.eval();
  EvalStats local;
  for (auto& batch : loader) {
    auto logits = model.forward(batch.data).to(torch::kFloat);
    local.add(logits, batch.target,
              torch::cross_entropy_loss(logits, batch.target, {}, at::Reduction::None));
  }
  model.train();
  return all_reduce(local, pg);
}

// The final model for other tools: model.pt (LibTorch archive) and model_state.pt, a plain
// {name: tensor} dict that Python's torch.load() reads.
void save_final_model(ModelImpl& model, const fs::path& dir) {
  torch::save(std::static_pointer_cast<torch::nn::Module>(model.shared_from_this()),
              (dir / "model.pt").string());
  c10::Dict<std::string, at::Tensor> state;
  for (const auto& item : model.named_parameters()) state.insert(item.key(), item.value().cpu());
  for (const auto& item : model.named_buffers()) state.insert(item.key(), item.value().cpu());
  const std::vector<char> bytes = torch::pickle_save(c10::IValue(state));
  std::ofstream out(dir / "model_state.pt", std::ios::binary);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  if (!out) throw Error(fmt::format("cannot write {}", (dir / "model_state.pt").string()));
}

}  // namespace

int run(const TrainConfig& c) {
  const auto wall_start = Clock::now();
  auto pg = init_process_group();
  const int rank = pg->rank(), world = pg->size();
  const bool main = rank == 0;
  torch::set_num_threads(choose_threads(c, *pg));

  const bool cuda_available = torch::cuda::is_available();
  if (c.device == "cuda" && !cuda_available) {
    throw ConfigError("--device cuda: no CUDA device is available to this process");
  }
  const bool cuda = c.device == "cuda" || (c.device == "auto" && cuda_available);
  const c10::Device device = cuda ? c10::Device(c10::kCUDA, pg->local_rank()) : c10::Device(c10::kCPU);
  if (c.precision == "fp16" && !cuda) {
    throw ConfigError("--precision fp16 needs CUDA (fp16 autocast with a gradient scaler); on "
                      "the CPU use --precision bf16");
  }

  // Data: every rank reads the files; the sampler gives it its shard.
  auto train_set = load_split(Split::kTrain, c, c.train_subset);
  auto test_set = load_split(Split::kTest, c, c.test_subset);
  DistributedSampler sampler(train_set->size(), {.shuffle = true, .seed = c.seed});
  DataLoader loader(train_set, sampler,
                    {.batch_size = c.batch_size, .num_workers = c.workers, .device = device});

  // Model: the same seed everywhere (DDP copies rank 0's weights anyway).
  torch::manual_seed(c.seed);
  auto net = make_model(c.model, c.sync_bn);
  net->to(device);
  DistributedDataParallel model(net, {});
  auto opt = make_optimizer(c, model.parameters());
  std::optional<GradScaler> scaler;
  if (c.precision == "fp16") scaler.emplace();

  const int64_t batches_per_epoch = (sampler.num_samples() + c.batch_size - 1) / c.batch_size;
  const int64_t steps_per_epoch = (batches_per_epoch + c.grad_accum - 1) / c.grad_accum;
  const WarmupCosine schedule{
      .peak = c.lr * (c.scale_lr ? world : 1),
      .warmup_steps = static_cast<int64_t>(c.warmup_epochs * steps_per_epoch),
      .total_steps = c.epochs * steps_per_epoch};

  // Output and resume.
  const fs::path dir = run_dir(c, *pg);
  std::optional<RunLog> log;
  Progress progress(main, c.log_every);
  if (main) {
    log.emplace(dir);
    nlohmann::json hp = c.to_json();
    hp["world_size"] = world;
    hp["threads_per_rank"] = torch::get_num_threads();
    hp["ddp_version"] = DDP_VERSION;
    hp["blas"] = inspect_blas().summary();
    log->write_hparams(hp);
  }
  Checkpointer checkpoints(dir / "checkpoints",
                           {.keep = c.keep, .model_label = "--model " + c.model});
  CheckpointRefs refs{.model = net.get(), .optimizer = opt.get(), .sampler = &sampler};
  int64_t step = 0, start_epoch = 0;
  std::optional<fs::path> resume_from;
  if (c.resume == "auto") {
    ResumePoint found = checkpoints.latest_valid(pg.get());
    for (const auto& s : found.skipped) {
      progress.line(fmt::format("resume: skipped {}: {}", s.path.string(), s.reason));
    }
    resume_from = found.path;
  } else if (!c.resume.empty()) {
    resume_from = fs::path(c.resume);
  }
  if (resume_from) {
    LoadedCheckpoint got = checkpoints.load(*resume_from, refs, pg.get());
    step = got.meta.step;
    start_epoch = got.meta.epoch;
    progress.line(fmt::format("resumed from {} at epoch {}, step {}{}", resume_from->string(),
                              start_epoch, step,
                              got.world_size_changed
                                  ? fmt::format(" (written at world size {}, now {})",
                                                got.meta.world_size, world)
                                  : ""));
  }
  progress.line(fmt::format(
      "ddp-train: {} on Fashion-MNIST ({} train / {} test images), {} ranks x {} threads, "
      "batch {} per rank x {} accumulation, {} steps/epoch, {} epochs, {} lr {:.3g}, {}; run "
      "folder {}",
      c.model, train_set->size(), test_set->size(), world, torch::get_num_threads(), c.batch_size,
      c.grad_accum, steps_per_epoch, c.epochs, c.optimizer, schedule.peak, c.precision,
      dir.string()));

  progress.line(inspect_blas().summary());

  auto save_checkpoint = [&](int64_t epoch) {
    checkpoints.save(refs, {.step = step, .epoch = epoch, .hparams_json = c.to_json().dump()},
                     pg.get());
  };

  EvalStats last_eval;
  bool stop = c.max_steps > 0 && step >= c.max_steps;
  for (int64_t epoch = start_epoch; epoch < c.epochs && !stop; ++epoch) {
    sampler.set_epoch(epoch);  // a restored sampler keeps its position within this epoch
    const auto epoch_start = Clock::now();
    const int64_t remaining = static_cast<int64_t>(sampler.remaining().size());
    const int64_t batches = (remaining + c.batch_size - 1) / c.batch_size;
    progress.start_epoch(epoch, c.epochs, steps_per_epoch, steps_per_epoch -
                         (batches + c.grad_accum - 1) / c.grad_accum);
    int64_t b = 0, micro = 0, step_in_epoch = steps_per_epoch - (batches + c.grad_accum - 1) / c.grad_accum;
    double step_loss = 0, interval_loss = 0;
    int64_t interval_steps = 0, step_samples = 0;
    for (auto& batch : loader) {
      // Micro-batches in this optimizer step: grad_accum, or fewer at the end of the epoch.
      const int64_t group_start = b - micro;
      const int64_t in_group = std::min<int64_t>(c.grad_accum, batches - group_start);
      const bool sync_now = micro + 1 == in_group;
      {
        std::optional<NoSyncGuard> no_sync;
        if (!sync_now) no_sync.emplace(model.core());
        torch::Tensor loss;
        {
          Autocast autocast(c.precision != "fp32", cuda);
          loss = torch::cross_entropy_loss(model(batch.data).to(torch::kFloat), batch.target) /
                 static_cast<double>(in_group);
        }
        (scaler ? scaler->scale(loss) : loss).backward();
        step_loss += loss.item<double>();
      }
      step_samples += batch.data.size(0);
      ++b;
      if (!sync_now) {
        ++micro;
        continue;
      }
      micro = 0;
      set_lr(*opt, schedule.at(step));
      if (scaler) {
        const bool finite = scaler->unscale_and_check(model.parameters(), *pg);
        if (finite) opt->step();
        scaler->update(finite);
      } else {
        opt->step();
      }
      opt->zero_grad();
      ++step;
      ++step_in_epoch;
      interval_loss += step_loss;
      ++interval_steps;
      progress.step(step_in_epoch, step_loss, step_samples * world);
      step_loss = 0;
      step_samples = 0;
      if (step % c.log_every == 0) {
        at::Tensor l = at::full({1}, interval_loss / interval_steps, at::kDouble);
        pg->all_reduce(l, ReduceOp::kAvg).wait();
        if (log) {
          log->append({.step = step, .epoch = epoch, .split = "train", .loss = l.item<double>(),
                       .lr = schedule.at(step - 1), .samples_per_s = progress.samples_per_s(),
                       .wall_s = seconds_since(wall_start)});
        }
        interval_loss = 0;
        interval_steps = 0;
      }
      if (c.checkpoint_every > 0 && step % c.checkpoint_every == 0) save_checkpoint(epoch);
      if (c.max_steps > 0 && step >= c.max_steps) {
        stop = true;
        break;
      }
    }
    progress.end_epoch();
    const double train_samples_per_s = progress.samples_per_s();
    if (stop && c.checkpoint_every > 0 && step % c.checkpoint_every == 0) {
      // Stopped mid-epoch exactly at a checkpoint: it is already written.
    } else if (stop) {
      save_checkpoint(epoch);
    }
    last_eval = evaluate(*net, *test_set, *pg, device, 256);
    const double epoch_s = seconds_since(epoch_start);
    progress.line(fmt::format(
        "epoch {}/{}: test loss {:.4f}, test accuracy {:.2f}% ({}/{}), {:.1f} s, {:.0f} "
        "samples/s",
        epoch + 1, c.epochs, last_eval.mean_loss(), 100 * last_eval.accuracy(),
        last_eval.correct, last_eval.count, epoch_s, train_samples_per_s));
    if (log) {
      log->append({.step = step, .epoch = epoch, .split = "test", .loss = last_eval.mean_loss(),
                   .accuracy = last_eval.accuracy(), .lr = schedule.at(std::max<int64_t>(step - 1, 0)),
                   .samples_per_s = train_samples_per_s, .wall_s = seconds_since(wall_start)});
    }
    if (!stop) {
      sampler.set_epoch(epoch + 1);  // the checkpoint resumes at the next epoch's start
      save_checkpoint(epoch + 1);
    }
  }

  if (main) {
    save_final_model(*net, dir);
    progress.line(fmt::format(
        "done: test accuracy {:.2f}% ({}/{}), test loss {:.4f}, {} steps, {:.1f} s; model in {}",
        100 * last_eval.accuracy(), last_eval.correct, last_eval.count, last_eval.mean_loss(),
        step, seconds_since(wall_start), (dir / "model_state.pt").string()));
    if (c.plots) progress.line(log->plot());
  }
  barrier();
  destroy_process_group();
  return 0;
}

}  // namespace ddp::train
