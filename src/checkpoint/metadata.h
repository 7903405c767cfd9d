// The JSON metadata of a checkpoint file (Note [Checkpoint file format] in format.h): what it
// records besides tensors, including the model fingerprint. Torch-free.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "ddp/checkpoint.h"

namespace ddp::ckpt {

// One entry of the model fingerprint.
struct TensorSig {
  std::string kind;  // "parameter" or "buffer"
  std::string name;  // e.g. "fc1.weight"
  std::vector<int64_t> shape;
  std::string dtype;  // e.g. "Float"; "undefined" for an undefined buffer (not stored)
  bool operator==(const TensorSig&) const = default;
};

struct FileMeta {
  CheckpointMeta meta;                    // blob empty: it lives in the payload
  std::vector<TensorSig> model;           // registration order: parameters, then buffers
  std::vector<int64_t> optimizer_groups;  // parameters per param group
  uint64_t blob_bytes = 0;
};

std::string encode_metadata(const FileMeta& m);
// Throws std::exception (nlohmann's) when the text is not metadata of this format.
FileMeta decode_metadata(const std::string& text);

// Throws ConfigError when `text` is not JSON (what: "hparams_json").
void check_json(const std::string& text, const char* what);

// "[128, 784]"
std::string shape_str(const std::vector<int64_t>& shape);

}  // namespace ddp::ckpt
