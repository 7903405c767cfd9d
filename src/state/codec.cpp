// States <-> index and payload (Note [State payload] in codec.h).
#include "state/codec.h"

#include <algorithm>
#include <cstring>  // memcpy
#include <optional>
#include <set>

#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
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

// Zero bytes to pad each tensor's start to kPayloadAlign.
constexpr char kZeros[kPayloadAlign] = {};

json encode_state(const std::string& key, const StateDict& s, Encoded& payload) {
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
    json entry;
    if (const ShardPlacement* p = s.shard(name)) {
      entry["shard"] = {{"whole", p->whole_shape}, {"offset", p->offset}};
    }
    if (!tensor.defined()) {
      entry["name"] = name;
      entry["dtype"] = kUndefined;
      j["tensors"].push_back(std::move(entry));
      continue;
    }
    DDP_CHECK(dtype_named(c10::toString(tensor.scalar_type())), ConfigError,
              "state '{}': tensor '{}' is {}, which a checkpoint cannot hold", key, name,
              c10::toString(tensor.scalar_type()));
    const at::Tensor c = tensor.detach().to(at::kCPU).contiguous();  // no copy when it is
    const size_t offset = aligned(payload.payload_size);
    if (offset > payload.payload_size) {
      payload.parts.emplace_back(kZeros, offset - payload.payload_size);
    }
    if (c.nbytes() > 0) {
      payload.parts.emplace_back(static_cast<const char*>(c.data_ptr()), c.nbytes());
      payload.keep.push_back(c);
    }
    payload.payload_size = offset + c.nbytes();
    entry["name"] = name;
    entry["dtype"] = c10::toString(c.scalar_type());
    entry["shape"] = c.sizes().vec();
    entry["offset"] = offset;
    entry["bytes"] = c.nbytes();
    j["tensors"].push_back(std::move(entry));
  }
  for (const auto& [name, p] : s.shards) {
    DDP_CHECK(names.count(name) == 1, ConfigError,
              "state '{}': piece '{}' is placed (StateDict::shards) but is not one of its tensors",
              key, name);
    const at::Tensor* t = s.find(name);
    int64_t whole = 1;
    for (int64_t d : p.whole_shape) whole *= d;
    DDP_CHECK(p.offset >= 0 && (!t->defined() || p.offset + t->numel() <= whole), ConfigError,
              "state '{}': piece '{}' of {} elements at {} lies outside its whole tensor of {}",
              key, name, t->defined() ? t->numel() : 0, p.offset, whole);
  }
  return j;
}

// One tensor of an index, checked against the payload and copied out of it.
at::Tensor decode_tensor(const json& t, std::string_view payload, const std::string& where,
                         const Fail& corrupt, const std::shared_ptr<void>& owner) {
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
  if (owner != nullptr && bytes > 0) {  // a view of the payload, which `owner` keeps alive
    return at::from_blob(
        const_cast<char*>(payload.data() + offset), shape, [owner](void*) {},
        at::TensorOptions().dtype(*type));
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
    for (const StateDict& s : e.ranks) ranks.push_back(encode_state(e.key, s, out));
    out.index.push_back({{"key", e.key}, {"scope", to_string(e.scope)}, {"ranks", ranks}});
  }
  return out;
}

namespace {

// decode() and decode_index(): `payload` null for the index alone.
std::vector<Snapshot::Entry> decode_entries(
    const json& index, const std::string_view* payload,
    const std::function<void(const std::string&)>& corrupt_callback,
    const std::shared_ptr<void>& owner) {
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
      for (StateScope s : {StateScope::kReplicated, StateScope::kPerRank, StateScope::kCollective,
                           StateScope::kSharded}) {
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
          if (t.contains("shard")) {
            ShardPlacement p{t.at("shard").at("whole").get<std::vector<int64_t>>(),
                             t.at("shard").at("offset").get<int64_t>()};
            if (p.offset < 0 || std::any_of(p.whole_shape.begin(), p.whole_shape.end(),
                                            [](int64_t d) { return d < 0; })) {
              corrupt(where + " has an impossible placement");
            }
            s.shards.emplace_back(name, std::move(p));
          }
          at::Tensor tensor;
          if (payload != nullptr) {
            tensor = decode_tensor(t, *payload, where, corrupt, owner);
          } else if (t.at("dtype").get<std::string>() != kUndefined) {
            const auto type = dtype_named(t.at("dtype").get<std::string>());
            if (!type) corrupt(fmt::format("{} has an unknown dtype", where));
            const auto shape = t.at("shape").get<std::vector<int64_t>>();
            if (std::any_of(shape.begin(), shape.end(), [](int64_t d) { return d < 0; })) {
              corrupt(fmt::format("{} has an impossible shape", where));
            }
            tensor = at::empty(shape, at::TensorOptions().dtype(*type).device(c10::kMeta));
          }
          s.tensors.emplace_back(std::move(name), std::move(tensor));
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

}  // namespace

std::string Encoded::joined() const {
  std::string out;
  out.reserve(payload_size);
  for (std::string_view p : parts) out.append(p);
  return out;
}

std::vector<Snapshot::Entry> decode(const json& index, std::string_view payload,
                                    const std::function<void(const std::string&)>& corrupt_callback,
                                    const std::shared_ptr<void>& owner) {
  return decode_entries(index, &payload, corrupt_callback, owner);
}

std::vector<Snapshot::Entry> decode_index(
    const json& index, const std::function<void(const std::string&)>& corrupt_callback) {
  return decode_entries(index, nullptr, corrupt_callback, nullptr);
}

}  // namespace ddp::state
