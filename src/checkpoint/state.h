// What goes into a checkpoint's payload and how it comes back: the model fingerprint, generator
// states, and the LibTorch archive of the tensors (model, optimizer, RNG, blob).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/serialize/input-archive.h>

#include "checkpoint/metadata.h"
#include "ddp/checkpoint.h"

namespace ddp::ckpt {

// The model's parameters then buffers (recursive, registration order) as name/shape/dtype.
std::vector<TensorSig> fingerprint(torch::nn::Module& model);

// Empty when `model` fits `saved` exactly (same names, shapes, dtypes and order); otherwise
// the differences, e.g. "checkpoint holds parameter 'fc1.weight' [128, 784] but the model has
// [256, 784]; it was written by --model mlp, this run is --model cnn".
std::string explain_mismatch(const std::vector<TensorSig>& saved,
                             const std::vector<TensorSig>& model, const std::string& saved_label,
                             const std::string& run_label);

std::string optimizer_type_name(const torch::optim::Optimizer& optimizer);  // demangled
std::vector<int64_t> group_sizes(const torch::optim::Optimizer& optimizer);
// What the metadata records of a ZeroRedundancyOptimizer: its type name starts with this.
inline constexpr std::string_view kZeroTypePrefix = "ddp::ZeroRedundancyOptimizer(";

// This process's default generators (CPU, and each CUDA device's), packed into bytes.
std::string capture_rng();

// The tensors of a payload, read and checked against the metadata, not yet applied.
struct Payload {
  std::vector<at::Tensor> model;  // indexed like FileMeta::model; undefined for "undefined"
  bool has_optimizer = false;
  torch::serialize::InputArchive optimizer;         // Optimizer::save's archive
  torch::serialize::InputArchive optimizer_groups;  // "group/<i>": each group's options
  std::string zero_optimizer;  // ZeroRedundancyOptimizer's consolidated state, if saved so
  std::string rng;                                  // packed (capture_rng), empty if none
  std::string powersgd;  // PowerSGDState::state_dict() of rank rng_rank % count, if saved
  std::string blob;
};

std::string build_payload(const CheckpointRefs& refs, const std::vector<std::string>& rng_states,
                          const std::vector<std::string>& powersgd_states,
                          const std::string& blob);

// Parses `bytes` (already checksummed) and checks it against `meta`: throws
// CorruptCheckpointError "<file>: ..." when LibTorch cannot read it or it disagrees with the
// metadata. `rng_rank` selects the generator state to take. Tensors land on `device`.
Payload read_payload(const std::string& file, const std::string& bytes, const FileMeta& meta,
                     int rng_rank, c10::optional<c10::Device> device);

// Why `packed` cannot be restored in this process ("" if it can). exact=false when it can but
// not completely (e.g. another number of CUDA devices: their states are left alone).
std::string check_rng(std::string_view packed, bool& exact);
void restore_rng(std::string_view packed);

// Copies the model tensors in place, loads the optimizer (state and group options).
void apply_model(torch::nn::Module& model, const Payload& payload);
void apply_optimizer(torch::optim::Optimizer& optimizer, Payload& payload);

}  // namespace ddp::ckpt
