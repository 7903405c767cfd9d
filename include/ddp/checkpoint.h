// Checkpoints: everything a training run needs to continue exactly where it stopped, in a file.
//
//   ddp::TrainingState state;                         // what is saved (ddp/training_state.h)
//   state.add("model", model);                        // a DistributedDataParallel
//   state.add("optimizer", opt);
//   state.add("sampler", sampler);
//   state.add("rng", ddp::default_generators());
//   ddp::Checkpointer ckpt(out_dir / "checkpoints", {.keep = 3, .model_label = "--model mlp"});
//   ddp::ResumePoint found = ckpt.latest_valid(*pg);  // --resume auto (collective)
//   for (auto& s : found.skipped) log("skipped {}: {}", s.path.string(), s.reason);
//   if (found.path) {
//     ddp::LoadedCheckpoint got = ckpt.load(*found.path, state, *pg);  // in place
//     step = got.meta.step; epoch = got.meta.epoch;
//   }
//   ...
//   ckpt.save(state, {.step = step, .epoch = epoch, .hparams_json = hp.dump()}, *pg);
//
// What a checkpoint holds: the state of every object registered in the TrainingState, each
// under its key (named tensors plus JSON: ddp/stateful.h), and the metadata: step, epoch,
// world size, hparams (JSON), a model label, the writer's thread count and versions.
// Exact resume: see ddp/training_state.h. At another world size load() succeeds and says so
// (LoadedCheckpoint::world_size_changed): the sampler splits the rest of the epoch among the new
// ranks (ddp/sampler.h); each per-rank state (generators, PowerSGD) is taken from rank
// r % old world size (per_rank_exact = false).
//
// The file: a checksummed 88-byte header ("DDP-CKPT", format version, lengths, SHA-256 of the
// payload, SHA-256 of the header and metadata), JSON metadata, then the payload (every tensor's
// bytes). Every check runs before a payload byte is used, and every failure is a
// CorruptCheckpointError naming the file and what was wrong ("truncated: the file has 5000
// bytes, its header declares 7236 ...", "payload checksum mismatch ...").
// Files of format 1 (written before TrainingState, by ddp-cpp 0.1.0 of 2026-11-27 and earlier)
// still load: their model, optimizer (plain or ZeRO), sampler, generators and PowerSGD states
// appear under the keys "model", "optimizer", "sampler", "rng" and "powersgd", and their opaque
// blob in LoadedCheckpoint::meta.blob. Writes are atomic: a temporary file, fsync, rename,
// fsync of the directory; an existing checkpoint is never touched before its replacement is
// complete on disk.
//
// The same bytes in memory: encode_checkpoint() gives a Snapshot (TrainingState::snapshot()) as
// the bytes of a checkpoint file, decode_checkpoint() verifies and reads them back; what a live
// rank sends another instead of writing a file.
//
// Note [Checkpoint directory]
// A Checkpointer owns one directory:
//   epoch=E-step=S.ckpt   one per save (Lightning's default name); keep-K removes the oldest
//   last.ckpt             the newest save: a hard link to its epoch=E-step=S.ckpt (so it costs
//                         no space and is itself a complete checkpoint that load() reads like
//                         any other), made atomically (link to a temporary, rename); where the
//                         file system refuses hard links, an atomic copy (a warning says so)
// With CheckpointerOptions::sharded, epoch=E-step=S.ckpt is a directory (metadata.ckpt and one
// file per rank: Note [Sharded checkpoint] in src/checkpoint/sharded.h) and last.ckpt a symbolic
// link to the newest one; every function here reads either kind.
// Ordering is by (step, epoch). latest_valid() ("--resume auto") verifies candidates newest
// first (full verification, both checksums) and returns the first valid one, with the newer
// files it skipped and why; last.ckpt is a candidate too (by the step in its header), skipped
// when it is the same file as a step checkpoint. One writer per directory: two jobs sharing a
// directory would prune and clean each other's files.
//
// Collective behaviour. With a ProcessGroup, save(), latest_valid() and load() are collectives
// (every rank calls them, in the same order relative to its other collectives):
//   save: a collective snapshot (TrainingState::snapshot(group): per-rank states gathered,
//         kCollective objects consolidated, sharded pieces joined); rank 0 writes (from its own
//         replicated states: the other ranks' are not read); sharded: every rank writes its own
//         file, rank 0 publishes the directory; rank 0 broadcasts the outcome. No rank returns
//         before the file is complete on disk, and a failure on rank 0 is thrown on every rank
//         (rank 0: the cause; others: "rank 0 failed to write ..."). Every rank must register
//         the same keys (a ConfigError on every rank names the first difference).
//   latest_valid: rank 0 scans and broadcasts its choice, so all ranks resume from one file.
//   load: every rank reads the file itself (a shared file system, or the same path on every
//         node) and verifies it; the ranks then exchange success, so if any rank fails, every
//         rank throws (naming the ranks that failed).
// Without a group (the overloads without one), the caller is the only process involved: call
// save() on the main process only; the per-rank states saved are this process's.
//
// Errors: CheckpointError (I/O: cannot create, write, rename, list), its subclasses
// CorruptCheckpointError (the file is not an intact checkpoint) and
// IncompatibleCheckpointError (an intact checkpoint of another model, optimizer or dataset, or
// without a state that was asked for); ConfigError for bad arguments. Loading checks every
// registered object against the file (ddp::Stateful::check) before it modifies any of them.
//
// Thread-safety: a Checkpointer holds only constant options; concurrent saves into one
// directory are not supported. Loading modifies the registered objects: nothing else may use
// them meanwhile (the generators are process-wide).
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "ddp/error.h"
#include "ddp/training_state.h"

namespace ddp {

class RunLease;  // ddp/run_lease.h

class ProcessGroup;

// Any checkpoint failure: an I/O error reading or writing (the message names the file and the
// system error).
class CheckpointError : public Error {
 public:
  using Error::Error;
};

// The file is not an intact checkpoint: empty, truncated, wrong magic, unknown format version,
// checksum mismatch. latest_valid() skips such files.
class CorruptCheckpointError : public CheckpointError {
 public:
  using CheckpointError::CheckpointError;
};

// An intact checkpoint that does not fit: another model (the message names the differing
// parameters), another optimizer type or param groups, a sampler over another dataset, a key
// the TrainingState asks for that the checkpoint lacks.
class IncompatibleCheckpointError : public CheckpointError {
 public:
  using CheckpointError::CheckpointError;
};

// 2: TrainingState's keys (this version writes it); 1: the fixed set of objects of ddp-cpp
// 0.1.0 (read only).
inline constexpr uint32_t kCheckpointFormatVersion = 2;
inline constexpr uint32_t kMaxCheckpointMetadataBytes = 64u << 20;  // sanity bound on M
// Keep the 3 newest step checkpoints (plus last.ckpt): enough to fall back past a damaged one.
inline constexpr int kDefaultCheckpointKeep = 3;
inline constexpr const char* kLastCheckpointName = "last.ckpt";

// What a checkpoint records besides the registered states.
struct CheckpointMeta {
  // Set by the caller for save().
  int64_t step = 0;  // optimizer steps completed
  int64_t epoch = 0;
  // JSON text: checked at save (ConfigError if malformed), stored as JSON in the metadata,
  // returned re-serialized (compact).
  std::string hparams_json = "{}";
  std::string model_label;  // e.g. "--model mlp": quoted when a model does not fit
  int world_size = 1;       // set by save() from the group when one is given

  // Filled by save() and returned by load() and read_checkpoint_meta().
  std::vector<std::string> keys;  // the states saved, in order
  int num_threads = 0;            // at::get_num_threads() of the writer (see Exact resume)
  std::string torch_version;
  std::string ddp_version;
  int64_t created_unix_ms = 0;
  uint32_t format_version = kCheckpointFormatVersion;
  // Format 1 only: the opaque bytes such a checkpoint carried (ddp-train kept its trainer state
  // there); format 2 keeps such state in a Stateful. Empty from read_checkpoint_meta().
  std::string blob;
};

struct LoadOptions {
  int rank = 0;             // whose generator state to restore
  int world_size = 1;       // this run's, compared with the checkpoint's
  std::string model_label;  // this run's, quoted when the model does not fit
};

struct LoadedCheckpoint {
  std::filesystem::path path;
  CheckpointMeta meta;              // as saved
  bool world_size_changed = false;  // meta.world_size != this run's world size
  // Every per-rank state loaded (generators, PowerSGD) was this rank's own.
  bool per_rank_exact = true;
  std::vector<std::string> absent;   // optional keys the checkpoint lacks (left as they were)
  std::vector<std::string> ignored;  // keys in the checkpoint that the TrainingState lacks
};

// --- One file ---------------------------------------------------------------------------------

// Writes `file` atomically (see above) from `state` (TrainingState::snapshot(): this process
// alone) and `meta`. Throws CheckpointError (I/O), ConfigError (bad JSON, an empty state).
void save_checkpoint(const std::filesystem::path& file, TrainingState& state,
                     const CheckpointMeta& meta);
// Checks the header and metadata (cheap: the payload is not read, only its length);
// throws CorruptCheckpointError.
CheckpointMeta read_checkpoint_meta(const std::filesystem::path& file);
// Full verification: header, metadata and payload checksum. Throws CorruptCheckpointError.
void verify_checkpoint(const std::filesystem::path& file);
// Verifies `file`, checks that it fits `state`, then restores every registered object in place
// (see the top).
LoadedCheckpoint load_checkpoint(const std::filesystem::path& file, TrainingState& state,
                                 const LoadOptions& options = {});

// --- The same bytes in memory -----------------------------------------------------------------

// `snapshot` and `meta` as the bytes of a checkpoint file (meta's save-time fields filled in as
// save() fills them; meta.world_size from the snapshot). ConfigError for malformed JSON.
std::string encode_checkpoint(const Snapshot& snapshot, const CheckpointMeta& meta);
// Verifies `bytes` as a checkpoint file (every check of load_checkpoint's file reading; errors
// name `what` where they would name the file) and returns its metadata and states; tensors are
// on the CPU. Throws CorruptCheckpointError.
struct DecodedCheckpoint {
  CheckpointMeta meta;
  Snapshot snapshot;
};
DecodedCheckpoint decode_checkpoint(std::string_view bytes, std::string_view what = "checkpoint");

// --- A directory of checkpoints ---------------------------------------------------------------

struct CheckpointerOptions {
  // Step checkpoints kept after each save (the newest ones, always including the one just
  // written), plus last.ckpt; 0 keeps every one.
  int keep = kDefaultCheckpointKeep;
  bool save_last = true;    // maintain last.ckpt
  std::string model_label;  // written into each checkpoint; quoted when a model does not fit
  // Fault injection, to test a program's recovery: called as a write reaches each stage
  // ("open", "write" (half the bytes are written), "fsync", "rename", "sync_dir"; "last" before
  // linking last.ckpt) with the file's path; a hook that throws simulates a failure there (a
  // full disk, an I/O error). Empty in production.
  std::function<void(std::string_view stage, const std::filesystem::path& file)> fault_hook;
  // Each rank writes its own states into its own file, in a directory named as the file would
  // be (Note [Sharded checkpoint] in src/checkpoint/sharded.h): no rank gathers another's
  // per-rank states or FullyShardedDataParallel pieces, so a model that fits no single process
  // is saved by the ranks it is sharded over, and loads at any world size. The ranks need a
  // shared file system (or one host). load() and latest_valid() read either kind.
  bool sharded = false;
  // The run folder's lease (ddp/run_lease.h), held by the writing rank: each file is checked
  // against it before the rename that publishes it, and a group that lost the folder to another
  // fails with FencedError (relayed to the other ranks as a CheckpointError) instead of
  // replacing that group's files. Null: no fencing.
  std::shared_ptr<const RunLease> lease;
};

struct SkippedCheckpoint {
  std::filesystem::path path;
  std::string reason;  // e.g. "payload checksum mismatch (expected 3f2a..., got 9c01...)"
};

struct ResumePoint {
  std::optional<std::filesystem::path> path;  // none: no valid checkpoint (a fresh start)
  std::vector<SkippedCheckpoint> skipped;     // newer files that failed verification (rank 0)
};

struct SavedCheckpoint {
  std::filesystem::path path;                  // the epoch=E-step=S.ckpt written
  std::vector<std::filesystem::path> removed;  // by keep-K (rank 0)
  std::vector<std::string> warnings;           // e.g. last.ckpt copied, not linked (rank 0)
};

class Checkpointer {
 public:
  // Creates `dir` (and parents) when it does not exist; throws CheckpointError if it cannot,
  // ConfigError for keep < 0.
  explicit Checkpointer(std::filesystem::path dir, CheckpointerOptions options = {});

  // Writes epoch=E-step=S.ckpt (replacing one of the same name), updates last.ckpt, prunes to
  // `keep`, and first removes temporary files left by a crashed write. Collective with a group
  // (see the top; meta.world_size becomes group->size()). Throws CheckpointError: when it
  // fails, every checkpoint that existed before is intact (a failure updating last.ckpt after
  // the step file is complete is still thrown: the step file stays, last.ckpt is the old one).
  SavedCheckpoint save(TrainingState& state, const CheckpointMeta& meta) const;
  SavedCheckpoint save(TrainingState& state, const CheckpointMeta& meta, ProcessGroup& group) const;

  // The newest checkpoint that passes full verification ("--resume auto"); see the Note.
  ResumePoint latest_valid() const;
  ResumePoint latest_valid(ProcessGroup& group) const;

  // load_checkpoint with this run's rank and world size (from the group; without one, rank 0
  // of 1) and the options' model label; collective with a group.
  LoadedCheckpoint load(const std::filesystem::path& file, TrainingState& state) const;
  LoadedCheckpoint load(const std::filesystem::path& file, TrainingState& state,
                        ProcessGroup& group) const;

  // Step checkpoints in the directory, newest first (by step, then epoch); not verified.
  std::vector<std::filesystem::path> list() const;
  // Deletes temporary files of interrupted writes; returns them. Call it only while no write
  // into this directory is in progress (save() calls it on the writing rank).
  std::vector<std::filesystem::path> remove_stale_temp_files() const;

  const std::filesystem::path& dir() const { return dir_; }
  std::filesystem::path last_path() const { return dir_ / kLastCheckpointName; }
  // "epoch=E-step=S.ckpt"
  static std::string file_name(int64_t epoch, int64_t step);

 private:
  SavedCheckpoint save(TrainingState& state, const CheckpointMeta& meta, ProcessGroup* group) const;
  ResumePoint latest_valid(ProcessGroup* group) const;
  LoadedCheckpoint load(const std::filesystem::path& file, TrainingState& state,
                        ProcessGroup* group) const;

  // Constant after construction.
  std::filesystem::path dir_;
  CheckpointerOptions options_;
};

}  // namespace ddp
