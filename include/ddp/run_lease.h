// A run folder's lease: which group of which job may write into it (checkpoints, metrics).
//
// Note [Run folder lease]
// A run folder (ddp-train's --output-dir, or any folder a program keeps its checkpoints in)
// must have one writer: two groups that write into it both replace last.ckpt and both append
// metrics, and the resumed run silently loses one of them. Two groups can exist when
//   - two jobs are started by mistake with the same folder (different --rdzv-id, or the same);
//   - a group of a job lives on after the job re-formed without it: its ranks are still in a
//     step, or finishing a checkpoint, when the next round (TORCHELASTIC_RESTART_COUNT + 1)
//     starts elsewhere (ddprun's rounds never let two rounds train at once, Note [Never two
//     groups] in tools/ddprun/quorum.h, but a rank that has not yet noticed can still write);
//   - an instance of the job that should not exist: ddprun's elastic rounds name each instance
//     of the job's store with a lineage (DDP_RUN_LINEAGE); a fresh store at the endpoint while the
//     job runs elsewhere starts another lineage.
// The group's rank 0 therefore holds the folder's lease, a small file (run.lease, JSON) naming
// the job (run id), the lineage, the round, and the holder (host, pid and its start time), which
// a thread of the holder renews every ttl/4. A newcomer takes the folder:
//   - at once when nobody holds it (no file, or the holder released it at its end);
//   - at once from an older round of its own job and lineage (a re-formed job goes on; the old
//     group is fenced);
//   - at once from a holder on this host whose process is gone;
//   - after watching the lease for a whole ttl without a renewal, from any other holder (a
//     crashed host; a job started again with a new lineage).
// It is refused, with the holder named:
//   - at once by a holder of another run id that renewed within its ttl (two jobs, one folder);
//   - at once by a newer round of its own job and lineage (this group is the stale one);
//   - by any holder that renews while it watches.
// Every write into the folder checks the lease first (Checkpointer: before the rename that
// publishes each file; ddp-train: each metrics row): a group whose lease was taken fails with
// FencedError instead of writing. Claims and renewals are read-modify-writes under flock(2) on
// run.lease.lock (bounded: never a hang), each written by rename; every claim and release is
// appended to run.lease.log, the folder's history of who wrote into it.
//
// What it assumes: the holders see one file system (a shared folder, NFSv4 or a local disk)
// with working flock and rename; and, only for the at-once refusal of another job, clocks
// within the ttl of each other (a takeover never relies on clocks: it watches renewals).
// Its file calls (open, read, rename, flock's wait aside) are bounded only as the file system
// bounds them, as every checkpoint write is: on a hung hard-mounted NFS they wait with it.
// What it does not do: a check and the write after it are two steps, so a holder that stalls
// between them (SIGSTOP) for longer than a ttl can still publish one file late; the round
// rule of the launcher, not the lease, is what keeps two groups from training.
#pragma once

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>

#include "ddp/error.h"

namespace ddp {

// This group lost (or never got) its run folder: another group holds it.
class FencedError : public Error {
 public:
  using Error::Error;
};

// Who writes into a run folder.
struct RunIdentity {
  std::string run_id;   // the job: TORCHELASTIC_RUN_ID ("" without a launcher)
  std::string lineage;  // which instance of the job: DDP_RUN_LINEAGE ("" without ddprun)
  int64_t round = 0;    // which group of that instance: TORCHELASTIC_RESTART_COUNT

  // The launch environment's (run id, lineage, restart count).
  static RunIdentity from_environment();
  // "job 'x' (lineage 3fa2..., round 2)"
  std::string describe() const;
};

struct RunLeaseOptions {
  // A holder that has not renewed for this long may be taken over (the watch lasts this long).
  // DDP_RUN_LEASE_TTL overrides the default.
  std::chrono::milliseconds ttl{10'000};
  // flock(2) on the lock file waits at most this long, then fails naming the file.
  std::chrono::milliseconds lock_timeout{5'000};
};

// The default options, DDP_RUN_LEASE_TTL applied. Throws ConfigError for a malformed value.
RunLeaseOptions default_run_lease_options();

class RunLease {
 public:
  // Takes `dir`'s lease for `me` (see the Note), creating `dir` if needed; returns once held.
  // Blocks at most about options.ttl (a watch). Throws FencedError when refused, Error when
  // the folder cannot be used (unwritable, lock not obtained in time).
  static std::shared_ptr<RunLease> acquire(const std::filesystem::path& dir, const RunIdentity& me,
                                           RunLeaseOptions options = default_run_lease_options());

  // Stops renewing and releases the lease when it is still this one's.
  ~RunLease();
  RunLease(const RunLease&) = delete;
  RunLease& operator=(const RunLease&) = delete;

  // Throws FencedError, naming the new holder, when the lease is no longer this one's (read
  // from the file now); `what` names the write refused ("checkpoint epoch=1-step=40.ckpt").
  void check(const std::string& what) const;
  // Whether the lease is still this one's (the file, read now).
  bool held() const;
  // Releases now (idempotent): the file is removed when it is still this one's.
  void release();

  const std::filesystem::path& dir() const { return dir_; }
  const RunIdentity& identity() const { return me_; }
  // The lease file, the lock file and the history of claims.
  static std::filesystem::path lease_path(const std::filesystem::path& dir);
  static std::filesystem::path log_path(const std::filesystem::path& dir);

 private:
  struct Renewer;
  RunLease(std::filesystem::path dir, RunIdentity me, RunLeaseOptions options, std::string nonce);

  std::filesystem::path dir_;
  RunIdentity me_;
  RunLeaseOptions options_;
  std::string nonce_;  // tells this holder from any other, even in one process
  std::unique_ptr<Renewer> renewer_;
};

}  // namespace ddp
