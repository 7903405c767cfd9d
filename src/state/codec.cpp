// States <-> index and payload (Note [State payload] in codec.h).
#include "state/codec.h"

#include <cstring>  // memcpy
#include <optional>
#include <set>

#include <ATen/ops/empty.h>
#include <c10/core/ScalarType.h>
#include <fmt/format.h>

#include "base/check.h"

namespace ddp::state {
namespace {

using nlohmann::json;

constexpr const char* kUndefined = "undefined";

// The dtypes a state may hold: every fixed-width type LibTorch's checkpoints use.
constexpr c10::ScalarType kDtypes[] = {
    c10::kByte, c10::kChar,     c10::kShort,        c10::kInt,           c10::kLong,
    c10::kHalf, c10::kFloat,    c10::kDouble,       c10::kBool,          c10::kBFloat16,
    c10::kComplexFloat,         c10::kComplexDouble};

std::optional<c10::ScalarType> dtype_named(const std::string& name) {
  for (c10::ScalarType t : kDtypes) {
    if (name == c10::toString(t)) return t;
  }
  return std::nullopt;
}

// Calls the caller's corrupt(), which throws (a guard for one that does not).
struct Fail {
  const std::function<void(const std::string&)>& corrupt;
  [[noreturn]] void operator()(const std::string& what) const {
    corrupt(what);
    throw InternalError("state decoding: the corrupt() callback returned for: " + what);
  }
};

size_t aligned(size_t n) { return (n + kPayloadAlign - 1) / kPayloadAlign * kPayloadAlign; }

json encode_state(const std::string& key, const StateDict& s, std::string& payload) {
  json j = {{"json", nullptr}, {"tensors", json::array()}};
  DDP_CHECK(json::accept(s.json), ConfigError,
            "state '{}': its JSON is not JSON: '{}'; a Stateful's state_dict() must return JSON "
            "text",
            key, s.json.substr(0, 200));
  j["json"] = json::parse(s.json);
  std::set<std::string> names;
  for (const auto& [name, tensor] : s.tensors) {
    DDP_CHECK(names.insert(name).second, ConfigError,
              "state '{}': two tensors are named '{}'; names must be unique", key, name);
    if (!tensor.defined()) {
      j["tensors"].push_back({{"name", name}, {"dtype", kUndefined}});
      continue;
    }
    DDP_CHECK(dtype_named(c10::toString(tensor.scalar_type())), ConfigError,
              "state '{}': tensor '{}' is {}, which a checkpoint cannot hold", key, name,
              c10::toString(tensor.scalar_type()));
    const at::Tensor c = tensor.detach().to(at::kCPU).contiguous();
    const size_t offset = aligned(payload.size());
    payload.resize(offset, '\0');
    payload.append(static_cast<const char*>(c.data_ptr()), c.nbytes());
    j["tensors"].push_back({{"name", name},
                            {"dtype", c10::toString(c.scalar_type())},
                            {"shape", c.sizes().vec()},
                            {"offset", offset},
                            {"bytes", c.nbytes()}});
  }
  return j;
}

// One tensor of an index, checked against the payload and copied out of it.
at::Tensor decode_tensor(const json& t, std::string_view payload, const std::string& where,
                         const Fail& corrupt) {
  const std::string dtype = t.at("dtype").get<std::string>();
  if (dtype == kUndefined) return {};
  const auto type = dtype_named(dtype);
  if (!type) corrupt(fmt::format("{} has dtype '{}', which this build does not know", where, dtype));
  const auto shape = t.at("shape").get<std::vector<int64_t>>();
  uint64_t elements = 1;
  for (int64_t d : shape) {
    if (d < 0 || (d > 0 && elements > UINT64_MAX / static_cast<uint64_t>(d))) {
      corrupt(fmt::format("{} has an impossible shape", where));
    }
    elements *= static_cast<uint64_t>(d);
  }
  const uint64_t offset = t.at("offset").get<uint64_t>();
  const uint64_t bytes = t.at("bytes").get<uint64_t>();
  const uint64_t item = c10::elementSize(*type);
  if (elements > UINT64_MAX / item || bytes != elements * item) {
    corrupt(fmt::format("{} declares {} bytes for {} elements of {}", where, bytes, elements, dtype));
  }
  if (offset > payload.size() || bytes > payload.size() - offset) {
    corrupt(fmt::format("{} lies outside the payload ({} bytes at offset {} of {})", where, bytes,
                        offset, payload.size()));
  }
  at::Tensor out = at::empty(shape, at::TensorOptions().dtype(*type));
  if (bytes > 0) std::memcpy(out.data_ptr(), payload.data() + offset, bytes);
  return out;
}

}  // namespace

Encoded encode(const std::vector<Snapshot::Entry>& entries) {
  Encoded out;
  out.index = json::array();
  for (const auto& e : entries) {
    json ranks = json::array();
    for (const StateDict& s : e.ranks) ranks.push_back(encode_state(e.key, s, out.payload));
    out.index.push_back({{"key", e.key}, {"scope", to_string(e.scope)}, {"ranks", ranks}});
  }
  return out;
}

std::vector<Snapshot::Entry> decode(
    const json& index, std::string_view payload,
    const std::function<void(const std::string&)>& corrupt_callback) {
  const Fail corrupt{corrupt_callback};
  std::vector<Snapshot::Entry> out;
  std::set<std::string> keys;
  try {
    for (const json& e : index) {
      Snapshot::Entry entry;
      entry.key = e.at("key").get<std::string>();
      if (!keys.insert(entry.key).second) corrupt(fmt::format("state '{}' appears twice", entry.key));
      const std::string scope = e.at("scope").get<std::string>();
      bool known = false;
      for (StateScope s : {StateScope::kReplicated, StateScope::kPerRank, StateScope::kCollective}) {
        if (scope == to_string(s)) {
          entry.scope = s;
          known = true;
        }
      }
      if (!known) corrupt(fmt::format("state '{}' has scope '{}'", entry.key, scope));
      for (const json& r : e.at("ranks")) {
        StateDict s;
        s.json = r.at("json").dump();
        std::set<std::string> names;
        for (const json& t : r.at("tensors")) {
          std::string name = t.at("name").get<std::string>();
          const std::string where =
              fmt::format("state '{}' rank {} tensor '{}'", entry.key, entry.ranks.size(), name);
          if (!names.insert(name).second) corrupt(where + " appears twice");
          s.tensors.emplace_back(std::move(name), decode_tensor(t, payload, where, corrupt));
        }
        entry.ranks.push_back(std::move(s));
      }
      if (entry.ranks.empty()) corrupt(fmt::format("state '{}' holds no state", entry.key));
      out.push_back(std::move(entry));
    }
  } catch (const json::exception& e) {
    corrupt(fmt::format("its index of states is malformed ({})", e.what()));
  }
  return out;
}

}  // namespace ddp::state
