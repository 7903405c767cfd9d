// TrainingState: the registry, the snapshot (one rank, or collective) and the restore loop.
//
// Note [Collective snapshot]
// Every rank calls snapshot(group) at the same point. First one all-gather (two collectives:
// the lengths, then the bytes) carries from every rank its registry (each key with its scope)
// and its kPerRank states (encoded: Note [State payload] in codec.h): every rank compares the
// registries and, when they differ, throws the same ConfigError naming the first difference,
// before any object's own collective could run out of step. Then the kCollective objects'
// state_dict() on every rank, in registration order (ZeroRedundancyOptimizer consolidates on
// rank 0 there); the kReplicated ones on rank 0 alone (the other ranks' copies are the same).
// Rank 0 assembles the snapshot in registration order; the others return an empty one.
#include "ddp/training_state.h"

#include <algorithm>
#include <cctype>  // isalnum
#include <cstring>
#include <deque>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "base/check.h"
#include "ddp/process_group.h"
#include "process_group/bytes_collectives.h"
#include "state/group_bound.h"
#include "state/adapters.h"
#include "state/codec.h"
#include "state/shards.h"

namespace ddp {
namespace {

constexpr size_t kMaxKeyLength = 200;

// A Stateful the caller owns: forwards to it.
class Borrowed : public Stateful {
 public:
  explicit Borrowed(Stateful& s) : s_(s) {}
  StateDict state_dict() override { return s_.state_dict(); }
  std::string check(const StateDict& saved, const LoadContext& c) override {
    return s_.check(saved, c);
  }
  void load_state_dict(const StateDict& saved, const LoadContext& c) override {
    s_.load_state_dict(saved, c);
  }
  StateScope scope() const override { return s_.scope(); }
  std::string kind() const override { return s_.kind(); }
  std::optional<ElementRange> wanted(const std::string& name,
                                     const std::vector<int64_t>& whole_shape) const override {
    return s_.wanted(name, whole_shape);
  }

 private:
  Stateful& s_;
};

void check_key(const std::string& key) {
  const bool ok = !key.empty() && key.size() <= kMaxKeyLength &&
                  std::all_of(key.begin(), key.end(), [](unsigned char c) {
                    return std::isalnum(c) || c == '_' || c == '-' || c == '.' || c == '/';
                  });
  DDP_CHECK(ok, ConfigError,
            "TrainingState::add: key '{}' must be 1 to {} letters, digits or '_-./'", key,
            kMaxKeyLength);
}

// "model (replicated), rng (per-rank)": a registry as the ranks compare it.
std::string describe(const std::vector<std::pair<std::string, StateScope>>& registry) {
  std::vector<std::string> parts;
  for (const auto& [key, scope] : registry) parts.push_back(fmt::format("{} ({})", key, to_string(scope)));
  return parts.empty() ? "nothing" : fmt::format("{}", fmt::join(parts, ", "));
}

// A rank's contribution to a collective snapshot: its registry and its per-rank states.
//   u64 length of the registry text, the text, u64 length of the index, the index (JSON),
//   the payload.
std::string pack(const std::string& registry, const state::Encoded& mine) {
  const std::string index = mine.index.dump();
  std::string out;
  auto put = [&](const std::string& s) {
    const uint64_t n = s.size();
    out.append(reinterpret_cast<const char*>(&n), sizeof n);
    out += s;
  };
  put(registry);
  put(index);
  for (std::string_view part : mine.parts) out.append(part);
  return out;
}

struct Unpacked {
  std::string registry;
  std::string index;
  std::string_view payload;
};

Unpacked unpack(std::string_view bytes) {
  Unpacked u;
  auto take = [&](std::string& s) {
    uint64_t n = 0;
    DDP_ASSERT(bytes.size() >= sizeof n, "truncated per-rank state");
    std::memcpy(&n, bytes.data(), sizeof n);
    bytes.remove_prefix(sizeof n);
    DDP_ASSERT(bytes.size() >= n, "truncated per-rank state");
    s.assign(bytes.substr(0, n));
    bytes.remove_prefix(n);
  };
  take(u.registry);
  take(u.index);
  u.payload = bytes;
  return u;
}

}  // namespace

const Snapshot::Entry* Snapshot::find(std::string_view key) const {
  for (const Entry& e : entries) {
    if (e.key == key) return &e;
  }
  return nullptr;
}

struct TrainingState::Impl {
  struct Item {
    std::string key;
    std::shared_ptr<Stateful> object;
    AddOptions options;
  };
  std::vector<Item> items;

  std::vector<std::pair<std::string, StateScope>> registry() const {
    std::vector<std::pair<std::string, StateScope>> out;
    for (const Item& i : items) out.emplace_back(i.key, i.object->scope());
    return out;
  }
};

TrainingState::TrainingState() : impl_(std::make_unique<Impl>()) {}
TrainingState::~TrainingState() = default;
TrainingState::TrainingState(TrainingState&&) noexcept = default;
TrainingState& TrainingState::operator=(TrainingState&&) noexcept = default;

void TrainingState::add(std::string key, std::shared_ptr<Stateful> object, AddOptions options) {
  check_key(key);
  DDP_CHECK(object != nullptr, ConfigError, "TrainingState::add('{}'): the object is null", key);
  DDP_CHECK(!contains(key), ConfigError,
            "TrainingState::add: key '{}' is registered already; each object needs its own key",
            key);
  impl_->items.push_back({std::move(key), std::move(object), options});
}

void TrainingState::add(std::string key, Stateful& object, AddOptions options) {
  add(std::move(key), std::make_shared<Borrowed>(object), options);
}
void TrainingState::add(std::string key, torch::nn::Module& module, AddOptions options) {
  add(std::move(key), state::module_state(module), options);
}
void TrainingState::add(std::string key, DistributedDataParallelBase& model, AddOptions options) {
  add(std::move(key), state::ddp_state(model), options);
}
void TrainingState::add(std::string key, torch::optim::Optimizer& optimizer, AddOptions options) {
  add(std::move(key), state::optimizer_state(optimizer), options);
}
void TrainingState::add(std::string key, ZeroRedundancyOptimizer& optimizer, AddOptions options) {
  add(std::move(key), state::zero_state(optimizer), options);
}
void TrainingState::add(std::string key, FullyShardedDataParallelBase& model, AddOptions options) {
  add(std::move(key), state::fsdp_state(model), options);
}
void TrainingState::add(std::string key, torch::optim::Optimizer& optimizer,
                        FullyShardedDataParallelBase& sharded_by, AddOptions options) {
  add(std::move(key), state::fsdp_optimizer_state(optimizer, sharded_by), options);
}
void TrainingState::add(std::string key, DistributedSampler& sampler, AddOptions options) {
  add(std::move(key), state::sampler_state(sampler), options);
}
void TrainingState::add(std::string key, comm_hooks::PowerSGDState& state, AddOptions options) {
  add(std::move(key), state::powersgd_state(state), options);
}

std::vector<std::string> TrainingState::keys() const {
  std::vector<std::string> out;
  for (const auto& i : impl_->items) out.push_back(i.key);
  return out;
}

void TrainingState::for_each(
    const std::function<void(const std::string& key, Stateful& object)>& f) const {
  for (const auto& i : impl_->items) f(i.key, *i.object);
}

std::vector<state::GroupBound*> state::group_bound(TrainingState& state) {
  std::vector<GroupBound*> out;
  state.for_each([&](const std::string&, Stateful& object) {
    if (auto* bound = dynamic_cast<GroupBound*>(&object)) out.push_back(bound);
  });
  return out;
}

bool TrainingState::contains(std::string_view key) const {
  return std::any_of(impl_->items.begin(), impl_->items.end(),
                     [&](const Impl::Item& i) { return i.key == key; });
}

Snapshot TrainingState::snapshot() {
  Snapshot out;
  for (const auto& i : impl_->items) out.entries.push_back({i.key, i.object->scope(), {i.object->state_dict()}});
  return out;
}

namespace {

// Every rank's registry compared with rank 0's (one all-gather of the registries and of
// `mine`, encoded): the same ConfigError on every rank when they differ. Returns what each rank
// sent.
std::vector<Unpacked> gather_and_compare(ProcessGroup& group, const std::string& registry,
                                         const std::vector<Snapshot::Entry>& mine,
                                         std::vector<std::string>& keep) {
  keep = all_gather_bytes(group, pack(registry, state::encode(mine)));
  std::vector<Unpacked> ranks;
  for (const std::string& bytes : keep) ranks.push_back(unpack(bytes));
  for (int r = 1; r < group.size(); ++r) {
    DDP_CHECK(ranks[r].registry == ranks[0].registry, ConfigError,
              "[rank {}] checkpoint: the ranks registered different states: rank 0 has [{}], "
              "rank {} has [{}]. Every rank must add the same keys, in the same order, to its "
              "TrainingState",
              group.rank(), ranks[0].registry, r, ranks[r].registry);
  }
  return ranks;
}

}  // namespace

Snapshot state::rank_snapshot(TrainingState& state, ProcessGroup& group) {
  const int rank = group.rank();
  std::vector<std::pair<std::string, StateScope>> registry;
  state.for_each([&](const std::string& key, Stateful& object) {
    registry.emplace_back(key, object.scope());
  });
  std::vector<std::string> keep;
  gather_and_compare(group, describe(registry), {}, keep);
  Snapshot out;
  out.world_size = group.size();
  state.for_each([&](const std::string& key, Stateful& object) {
    const StateScope scope = object.scope();
    if (scope == StateScope::kCollective || state::saved_by_each_rank(scope) || rank == 0) {
      StateDict s = object.state_dict();
      if (rank == 0 || state::saved_by_each_rank(scope))
        out.entries.push_back({key, scope, {std::move(s)}});
    }
  });
  return out;
}

Snapshot TrainingState::snapshot(ProcessGroup& group) {
  const int rank = group.rank();
  // 1. Registries and per-rank states, gathered (Note [Collective snapshot]).
  std::vector<Snapshot::Entry> mine;
  for (const auto& i : impl_->items) {
    if (state::saved_by_each_rank(i.object->scope())) {
      mine.push_back({i.key, i.object->scope(), {i.object->state_dict()}});
    }
  }
  std::vector<std::string> keep;
  const std::vector<Unpacked> ranks =
      gather_and_compare(group, describe(impl_->registry()), mine, keep);
  mine.clear();  // what they held is in `keep` now; sharded pieces may be large
  // 2. The others: collective ones on every rank, replicated ones on rank 0.
  Snapshot out;
  out.world_size = group.size();
  for (const auto& i : impl_->items) {
    const StateScope scope = i.object->scope();
    if (scope == StateScope::kCollective || (scope == StateScope::kReplicated && rank == 0)) {
      StateDict s = i.object->state_dict();
      if (rank == 0) out.entries.push_back({i.key, scope, {std::move(s)}});
    } else if (state::saved_by_each_rank(scope) && rank == 0) {
      out.entries.push_back({i.key, scope, {}});
    }
  }
  if (rank != 0) return {};
  // 3. Rank 0: every rank's per-rank states into their entries, sharded pieces joined whole.
  for (int r = 0; r < group.size(); ++r) {
    const auto entries = state::decode(
        nlohmann::json::parse(ranks[r].index), ranks[r].payload, [&](const std::string& what) {
          throw InternalError(fmt::format("rank {}'s per-rank states do not decode: {}", r, what));
        });
    for (const auto& e : entries) {
      auto it = std::find_if(out.entries.begin(), out.entries.end(),
                             [&](const Snapshot::Entry& x) { return x.key == e.key; });
      DDP_ASSERT(it != out.entries.end() && e.ranks.size() == 1, "per-rank state '{}'", e.key);
      it->ranks.push_back(e.ranks.front());
    }
  }
  for (Snapshot::Entry& e : out.entries) {
    if (e.scope == StateScope::kSharded) e.ranks = {state::join_pieces(e.key, e.ranks)};
  }
  return out;
}

RestoreReport TrainingState::restore(const Snapshot& snapshot, int rank, int world_size) {
  DDP_CHECK(rank >= 0 && rank < world_size, ConfigError,
            "TrainingState::restore: rank {} outside a world of {}", rank, world_size);
  RestoreReport report;
  report.world_size_changed = snapshot.world_size != world_size;
  struct Planned {
    const std::string* key;
    Stateful* object;
    const StateDict* saved;
    LoadContext context;
  };
  std::vector<Planned> plan;
  std::deque<StateDict> assembled;  // kSharded objects' parts, assembled (stable addresses)
  std::vector<std::string> problems;
  // Phase 1: check every object; nothing changes yet.
  for (const auto& i : impl_->items) {
    const Snapshot::Entry* e = snapshot.find(i.key);
    if (e == nullptr || e->ranks.empty()) {
      if (i.options.optional) {
        report.absent.push_back(i.key);
      } else {
        const std::string kind = i.object->kind();
        problems.push_back(kind.empty()
                               ? fmt::format("it holds no '{}' state (saved without it)", i.key)
                               : fmt::format("it holds no {} state under '{}' (saved without it)",
                                             kind, i.key));
      }
      continue;
    }
    LoadContext c{.rank = rank, .world_size = world_size, .saved_world_size = snapshot.world_size};
    // A kSharded object may find a state saved per rank (an older save of its kind): which
    // rank's it takes is decided as for a kPerRank one.
    const bool per_rank_saved = e->scope == StateScope::kPerRank;
    if (i.object->scope() == StateScope::kPerRank ||
        (i.object->scope() == StateScope::kSharded && per_rank_saved)) {
      const int n = static_cast<int>(e->ranks.size());
      c.own = !report.world_size_changed && rank < n;
      c.saved_rank = c.own ? rank : rank % n;
      report.per_rank_exact = report.per_rank_exact && c.own;
    }
    const StateDict* saved_ptr = &e->ranks[static_cast<size_t>(c.saved_rank)];
    if (i.object->scope() == StateScope::kSharded) {
      // Note [Sharded states]: this rank's part, from every saved rank's pieces (or from whole
      // tensors saved under another scope).
      StateDict& part = assembled.emplace_back();
      const std::vector<StateDict> own_rank =
          per_rank_saved ? std::vector<StateDict>{*saved_ptr} : std::vector<StateDict>{};
      if (std::string why = state::assemble(*i.object, per_rank_saved ? own_rank : e->ranks,
                                            e->scope == StateScope::kSharded, part);
          !why.empty()) {
        problems.push_back(fmt::format("{}: {}", i.key, why));
        continue;
      }
      saved_ptr = &part;
    }
    const StateDict& saved = *saved_ptr;
    if (std::string why = i.object->check(saved, c); !why.empty()) {
      problems.push_back(fmt::format("{}: {}", i.key, why));
      continue;
    }
    plan.push_back({&i.key, i.object.get(), &saved, c});
  }
  if (!problems.empty()) {
    throw IncompatibleStateError(fmt::format("{}", fmt::join(problems, "; ")));
  }
  // Phase 2: load, in registration order.
  for (const Planned& p : plan) {
    try {
      p.object->load_state_dict(*p.saved, p.context);
    } catch (const std::exception& e) {
      const std::string& key = *p.key;
      throw Error(fmt::format("restoring '{}' failed after its check passed ({}); the states "
                              "registered before it are restored, '{}' may be partly restored: do "
                              "not train on",
                              key, e.what(), key));
    }
  }
  for (const auto& e : snapshot.entries) {
    if (!contains(e.key)) report.ignored.push_back(e.key);
  }
  return report;
}

}  // namespace ddp
