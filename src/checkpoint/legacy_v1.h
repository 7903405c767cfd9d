// Checkpoint format 1 (ddp-cpp 0.1.0, before TrainingState): read only. Its fixed set of
// objects becomes the states format 2 holds under the keys the library's adapters read:
//   model       the fingerprint's tensors ("parameters": how many are parameters)
//   optimizer   a torch::optim optimizer's archive (the whole payload: its "optimizer" and
//               "optimizer_groups" are where the adapter looks), or ZeRO's consolidated state
//   sampler     the sampler's cursor
//   rng         per rank: "cpu" and "cuda:<i>" generator states
//   powersgd    per rank: PowerSGDState::state_dict()
// and its opaque blob becomes CheckpointMeta::blob.
#pragma once

#include <functional>
#include <string>

#include "ddp/checkpoint.h"

namespace ddp::ckpt {

// The metadata's CheckpointMeta (keys listed as above; no blob: it lives in the payload).
// Throws std::exception (nlohmann's) when the text is not format 1's metadata.
CheckpointMeta decode_v1_metadata(const std::string& text);

// The states of a format-1 file whose payload's checksum matched. `corrupt(what)` throws.
// `meta` receives the metadata and the blob.
Snapshot decode_v1(const std::string& metadata, const std::string& payload,
                   const std::function<void(const std::string&)>& corrupt, CheckpointMeta& meta);

}  // namespace ddp::ckpt
