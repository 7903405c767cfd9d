// Checkpoint format 1, read into format 2's states (legacy_v1.h).
#include "checkpoint/legacy_v1.h"

#include <ATen/ops/from_blob.h>
#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <torch/serialize/input-archive.h>

#include "base/tensor_bytes.h"
#include "checkpoint/metadata.h"  // get_common

namespace ddp::ckpt {
namespace {

using nlohmann::json;

// What a format-1 ZeroRedundancyOptimizer's type name starts with.
constexpr std::string_view kZeroTypePrefix = "ddp::ZeroRedundancyOptimizer(";

struct V1 {
  CheckpointMeta meta;
  json model;      // [{kind, name, shape, dtype}]: the fingerprint
  json sampler;    // the cursor, or null
  json optimizer;  // {type, group_sizes}, or null
  int rng_states = 0;
  int powersgd_states = 0;
  uint64_t blob_bytes = 0;
};

V1 parse(const std::string& text) {
  const json j = json::parse(text);
  V1 v;
  get_common(j, v.meta);
  v.meta.format_version = 1;
  v.model = j.at("model");
  v.sampler = j.at("sampler");
  v.optimizer = j.at("optimizer");
  j.at("rng_states").get_to(v.rng_states);
  v.powersgd_states = j.value("powersgd_states", 0);  // absent in files from before PowerSGD
  j.at("blob_bytes").get_to(v.blob_bytes);
  v.meta.keys.push_back("model");
  if (!v.optimizer.is_null()) v.meta.keys.push_back("optimizer");
  if (!v.sampler.is_null()) v.meta.keys.push_back("sampler");
  if (v.rng_states > 0) v.meta.keys.push_back("rng");
  if (v.powersgd_states > 0) v.meta.keys.push_back("powersgd");
  return v;
}

// Format 1 packed each rank's generators as: u64 count, then per generator u64 kind (0: CPU,
// 1: CUDA), u64 device index, u64 length, the state's bytes.
bool take_u64(std::string_view in, size_t& at, uint64_t& v) {
  if (at > in.size() || in.size() - at < 8) return false;
  v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | static_cast<unsigned char>(in[at + i]);
  at += 8;
  return true;
}

std::optional<StateDict> unpack_generators(std::string_view packed) {
  StateDict s;
  size_t at = 0;
  uint64_t count = 0;
  if (!take_u64(packed, at, count) || count >= 1024) return std::nullopt;
  for (uint64_t i = 0; i < count; ++i) {
    uint64_t kind = 0, index = 0, len = 0;
    if (!take_u64(packed, at, kind) || !take_u64(packed, at, index) || !take_u64(packed, at, len) ||
        kind > 1 || len > packed.size() - at) {
      return std::nullopt;
    }
    s.tensors.emplace_back(kind == 0 ? "cpu" : fmt::format("cuda:{}", index),
                           bytes_tensor(packed.substr(at, len)));
    at += len;
  }
  if (at != packed.size() || s.tensors.empty() || s.tensors.front().first != "cpu") {
    return std::nullopt;
  }
  return s;
}

}  // namespace

CheckpointMeta decode_v1_metadata(const std::string& text) { return parse(text).meta; }

Snapshot decode_v1(const std::string& metadata, const std::string& payload,
                   const std::function<void(const std::string&)>& corrupt_callback,
                   CheckpointMeta& meta) {
  auto corrupt = [&](const std::string& what) {
    corrupt_callback(fmt::format(
        "the payload passed its checksum but {}; it was not written by ddp-cpp or a bug "
        "corrupted it before the checksum",
        what));
    throw InternalError("decode_v1: corrupt() returned");
  };
  const V1 v = parse(metadata);
  meta = v.meta;
  Snapshot out;
  out.world_size = v.meta.world_size;
  try {
    torch::serialize::InputArchive ar;
    ar.load_from(payload.data(), payload.size());

    // The model: "model/tensor/<i>" for entry i of the fingerprint.
    torch::serialize::InputArchive model_ar;
    if (!ar.try_read("model", model_ar)) corrupt("it has no model tensors");
    StateDict model;
    size_t params = 0;
    for (size_t i = 0; i < v.model.size(); ++i) {
      const json& sig = v.model[i];
      const std::string kind = sig.at("kind"), name = sig.at("name"), dtype = sig.at("dtype");
      if (kind == "parameter") ++params;
      at::Tensor t;
      if (dtype != "undefined") {
        if (!model_ar.try_read(fmt::format("tensor/{}", i), t, /*is_buffer=*/true)) {
          corrupt(fmt::format("it lacks {} '{}'", kind, name));
        }
        if (t.sizes().vec() != sig.at("shape").get<std::vector<int64_t>>() ||
            c10::toString(t.scalar_type()) != dtype) {
          corrupt(fmt::format("{} '{}' is not what the metadata says", kind, name));
        }
      }
      model.tensors.emplace_back(name, t);
    }
    model.json = json{{"parameters", params}}.dump();
    out.entries.push_back({"model", StateScope::kReplicated, {std::move(model)}});

    if (!v.optimizer.is_null()) {
      const std::string type = v.optimizer.at("type");
      StateDict opt;
      opt.json = v.optimizer.dump();  // {"type", "group_sizes"}: the adapters' fields
      if (type.starts_with(kZeroTypePrefix)) {
        at::Tensor zero;
        if (!ar.try_read("zero_optimizer", zero, true))
          corrupt("it lacks the sharded optimizer state");
        opt.tensors.emplace_back("state", zero);
      } else {
        torch::serialize::InputArchive probe;
        if (!ar.try_read("optimizer", probe) || !ar.try_read("optimizer_groups", probe)) {
          corrupt("it lacks the optimizer state its metadata lists");
        }
        opt.tensors.emplace_back("archive", bytes_tensor(payload));
      }
      out.entries.push_back({"optimizer", StateScope::kReplicated, {std::move(opt)}});
    }
    if (!v.sampler.is_null()) {
      out.entries.push_back(
          {"sampler", StateScope::kReplicated, {StateDict{.json = v.sampler.dump()}}});
    }

    // Per-rank bytes under NAME/rank/<r>, one for each of `count` ranks.
    auto per_rank = [&](const char* name, int count, const char* what) {
      torch::serialize::InputArchive sub;
      if (!ar.try_read(name, sub)) corrupt(fmt::format("it lacks the {}s", what));
      std::vector<std::string> all;
      for (int r = 0; r < count; ++r) {
        at::Tensor t;
        if (!sub.try_read(fmt::format("rank/{}", r), t, true)) {
          corrupt(fmt::format("it lacks the {} of rank {}", what, r));
        }
        all.push_back(tensor_bytes(t));
      }
      return all;
    };
    if (v.rng_states > 0) {
      Snapshot::Entry rng{"rng", StateScope::kPerRank, {}};
      for (const std::string& packed : per_rank("rng", v.rng_states, "generator state")) {
        std::optional<StateDict> s = unpack_generators(packed);
        if (!s) corrupt("a generator state is malformed");
        rng.ranks.push_back(std::move(*s));
      }
      out.entries.push_back(std::move(rng));
    }
    if (v.powersgd_states > 0) {
      Snapshot::Entry psgd{"powersgd", StateScope::kPerRank, {}};
      for (const std::string& bytes : per_rank("powersgd", v.powersgd_states, "PowerSGD state")) {
        StateDict s;
        s.tensors.emplace_back("state", bytes_tensor(bytes));
        psgd.ranks.push_back(std::move(s));
      }
      out.entries.push_back(std::move(psgd));
    }

    at::Tensor blob;
    if (!ar.try_read("blob", blob, true) || static_cast<uint64_t>(blob.numel()) != v.blob_bytes) {
      corrupt("its blob is missing or of another size than the metadata says");
    }
    meta.blob = tensor_bytes(blob);
  } catch (const c10::Error& e) {
    corrupt(fmt::format("LibTorch cannot read it ({})", e.what_without_backtrace()));
  } catch (const json::exception& e) {
    corrupt(fmt::format("its model fingerprint is malformed ({})", e.what()));
  }
  return out;
}

}  // namespace ddp::ckpt
