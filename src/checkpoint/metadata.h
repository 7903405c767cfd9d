// The JSON metadata of a checkpoint file (Note [Checkpoint file format] in format.h), format 2:
// CheckpointMeta's fields and the index of the states (Note [State payload] in
// src/state/codec.h). Format 1's metadata is read by legacy_v1.h.
#pragma once

#include <string>

#include <nlohmann/json.hpp>

#include "ddp/checkpoint.h"
#include "state/codec.h"

namespace ddp::ckpt {

struct FileMeta {
  CheckpointMeta meta;
  nlohmann::json states;  // the index: an array, one object per key
  // A sharded checkpoint's metadata.ckpt: its rank files, in rank order (Note [Sharded
  // checkpoint] in sharded.h); null in any other file.
  nlohmann::json files;
};

std::string encode_metadata(const FileMeta& m);
// Throws std::exception (nlohmann's) when the text is not metadata of format 2.
FileMeta decode_metadata(const std::string& text);

// Throws ConfigError when `text` is not JSON (what: "hparams_json").
void check_json(const std::string& text, const char* what);
// What every save checks on every rank before anything else: a state with something in it
// (`state` may be null: not known), hparams that are JSON. Throws ConfigError.
void check_save_args(const TrainingState* state, const CheckpointMeta& meta);

// Sets the fields every save fills in (thread count, versions, format, time).
void fill_save_fields(CheckpointMeta& meta);

// A checkpoint file ready to be written: its head (the header and the metadata) and its
// payload, whose parts point into the states' own tensors (kept alive here): written from
// there, a state is never copied whole in memory.
struct EncodedFile {
  std::string head;
  state::Encoded payload;
  std::vector<std::string_view> parts() const;  // the head, then the payload's parts
  uint64_t size() const { return head.size() + payload.payload_size; }
};
// `entries` with the metadata `fm` (its save-time fields filled; its keys as given).
EncodedFile encode_file(const std::vector<Snapshot::Entry>& entries, FileMeta fm);
// A Snapshot as a checkpoint file (encode_checkpoint without the copy into one string).
EncodedFile encode_snapshot(const Snapshot& snapshot, const CheckpointMeta& meta);

// `snapshot` (read from `path`, with `meta`) restored into `state`, the errors named as
// load_checkpoint names them.
LoadedCheckpoint restore_checkpoint(const std::filesystem::path& path, CheckpointMeta meta,
                                    const Snapshot& snapshot, TrainingState& state,
                                    const LoadOptions& options);

// CheckpointMeta's common fields: written by encode_metadata, read by both formats' decoders.
void put_common(nlohmann::json& j, const CheckpointMeta& c);
void get_common(const nlohmann::json& j, CheckpointMeta& c);

}  // namespace ddp::ckpt
