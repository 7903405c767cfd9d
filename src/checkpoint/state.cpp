// The payload of a checkpoint: model fingerprint, generator states, LibTorch archive.
#include "checkpoint/state.h"

#include <cxxabi.h>  // abi::__cxa_demangle: the optimizer's type name

#include <algorithm>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <typeinfo>

#include <ATen/CPUGeneratorImpl.h>  // at::detail::getDefaultCPUGenerator
#include <ATen/Context.h>           // at::globalContext().defaultGenerator(cuda:i)
#include <fmt/format.h>
#include <torch/cuda.h>  // torch::cuda::device_count (0 on CPU builds)
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>
#include <torch/serialize/output-archive.h>

#include "base/check.h"
#include "checkpoint/bytes.h"
#include "ddp/zero_redundancy_optimizer.h"  // state_dict: the sharded optimizer's state

namespace ddp::ckpt {
namespace {

// Differences listed in a mismatch message before "and N more".
constexpr size_t kMaxListedDifferences = 6;

// Generators in a packed RNG state.
enum class GenKind : uint8_t { kCpu = 0, kCuda = 1 };

void append_u64(std::string& out, uint64_t v) {
  for (int i = 0; i < 8; ++i) out += static_cast<char>((v >> (8 * i)) & 0xff);
}

// Reads a u64 at `at`, advancing it; false past the end.
bool take_u64(std::string_view in, size_t& at, uint64_t& v) {
  if (at > in.size() || in.size() - at < 8) return false;
  v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | static_cast<unsigned char>(in[at + i]);
  at += 8;
  return true;
}

struct GenState {
  GenKind kind;
  int64_t index;
  std::string bytes;
};

// Packed: u64 count, then per generator u64 kind, u64 index, u64 length, bytes.
std::vector<GenState> unpack(std::string_view packed, bool& ok) {
  std::vector<GenState> out;
  size_t at = 0;
  uint64_t count = 0;
  ok = take_u64(packed, at, count) && count < 1024;
  for (uint64_t i = 0; ok && i < count; ++i) {
    uint64_t kind = 0, index = 0, len = 0;
    ok = take_u64(packed, at, kind) && take_u64(packed, at, index) && take_u64(packed, at, len) &&
         kind <= 1 && len <= packed.size() - at;
    if (ok) {
      out.push_back({static_cast<GenKind>(kind), static_cast<int64_t>(index),
                     std::string(packed.substr(at, len))});
      at += len;
    }
  }
  ok = ok && at == packed.size();
  return out;
}

at::Generator generator(GenKind kind, int64_t index) {
  if (kind == GenKind::kCpu) return at::detail::getDefaultCPUGenerator();
  return at::globalContext().defaultGenerator(c10::Device(c10::DeviceType::CUDA, index));
}

std::string get_state(at::Generator gen) {
  std::lock_guard<std::mutex> lock(gen.mutex());  // generators are shared by all threads
  return tensor_bytes(gen.get_state());
}

std::string describe(const TensorSig& s) { return fmt::format("{} '{}'", s.kind, s.name); }

}  // namespace

std::vector<TensorSig> fingerprint(torch::nn::Module& model) {
  std::vector<TensorSig> out;
  auto add = [&](const char* kind, const std::string& name, const at::Tensor& t) {
    if (!t.defined()) {
      out.push_back({kind, name, {}, "undefined"});
    } else {
      out.push_back({kind, name, t.sizes().vec(), std::string(c10::toString(t.scalar_type()))});
    }
  };
  for (const auto& item : model.named_parameters(/*recurse=*/true)) {
    add("parameter", item.key(), item.value());
  }
  for (const auto& item : model.named_buffers(/*recurse=*/true)) {
    add("buffer", item.key(), item.value());
  }
  return out;
}

std::string explain_mismatch(const std::vector<TensorSig>& saved,
                             const std::vector<TensorSig>& model, const std::string& saved_label,
                             const std::string& run_label) {
  std::map<std::string, const TensorSig*> in_model, in_saved;
  for (const auto& s : model) in_model[s.kind + "/" + s.name] = &s;
  for (const auto& s : saved) in_saved[s.kind + "/" + s.name] = &s;
  // Shape and dtype differences first (the most telling), then tensors present on one side
  // only, alternating sides so that both show up within the listed few.
  std::vector<std::string> diffs, only_saved, only_model;
  for (const auto& s : saved) {
    auto it = in_model.find(s.kind + "/" + s.name);
    if (it == in_model.end()) {
      only_saved.push_back(fmt::format("checkpoint holds {} {} that the model lacks", describe(s),
                                       shape_str(s.shape)));
    } else if (it->second->shape != s.shape) {
      diffs.push_back(fmt::format("checkpoint holds {} {} but the model has {}", describe(s),
                                  shape_str(s.shape), shape_str(it->second->shape)));
    } else if (it->second->dtype != s.dtype) {
      diffs.push_back(fmt::format("checkpoint holds {} as {} but the model has {}", describe(s),
                                  s.dtype, it->second->dtype));
    }
  }
  for (const auto& s : model) {
    if (!in_saved.count(s.kind + "/" + s.name)) {
      only_model.push_back(fmt::format("the model has {} {} that the checkpoint lacks", describe(s),
                                       shape_str(s.shape)));
    }
  }
  for (size_t i = 0; i < std::max(only_saved.size(), only_model.size()); ++i) {
    if (i < only_saved.size()) diffs.push_back(only_saved[i]);
    if (i < only_model.size()) diffs.push_back(only_model[i]);
  }
  if (diffs.empty() && saved != model) {
    // Same tensors, another order: the optimizer state is matched to parameters by position.
    size_t i = 0;
    while (i < saved.size() && saved[i] == model[i]) ++i;
    diffs.push_back(fmt::format(
        "the same tensors are registered in another order (first at #{}: checkpoint {}, model "
        "{}); optimizer state is matched by position, so the order must agree",
        i, describe(saved[i]), describe(model[i])));
  }
  if (diffs.empty()) return "";
  std::string out;
  for (size_t i = 0; i < diffs.size() && i < kMaxListedDifferences; ++i) {
    out += (i ? "; " : "") + diffs[i];
  }
  if (diffs.size() > kMaxListedDifferences) {
    const size_t more = diffs.size() - kMaxListedDifferences;
    out += fmt::format("; and {} more difference{}", more, more == 1 ? "" : "s");
  }
  if (!saved_label.empty() || !run_label.empty()) {
    out += fmt::format("; it was written by {}, this run is {}",
                       saved_label.empty() ? "an unlabelled run" : saved_label,
                       run_label.empty() ? "unlabelled" : run_label);
  }
  return out;
}

std::string optimizer_type_name(const torch::optim::Optimizer& optimizer) {
  const char* mangled = typeid(optimizer).name();
  int status = 0;
  std::unique_ptr<char, void (*)(void*)> name(abi::__cxa_demangle(mangled, nullptr, nullptr,
                                                                  &status),
                                              std::free);
  return status == 0 && name ? std::string(name.get()) : std::string(mangled);
}

std::vector<int64_t> group_sizes(const torch::optim::Optimizer& optimizer) {
  std::vector<int64_t> out;
  for (const auto& g : optimizer.param_groups()) {
    out.push_back(static_cast<int64_t>(g.params().size()));
  }
  return out;
}

std::string capture_rng() {
  std::vector<GenState> gens;
  gens.push_back({GenKind::kCpu, 0, get_state(generator(GenKind::kCpu, 0))});
  // On a CPU-only LibTorch there are none; on CUDA each device has its own default generator
  // (dropout on cuda:i draws from it).
  const int64_t cuda = static_cast<int64_t>(torch::cuda::device_count());
  for (int64_t i = 0; i < cuda; ++i) {
    gens.push_back({GenKind::kCuda, i, get_state(generator(GenKind::kCuda, i))});
  }
  std::string out;
  append_u64(out, gens.size());
  for (const auto& g : gens) {
    append_u64(out, static_cast<uint64_t>(g.kind));
    append_u64(out, static_cast<uint64_t>(g.index));
    append_u64(out, g.bytes.size());
    out += g.bytes;
  }
  return out;
}

std::string check_rng(std::string_view packed, bool& exact) {
  bool ok = false;
  const auto gens = unpack(packed, ok);
  if (!ok || gens.empty() || gens[0].kind != GenKind::kCpu) return "malformed generator state";
  const size_t cpu_size = get_state(generator(GenKind::kCpu, 0)).size();
  if (gens[0].bytes.size() != cpu_size) {
    return fmt::format("CPU generator state of {} bytes; this LibTorch's has {}",
                       gens[0].bytes.size(), cpu_size);
  }
  const size_t cuda = static_cast<size_t>(torch::cuda::device_count());
  exact = gens.size() - 1 == cuda;
  return "";
}

void restore_rng(std::string_view packed) {
  bool ok = false;
  const auto gens = unpack(packed, ok);
  DDP_ASSERT(ok, "restore_rng: unchecked state");
  const int64_t cuda = static_cast<int64_t>(torch::cuda::device_count());
  const bool cuda_fits = static_cast<int64_t>(gens.size()) - 1 == cuda;
  for (const auto& g : gens) {
    if (g.kind == GenKind::kCuda && !cuda_fits) continue;  // another machine: leave them
    at::Generator gen = generator(g.kind, g.index);
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_state(bytes_tensor(g.bytes));
  }
}

std::string build_payload(const CheckpointRefs& refs, const std::vector<std::string>& rng_states,
                          const std::vector<std::string>& powersgd_states,
                          const std::string& blob) {
  torch::serialize::OutputArchive ar;
  auto cu = ar.compilation_unit();
  // Model: "tensor/<i>" for entry i of the fingerprint (names live in the metadata: archive
  // keys must not contain the dots of "fc1.weight").
  torch::serialize::OutputArchive model_ar(cu);
  int64_t i = 0;
  auto add = [&](const at::Tensor& t) {
    if (t.defined()) model_ar.write(fmt::format("tensor/{}", i), t.detach(), /*is_buffer=*/true);
    ++i;
  };
  for (const auto& item : refs.model->named_parameters(true)) add(item.value());
  for (const auto& item : refs.model->named_buffers(true)) add(item.value());
  ar.write("model", model_ar);

  if (refs.optimizer) {
    torch::serialize::OutputArchive opt_ar(cu);
    refs.optimizer->save(opt_ar);
    ar.write("optimizer", opt_ar);
    // LibTorch's Optimizer::load restores the per-parameter state but not the param groups'
    // options (lr, momentum, ...), which a scheduler may have changed: save them ourselves.
    torch::serialize::OutputArchive groups_ar(cu);
    const auto& groups = refs.optimizer->param_groups();
    for (size_t g = 0; g < groups.size(); ++g) {
      torch::serialize::OutputArchive group_ar(cu);
      groups[g].options().serialize(group_ar);
      groups_ar.write(fmt::format("group/{}", g), group_ar);
    }
    ar.write("optimizer_groups", groups_ar);
  }

  if (refs.zero_optimizer) {  // consolidated on rank 0 by the caller (Checkpointer::save)
    ar.write("zero_optimizer", bytes_tensor(refs.zero_optimizer->state_dict()),
             /*is_buffer=*/true);
  }

  torch::serialize::OutputArchive rng_ar(cu);
  for (size_t r = 0; r < rng_states.size(); ++r) {
    rng_ar.write(fmt::format("rank/{}", r), bytes_tensor(rng_states[r]), /*is_buffer=*/true);
  }
  ar.write("rng", rng_ar);
  if (!powersgd_states.empty()) {
    torch::serialize::OutputArchive psgd_ar(cu);
    for (size_t r = 0; r < powersgd_states.size(); ++r) {
      psgd_ar.write(fmt::format("rank/{}", r), bytes_tensor(powersgd_states[r]), true);
    }
    ar.write("powersgd", psgd_ar);
  }
  ar.write("blob", bytes_tensor(blob), /*is_buffer=*/true);

  std::ostringstream os;
  ar.save_to(os);
  return std::move(os).str();
}

Payload read_payload(const std::string& file, const std::string& bytes, const FileMeta& meta,
                     int rng_rank, c10::optional<c10::Device> device) {
  auto bad = [&](const std::string& what) {
    return CorruptCheckpointError(fmt::format(
        "{}: the payload passed its checksum but {}; it was not written by this version of "
        "ddp-cpp or a bug corrupted it before the checksum",
        file, what));
  };
  Payload p;
  try {
    torch::serialize::InputArchive ar;
    ar.load_from(bytes.data(), bytes.size(), device);

    torch::serialize::InputArchive model_ar;
    if (!ar.try_read("model", model_ar)) throw bad("it has no model tensors");
    p.model.resize(meta.model.size());
    for (size_t i = 0; i < meta.model.size(); ++i) {
      const TensorSig& sig = meta.model[i];
      if (sig.dtype == "undefined") continue;
      at::Tensor t;
      if (!model_ar.try_read(fmt::format("tensor/{}", i), t, /*is_buffer=*/true)) {
        throw bad(fmt::format("it lacks {} '{}'", sig.kind, sig.name));
      }
      if (t.sizes().vec() != sig.shape ||
          std::string(c10::toString(t.scalar_type())) != sig.dtype) {
        throw bad(fmt::format("{} '{}' is {} {} in the payload, {} {} in the metadata", sig.kind,
                              sig.name, c10::toString(t.scalar_type()), shape_str(t.sizes().vec()),
                              sig.dtype, shape_str(sig.shape)));
      }
      p.model[i] = t;
    }

    p.has_optimizer = !meta.meta.optimizer_type.empty();
    if (meta.meta.optimizer_type.starts_with(kZeroTypePrefix)) {
      at::Tensor zero;
      if (!ar.try_read("zero_optimizer", zero, /*is_buffer=*/true)) {
        throw bad("it lacks the sharded optimizer state its metadata lists");
      }
      p.zero_optimizer = tensor_bytes(zero);
    } else if (p.has_optimizer && (!ar.try_read("optimizer", p.optimizer) ||
                                   !ar.try_read("optimizer_groups", p.optimizer_groups))) {
      throw bad("it lacks the optimizer state its metadata lists");
    }

    // Per-rank bytes saved under NAME/rank/<r>, one for each of `count` ranks: this rank's
    // (rng_rank modulo the count).
    auto per_rank = [&](const char* name, int count, const char* what) {
      torch::serialize::InputArchive sub;
      at::Tensor t;
      const int r = rng_rank % count;
      if (!ar.try_read(name, sub) ||
          !sub.try_read(fmt::format("rank/{}", r), t, /*is_buffer=*/true)) {
        throw bad(fmt::format("it lacks the {} of rank {}", what, r));
      }
      return tensor_bytes(t);
    };
    if (meta.meta.rng_states > 0) p.rng = per_rank("rng", meta.meta.rng_states, "generator state");
    if (meta.meta.powersgd_states > 0) {
      p.powersgd = per_rank("powersgd", meta.meta.powersgd_states, "PowerSGD state");
    }

    at::Tensor blob;
    if (!ar.try_read("blob", blob, /*is_buffer=*/true) ||
        static_cast<uint64_t>(blob.numel()) != meta.blob_bytes) {
      throw bad("its blob is missing or of another size than the metadata says");
    }
    p.blob = tensor_bytes(blob);
  } catch (const c10::Error& e) {
    throw bad(fmt::format("LibTorch cannot read it ({})", e.what_without_backtrace()));
  }
  return p;
}

void apply_model(torch::nn::Module& model, const Payload& payload) {
  torch::NoGradGuard no_grad;
  // copy_ keeps each tensor's storage: optimizers, DDP bucket views and anything else that
  // holds the parameters keep seeing them (InputArchive::read would set_() new storage).
  size_t i = 0;
  auto copy = [&](at::Tensor& target) {
    if (target.defined()) target.copy_(payload.model[i]);
    ++i;
  };
  for (auto& item : model.named_parameters(true)) copy(item.value());
  for (auto& item : model.named_buffers(true)) copy(item.value());
}

void apply_optimizer(torch::optim::Optimizer& optimizer, Payload& payload) {
  // Clear first: a parameter without saved state (no gradient yet when saved) must not keep
  // state from this run.
  optimizer.state().clear();
  optimizer.load(payload.optimizer);
  auto& groups = optimizer.param_groups();
  for (size_t g = 0; g < groups.size(); ++g) {
    torch::serialize::InputArchive group_ar;
    payload.optimizer_groups.read(fmt::format("group/{}", g), group_ar);
    groups[g].options().serialize(group_ar);
  }
}

}  // namespace ddp::ckpt
