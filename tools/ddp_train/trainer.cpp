// ddp-train's training run (see Note [Training loop] in trainer.h).
#include "trainer.h"

#include "run.h"

#include <unistd.h>  // getpid

#include <algorithm>
#include <chrono>
#include <cstring>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <optional>
#include <thread>

#include <ATen/autocast_mode.h>
#include <fmt/format.h>
#include <torch/csrc/jit/serialization/pickle.h>
#include <torch/torch.h>

#include "ddp/datasets.h"  // FashionMnist
#include "ddp/ddp.h"
#include "ddp/run_lease.h"  // RunLease: this group holds the run folder
#include "ddp/runtime.h"    // set_num_threads, inspect_blas, parse_dist_env
#include "grad_scaler.h"
#include "models.h"
#include "preemption.h"
#include "progress.h"
#include "run_log.h"
#include "schedule.h"

namespace ddp::train {

double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

// The run folder: --output-dir, or runs/<name>/version_N (rank 0 picks N: the next free one,
// or with --resume auto the newest existing one).
fs::path pick_run_dir(const TrainConfig& c) {
  if (!c.output_dir.empty()) return c.output_dir;
  const fs::path base = fs::path("runs") / c.name;
  int64_t newest = -1;
  if (fs::exists(base)) {
    for (const auto& e : fs::directory_iterator(base)) {
      const std::string n = e.path().filename().string();
      if (n.rfind("version_", 0) == 0)
        newest = std::max<int64_t>(newest, std::atoll(n.c_str() + 8));
    }
  }
  return base / fmt::format("version_{}", c.resume == "auto" && newest >= 0 ? newest : newest + 1);
}

// Rank 0's text on every rank (a length, then the bytes).
std::string broadcast_text(ProcessGroup& pg, std::string text) {
  at::Tensor n = at::full({1}, static_cast<int64_t>(text.size()), at::kLong);
  pg.broadcast(n, 0).wait();
  at::Tensor bytes = at::zeros({n.item<int64_t>()}, at::kByte);
  if (pg.rank() == 0) std::memcpy(bytes.data_ptr(), text.data(), text.size());
  pg.broadcast(bytes, 0).wait();
  return {static_cast<const char*>(bytes.data_ptr()), static_cast<size_t>(bytes.numel())};
}

// `forward`: the model's, or its wrapper's (FSDP gathers the parameters for it).
EvalStats evaluate(ModelImpl& model, const std::function<at::Tensor(const at::Tensor&)>& forward,
                   const Dataset& test, ProcessGroup& pg, c10::Device device, int64_t batch_size) {
  // Each test sample exactly once across ranks: no padding, no shuffling.
  DistributedSampler sampler(test.size(), {.num_replicas = pg.size(),
                                           .rank = pg.rank(),
                                           .shuffle = false,
                                           .pad = false});
  // A non-owning pointer: `test` outlives the loader.
  DataLoader loader(std::shared_ptr<const Dataset>(&test, [](const Dataset*) {}), sampler,
                    {.batch_size = batch_size, .device = device});
  torch::NoGradGuard no_grad;
  model.eval();
  EvalStats local;
  for (auto& batch : loader) {
    auto logits = forward(batch.data).to(torch::kFloat);
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

namespace {

// Exposed communication above this share of the step gets a line of advice at the epoch's end.
constexpr double kCommShareAdvice = 0.25;

// The launcher's LOCAL_WORLD_SIZE (1 alone).
int local_ranks() {
  try {
    return parse_dist_env(current_environment()).local_world_size;
  } catch (const Error&) {
    return 1;
  }
}

// Rank 0's run folder, agreed by broadcast.
fs::path run_dir(const TrainConfig& c, ProcessGroup& pg) {
  if (!c.output_dir.empty()) return c.output_dir;
  return broadcast_text(pg, pg.rank() == 0 ? pick_run_dir(c).string() : "");
}

// The four Fashion-MNIST files (gzipped or not), else an error that speaks in ddp-train's flags.
void require_fashion_mnist(const TrainConfig& c) {
  const fs::path dir = c.data_dir.empty() ? std::string(kFashionMnistDefaultDir) : c.data_dir;
  for (const std::string name : {"train-images-idx3-ubyte", "train-labels-idx1-ubyte",
                                 "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"}) {
    std::error_code ec;
    if (fs::is_regular_file(dir / (name + ".gz"), ec) || fs::is_regular_file(dir / name, ec)) {
      continue;
    }
    throw ConfigError(fmt::format(
        "Fashion-MNIST not found: {} has no {}.gz (nor {}). {}", dir.string(), name, name,
        c.data_dir.empty()
            ? fmt::format("Install Debian's package dataset-fashion-mnist (apt-get install "
                          "dataset-fashion-mnist puts it in {}), or pass --data-dir FOLDER "
                          "holding {{train,t10k}}-{{images-idx3,labels-idx1}}-ubyte[.gz]",
                          kFashionMnistDefaultDir)
            : fmt::format("Check --data-dir {}: it must hold "
                          "{{train,t10k}}-{{images-idx3,labels-idx1}}-ubyte[.gz]; or install "
                          "Debian's package dataset-fashion-mnist and leave --data-dir out (it "
                          "defaults to {})",
                          c.data_dir, kFashionMnistDefaultDir)));
  }
}

std::shared_ptr<Dataset> load_split(Split split, const TrainConfig& c, int64_t subset) {
  // Only the subset is kept (a worker of a short run starts faster), unless the split has
  // fewer samples, which the check below names. Each host's local rank 0 reads the files whole,
  // checking them (length, gzip CRC) for every rank there; the others read only their subset
  // (the train images' rest is 0.4 CPU-s of a worker's start). A damaged file fails the job.
  const bool checker = parse_dist_env(current_environment()).local_rank == 0;
  auto full =
      std::make_shared<FashionMnist>(split, FashionMnistOptions{.dir = c.data_dir,
                                                                .normalize = true,
                                                                .limit = subset,
                                                                .check_whole_files = checker});
  if (subset > full->size()) {
    const char* which = split == Split::kTrain ? "train" : "test";
    throw ConfigError(fmt::format("--{}-subset {}: the {} set has {} images; use at most {} (0: "
                                  "all of them)",
                                  which, subset, which, full->size(), full->size()));
  }
  if (subset <= 0 || subset == full->size()) return full;
  return std::make_shared<TensorDataset>(full->data().narrow(0, 0, subset),
                                         full->targets().narrow(0, 0, subset));
}

std::unique_ptr<torch::optim::Optimizer> make_optimizer(const TrainConfig& c,
                                                        std::vector<torch::Tensor> params) {
  if (c.optimizer == Optimizer::kAdamW) {
    return std::make_unique<torch::optim::AdamW>(params,
                                                 torch::optim::AdamWOptions(c.lr).weight_decay(
                                                     c.weight_decay));
  }
  return std::make_unique<torch::optim::SGD>(
      params, torch::optim::SGDOptions(c.lr).momentum(c.momentum).weight_decay(c.weight_decay));
}

void set_lr(torch::optim::Optimizer& opt, double lr) {
  for (auto& group : opt.param_groups()) group.options().set_lr(lr);
}

// --zero: the same optimizer, its state sharded over the ranks (Note [ZeRO-1]).
std::unique_ptr<ZeroRedundancyOptimizer> make_zero_optimizer(const TrainConfig& c,
                                                              std::vector<torch::Tensor> params,
                                                              std::shared_ptr<ProcessGroup> pg) {
  if (c.optimizer == Optimizer::kAdamW) {
    return std::make_unique<ZeroRedundancyOptimizer>(
        ZeroRedundancyOptimizer::make<torch::optim::AdamW>(
            std::move(params), torch::optim::AdamWOptions(c.lr).weight_decay(c.weight_decay),
            std::move(pg)));
  }
  return std::make_unique<ZeroRedundancyOptimizer>(ZeroRedundancyOptimizer::make<torch::optim::SGD>(
      std::move(params),
      torch::optim::SGDOptions(c.lr).momentum(c.momentum).weight_decay(c.weight_decay),
      std::move(pg)));
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
    if (cuda_)
      at::autocast::set_enabled(false);
    else
      at::autocast::set_cpu_enabled(false);
    at::autocast::clear_cache();
  }

 private:
  bool on_, cuda_;
};

}  // namespace

SampleLog::SampleLog(const fs::path& dir, const std::string& name) {
  fs::create_directories(dir);
  out_.open(dir / name, std::ios::app);
  if (!out_) throw Error(fmt::format("--sample-log: cannot write {}", (dir / name).string()));
}

void SampleLog::write(int64_t epoch, int64_t step, int world, const std::vector<int64_t>& indices) {
  out_ << epoch << ' ' << step << ' ' << world;
  for (int64_t i : indices) out_ << ' ' << i;
  out_ << '\n' << std::flush;
}

Run::Run(const TrainConfig& c) : c_(c) {
  // The device first, before the group forms (no rendezvous wait for a job that cannot run) and
  // before anything touches CUDA: a CUDA rank binds cuda:LOCAL_RANK whatever the backend
  // (Note [Device binding]).
  const bool cuda_available = torch::cuda::is_available();
  if (c_.device == Device::kCuda && !cuda_available) {
    throw ConfigError(
        "--device cuda: no CUDA device is available to this process (a CPU-only LibTorch, no "
        "GPU, or CUDA_VISIBLE_DEVICES hides them); use --device cpu or --device auto");
  }
  cuda_ = c_.device == Device::kCuda || (c_.device == Device::kAuto && cuda_available);
  if (c_.ft && cuda_) {
    throw ConfigError(
        "--ft trains on the CPU for now (a CUDA group would need NCCL's abort and a new "
        "communicator per quorum, which is designed but not built); use --device cpu");
  }
  InitOptions init;
  if (cuda_) {
    const int local_rank = parse_dist_env(current_environment()).local_rank;
    const int visible = static_cast<int>(torch::cuda::device_count());
    if (local_rank >= visible) {
      throw ConfigError(fmt::format(
          "--device {}: LOCAL_RANK {} has no GPU ({} visible); start at most {} ranks per node "
          "(ddprun --nproc-per-node gpu)",
          to_string(c_.device), local_rank, visible, visible));
    }
    init.device_id = local_rank;
  }
  if (c_.ft) {
    const EnvMap env = current_environment();
    const auto agent = env.find("DDP_AGENT_STORE");
    if (agent == env.end() || agent->second != "ddp") {
      throw ConfigError(
          "--ft needs a coordination store that outlives every replica, which ddprun --ft "
          "hosts: start the job with ddprun --ft ... ddp-train --ft (DDP_AGENT_STORE is not "
          "'ddp' here)");
    }
    // No job-wide group: one per quorum, the manager's (the first a group of this replica alone
    // until start_quorum()); the threads init_process_group() would have set.
    ft::ManagerOptions mo;
    mo.replica_id = fmt::format("{}-pid{}", c_.name, static_cast<int>(::getpid()));
    mo.min_replicas = c_.ft_min_replicas;
    ft_ = std::make_unique<ft::Manager>(state_, mo);
    pg_ = ft_->process_group();
    ddp::set_num_threads(c_.threads > 0 ? c_.threads : threads_per_rank(local_ranks()));
  } else {
    pg_ = init_process_group(init);
    // init_process_group set threads_per_rank() for LibTorch and the BLAS; --threads overrides.
    if (c_.threads > 0) ddp::set_num_threads(c_.threads);
  }
  device_ = cuda_ ? c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(*pg_->bound_device_id()))
                  : c10::Device(c10::kCPU);
  if (c_.precision == Precision::kFp16 && !cuda_) {
    throw ConfigError(
        "--precision fp16 needs CUDA (fp16 autocast with a gradient scaler); on "
        "the CPU use --precision bf16");
  }

  // Data: every rank reads the files; the sampler gives it its shard.
  require_fashion_mnist(c_);
  train_set_ = load_split(Split::kTrain, c_, c_.train_subset);
  test_set_ = load_split(Split::kTest, c_, c_.test_subset);
  sampler_ = DistributedSampler(train_set_->size(), {.shuffle = true, .seed = c_.seed});
  // A batch above a rank's share would be one short batch per epoch on every rank (and, for a
  // number like 1e14, an allocation the kernel's OOM killer ends): one line instead.
  if (c_.batch_size > sampler_.num_samples()) {
    throw ConfigError(fmt::format(
        "--batch-size {} is larger than each rank's share of the training set ({} images at "
        "world size {}: {} per rank); use at most {}",
        c_.batch_size, train_set_->size(), pg_->size(), sampler_.num_samples(),
        sampler_.num_samples()));
  }
  const int64_t batches = (sampler_.num_samples() + c_.batch_size - 1) / c_.batch_size;
  if (c_.grad_accum > batches) {
    throw ConfigError(fmt::format(
        "--grad-accum {} is more micro-batches than an epoch has ({} of {} images per rank): "
        "each optimizer step would be the whole epoch, not {} micro-batches; use at most {}",
        c_.grad_accum, batches, sampler_.num_samples(), c_.grad_accum, batches));
  }
  loader_ = std::make_unique<DataLoader>(train_set_, sampler_,
                                         LoaderOptions{.batch_size = c_.batch_size,
                                                       .num_workers = c_.workers,
                                                       .device = device_});

  // Model: the same seed everywhere (DDP copies rank 0's weights anyway).
  torch::manual_seed(c_.seed);
  net_ = make_model(c_.model, c_.sync_bn, /*sharded=*/c_.fsdp == "zero3");
  net_->to(device_);
  if (!c_.fsdp.empty()) build_fsdp();
  // Gradients as views into the buckets, as the README's example: no copy into the buckets
  // after backward, none back out (the MLP: 82% -> 88% of the communication-free ceiling).
  // With --ft, on the manager's group, which it follows to every quorum; the first quorum gives
  // every replica rank 0's weights (init_sync's part).
  if (!fsdp_) {
    model_ =
        std::make_unique<DistributedDataParallel<ModelImpl>>(net_,
                                                             DDPOptions{.process_group = pg_,
                                                                        .gradient_as_bucket_view =
                                                                            true,
                                                                        .init_sync = !c_.ft});
  }
  if (c_.comm_hook == CommHook::kFp16) model_->register_comm_hook(comm_hooks::fp16_compress());
  if (c_.comm_hook == CommHook::kBf16) model_->register_comm_hook(comm_hooks::bf16_compress());
  if (c_.comm_hook == CommHook::kPowerSGD) {
    powersgd_ = std::make_shared<comm_hooks::PowerSGDState>(comm_hooks::PowerSGDOptions{
        .matrix_approximation_rank = c_.powersgd_rank, .start_powerSGD_iter = c_.powersgd_start});
    model_->register_comm_hook(comm_hooks::powerSGD_hook(powersgd_));
  }
  if (c_.zero) {
    zero_opt_ = make_zero_optimizer(c_, model_->parameters(), pg_);
  } else {
    opt_ = make_optimizer(c_, trained_parameters());
  }
  if (c_.precision == Precision::kFp16) scaler_.emplace();

  set_schedule(pg_->size());
  if (!c_.ft) {  // --ft: at each quorum (on_quorum())
    dir_ = run_dir(c_, *pg_);
    claim_run_folder(RunIdentity{.run_id = pg_->env().run_id,
                                 .lineage = pg_->env().run_lineage,
                                 .round = pg_->env().restart_count});
    if (!c_.sample_log.empty()) {
      const DistEnv& env = pg_->env();
      sample_log_.emplace(c_.sample_log,
                          fmt::format("attempt{}.rank{}.pid{}.txt", env.restart_count, env.rank,
                                      static_cast<int>(::getpid())));
    }
    progress_ = std::make_unique<Progress>(pg_->rank() == 0, c_.log_every);
    open_run_log();
    checkpoints_ =
        std::make_unique<Checkpointer>(dir_ / "checkpoints",
                                       CheckpointerOptions{.keep = c_.keep,
                                                           .model_label = "--model " + c_.model,
                                                           .sharded =
                                                               c_.checkpoint_format == "sharded",
                                                           .lease = lease_});
  }
  if (fsdp_) {
    state_.add("model", *fsdp_);             // each rank's part: any world size
    state_.add("optimizer", *opt_, *fsdp_);  // each rank's shards' state: the same world size
  } else {
    state_.add("model", *model_);  // the module and DDP's rebuilt bucket order
    if (zero_opt_) {
      state_.add("optimizer", *zero_opt_);
    } else {
      state_.add("optimizer", *opt_);
    }
  }
  state_.add("sampler", sampler_);
  state_.add("rng", default_generators());
  if (powersgd_) state_.add("powersgd", *powersgd_);
  // The evaluation of exactly the saved step (a finished run reports it without evaluating
  // again). Optional: checkpoints of format 1 kept it in their blob (resume()).
  state_.add("trainer",
             json_state([this] { return trainer_json(); },
                        [this](const std::string& j) { load_trainer_json(j); }),
             {.optional = true});
}

// Steps per epoch and the schedule at this world size (Note [Progress]).
void Run::set_schedule(int world_size) {
  // Each rank's share of an epoch at this size (pad: every rank the same).
  const int64_t per_rank =
      DistributedSampler(train_set_->size(), {.num_replicas = world_size, .rank = 0}).num_samples();
  const int64_t batches_per_epoch = (per_rank + c_.batch_size - 1) / c_.batch_size;
  steps_per_epoch_ = (batches_per_epoch + c_.grad_accum - 1) / c_.grad_accum;
  schedule_ = {.peak = c_.lr * (c_.scale_lr ? world_size : 1),
               .warmup_steps = static_cast<int64_t>(c_.warmup_epochs * steps_per_epoch_),
               .total_steps = c_.epochs * steps_per_epoch_};
}

// Rank 0's metrics.csv and hparams.json.
void Run::open_run_log() {
  if (pg_->rank() != 0) {
    log_.reset();
    return;
  }
  log_.emplace(dir_, lease_);
  nlohmann::json hp = c_.to_json();
  hp["world_size"] = pg_->size();
  hp["threads_per_rank"] = torch::get_num_threads();
  hp["ddp_version"] = DDP_VERSION;
  hp["blas"] = inspect_blas().summary();
  log_->write_hparams(hp);
}

// Note [Run folder lease] (ddp/run_lease.h): rank 0 holds the run folder before anything is
// written into it, and every rank learns whether it could.
void Run::claim_run_folder(const RunIdentity& me) {
  std::exception_ptr failed;
  std::string why;
  if (pg_->rank() == 0 && !(lease_ && lease_->held())) {
    try {
      lease_ = RunLease::acquire(dir_, me);
    } catch (const Error& e) {
      failed = std::current_exception();
      why = e.what();
    }
  }
  why = broadcast_text(*pg_, why);
  if (failed) std::rethrow_exception(failed);
  if (!why.empty()) {
    throw Relayed<FencedError>(0, fmt::format("[rank {}] rank 0 could not take the run folder: {}",
                                              pg_->rank(), why));
  }
}

std::string Run::trainer_json() const {
  nlohmann::json j = {{"step", step_}, {"test", nullptr}};
  if (eval_step_ == step_) {  // the evaluation of exactly this state
    j["test"] = {{"loss_sum", last_eval_.loss_sum},
                 {"correct", last_eval_.correct},
                 {"count", last_eval_.count}};
  }
  return j.dump();
}

void Run::load_trainer_json(const std::string& text) {
  const nlohmann::json j = nlohmann::json::parse(text);
  if (j.contains("test") && j["test"].is_object()) {
    last_eval_ = {.loss_sum = j["test"]["loss_sum"],
                  .correct = j["test"]["correct"],
                  .count = j["test"]["count"]};
    eval_step_ = j.value("step", int64_t{-1});
  }
}

void Run::resume() {
  std::optional<fs::path> from;
  if (c_.resume == "auto") {
    ResumePoint found = checkpoints_->latest_valid(*pg_);
    for (const auto& s : found.skipped) {
      progress_->line(fmt::format("resume: skipped {}: {}", s.path.string(), s.reason));
    }
    // Every checkpoint damaged: starting over would silently discard the run's progress, so
    // refuse, on every rank, with rank 0's list of files and reasons.
    std::string refusal;
    if (pg_->rank() == 0 && !found.path && !found.skipped.empty()) {
      std::vector<std::string> why;
      for (const auto& s : found.skipped) {
        why.push_back(fmt::format("{}: {}", s.path.filename().string(), s.reason));
      }
      refusal = fmt::format(
          "--resume auto: none of the {} checkpoint(s) in {} is valid ({}); not starting over "
          "from step 0, which would discard the run's progress. To start over, move or delete "
          "that folder; to resume from a particular file, pass --resume PATH",
          found.skipped.size(), checkpoints_->dir().string(), fmt::join(why, "; "));
    }
    refusal = broadcast_text(*pg_, refusal);
    if (!refusal.empty()) throw ConfigError(refusal);
    if (!found.path) {
      progress_->line(fmt::format("resume: no checkpoint in {} yet; starting from step 0",
                                  checkpoints_->dir().string()));
    }
    from = found.path;
  } else if (!c_.resume.empty()) {
    from = fs::path(c_.resume);
  }
  if (from) {
    const auto load_started = Clock::now();
    LoadedCheckpoint got = checkpoints_->load(*from, state_, *pg_);
    const double load_s = seconds_since(load_started);
    step_ = got.meta.step;
    ddp::set_training_step(step_);
    saved_step_ = step_;
    saved_path_ = *from;
    start_epoch_ = got.meta.epoch;
    if (got.meta.format_version == 1) resume_format_1(got.meta.blob);
    std::string where;
    if (got.world_size_changed && !finished()) {
      where = fmt::format(
          " (written at world size {}, now {}: the epoch continues from the same sample, "
          "{} steps of {} left in it at this world size)",
          got.meta.world_size, pg_->size(), steps_left_in_epoch(), steps_per_epoch_);
    }
    progress_->line(
        fmt::format("resumed from {} at epoch {}, step {}{} (read and restored in "
                    "{:.0f} ms)",
                    from->string(), start_epoch_, step_, where, 1000 * load_s));
  }
  // The rows an interrupted attempt wrote after this checkpoint would repeat steps.
  if (log_ && !c_.resume.empty()) {
    if (const int64_t dropped = log_->drop_after(step_); dropped > 0) {
      progress_->line(
          fmt::format("metrics.csv: dropped {} row(s) after step {} (written after "
                      "that checkpoint by the interrupted run)",
                      dropped, step_));
    }
  }
}

int64_t Run::steps_left_in_epoch() const {
  const int64_t batches = (samples_left_in_epoch() + c_.batch_size - 1) / c_.batch_size;
  return (batches + c_.grad_accum - 1) / c_.grad_accum;
}

bool Run::finished() const {
  return start_epoch_ >= c_.epochs || (c_.max_steps > 0 && step_ >= c_.max_steps);
}

// A finished run's summary: the final evaluation stored in its checkpoint, or (checkpoints
// without one: those written mid-epoch) a fresh one of the restored model.
int Run::report_finished() {
  if (eval_step_ != step_)
    last_eval_ = evaluate(*net_, model_forward(), *test_set_, *pg_, device_, 256);
  const std::string where =
      start_epoch_ >= c_.epochs
          ? fmt::format("epoch {}/{}", c_.epochs, c_.epochs)
          : fmt::format("--max-steps {}, in epoch {}/{}; raise --max-steps to train on",
                        c_.max_steps, start_epoch_ + 1, c_.epochs);
  progress_->line(fmt::format(
      "run already finished at step {} ({}); nothing to do. Test accuracy {:.2f}% ({}/{}), "
      "test loss {:.4f}; model in {}",
      step_, where, 100 * last_eval_.accuracy(), last_eval_.correct, last_eval_.count,
      last_eval_.mean_loss(), (dir_ / "model_state.pt").string()));
  barrier();
  destroy_process_group();
  return 0;
}

// A checkpoint of format 1 (ddp-cpp 0.1.0) kept DDP's bucket order and the last evaluation in
// its blob, as JSON.
void Run::resume_format_1(const std::string& blob_text) {
  if (blob_text.empty()) return;
  const nlohmann::json blob = nlohmann::json::parse(blob_text);
  // The buckets the saved run had rebuilt, so summation order matches from the first step.
  if (blob.contains("bucket_order") && model_) {
    model_->restore_bucket_order(blob["bucket_order"].get<std::vector<int64_t>>());
  }
  if (blob.contains("test"))
    load_trainer_json(nlohmann::json{{"step", step_}, {"test", blob["test"]}}.dump());
}

void Run::save_checkpoint(int64_t epoch) {
  saved_path_ =
      checkpoints_
          ->save(state_, {.step = step_, .epoch = epoch, .hparams_json = c_.to_json().dump()}, *pg_)
          .path;
  saved_step_ = step_;
}

double Run::micro_step(const Batch& batch, bool sync, int64_t micro_batches) {
  // The forward and backward through `model` (DDP or FSDP), inside its no_sync guard.
  torch::Tensor loss;
  auto forward_backward = [&](auto& model) {
    {
      Autocast autocast(c_.precision != Precision::kFp32, cuda_);
      loss = torch::cross_entropy_loss(model(batch.data).to(torch::kFloat), batch.target) /
             static_cast<double>(micro_batches);
    }
    (scaler_ ? scaler_->scale(loss) : loss).backward();
  };
  if (fsdp_) {
    const FSDPNoSyncGuard no_sync = fsdp_->no_sync(/*enabled=*/!sync);
    forward_backward(*fsdp_);
  } else {
    const NoSyncGuard no_sync = model_->no_sync(/*enabled=*/!sync);
    forward_backward(*model_);
    if (sync && pg_->size() > 1) {
      const IterationStats& s = model_->last_iteration_stats();
      comm_s_ += s.finalize_end_s - s.finalize_start_s;
    }
  }
  return loss.item<double>();
}

void Run::optimizer_step(int64_t schedule_step) {
  lr_ = schedule_.at(schedule_step);
  auto step = [&] { zero_opt_ ? zero_opt_->step() : static_cast<void>(opt_->step()); };
  if (zero_opt_) {
    zero_opt_->set_lr(lr_);
  } else {
    set_lr(*opt_, lr_);
  }
  if (scaler_) {
    const bool finite = scaler_->unscale_and_check(trained_parameters(), *pg_);
    if (finite) step();
    scaler_->update(finite);
  } else {
    step();
  }
  if (zero_opt_) {
    zero_opt_->zero_grad();
  } else {
    opt_->zero_grad();
  }
  ++step_;
  ddp::set_training_step(step_);  // hang reports name the step of each collective
}

void Run::pace(Clock::time_point started) const {
  if (c_.min_step_ms > 0)
    std::this_thread::sleep_until(started + std::chrono::milliseconds(c_.min_step_ms));
}

bool Run::stop_requested() {
  if (pg_->size() == 1) return preemption_->requested();
  at::Tensor flag = at::full({1}, preemption_->requested() ? 1 : 0, at::kInt);
  pg_->all_reduce(flag, ReduceOp::kMax).wait();
  return flag.item<int>() != 0;
}

// Every rank knows the step, so every rank joins this all-reduce of the interval's loss.
void Run::log_interval(int64_t epoch) {
  at::Tensor l = at::full({1}, interval_loss_ / interval_steps_, at::kDouble);
  pg_->all_reduce(l, ReduceOp::kAvg).wait();
  if (log_) {
    log_->append({.step = step_,
                  .epoch = epoch,
                  .split = "train",
                  .loss = l.item<double>(),
                  .lr = lr_,
                  .samples_per_s = progress_->samples_per_s(),
                  .wall_s = seconds_since(wall_start_)});
  }
  interval_loss_ = 0;
  interval_steps_ = 0;
}

EpochEnd Run::train_epoch(int64_t epoch) {
  // What is left of the epoch (all of it, unless resumed mid-epoch): `batches` micro-batches
  // in optimizer steps of grad_accum (the last step of an epoch may have fewer).
  const int64_t batches = (samples_left_in_epoch() + c_.batch_size - 1) / c_.batch_size;
  int64_t step_in_epoch = steps_per_epoch_ - steps_left_in_epoch();
  progress_->start_epoch(epoch, c_.epochs, steps_per_epoch_, step_in_epoch);
  int64_t b = 0, micro = 0, step_samples = 0;
  double step_loss = 0;
  // --sample-log: this rank's indices for the rest of the epoch, in the loader's order.
  const std::vector<int64_t> plan =
      sample_log_ ? sampler_.remaining() : std::vector<int64_t>{};
  size_t planned = 0;
  std::vector<int64_t> step_indices;
  comm_s_ = step_s_ = 0;
  auto step_start = Clock::now();  // the step's data loading counts as part of it
  for (auto& batch : *loader_) {
    const int64_t in_group = std::min<int64_t>(c_.grad_accum, batches - (b - micro));
    const bool sync = micro + 1 == in_group;
    step_loss += micro_step(batch, sync, in_group);
    step_samples += batch.data.size(0);
    if (sample_log_) {
      const size_t rows = static_cast<size_t>(batch.data.size(0));
      step_indices.insert(step_indices.end(), plan.begin() + static_cast<ptrdiff_t>(planned),
                          plan.begin() + static_cast<ptrdiff_t>(std::min(planned + rows,
                                                                          plan.size())));
      planned += rows;
    }
    ++b;
    if (!sync) {
      ++micro;
      continue;
    }
    micro = 0;
    optimizer_step(epoch * steps_per_epoch_ + step_in_epoch);
    if (sample_log_) {
      sample_log_->write(epoch, step_, pg_->size(), step_indices);
      step_indices.clear();
    }
    step_s_ += seconds_since(step_start);
    pace(step_start);
    interval_loss_ += step_loss;
    ++interval_steps_;
    progress_->step(++step_in_epoch, step_loss, step_samples * pg_->size());
    step_loss = 0;
    step_samples = 0;
    if (step_ % c_.log_every == 0) log_interval(epoch);
    if (c_.checkpoint_every > 0 && step_ % c_.checkpoint_every == 0) save_checkpoint(epoch);
    if (stop_requested()) return EpochEnd::kPreempted;
    if (c_.max_steps > 0 && step_ >= c_.max_steps) return EpochEnd::kMaxSteps;
    step_start = Clock::now();  // logging and checkpoints are not part of a step
  }
  return EpochEnd::kDone;
}

void Run::end_epoch(int64_t epoch, bool stopped, double samples_per_s, Clock::time_point started) {
  last_eval_ = evaluate(*net_, model_forward(), *test_set_, *pg_, device_, 256);
  eval_step_ = step_;
  if (stopped && saved_step_ != step_) {
    save_checkpoint(epoch);  // stopped mid-epoch (--max-steps) between two checkpoints
  }
  // Rank 0's share of the step spent waiting for gradients after backward's compute.
  const double comm_share = step_s_ > 0 ? comm_s_ / step_s_ : 0;
  progress_->line(fmt::format(
      "epoch {}/{}: test loss {:.4f}, test accuracy {:.2f}% ({}/{}), {:.1f} s, {:.0f} samples/s{}",
      epoch + 1, c_.epochs, last_eval_.mean_loss(), 100 * last_eval_.accuracy(), last_eval_.correct,
      last_eval_.count, seconds_since(started), samples_per_s,
      pg_->size() > 1 && !fsdp_ ? fmt::format(", comm {:.0f}% of step", 100 * comm_share) : ""));
  if (pg_->size() > 1 && comm_share > kCommShareAdvice) {
    // PowerSGD's P and Q all-reduces run in that wait by design (Note [Chained futures]).
    const char* hook_advice = c_.comm_hook == CommHook::kNone
                                  ? ", or --comm-hook bf16 (half the bytes) or powersgd"
                              : c_.comm_hook == CommHook::kPowerSGD
                                  ? " (with PowerSGD, its second and third all-reduces of "
                                    "each bucket wait here by design)"
                                  : "";
    progress_->line(fmt::format(
        "note: {:.0f}% of each step waits for gradient communication after backward; try a "
        "larger --batch-size or --grad-accum K{}",
        100 * comm_share, hook_advice));
  }
  log_test_row(epoch, samples_per_s);
  if (!stopped) {
    sampler_.set_epoch(epoch + 1);  // the checkpoint resumes at the next epoch's start
    save_checkpoint(epoch + 1);
  }
}

// Rank 0's metrics.csv row of last_eval_, the evaluation of this step.
void Run::log_test_row(int64_t epoch, double samples_per_s) {
  if (!log_) return;
  log_->append({.step = step_,
                .epoch = epoch,
                .split = "test",
                .loss = last_eval_.mean_loss(),
                .accuracy = last_eval_.accuracy(),
                .lr = lr_,
                .samples_per_s = samples_per_s,
                .wall_s = seconds_since(wall_start_)});
}

// Every rank agreed to stop after this step: a checkpoint of it (unless one was just
// written), then out with kExitPreempted. No evaluation: the grace period is short.
int Run::preempted(int64_t epoch) {
  if (saved_step_ != step_) save_checkpoint(epoch);
  progress_->line(
      fmt::format("preempted at step {} (epoch {}/{}); checkpoint {}; resume with --resume auto",
                  step_, epoch + 1, c_.epochs, saved_path_.string()));
  preemption_.reset();
  barrier();
  destroy_process_group();
  return kExitPreempted;
}

void Run::finish() {
  // FSDP: the parameters gathered whole (every rank) into a plain model, which rank 0 saves
  // under the names the plain model has (no Sharded "module.").
  std::shared_ptr<ModelImpl> whole = net_;
  if (fsdp_) {
    // Training is over and its last state is on disk: the optimizer's state and the shards'
    // gradients (most of what a rank holds under Adam) go before the model is gathered whole
    // for the final files. Under a memory limit that only the shards fit, the final files ran
    // out of memory without this.
    if (saved_step_ == step_) opt_->state().clear();
    for (at::Tensor& p : fsdp_->parameters()) p.mutable_grad() = at::Tensor();
    whole = gathered_model();
  }
  if (pg_->rank() == 0) {
    if (lease_) lease_->check("the final model");
    save_final_model(*whole, dir_);
    progress_->line(fmt::format(
        "done: test accuracy {:.2f}% ({}/{}), test loss {:.4f}, {} steps, {:.1f} s; model in {}",
        100 * last_eval_.accuracy(), last_eval_.correct, last_eval_.count, last_eval_.mean_loss(),
        step_, seconds_since(wall_start_), (dir_ / "model_state.pt").string()));
    if (c_.plots) progress_->line(log_->plot());
  }
  barrier();
  destroy_process_group();
}

std::string Run::device_text() const {
  if (cuda_) {
    return fmt::format("1 GPU ({} on rank {}{})", device_.str(), pg_->rank(),
                       c_.device == Device::kAuto ? ", --device auto: CUDA is available" : "");
  }
  const int threads = torch::get_num_threads(), blas = blas_num_threads();
  const std::string whose = blas == threads ? "LibTorch and BLAS"
                            : blas < 0      ? "LibTorch; the BLAS cannot say"
                                            : fmt::format("LibTorch; BLAS {}", blas);
  return fmt::format("{} thread{} ({}) on the CPU{}", threads, threads == 1 ? "" : "s", whose,
                     c_.device == Device::kAuto ? " (--device auto: no CUDA device)" : "");
}

// How gradients travel, when not the plain all-reduce: for the header.
void Run::build_fsdp() {
  // --precision bf16|fp16: FSDP's mixed precision, under the same autocast as DDP's (the loss in
  // fp32): units gathered and computed in it, buffers kept in it (LibTorch 1.13's CPU BatchNorm
  // wants them in its input's dtype), gradients summed in fp32, the shards stepped in fp32.
  MixedPrecision mixed;
  if (c_.precision != Precision::kFp32) {
    const at::ScalarType low = c_.precision == Precision::kBf16 ? at::kBFloat16 : at::kHalf;
    mixed = {.param_dtype = low, .reduce_dtype = at::kFloat, .buffer_dtype = low};
  }
  fsdp_ = std::make_unique<FullyShardedDataParallel<ModelImpl>>(
      net_, FSDPOptions{.process_group = pg_,
                        .sharding_strategy = c_.fsdp == "zero3" ? ShardingStrategy::kFullShard
                                                                : ShardingStrategy::kShardGradOp,
                        .mixed_precision = mixed});
}

std::vector<at::Tensor> Run::trained_parameters() const {
  return fsdp_ ? fsdp_->parameters() : model_->parameters();
}

std::function<at::Tensor(const at::Tensor&)> Run::model_forward() {
  if (fsdp_) return [this](const at::Tensor& x) { return (*fsdp_)(x); };
  return [this](const at::Tensor& x) { return net_->forward(x); };
}

std::shared_ptr<ModelImpl> Run::gathered_model() {
  auto plain = make_model(c_.model, c_.sync_bn, /*sharded=*/false);
  plain->to(device_);
  torch::NoGradGuard no_grad;
  auto params = plain->named_parameters();
  // A collective; one unit whole at a time, copied into the plain model: the model whole once.
  fsdp_->for_each_full_parameter(
      [&params](const std::string& name, const at::Tensor& whole) { params[name].copy_(whole); });
  // Buffers (BatchNorm's running statistics) are not sharded: this rank's, by the plain names.
  auto buffers = plain->named_buffers();
  for (const auto& item : net_->named_buffers()) {
    std::string name = item.key();
    for (size_t at; (at = name.find(".module.")) != std::string::npos;) name.erase(at, 7);
    buffers[name].copy_(item.value());
  }
  return plain;
}

std::string Run::hook_text() const {
  if (!c_.fsdp.empty()) {
    return fmt::format(" (FullyShardedDataParallel, {}{})",
                       c_.fsdp == "zero3" ? "ZeRO-3: each layer a unit" : "ZeRO-2",
                       c_.precision == Precision::kFp32
                           ? ""
                           : fmt::format(", gathered in {}, gradients summed in fp32",
                                         to_string(c_.precision)));
  }
  switch (c_.comm_hook) {
    case CommHook::kNone:
      return "";
    case CommHook::kFp16:
    case CommHook::kBf16:
      return fmt::format(" ({} compression)", to_string(c_.comm_hook));
    case CommHook::kPowerSGD:
      return fmt::format(" (PowerSGD rank {} from step {})", c_.powersgd_rank, c_.powersgd_start);
  }
  return "";
}

int Run::execute() {
  resume();
  if (finished()) return report_finished();
  progress_->line(fmt::format(
      "ddp-train: {} on Fashion-MNIST ({} train / {} test images), {} rank{} x {} over "
      "{}{}, batch {} per rank x {} accumulation, {} steps/epoch, {} epochs, {} lr {:.3g}, {}; "
      "run folder {}",
      c_.model, train_set_->size(), test_set_->size(), pg_->size(), pg_->size() == 1 ? "" : "s",
      device_text(), pg_->backend(), hook_text(),
      c_.batch_size, c_.grad_accum, steps_per_epoch_, c_.epochs,
      zero_opt_ ? fmt::format("{} (ZeRO-1: state sharded over {} rank{})",
                              to_string(c_.optimizer), pg_->size(), pg_->size() == 1 ? "" : "s")
                : std::string(to_string(c_.optimizer)),
      schedule_.peak, to_string(c_.precision), dir_.string()));
  progress_->line(inspect_blas().summary());
  preemption_.emplace();
  bool stopped = false;
  for (int64_t epoch = start_epoch_; epoch < c_.epochs && !stopped; ++epoch) {
    sampler_.set_epoch(epoch);  // a restored sampler keeps its position within this epoch
    const auto started = Clock::now();
    const EpochEnd end = train_epoch(epoch);
    progress_->end_epoch();
    if (end == EpochEnd::kPreempted) return preempted(epoch);
    stopped = end == EpochEnd::kMaxSteps;
    end_epoch(epoch, stopped, progress_->samples_per_s(), started);
  }
  preemption_.reset();  // from here on SIGTERM ends the process at once
  finish();
  return 0;
}

int run(const TrainConfig& config) {
  Run run(config);
  return config.ft ? run.execute_ft() : run.execute();
}

}  // namespace ddp::train
