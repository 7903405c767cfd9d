// Turning the caller's objects into checkpoint bytes (shared by save_checkpoint and
// Checkpointer::save, which gathers the generator states of all ranks first).
#pragma once

#include <string>
#include <vector>

#include "ddp/checkpoint.h"

namespace ddp::ckpt {

struct Encoded {
  std::string head;     // 88-byte header + metadata
  std::string payload;  // the LibTorch archive
};

// Throws ConfigError for a missing model or malformed hparams JSON. Cheap: every rank of a
// collective save calls it before the first collective, so a bad argument fails everywhere.
void check_save_args(const CheckpointRefs& refs, const CheckpointMeta& meta);

// Fills the library's fields of `meta` (sampler, optimizer type, RNG count, versions, time)
// and encodes the file. `rng_states`: one packed state per rank (empty when refs.rng is false);
// `powersgd_states`: one PowerSGDState::state_dict() per rank (empty without refs.powersgd).
Encoded encode_checkpoint(const CheckpointRefs& refs, CheckpointMeta meta,
                          const std::vector<std::string>& rng_states,
                          const std::vector<std::string>& powersgd_states);

}  // namespace ddp::ckpt
