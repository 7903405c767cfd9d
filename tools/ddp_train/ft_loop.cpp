// ddp-train --ft: the training loop with each step under ddp::ft::Manager.
//
// Note [Training under ft::Manager]
// Under `ddprun --ft`, each worker is a replica. The manager (ddp/fault_tolerance.h, Note
// [Per-step fault tolerance]) forms a group per quorum; DDP and the sampler, registered in the
// run's TrainingState with the model, the optimizer, the RNGs and the trainer's own state,
// follow each new group and are healed live with the rest. Each loop turn:
//   1. start_quorum(): at once while nothing changed; else the survivors (and any replica that
//      came back) re-form and the ones behind receive the state of one that holds the newest
//      committed step. At a new quorum every member sets up what depends on the group
//      (on_quorum()): the schedule at the new size (--scale-lr: the new size; Note [Progress]),
//      the run folder (rank 0's, broadcast), the folder's lease (a new rank 0 claims it with
//      the quorum's number as its round, which fences the old holder), metrics.csv, the
//      checkpoint directory, and rank 0's view of what was evaluated and saved.
//   2. The step: up to grad_accum micro-batches of batch_size taken from the sampler's
//      remaining() (no prefetching loader: a pass must not be drawing from the sampler when a
//      quorum reshards it), the cursor advanced, forward and backward through DDP. Any error
//      (a bucket all-reduce that failed) is reported to the manager, not thrown.
//   3. should_commit(): the vote. Committed: the optimizer steps, the trainer counts the step
//      (the manager's count: the two never differ). Not: the gradients are dropped, the sampler
//      goes back to its last committed cursor at the next quorum, and the step is taken again.
// Collectives outside a step (a log interval's loss, the SIGTERM vote, the epoch's
// evaluation, checkpoints) are decided from agreed state only (the step, the epoch, what rank
// 0 said was evaluated and saved), so every member calls the same ones; a failure in one is
// kept and fails the next step's vote on that replica, so the quorum re-forms before anything
// else is tried (outside()). Ten uncommitted steps in a row end the run with the last error:
// an error of the program's own would otherwise repeat for ever.
// An epoch ends when the sampler has nothing left: the test set is evaluated once (each
// sample once over the quorum), then the sampler moves to the next epoch and a checkpoint is
// written there; --checkpoint-every also counts committed steps. --resume (auto or a path) is
// looked at once, by the first quorum, and only while it is at step 0 (the job's start):
// a replica that joins later is healed instead. The checkpoint stays for whole-job losses: with
// every replica gone, the restarted ones refuse to train from an older state (the manager), and
// a new job resumes from the newest checkpoint.
// --sample-log writes DIR/ft.<name>-pid<P>.txt, a line per step attempted (Note [Sample log]).
// Not yet: CUDA, ZeRO, SyncBatchNorm, PowerSGD and fp16 (refused with a reason), and the
// progress bar (rank 0 prints lines).
#include <fmt/format.h>

#include "run.h"

namespace ddp::train {

namespace {
constexpr int64_t kMaxDroppedInARow = 10;
}  // namespace

template <typename F>
bool Run::outside(const char* what, F&& f) {
  if (!outside_error_.empty()) return false;
  try {
    f();
    return true;
  } catch (const FencedError&) {
    throw;  // another group holds the run folder: no new quorum changes that
  } catch (const ConfigError&) {
    throw;  // nor a bad setting (--resume of a missing file)
  } catch (const IncompatibleCheckpointError&) {
    throw;  // nor a checkpoint of another model, or one written without --ft
  } catch (const CorruptCheckpointError&) {
    throw;  // nor a damaged --resume PATH
  } catch (const Error& e) {
    outside_error_ = fmt::format("{} failed: {}", what, e.what());
    return false;
  }
}

// Rank 0's record of what the group evaluated and saved, on every member: the decisions
// that start a collective outside a step must be the same everywhere.
void Run::sync_trainer_state() {
  nlohmann::json j;
  if (pg_->rank() == 0) {
    j = {{"eval_step", eval_step_},
         {"loss_sum", last_eval_.loss_sum},
         {"correct", last_eval_.correct},
         {"count", last_eval_.count},
         {"checkpoint_step", checkpoint_step_}};
  }
  j = nlohmann::json::parse(broadcast_text(*pg_, pg_->rank() == 0 ? j.dump() : ""));
  eval_step_ = j["eval_step"];
  last_eval_ = {.loss_sum = j["loss_sum"], .correct = j["correct"], .count = j["count"]};
  checkpoint_step_ = j["checkpoint_step"];
}

void Run::on_quorum() {
  pg_ = ft_->process_group();
  step_ = ft_->current_step();
  ddp::set_training_step(step_);
  set_schedule(pg_->size());
  progress_ = std::make_unique<Progress>(pg_->rank() == 0, c_.log_every);
  dir_ = broadcast_text(*pg_, pg_->rank() == 0 ? (dir_.empty() ? pick_run_dir(c_) : dir_).string()
                                               : std::string());
  if (pg_->rank() != 0) {
    log_.reset();
    lease_.reset();  // a rank 0 dropped and back: its lease was taken, and it writes nothing
  }
  // Rank 0 claims the folder unless it holds it; the quorum's number is the round, newer than
  // an old holder's (a replica of an older quorum is fenced). Every member learns the outcome.
  const RunLease* before = lease_.get();
  RunIdentity me = RunIdentity::from_environment();
  me.round = ft_->quorum_id();
  claim_run_folder(me);
  if (pg_->rank() == 0 && (lease_.get() != before || !log_)) open_run_log();
  checkpoints_ =
      std::make_unique<Checkpointer>(dir_ / "checkpoints",
                                     CheckpointerOptions{.keep = c_.keep,
                                                         .model_label = "--model " + c_.model,
                                                         .lease = lease_});
  // --resume, once per job: rank 0 decides (a replica that joins later never reads one).
  const bool first = !ft_resumed_ && step_ == 0 && !c_.resume.empty();
  if (broadcast_text(*pg_, pg_->rank() == 0 && first ? "resume" : "") == "resume") {
    resume();
    step_ = ft_->current_step();
    if (saved_step_ == step_) checkpoint_step_ = step_;  // resumed from a file
  }
  ft_resumed_ = true;
  sync_trainer_state();
  progress_->line(fmt::format("quorum {}: {} replica{}, step {}, epoch {}/{}, peak lr {:.3g}",
                              ft_->quorum_id(), pg_->size(), pg_->size() == 1 ? "" : "s", step_,
                              std::min(sampler_.epoch() + 1, c_.epochs), c_.epochs,
                              schedule_.peak));
  quorum_ = ft_->quorum_id();
}

// A step this replica cannot take (a collective outside the last one failed): the vote fails
// everywhere and the next start_quorum() re-forms.
void Run::fail_step() {
  ft_->report_error(outside_error_);
  outside_error_.clear();
  if (ft_->should_commit()) {  // cannot: this replica voted no
    throw Error("ft: a step committed although this replica voted against it");
  }
  count_dropped();
}

void Run::count_dropped() {
  ++dropped_;
  if (++dropped_in_a_row_ >= kMaxDroppedInARow) {
    throw Error(fmt::format("--ft: {} steps in a row were not committed; the last: {}",
                            dropped_in_a_row_, ft_->errored()));
  }
}

bool Run::ft_step() {
  const int64_t epoch = sampler_.epoch();
  const std::vector<int64_t> rest = sampler_.remaining(c_.batch_size * c_.grad_accum);
  const auto take = static_cast<int64_t>(rest.size());
  const int64_t micro = (take + c_.batch_size - 1) / c_.batch_size;
  const int64_t schedule_step = epoch * steps_per_epoch_ + steps_per_epoch_ - steps_left_in_epoch();
  sampler_.advance(take);  // committed with the step; a dropped step's batch comes back
  double loss = 0;
  const auto started = Clock::now();
  if (ft_epoch_samples_ == 0) ft_epoch_started_ = started;
  try {
    for (int64_t m = 0; m < micro; ++m) {
      const auto first = rest.begin() + m * c_.batch_size;
      Batch batch = train_set_->get_batch(
          std::vector<int64_t>(first, rest.begin() + std::min(take, (m + 1) * c_.batch_size)));
      batch.data = batch.data.to(device_);
      batch.target = batch.target.to(device_);
      loss += micro_step(batch, m + 1 == micro, micro);
    }
  } catch (const std::exception& e) {
    ft_->report_error(e.what());
  }
  // Before the vote: a replica killed between the commit and a line written after it would
  // leave trained samples out of the log (Note [Sample log]).
  if (sample_log_) {
    sample_log_->write(epoch, step_ + 1, pg_->size(),
                       std::vector<int64_t>(rest.begin(), rest.begin() + take));
  }
  if (!ft_->should_commit()) {
    zero_opt_ ? zero_opt_->zero_grad() : opt_->zero_grad();  // the manager said why, on each
    count_dropped();
    return false;
  }
  dropped_in_a_row_ = 0;
  optimizer_step(schedule_step);
  if (step_ != ft_->current_step()) {
    throw Error(
        fmt::format("ft: the trainer counts step {}, the manager {}", step_, ft_->current_step()));
  }
  step_s_ += seconds_since(started);
  ft_epoch_samples_ += take * pg_->size();
  pace(started);
  interval_loss_ += loss;
  ++interval_steps_;
  return true;
}

// After a committed step: the collectives every member calls at this step.
void Run::ft_after_commit() {
  if (step_ % c_.log_every == 0) {
    outside("the log interval's loss", [&] {
      // A replica healed into the interval has fewer steps of it: the mean over all.
      at::Tensor l =
          at::tensor({interval_loss_, static_cast<double>(interval_steps_)}, at::kDouble);
      pg_->all_reduce(l, ReduceOp::kSum).wait();
      const double mean = l[1].item<double>() > 0 ? l[0].item<double>() / l[1].item<double>() : 0;
      progress_->line(fmt::format("step {} (epoch {}/{}): loss {:.4f}, lr {:.3g}, {} replica{}",
                                  step_, sampler_.epoch() + 1, c_.epochs, mean, lr_, pg_->size(),
                                  pg_->size() == 1 ? "" : "s"));
      if (log_) {
        log_->append({.step = step_,
                      .epoch = sampler_.epoch(),
                      .split = "train",
                      .loss = mean,
                      .lr = lr_,
                      .samples_per_s = 0,
                      .wall_s = seconds_since(wall_start_)});
      }
      interval_loss_ = 0;
      interval_steps_ = 0;
    });
  }
  if (c_.checkpoint_every > 0 && step_ % c_.checkpoint_every == 0) {
    outside("the checkpoint", [&] {
      save_checkpoint(sampler_.epoch());
      checkpoint_step_ = step_;
    });
  }
}

// The sampler has nothing left of this epoch: evaluate (once per step), move to the next
// epoch, checkpoint there.
void Run::ft_epoch_end() {
  const int64_t epoch = sampler_.epoch();
  const double seconds = seconds_since(ft_epoch_started_);  // training only, as the plain loop
  if (eval_step_ != step_) {
    const bool ok = outside("the evaluation", [&] {
      last_eval_ = evaluate(*net_, model_forward(), *test_set_, *pg_, device_, 256);
      eval_step_ = step_;
    });
    if (!ok) return;
    // This replica's view of the epoch (a healed one saw only its part of it).
    const double samples_per_s = seconds > 0 ? ft_epoch_samples_ / seconds : 0;
    progress_->line(fmt::format(
        "epoch {}/{}: test loss {:.4f}, test accuracy {:.2f}% ({}/{}), step {}, {} replica{}, "
        "{:.0f} samples/s",
        epoch + 1, c_.epochs, last_eval_.mean_loss(), 100 * last_eval_.accuracy(),
        last_eval_.correct, last_eval_.count, step_, pg_->size(), pg_->size() == 1 ? "" : "s",
        samples_per_s));
    log_test_row(epoch, samples_per_s);
  }
  ft_epoch_samples_ = 0;
  sampler_.set_epoch(epoch + 1);  // a dropped step takes the sampler back to this epoch's end
  if (checkpoint_step_ != step_) {
    outside("the checkpoint", [&] {
      save_checkpoint(epoch + 1);
      checkpoint_step_ = step_;
    });
  }
}

// The run is done (its epochs, or --max-steps): the evaluation and the checkpoint of this
// step if missing, then rank 0 writes the final model. False: a collective failed, the
// quorum re-forms and this is tried again.
bool Run::ft_finish() {
  if (eval_step_ != step_ && !outside("the final evaluation", [&] {
        last_eval_ = evaluate(*net_, model_forward(), *test_set_, *pg_, device_, 256);
        eval_step_ = step_;
      })) {
    return false;
  }
  if (checkpoint_step_ != step_ && !outside("the last checkpoint", [&] {
        save_checkpoint(std::min(sampler_.epoch(), c_.epochs));
        checkpoint_step_ = step_;
      })) {
    return false;
  }
  ft_->finish();
  if (pg_->rank() == 0) {
    if (lease_) lease_->check("the final model");
    save_final_model(*net_, dir_);
    progress_->line(fmt::format(
        "done: test accuracy {:.2f}% ({}/{}), test loss {:.4f}, {} steps ({} not committed), "
        "{:.1f} s; model in {}",
        100 * last_eval_.accuracy(), last_eval_.correct, last_eval_.count, last_eval_.mean_loss(),
        step_, dropped_, seconds_since(wall_start_), (dir_ / "model_state.pt").string()));
    if (c_.plots && log_) progress_->line(log_->plot());
  }
  return true;
}

int Run::execute_ft() {
  if (!c_.sample_log.empty()) {
    sample_log_.emplace(c_.sample_log,
                        fmt::format("ft.{}-pid{}.txt", c_.name, static_cast<int>(::getpid())));
  }
  preemption_.emplace();
  for (;;) {
    ft_->start_quorum();
    if (ft_->job_finished()) {
      std::printf(
          "ddp-train: the job finished while this replica was away (at step %ld); "
          "nothing left to train\n",
          static_cast<long>(ft_->current_step()));
      return 0;
    }
    if (ft_->quorum_id() != quorum_) outside("setting up the quorum", [&] { on_quorum(); });
    if (!outside_error_.empty()) {
      fail_step();
      continue;
    }
    if (sampler_.epoch() >= c_.epochs || (c_.max_steps > 0 && step_ >= c_.max_steps)) {
      if (ft_finish()) break;
      continue;
    }
    if (samples_left_in_epoch() == 0) {
      ft_epoch_end();
      continue;
    }
    if (!ft_step()) continue;
    ft_after_commit();
    bool stop = false;
    outside("the SIGTERM vote", [&] { stop = stop_requested(); });
    if (stop) {
      if (checkpoint_step_ != step_) save_checkpoint(sampler_.epoch());
      progress_->line(fmt::format("preempted at step {}; checkpoint {}; resume with --resume auto",
                                  step_, saved_path_.string()));
      preemption_.reset();
      return kExitPreempted;
    }
  }
  preemption_.reset();
  return 0;
}

}  // namespace ddp::train
