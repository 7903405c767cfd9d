// One checkpoint: a Snapshot with its metadata as bytes, those bytes as a file, and a file (or
// bytes) restored into a TrainingState (see ddp/checkpoint.h).
//
// Loading runs in phases so that a checkpoint that does not fit leaves every object untouched:
// (1) the header and the metadata; (2) the payload, after its SHA-256 matched; (3) the states
// decoded and every registered object checked against its own (TrainingState::restore);
// (4) every object restored.
#include <chrono>
#include <exception>

#include <ATen/Parallel.h>  // at::get_num_threads: recorded, since it can change float results
#include <fmt/format.h>
#include <torch/version.h>  // TORCH_VERSION

#include "base/check.h"
#include "checkpoint/file_io.h"
#include "checkpoint/format.h"
#include "checkpoint/legacy_v1.h"
#include "checkpoint/metadata.h"
#include "checkpoint/sharded.h"
#include "ddp/checkpoint.h"
#include "ddp/config.h"  // DDP_VERSION
#include "state/codec.h"

namespace ddp {
namespace ckpt {
namespace {

// The metadata of an open file, of either format.
CheckpointMeta read_meta(const CheckpointFile& f) {
  try {
    return f.version() == 1 ? decode_v1_metadata(f.metadata()) : decode_metadata(f.metadata()).meta;
  } catch (const std::exception& e) {
    // The header checksum matched, so these bytes are what was written: another format.
    f.corrupt(
        fmt::format("its metadata is not what this version of ddp-cpp writes ({})", e.what()));
  }
}

// The whole checkpoint of an open file: metadata, then the payload (checked) decoded.
DecodedCheckpoint read_all(const CheckpointFile& f) {
  DecodedCheckpoint out;
  out.meta = read_meta(f);  // the metadata first: a damaged one is reported as such
  const std::string payload = f.read_payload();  // throws unless the SHA-256 matches
  const auto corrupt = [&](const std::string& what) { f.corrupt(what); };
  if (f.version() == 1) {
    out.snapshot = decode_v1(f.metadata(), payload, corrupt, out.meta);
    return out;
  }
  FileMeta fm = decode_metadata(f.metadata());
  out.snapshot.entries = state::decode(fm.states, payload, corrupt);
  out.snapshot.world_size = out.meta.world_size;
  return out;
}

// The run's label against the checkpoint's, for a state that does not fit.
std::string labels(const std::string& saved, const std::string& run) {
  if (saved.empty() && run.empty()) return "";
  return fmt::format("; it was written by {}, this run is {}",
                     saved.empty() ? "an unlabelled run" : saved, run.empty() ? "unlabelled" : run);
}

}  // namespace

void check_save_args(const TrainingState* state, const CheckpointMeta& meta) {
  DDP_CHECK(state == nullptr || !state->keys().empty(), ConfigError,
            "checkpoint save: the TrainingState holds nothing to save; add the model, the "
            "optimizer, ... to it (TrainingState::add)");
  check_json(meta.hparams_json, "hparams_json");
}

void fill_save_fields(CheckpointMeta& meta) {
  meta.num_threads = at::get_num_threads();
  meta.torch_version = TORCH_VERSION;
  meta.ddp_version = DDP_VERSION;
  meta.format_version = kCheckpointFormatVersion;
  meta.created_unix_ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                             std::chrono::system_clock::now().time_since_epoch())
                             .count();
  meta.blob.clear();
}

LoadedCheckpoint restore_checkpoint(const std::filesystem::path& path, CheckpointMeta meta,
                                    const Snapshot& snapshot, TrainingState& state,
                                    const LoadOptions& options) {
  LoadedCheckpoint out;
  out.path = path;
  try {
    RestoreReport r = state.restore(snapshot, options.rank, options.world_size);
    out.world_size_changed = r.world_size_changed;
    out.per_rank_exact = r.per_rank_exact;
    out.absent = std::move(r.absent);
    out.ignored = std::move(r.ignored);
  } catch (const IncompatibleStateError& e) {
    throw IncompatibleCheckpointError(fmt::format("{}: this checkpoint does not fit this run: {}{}",
                                                  path.string(), e.what(),
                                                  labels(meta.model_label, options.model_label)));
  } catch (const Error& e) {
    throw CheckpointError(fmt::format("{}: {}", path.string(), e.what()));
  }
  out.meta = std::move(meta);
  return out;
}

}  // namespace ckpt

namespace ckpt {

std::vector<std::string_view> EncodedFile::parts() const {
  std::vector<std::string_view> out{head};
  out.insert(out.end(), payload.parts.begin(), payload.parts.end());
  return out;
}

EncodedFile encode_file(const std::vector<Snapshot::Entry>& entries, FileMeta fm) {
  fill_save_fields(fm.meta);
  EncodedFile out;
  out.payload = state::encode(entries);
  fm.states = std::move(out.payload.index);
  out.head = encode_head(encode_metadata(fm), out.payload.parts);
  return out;
}

// A Snapshot as a checkpoint file (metadata `meta`, its keys the snapshot's).
EncodedFile encode_snapshot(const Snapshot& snapshot, const CheckpointMeta& meta) {
  check_save_args(nullptr, meta);
  FileMeta fm;
  fm.meta = meta;
  fm.meta.keys.clear();
  for (const auto& e : snapshot.entries) fm.meta.keys.push_back(e.key);
  return encode_file(snapshot.entries, std::move(fm));
}

}  // namespace ckpt

std::string encode_checkpoint(const Snapshot& snapshot, const CheckpointMeta& meta) {
  const ckpt::EncodedFile f = ckpt::encode_snapshot(snapshot, meta);
  std::string out;
  out.reserve(f.size());
  for (std::string_view part : f.parts()) out.append(part);
  return out;
}

DecodedCheckpoint decode_checkpoint(std::string_view bytes, std::string_view what) {
  const ckpt::CheckpointFile f(bytes, std::string(what));
  return ckpt::read_all(f);
}

void save_checkpoint(const std::filesystem::path& file, TrainingState& state,
                     const CheckpointMeta& meta) {
  ckpt::check_save_args(&state, meta);
  ckpt::write_atomic(file, ckpt::encode_snapshot(state.snapshot(), meta).parts(), {});
}

CheckpointMeta read_checkpoint_meta(const std::filesystem::path& file) {
  if (ckpt::is_sharded(file)) return ckpt::read_sharded_meta(file);
  const ckpt::CheckpointFile f(file);
  return ckpt::read_meta(f);
}

void verify_checkpoint(const std::filesystem::path& file) {
  if (ckpt::is_sharded(file)) return ckpt::verify_sharded(file);
  const ckpt::CheckpointFile f(file);
  ckpt::read_meta(f);
  f.verify_payload();
}

LoadedCheckpoint load_checkpoint(const std::filesystem::path& file, TrainingState& state,
                                 const LoadOptions& options) {
  DDP_CHECK(options.rank >= 0 && options.rank < options.world_size, ConfigError,
            "checkpoint load: rank {} outside a world of {}", options.rank, options.world_size);
  if (ckpt::is_sharded(file)) return ckpt::load_sharded(file, state, options);
  const ckpt::CheckpointFile f(file);
  DecodedCheckpoint d = ckpt::read_all(f);
  return ckpt::restore_checkpoint(file, std::move(d.meta), d.snapshot, state, options);
}

}  // namespace ddp
