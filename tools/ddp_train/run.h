// ddp-train's run, shared by its two loops: trainer.cpp (setup, the plain loop) and ft_loop.cpp
// (each step under ft::Manager, --ft). Internal to ddp-train.
#pragma once

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "config.h"
#include "ddp/ddp.h"
#include "ddp/run_lease.h"  // RunLease: this group holds the run folder
#include "grad_scaler.h"
#include "models.h"
#include "preemption.h"
#include "progress.h"
#include "run_log.h"
#include "schedule.h"

namespace ddp::train {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;
using tools::make_model;
using tools::ModelImpl;

double seconds_since(Clock::time_point t);
// Rank 0's choice of the run folder (run_dir() without the broadcast).
fs::path pick_run_dir(const TrainConfig& c);
// Rank 0's text on every rank (a length, then the bytes).
std::string broadcast_text(ProcessGroup& pg, std::string text);
// The test set, each sample once across the group's ranks, through `forward` (the model's, or
// FSDP's, which gathers the parameters for it).
EvalStats evaluate(ModelImpl& model, const std::function<at::Tensor(const at::Tensor&)>& forward,
                   const Dataset& test, ProcessGroup& pg, c10::Device device, int64_t batch_size);
// The final model for other tools: model.pt and model_state.pt.
void save_final_model(ModelImpl& model, const fs::path& dir);

// How train_epoch() ended.
enum class EpochEnd { kDone, kMaxSteps, kPreempted };

// Note [Sample log]
// --sample-log DIR: each rank of each attempt appends, after every optimizer step, one line
// "<epoch> <step> <world size> <index>..." (the dataset indices of the step's micro-batches on
// this rank, in the sampler's order) to DIR/attempt<A>.rank<R>.pid<P>.txt, A being the
// launcher's TORCHELASTIC_RESTART_COUNT, flushed per line. The samples the final model was
// trained on are then the lines of the last attempt that ran each step: an attempt resumed
// from a checkpoint redoes every step after it, so its first step replaces that step and all
// later ones of earlier attempts (tests/multinode checks each epoch's union that way).
// With --ft (ft_loop.cpp) each replica writes DIR/ft.<name>-pid<P>.txt, a line per step it
// attempts, before the step's vote (after it, a replica killed between the commit and the line
// would leave samples it trained out of the log). A step may be attempted more than once: in a
// file, a later line for the same step replaces the earlier; across files, a step's committed
// lines are those at the world size of the replicas that went on past it (a replica that died
// in a step the others dropped logged it at the old size). tests/multiproc/test_ft checks each
// epoch that way.
class SampleLog {
 public:
  // Appends to dir/name, creating dir.
  SampleLog(const fs::path& dir, const std::string& name);
  void write(int64_t epoch, int64_t step, int world, const std::vector<int64_t>& indices);

 private:
  std::ofstream out_;
};

// One training run's state, by lifetime: constant after setup, then what the loop advances.
class Run {
 public:
  explicit Run(const TrainConfig& config);
  int execute();
  // With --ft (ft_loop.cpp): the same run, each step under ft::Manager.
  int execute_ft();
  // The header's "what each rank computes on": "1 threads on the CPU" or "1 GPU (cuda:0 on rank
  // 0)"; --device auto says which it chose and why.
  std::string device_text() const;

 private:
  void resume();
  // Optimizer steps left in the current epoch at this world size: what the sampler has left
  // of the epoch, in batches of batch_size, in steps of grad_accum.
  int64_t steps_left_in_epoch() const;
  int64_t samples_left_in_epoch() const { return sampler_.num_samples() - sampler_.position(); }
  // Resumed from a checkpoint at or past the end (--epochs, --max-steps): nothing to train.
  bool finished() const;
  int report_finished();
  // One micro-batch's forward and backward; returns its (scaled) loss. A synchronising one
  // adds its exposed communication to comm_s_.
  double micro_step(const Batch& batch, bool sync, int64_t micro_batches);
  // `schedule_step`: the step's position on this world size's schedule (Note [Progress]).
  void optimizer_step(int64_t schedule_step);
  // --min-step-ms: sleeps until the step begun at `started` has lasted the floor.
  void pace(Clock::time_point started) const;
  // Collective, after every optimizer step: did any rank get SIGTERM (Note [Preemption])?
  bool stop_requested();
  EpochEnd train_epoch(int64_t epoch);
  void log_interval(int64_t epoch);
  void log_test_row(int64_t epoch, double samples_per_s);
  void end_epoch(int64_t epoch, bool stopped, double samples_per_s,
                 std::chrono::steady_clock::time_point started);
  void save_checkpoint(int64_t epoch);
  // --fsdp: the wrapper; the optimizer's parameters (FSDP's shards, or the model's); the
  // forward evaluation calls; the model whole (a collective) for the final save.
  void build_fsdp();
  std::vector<at::Tensor> trained_parameters() const;
  std::function<at::Tensor(const at::Tensor&)> model_forward();
  std::shared_ptr<ModelImpl> gathered_model();
  // The trainer's own state in a checkpoint ("trainer"), and format 1's blob.
  std::string trainer_json() const;
  void load_trainer_json(const std::string& text);
  void resume_format_1(const std::string& blob);
  int preempted(int64_t epoch);
  void finish();

  // Constant after construction.
  const TrainConfig c_;
  const Clock::time_point wall_start_ = Clock::now();
  std::shared_ptr<ProcessGroup> pg_;
  bool cuda_ = false;
  c10::Device device_{c10::kCPU};
  std::shared_ptr<Dataset> train_set_, test_set_;
  DistributedSampler sampler_{1, {.num_replicas = 1, .rank = 0}};  // replaced in the ctor
  std::unique_ptr<DataLoader> loader_;
  std::shared_ptr<ModelImpl> net_;
  std::unique_ptr<DistributedDataParallel<ModelImpl>> model_;  // or, with --fsdp:
  std::unique_ptr<FullyShardedDataParallel<ModelImpl>> fsdp_;
  std::unique_ptr<torch::optim::Optimizer> opt_;  // or, with --zero:
  std::unique_ptr<ZeroRedundancyOptimizer> zero_opt_;
  std::optional<GradScaler> scaler_;
  int64_t steps_per_epoch_ = 0;
  WarmupCosine schedule_;
  fs::path dir_;
  std::shared_ptr<RunLease> lease_;      // rank 0 only: the run folder (Note [Run folder lease])
  std::optional<RunLog> log_;            // rank 0 only
  std::optional<SampleLog> sample_log_;  // --sample-log
  std::unique_ptr<Progress> progress_;
  std::unique_ptr<Checkpointer> checkpoints_;
  std::shared_ptr<comm_hooks::PowerSGDState> powersgd_;  // --comm-hook powersgd
  std::string hook_text() const;
  void claim_run_folder(const RunIdentity& me);
  void open_run_log();

  // --ft (ft_loop.cpp, Note [Training under ft::Manager]).
  void on_quorum();
  void sync_trainer_state();
  void set_schedule(int world_size);
  bool ft_step();
  void ft_epoch_end();
  bool ft_finish();
  void ft_after_commit();
  void fail_step();
  void count_dropped();  // throws past kMaxDroppedInARow uncommitted steps in a row
  // Runs a collective outside the step (evaluation, logging, checkpoints); its failure is kept
  // for the next step, which then fails everywhere, and returns false.
  template <typename F>
  bool outside(const char* what, F&& f);
  std::unique_ptr<ft::Manager> ft_;
  int64_t quorum_ = -1;        // the quorum on_quorum() last set up
  std::string outside_error_;  // a collective outside the step failed since the last one
  int64_t dropped_ = 0, dropped_in_a_row_ = 0;
  bool ft_resumed_ = false;       // --resume was looked at (the first quorum, at step 0)
  int64_t checkpoint_step_ = -1;  // the step of the group's last checkpoint (agreed per quorum)
  // This epoch's committed samples (every replica's) since its first step began, wall time: the
  // epoch line's samples/s, quorums, dropped steps and healing included.
  int64_t ft_epoch_samples_ = 0;
  Clock::time_point ft_epoch_started_{};
  TrainingState state_;  // what a checkpoint saves: model, optimizer, sampler, rng, hook, trainer

  // Advanced by the loop.
  int64_t step_ = 0;  // optimizer steps done (by every attempt: Note [Progress])
  int64_t start_epoch_ = 0;
  double lr_ = 0;            // the rate of the last optimizer step
  int64_t saved_step_ = -1;  // the step of the last checkpoint this process wrote, and its file
  fs::path saved_path_;
  std::optional<PreemptionWatch> preemption_;  // while the training loop runs
  double interval_loss_ = 0;                   // sum of step losses since the last log line
  int64_t interval_steps_ = 0;
  // This epoch, on this rank: seconds of communication left after backward's compute (DDP's
  // finalize wait, IterationStats) and seconds of whole optimizer steps, data included.
  double comm_s_ = 0;
  double step_s_ = 0;
  EvalStats last_eval_;
  int64_t eval_step_ = -1;  // the step last_eval_ measured
};

}  // namespace ddp::train
