// One checkpoint file: save, inspect, verify, load (see ddp/checkpoint.h).
//
// Loading runs in two phases so that a checkpoint that does not fit leaves the caller's
// objects untouched: (1) check everything: header, metadata, model fingerprint, optimizer type
// and groups, sampler compatibility, payload checksum, payload contents, generator state;
// (2) apply: model, optimizer, generators, sampler.
#include <chrono>
#include <exception>

#include <ATen/Parallel.h>  // at::get_num_threads: recorded, since it can change float results
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>
#include <torch/version.h>  // TORCH_VERSION

#include "base/check.h"
#include "checkpoint/encode.h"
#include "checkpoint/format.h"
#include "checkpoint/metadata.h"
#include "checkpoint/state.h"
#include "ddp/checkpoint.h"
#include "ddp/comm_hooks.h"  // PowerSGDState
#include "ddp/config.h"      // DDP_VERSION
#include "ddp/zero_redundancy_optimizer.h"  // type_name, load_state_dict

namespace ddp {
namespace ckpt {
namespace {

FileMeta read_meta(const CheckpointFile& f) {
  try {
    return decode_metadata(f.metadata());
  } catch (const std::exception& e) {
    // The header checksum matched, so these bytes are what was written: another format.
    f.corrupt(
        fmt::format("its metadata is not what this version of ddp-cpp writes ({})", e.what()));
  }
}

// The device the model lives on (the archive's tensors are mapped there); none for CPU.
c10::optional<c10::Device> model_device(torch::nn::Module& model) {
  for (const auto& p : model.parameters(true)) {
    if (p.defined() && !p.device().is_cpu()) return p.device();
  }
  return c10::nullopt;
}

[[noreturn]] void incompatible(const std::filesystem::path& file, const std::string& what) {
  throw IncompatibleCheckpointError(fmt::format("{}: {}", file.string(), what));
}

}  // namespace

void check_save_args(const CheckpointRefs& refs, const CheckpointMeta& meta) {
  DDP_CHECK(refs.model != nullptr, ConfigError,
            "checkpoint save: CheckpointRefs::model is required (the module to save)");
  DDP_CHECK(refs.optimizer == nullptr || refs.zero_optimizer == nullptr, ConfigError,
            "checkpoint: CheckpointRefs takes an optimizer or a zero_optimizer, not both");
  check_json(meta.hparams_json, "hparams_json");
}

Encoded encode_checkpoint(const CheckpointRefs& refs, CheckpointMeta meta,
                          const std::vector<std::string>& rng_states,
                          const std::vector<std::string>& powersgd_states) {
  check_save_args(refs, meta);
  FileMeta fm;
  fm.model = fingerprint(*refs.model);
  meta.sampler = refs.sampler ? std::optional<SamplerState>(refs.sampler->state()) : std::nullopt;
  meta.optimizer_type = refs.optimizer        ? optimizer_type_name(*refs.optimizer)
                        : refs.zero_optimizer ? refs.zero_optimizer->type_name()
                                              : "";
  if (refs.optimizer) fm.optimizer_groups = group_sizes(*refs.optimizer);
  meta.rng_states = static_cast<int>(rng_states.size());
  meta.powersgd_states = static_cast<int>(powersgd_states.size());
  meta.num_threads = at::get_num_threads();
  meta.torch_version = TORCH_VERSION;
  meta.ddp_version = DDP_VERSION;
  meta.created_unix_ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                             std::chrono::system_clock::now().time_since_epoch())
                             .count();
  fm.blob_bytes = meta.blob.size();
  Encoded out;
  out.payload = build_payload(refs, rng_states, powersgd_states, meta.blob);
  meta.blob.clear();  // in the payload, not the metadata
  fm.meta = std::move(meta);
  out.head = encode_head(encode_metadata(fm), out.payload);
  return out;
}

}  // namespace ckpt

void save_checkpoint(const std::filesystem::path& file, const CheckpointRefs& refs,
                     const CheckpointMeta& meta) {
  std::vector<std::string> rng;
  if (refs.rng) rng.push_back(ckpt::capture_rng());
  std::vector<std::string> powersgd;
  if (refs.powersgd) powersgd.push_back(refs.powersgd->state_dict());
  const ckpt::Encoded e = ckpt::encode_checkpoint(refs, meta, rng, powersgd);
  ckpt::write_atomic(file, {e.head, e.payload}, {});
}

CheckpointMeta read_checkpoint_meta(const std::filesystem::path& file) {
  ckpt::CheckpointFile f(file);
  return ckpt::read_meta(f).meta;
}

void verify_checkpoint(const std::filesystem::path& file) {
  ckpt::CheckpointFile f(file);
  ckpt::read_meta(f);
  f.verify_payload();
}

LoadedCheckpoint load_checkpoint(const std::filesystem::path& file, const CheckpointRefs& refs,
                                 const LoadOptions& options) {
  DDP_CHECK(refs.model != nullptr, ConfigError,
            "checkpoint load: CheckpointRefs::model is required (the module to restore)");
  DDP_CHECK(options.rank >= 0 && options.rank < options.world_size, ConfigError,
            "checkpoint load: rank {} outside a world of {}", options.rank, options.world_size);

  // Phase 1: check. Header and metadata first (cheap), the payload last.
  const ckpt::CheckpointFile f(file);
  ckpt::FileMeta fm = ckpt::read_meta(f);
  const CheckpointMeta& m = fm.meta;

  const std::string why = ckpt::explain_mismatch(fm.model, ckpt::fingerprint(*refs.model),
                                                 m.model_label, options.model_label);
  if (!why.empty()) ckpt::incompatible(file, "this checkpoint does not fit the model: " + why);

  if (refs.optimizer) {
    if (m.optimizer_type.empty()) {
      ckpt::incompatible(file, "it holds no optimizer state (it was saved without an optimizer)");
    }
    const std::string type = ckpt::optimizer_type_name(*refs.optimizer);
    if (type != m.optimizer_type) {
      ckpt::incompatible(file, fmt::format("it holds {} state but this run's optimizer is {}",
                                           m.optimizer_type, type));
    }
    const auto sizes = ckpt::group_sizes(*refs.optimizer);
    if (sizes != fm.optimizer_groups) {
      ckpt::incompatible(file,
                         fmt::format("its optimizer has param groups of [{}] parameters, this "
                                     "run's has [{}]",
                                     fmt::join(fm.optimizer_groups, ", "), fmt::join(sizes, ", ")));
    }
  }
  if (refs.zero_optimizer) {
    const std::string& type = refs.zero_optimizer->type_name();
    if (m.optimizer_type.empty()) {
      ckpt::incompatible(file, "it holds no optimizer state (it was saved without an optimizer)");
    }
    if (type != m.optimizer_type) {
      ckpt::incompatible(file, fmt::format("it holds {} state but this run's optimizer is {}",
                                           m.optimizer_type, type));
    }
  }
  if (refs.sampler) {
    if (!m.sampler) ckpt::incompatible(file, "it holds no sampler state (saved without a sampler)");
    try {
      refs.sampler->clone().load_state(*m.sampler);  // a dry run on an independent copy
    } catch (const ConfigError& e) {
      ckpt::incompatible(file, fmt::format("its sampler state does not fit this run's sampler: {}",
                                           e.what()));
    }
  }

  const std::string bytes = f.read_payload();  // throws unless the SHA-256 matches
  ckpt::Payload payload =
      ckpt::read_payload(file.string(), bytes, fm, options.rank, ckpt::model_device(*refs.model));

  LoadedCheckpoint out;
  out.path = file;
  out.world_size_changed = m.world_size != options.world_size;
  bool cuda_exact = false;
  const bool restore_rng = refs.rng && !payload.rng.empty();
  if (restore_rng) {
    const std::string bad = ckpt::check_rng(payload.rng, cuda_exact);
    if (!bad.empty()) ckpt::incompatible(file, "its generator state cannot be restored: " + bad);
  }
  out.rng_exact = restore_rng && cuda_exact && options.rank < m.rng_states &&
                  m.world_size == options.world_size;
  // PowerSGD: this rank's own state when the world size is the same, else rank 0's (P, Q,
  // iteration and generator are the same on every rank) without the error feedback.
  const bool powersgd_own = m.world_size == options.world_size && options.rank < m.powersgd_states;
  if (refs.powersgd) {
    if (payload.powersgd.empty()) {
      ckpt::incompatible(file, "it holds no PowerSGD state (saved without the PowerSGD hook, or "
                               "without CheckpointRefs::powersgd)");
    }
    try {
      comm_hooks::PowerSGDState dry_run(refs.powersgd->options());
      dry_run.load_state_dict(payload.powersgd, powersgd_own);
    } catch (const Error& e) {
      ckpt::incompatible(file, e.what());
    }
  }

  // Phase 2: apply.
  ckpt::apply_model(*refs.model, payload);
  if (refs.powersgd) refs.powersgd->load_state_dict(payload.powersgd, powersgd_own);
  if (refs.zero_optimizer) refs.zero_optimizer->load_state_dict(payload.zero_optimizer);
  if (refs.optimizer) {
    try {
      ckpt::apply_optimizer(*refs.optimizer, payload);
    } catch (const c10::Error& e) {
      throw CheckpointError(fmt::format(
          "{}: LibTorch could not restore the optimizer state ({}); the model is restored, "
          "the optimizer may be partly restored: do not train on",
          file.string(), e.what_without_backtrace()));
    }
  }
  if (restore_rng) ckpt::restore_rng(payload.rng);
  if (refs.sampler) refs.sampler->load_state(*m.sampler);

  out.meta = std::move(fm.meta);
  out.meta.blob = std::move(payload.blob);
  return out;
}

}  // namespace ddp
