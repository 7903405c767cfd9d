// Preemption: SIGTERM asks ddp-train to stop at the next optimizer step with a checkpoint.
//
// Note [Preemption]
// A scheduler reclaiming the machine sends SIGTERM (ddprun forwards it to every worker, then
// SIGKILLs after --grace-period). While a PreemptionWatch lives, the first SIGTERM only sets a
// flag; the handler is one-shot (SA_RESETHAND), so a second SIGTERM kills the process as
// before. After each optimizer step the ranks all-reduce (MAX) one int, "did this rank get
// SIGTERM?", so all stop after the same step even when the signal reached them at different
// times; they write a checkpoint of that step (collective, like every save), rank 0 says
// "preempted at step N; checkpoint ...; resume with --resume auto", and every rank exits with
// kExitPreempted. The next `--resume auto` continues bit for bit. A step, its checkpoint and
// the exit must fit in the grace period, or the launcher's SIGKILL ends the run and the resume
// starts from the previous checkpoint instead.
#pragma once

namespace ddp::train {

// Exit code of a preempted run: sysexits' EX_TEMPFAIL ("try again later"), distinct from 0
// (done), 1 (failed) and 2 (bad configuration).
inline constexpr int kExitPreempted = 75;

// Catches SIGTERM for its lifetime (one at most; see the Note), then restores the previous
// handler. One at a time per process.
class PreemptionWatch {
 public:
  PreemptionWatch();
  ~PreemptionWatch();
  PreemptionWatch(const PreemptionWatch&) = delete;
  PreemptionWatch& operator=(const PreemptionWatch&) = delete;

  // This process received SIGTERM since the watch began.
  bool requested() const;
};

}  // namespace ddp::train
