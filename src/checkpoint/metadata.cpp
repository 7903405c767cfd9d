// Checkpoint metadata <-> JSON.
#include "checkpoint/metadata.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "base/check.h"

namespace ddp::ckpt {
namespace {

using nlohmann::json;

json sampler_to_json(const SamplerState& s) {
  return {{"epoch", s.epoch},
          {"position", s.position},
          {"num_replicas", s.num_replicas},
          {"offset", s.offset},
          {"dataset_size", s.dataset_size},
          {"seed", s.seed},
          {"shuffle", s.shuffle},
          {"drop_last", s.drop_last},
          {"pad", s.pad}};
}

SamplerState sampler_from_json(const json& j) {
  SamplerState s;
  j.at("epoch").get_to(s.epoch);
  j.at("position").get_to(s.position);
  j.at("num_replicas").get_to(s.num_replicas);
  j.at("offset").get_to(s.offset);
  j.at("dataset_size").get_to(s.dataset_size);
  j.at("seed").get_to(s.seed);
  j.at("shuffle").get_to(s.shuffle);
  j.at("drop_last").get_to(s.drop_last);
  j.at("pad").get_to(s.pad);
  return s;
}

}  // namespace

std::string shape_str(const std::vector<int64_t>& shape) {
  return fmt::format("[{}]", fmt::join(shape, ", "));
}

void check_json(const std::string& text, const char* what) {
  DDP_CHECK(json::accept(text), ConfigError, "checkpoint {}: not valid JSON: '{}'", what,
            text.substr(0, 200));
}

std::string encode_metadata(const FileMeta& m) {
  const CheckpointMeta& c = m.meta;
  json model = json::array();
  for (const auto& t : m.model) {
    model.push_back({{"kind", t.kind}, {"name", t.name}, {"shape", t.shape}, {"dtype", t.dtype}});
  }
  json j = {
      {"format", "ddp-cpp checkpoint"},
      {"step", c.step},
      {"epoch", c.epoch},
      {"world_size", c.world_size},
      {"model_label", c.model_label},
      {"hparams", json::parse(c.hparams_json)},
      {"sampler", c.sampler ? sampler_to_json(*c.sampler) : json(nullptr)},
      {"optimizer", c.optimizer_type.empty()
                        ? json(nullptr)
                        : json{{"type", c.optimizer_type}, {"group_sizes", m.optimizer_groups}}},
      {"rng_states", c.rng_states},
      {"powersgd_states", c.powersgd_states},
      {"blob_bytes", m.blob_bytes},
      {"num_threads", c.num_threads},
      {"torch_version", c.torch_version},
      {"ddp_version", c.ddp_version},
      {"created_unix_ms", c.created_unix_ms},
      {"model", model},
  };
  return j.dump(1);
}

FileMeta decode_metadata(const std::string& text) {
  const json j = json::parse(text);
  FileMeta m;
  CheckpointMeta& c = m.meta;
  j.at("step").get_to(c.step);
  j.at("epoch").get_to(c.epoch);
  j.at("world_size").get_to(c.world_size);
  j.at("model_label").get_to(c.model_label);
  c.hparams_json = j.at("hparams").dump();
  if (!j.at("sampler").is_null()) c.sampler = sampler_from_json(j.at("sampler"));
  if (!j.at("optimizer").is_null()) {
    j.at("optimizer").at("type").get_to(c.optimizer_type);
    j.at("optimizer").at("group_sizes").get_to(m.optimizer_groups);
  }
  j.at("rng_states").get_to(c.rng_states);
  c.powersgd_states = j.value("powersgd_states", 0);  // absent in files from before PowerSGD
  j.at("blob_bytes").get_to(m.blob_bytes);
  j.at("num_threads").get_to(c.num_threads);
  j.at("torch_version").get_to(c.torch_version);
  j.at("ddp_version").get_to(c.ddp_version);
  j.at("created_unix_ms").get_to(c.created_unix_ms);
  for (const auto& t : j.at("model")) {
    TensorSig s;
    t.at("kind").get_to(s.kind);
    t.at("name").get_to(s.name);
    t.at("shape").get_to(s.shape);
    t.at("dtype").get_to(s.dtype);
    m.model.push_back(std::move(s));
  }
  return m;
}

}  // namespace ddp::ckpt
