// Checkpoint metadata (format 2) <-> JSON.
#include "checkpoint/metadata.h"

#include <stdexcept>

#include "base/check.h"

namespace ddp::ckpt {

using nlohmann::json;

void check_json(const std::string& text, const char* what) {
  DDP_CHECK(json::accept(text), ConfigError, "checkpoint {}: not valid JSON: '{}'", what,
            text.substr(0, 200));
}

void put_common(json& j, const CheckpointMeta& c) {
  j["format"] = "ddp-cpp checkpoint";
  j["step"] = c.step;
  j["epoch"] = c.epoch;
  j["world_size"] = c.world_size;
  j["model_label"] = c.model_label;
  j["hparams"] = json::parse(c.hparams_json);
  j["num_threads"] = c.num_threads;
  j["torch_version"] = c.torch_version;
  j["ddp_version"] = c.ddp_version;
  j["created_unix_ms"] = c.created_unix_ms;
}

void get_common(const json& j, CheckpointMeta& c) {
  j.at("step").get_to(c.step);
  j.at("epoch").get_to(c.epoch);
  j.at("world_size").get_to(c.world_size);
  j.at("model_label").get_to(c.model_label);
  c.hparams_json = j.at("hparams").dump();
  j.at("num_threads").get_to(c.num_threads);
  j.at("torch_version").get_to(c.torch_version);
  j.at("ddp_version").get_to(c.ddp_version);
  j.at("created_unix_ms").get_to(c.created_unix_ms);
}

std::string encode_metadata(const FileMeta& m) {
  json j;
  put_common(j, m.meta);
  j["states"] = m.states;
  if (!m.files.is_null()) {
    j["files"] = m.files;
    j["keys"] = m.meta.keys;  // every key, in registration order: the rank files hold some
  }
  return j.dump(1);
}

FileMeta decode_metadata(const std::string& text) {
  const json j = json::parse(text);
  FileMeta m;
  get_common(j, m.meta);
  m.meta.format_version = 2;
  m.states = j.at("states");
  if (!m.states.is_array()) throw std::invalid_argument("'states' is not an array");
  for (const json& s : m.states) m.meta.keys.push_back(s.at("key").get<std::string>());
  if (j.contains("files")) {
    m.files = j.at("files");
    if (!m.files.is_array()) throw std::invalid_argument("'files' is not an array");
    m.meta.keys = j.at("keys").get<std::vector<std::string>>();
  }
  return m;
}

}  // namespace ddp::ckpt
