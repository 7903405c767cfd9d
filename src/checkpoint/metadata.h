// The JSON metadata of a checkpoint file (Note [Checkpoint file format] in format.h), format 2:
// CheckpointMeta's fields and the index of the states (Note [State payload] in
// src/state/codec.h). Format 1's metadata is read by legacy_v1.h.
#pragma once

#include <string>

#include <nlohmann/json.hpp>

#include "ddp/checkpoint.h"

namespace ddp::ckpt {

struct FileMeta {
  CheckpointMeta meta;
  nlohmann::json states;  // the index: an array, one object per key
};

std::string encode_metadata(const FileMeta& m);
// Throws std::exception (nlohmann's) when the text is not metadata of format 2.
FileMeta decode_metadata(const std::string& text);

// Throws ConfigError when `text` is not JSON (what: "hparams_json").
void check_json(const std::string& text, const char* what);
// What every save checks on every rank before anything else: a state with something in it
// (`state` may be null: not known), hparams that are JSON. Throws ConfigError.
void check_save_args(const TrainingState* state, const CheckpointMeta& meta);

// CheckpointMeta's common fields: written by encode_metadata, read by both formats' decoders.
void put_common(nlohmann::json& j, const CheckpointMeta& c);
void get_common(const nlohmann::json& j, CheckpointMeta& c);

}  // namespace ddp::ckpt
