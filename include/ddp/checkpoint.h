// Checkpoints: everything a training run needs to continue exactly where it stopped.
//
//   ddp::Checkpointer ckpt(out_dir / "checkpoints", {.keep = 3, .model_label = "--model mlp"});
//   ddp::CheckpointRefs refs{.model = ddp_model.module().get(), .optimizer = &opt,
//                            .sampler = &sampler};
//   ddp::ResumePoint found = ckpt.latest_valid(pg.get());      // --resume auto (collective)
//   for (auto& s : found.skipped) log("skipped {}: {}", s.path.string(), s.reason);
//   if (found.path) {
//     ddp::LoadedCheckpoint got = ckpt.load(*found.path, refs, pg.get());  // in place
//     step = got.meta.step; epoch = got.meta.epoch; scheduler.restore(got.meta.blob);
//   }
//   ...
//   ckpt.save(refs, {.step = step, .epoch = epoch, .hparams_json = hp.dump(),
//                    .blob = scheduler.state()}, pg.get());  // rank 0 writes, all return after
//
// What a checkpoint holds: the model's parameters and buffers (by name), the optimizer's
// state and its param-group options (lr, momentum, ...: as Python's load_state_dict restores
// them), the sampler's SamplerState, every rank's generator state (LibTorch's default CPU
// generator, and the default CUDA generators when CUDA is present), step, epoch, world size,
// hparams (JSON), an opaque blob (scheduler/trainer state, e.g. JSON) and the model
// fingerprint (each parameter's and buffer's name, shape and dtype, in registration order).
//
// Exact resume. Restoring a checkpoint written after optimizer step k, at the same world size,
// makes the run continue bit for bit as the uninterrupted one would have: same parameters,
// optimizer moments, data order (sampler), dropout masks (generators). Not captured, so keep
// them equal or put them in the blob: the number of intra-op threads (recorded in
// meta.num_threads for the caller to compare), the BLAS library, anything with its own RNG.
// At another world size load() succeeds and says so (LoadedCheckpoint::world_size_changed):
// the sampler splits the rest of the epoch among the new ranks (ddp/sampler.h); rank r takes
// the saved generator state of rank r % old_world_size (rng_exact = false).
//
// The file: a checksummed 88-byte header, JSON metadata, then the payload; every check runs
// before a payload byte reaches LibTorch, and every failure is a CorruptCheckpointError naming
// the file and what was wrong (Note [Checkpoint file format] in src/checkpoint/format.h).
// Writes are atomic: a temporary file, fsync, rename, fsync of the directory; an existing
// checkpoint is never touched before its replacement is complete on disk (Note [Atomic
// checkpoint write] in src/checkpoint/file_io.h).
//
// Note [Checkpoint directory]
// A Checkpointer owns one directory:
//   epoch=E-step=S.ckpt   one per save (Lightning's default name); keep-K removes the oldest
//   last.ckpt             the newest save: a hard link to its epoch=E-step=S.ckpt (so it costs
//                         no space and is itself a complete checkpoint that load() reads like
//                         any other), made atomically (link to a temporary, rename); where the
//                         file system refuses hard links, an atomic copy (a warning says so)
// Ordering is by (step, epoch). latest_valid() ("--resume auto") verifies candidates newest
// first (full verification, both checksums) and returns the first valid one, with the newer
// files it skipped and why; last.ckpt is a candidate too (by the step in its header), skipped
// when it is the same file as a step checkpoint. One writer per directory: two jobs sharing a
// directory would prune and clean each other's files.
//
// Collective behaviour. With a ProcessGroup, save(), latest_valid() and load() are collectives
// (every rank calls them, in the same order relative to its other collectives):
//   save: the ranks all-gather their generator states; rank 0 writes (from its own model,
//         optimizer and sampler; the other ranks' are not read); rank 0 broadcasts the outcome.
//         No rank returns before the file is complete on disk, and a failure on rank 0 is
//         thrown on every rank (rank 0: the cause; others: "rank 0 failed to write ...").
//         refs.rng must be the same on every rank.
//   latest_valid: rank 0 scans and broadcasts its choice, so all ranks resume from one file.
//   load: every rank reads the file itself (a shared file system, or the same path on every
//         node) and verifies it; the ranks then exchange success, so if any rank fails, every
//         rank throws (naming the ranks that failed).
// Without a group (the overloads without one), the caller is the only process involved: call save() on the main
// process only, and the RNG saved is this process's.
//
// Errors: CheckpointError (I/O: cannot create, write, rename, list), its subclasses
// CorruptCheckpointError (the file is not an intact checkpoint) and
// IncompatibleCheckpointError (an intact checkpoint of another model, optimizer or dataset);
// ConfigError for bad arguments. Loading validates everything it can (fingerprint, optimizer
// type and group sizes, sampler compatibility, payload checksum and contents) before it modifies
// any of the caller's objects.
//
// Thread-safety: a Checkpointer holds only constant options; concurrent saves into one
// directory are not supported. Loading modifies the objects in CheckpointRefs: nothing else
// may use them meanwhile (the generators are process-wide).
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "ddp/error.h"
#include "ddp/sampler.h"

namespace torch::nn {
class Module;
}
namespace torch::optim {
class Optimizer;
}

namespace ddp {

class ProcessGroup;
class ZeroRedundancyOptimizer;
namespace comm_hooks {
class PowerSGDState;
}

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
// parameters), another optimizer type or param groups, a sampler over another dataset.
class IncompatibleCheckpointError : public CheckpointError {
 public:
  using CheckpointError::CheckpointError;
};

inline constexpr uint32_t kCheckpointFormatVersion = 1;
inline constexpr uint32_t kMaxCheckpointMetadataBytes = 64u << 20;  // sanity bound on M
// Keep the 3 newest step checkpoints (plus last.ckpt): enough to fall back past a damaged one.
inline constexpr int kDefaultCheckpointKeep = 3;
inline constexpr const char* kLastCheckpointName = "last.ckpt";

// The caller's live objects: read by save, restored in place by load. Non-owning.
struct CheckpointRefs {
  torch::nn::Module* model = nullptr;            // required: parameters and buffers
  torch::optim::Optimizer* optimizer = nullptr;  // optional: state and param-group options
  // Or, instead of `optimizer`, a sharded one: save() consolidates its state on rank 0 (a
  // collective); load() gives each rank its part, at any world size (Note [ZeRO checkpoints]).
  ZeroRedundancyOptimizer* zero_optimizer = nullptr;
  DistributedSampler* sampler = nullptr;         // optional: its state()
  bool rng = true;                               // save/restore the default generators
  // The PowerSGD hook's state (iteration, generator, P, Q, error feedback): each rank's, as
  // the error feedback is per rank. save() gathers them (a collective: every rank passes its
  // own or none); load() gives each rank its own, or, at another world size, rank 0's without
  // the error feedback. Same world size: the resumed run compresses exactly as the original.
  comm_hooks::PowerSGDState* powersgd = nullptr;
};

// What a checkpoint records besides the tensors.
struct CheckpointMeta {
  // Set by the caller for save().
  int64_t step = 0;  // optimizer steps completed
  int64_t epoch = 0;
  // JSON text: checked at save (ConfigError if malformed), stored as JSON in the metadata,
  // returned re-serialized (compact).
  std::string hparams_json = "{}";
  std::string blob;         // opaque bytes (scheduler/trainer state), stored in the payload
  std::string model_label;  // e.g. "--model mlp": quoted when a model does not fit
  int world_size = 1;       // set by save() from the group when one is given

  // Filled by save() from the objects and the process; returned by load().
  std::optional<SamplerState> sampler;  // rank 0's sampler state, when a sampler was given
  std::string optimizer_type;           // e.g. "torch::optim::AdamW"; empty without an optimizer
  int rng_states = 0;                   // generator states saved (one per rank; 0 when rng = false)
  int powersgd_states = 0;              // PowerSGD states saved (one per rank; 0 without)
  int num_threads = 0;                  // at::get_num_threads() of the writer (see Exact resume)
  std::string torch_version;
  std::string ddp_version;
  int64_t created_unix_ms = 0;
};

struct LoadOptions {
  int rank = 0;             // whose generator state to restore
  int world_size = 1;       // this run's, compared with the checkpoint's
  std::string model_label;  // this run's, quoted when the model does not fit
};

struct LoadedCheckpoint {
  std::filesystem::path path;
  CheckpointMeta meta;              // as saved, blob included
  bool world_size_changed = false;  // meta.world_size != this run's world size
  bool rng_exact = true;            // this rank got its own saved generator state(s)
};

// --- One file ---------------------------------------------------------------------------------

// Writes `file` atomically (see above) from `refs` and `meta`, with this
// process's generator state. Throws CheckpointError (I/O), ConfigError (no model, bad JSON).
void save_checkpoint(const std::filesystem::path& file, const CheckpointRefs& refs,
                     const CheckpointMeta& meta);
// Checks the header and metadata (cheap: the payload is not read, only its length);
// throws CorruptCheckpointError. The blob is not returned (it lives in the payload).
CheckpointMeta read_checkpoint_meta(const std::filesystem::path& file);
// Full verification: header, metadata and payload checksum. Throws CorruptCheckpointError.
void verify_checkpoint(const std::filesystem::path& file);
// Verifies `file`, checks that it fits `refs`, then restores into them in place (see the top).
LoadedCheckpoint load_checkpoint(const std::filesystem::path& file, const CheckpointRefs& refs,
                                 const LoadOptions& options = {});

// --- A directory of checkpoints ---------------------------------------------------------------

struct CheckpointerOptions {
  // Step checkpoints kept after each save (the newest ones, always including the one just
  // written), plus last.ckpt; 0 keeps every one.
  int keep = kDefaultCheckpointKeep;
  bool save_last = true;    // maintain last.ckpt
  std::string model_label;  // written into each checkpoint; quoted when a model does not fit
  // Testing only: called as a write reaches each stage ("open", "write" (half the bytes are
  // written), "fsync", "rename", "sync_dir"; "last" before linking last.ckpt) with the file's
  // path; a hook that throws simulates a failure there (a full disk, an I/O error).
  std::function<void(std::string_view stage, const std::filesystem::path& file)> fault_hook;
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
  SavedCheckpoint save(const CheckpointRefs& refs, const CheckpointMeta& meta) const;
  SavedCheckpoint save(const CheckpointRefs& refs, const CheckpointMeta& meta,
                       ProcessGroup& group) const;

  // The newest checkpoint that passes full verification ("--resume auto"); see the Note.
  ResumePoint latest_valid() const;
  ResumePoint latest_valid(ProcessGroup& group) const;

  // load_checkpoint with this run's rank and world size (from the group; without one, rank 0
  // of 1) and the options' model label; collective with a group. Pass the module itself, not a
  // DistributedDataParallel wrapper: refs.model = ddp_model.module().get().
  LoadedCheckpoint load(const std::filesystem::path& file, const CheckpointRefs& refs) const;
  LoadedCheckpoint load(const std::filesystem::path& file, const CheckpointRefs& refs,
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
  SavedCheckpoint save(const CheckpointRefs& refs, const CheckpointMeta& meta,
                       ProcessGroup* group) const;
  ResumePoint latest_valid(ProcessGroup* group) const;
  LoadedCheckpoint load(const std::filesystem::path& file, const CheckpointRefs& refs,
                        ProcessGroup* group) const;

  // Constant after construction.
  std::filesystem::path dir_;
  CheckpointerOptions options_;
};

}  // namespace ddp
