// Snapshot entries <-> an index (JSON) and a payload (the tensors' bytes): the form states take
// in a checkpoint file (format 2) and between ranks (a collective snapshot's per-rank states).
//
// Note [State payload]
// The payload is every defined tensor's bytes, contiguous, in the index's order, each starting
// at a multiple of kPayloadAlign (zero bytes between). The index lists, per entry, its key,
// scope and, per rank, the state's JSON and its tensors: name, dtype (LibTorch's name: "Float",
// "BFloat16", "Byte"; "undefined" for an undefined tensor, which has no bytes), shape, offset
// and byte count, and for a piece of a kSharded state its placement ("shard": the whole shape and
// the piece's first element: Note [Sharded states] in shards.h). Bytes are the host's (little-endian on every platform LibTorch ships for).
// Decoding checks every field against the payload before it copies a byte: offsets and lengths
// inside it, lengths equal to the shape's elements times the dtype's size, known dtypes,
// unique names and keys; a failure names the entry and tensor.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "ddp/training_state.h"

namespace ddp::state {

inline constexpr size_t kPayloadAlign = 64;

// The payload is not copied: `parts` point at the tensors' own bytes (contiguous CPU tensors;
// others are copied once into `keep`), between them zero padding, so that a file is written
// straight from the states' memory.
struct Encoded {
  nlohmann::json index;  // an array: one object per entry
  std::vector<at::Tensor> keep;         // what `parts` point into (kept alive)
  std::vector<std::string_view> parts;  // the payload, in order
  uint64_t payload_size = 0;

  std::string joined() const;  // the payload as one string (a copy)
};

// Throws ConfigError when a state's JSON is not JSON, a tensor name repeats or a tensor's dtype
// has no fixed width.
Encoded encode(const std::vector<Snapshot::Entry>& entries);

// `corrupt(what)` is called (and must throw) for an index or payload that does not describe
// valid states. Tensors come back on the CPU, owning their memory; or, given the `owner` of the
// payload's bytes, as views of them that keep it alive (no copy).
std::vector<Snapshot::Entry> decode(const nlohmann::json& index, std::string_view payload,
                                    const std::function<void(const std::string&)>& corrupt,
                                    const std::shared_ptr<void>& owner = nullptr);
// The same from the index alone: every tensor on the meta device (its shape and dtype, no
// bytes): what a sharded checkpoint's loader knows of a rank file before it reads its payload.
std::vector<Snapshot::Entry> decode_index(const nlohmann::json& index,
                                          const std::function<void(const std::string&)>& corrupt);

}  // namespace ddp::state
