// Joining and assembling the pieces of kSharded states (Note [Sharded states] in shards.h).
#include "state/shards.h"

#include <algorithm>
#include <map>
#include <string_view>

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include "base/check.h"

namespace ddp::state {
namespace {

struct Piece {
  const at::Tensor* tensor;  // 1-D view taken by the caller: reshape(-1)
  int64_t offset;
};

struct Whole {
  std::vector<int64_t> shape;
  c10::ScalarType dtype = c10::kFloat;
  std::vector<Piece> pieces;
};

// Every piece of `saved`, by name, checked for agreeing shapes and dtypes; `why` says what does
// not agree. Names in the order they first appear.
std::vector<std::pair<std::string, Whole>> collect(const std::vector<StateDict>& saved, bool pieces,
                                                   std::string& why) {
  std::vector<std::pair<std::string, Whole>> out;
  std::map<std::string, size_t> at_index;
  for (const StateDict& s : saved) {
    std::map<std::string_view, const ShardPlacement*> placed;
    for (const auto& [name, p] : s.shards) placed.emplace(name, &p);
    for (const auto& [name, t] : s.tensors) {
      const auto found = placed.find(name);
      const ShardPlacement* p = pieces && found != placed.end() ? found->second : nullptr;
      if (pieces && p == nullptr) continue;  // not a piece: rank 0's, taken as it is
      if (!t.defined()) continue;
      const std::vector<int64_t> shape = p ? p->whole_shape : t.sizes().vec();
      const int64_t offset = p ? p->offset : 0;
      auto [it, fresh] = at_index.emplace(name, out.size());
      if (fresh) out.push_back({name, Whole{shape, t.scalar_type(), {}}});
      Whole& w = out[it->second].second;
      if (w.shape != shape || w.dtype != t.scalar_type()) {
        why = fmt::format("the saved pieces of '{}' disagree: {} {} and {} {}", name,
                          c10::str(c10::IntArrayRef(w.shape)), c10::toString(w.dtype),
                          c10::str(c10::IntArrayRef(shape)), c10::toString(t.scalar_type()));
        return {};
      }
      if (offset < 0 || offset + t.numel() > numel_of(shape)) {
        why = fmt::format("a saved piece of '{}' (elements {} to {}) lies outside its {} elements",
                          name, offset, offset + t.numel(), numel_of(shape));
        return {};
      }
      w.pieces.push_back({&t, offset});
    }
  }
  return out;
}

// `range` of the whole tensor `w` copied out of its pieces into `dst` (1-D, range.numel); ""
// or the first gap no piece covers.
std::string fill(const std::string& name, const Whole& w, const ElementRange& range,
                 at::Tensor& dst) {
  std::vector<std::pair<int64_t, int64_t>> covered;  // [begin, end) in the whole tensor
  for (const Piece& p : w.pieces) {
    const Overlap o = overlap(p.offset, p.tensor->numel(), range);
    if (o.numel == 0) continue;
    dst.narrow(0, o.offset - range.offset, o.numel)
        .copy_(p.tensor->reshape({-1}).narrow(0, o.from, o.numel));
    covered.emplace_back(o.offset, o.offset + o.numel);
  }
  std::sort(covered.begin(), covered.end());
  int64_t next = range.offset;
  for (const auto& [b, e] : covered) {
    if (b > next) break;
    next = std::max(next, e);
  }
  if (next < range.offset + range.numel) {
    return fmt::format("no saved piece of '{}' holds its elements from {} (of {}) on", name, next,
                       numel_of(w.shape));
  }
  return "";
}

}  // namespace

int64_t numel_of(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::map<std::string, std::pair<at::Tensor*, ShardPlacement*>> pieces_of(StateDict& s) {
  std::map<std::string, at::Tensor*> tensors;
  for (auto& [name, t] : s.tensors) tensors.emplace(name, &t);
  std::map<std::string, std::pair<at::Tensor*, ShardPlacement*>> out;
  for (auto& [name, p] : s.shards) out.emplace(name, std::make_pair(tensors.at(name), &p));
  return out;
}

Overlap overlap(int64_t piece_offset, int64_t piece_numel, const ElementRange& wanted) {
  const int64_t b = std::max(piece_offset, wanted.offset);
  const int64_t e = std::min(piece_offset + piece_numel, wanted.offset + wanted.numel);
  if (e <= b) return {};
  return {.offset = b, .numel = e - b, .from = b - piece_offset};
}

StateDict join_pieces(const std::string& key, const std::vector<StateDict>& ranks) {
  DDP_ASSERT(!ranks.empty(), "state '{}': no rank's pieces to join", key);
  std::string why;
  const auto wholes = collect(ranks, /*pieces=*/true, why);
  DDP_CHECK(why.empty(), ConfigError, "sharded state '{}': {}", key, why);
  StateDict out;
  out.json = ranks[0].json;
  for (const auto& [name, t] : ranks[0].tensors) {
    if (ranks[0].shard(name) == nullptr) out.tensors.emplace_back(name, t);
  }
  for (const auto& [name, w] : wholes) {
    const int64_t n = numel_of(w.shape);
    at::Tensor flat = at::empty({n}, at::TensorOptions().dtype(w.dtype));
    why = fill(name, w, {.offset = 0, .numel = n}, flat);
    DDP_CHECK(why.empty(), ConfigError, "sharded state '{}': the ranks' pieces leave a gap: {}",
              key, why);
    out.tensors.emplace_back(name, flat.view(w.shape));
    out.shards.emplace_back(name, ShardPlacement{w.shape, 0});
  }
  return out;
}

std::string assemble(const Stateful& object, const std::vector<StateDict>& saved, bool pieces,
                     StateDict& out) {
  if (saved.empty()) return "it holds no state";
  std::string why;
  const auto wholes = collect(saved, pieces, why);
  if (!why.empty()) return why;
  out = StateDict{};
  out.json = saved[0].json;
  if (pieces) {
    for (const auto& [name, t] : saved[0].tensors) {
      if (saved[0].shard(name) == nullptr) out.tensors.emplace_back(name, t);
    }
  }
  for (const auto& [name, w] : wholes) {
    const auto range = object.wanted(name, w.shape);
    at::Tensor part = at::empty({0}, at::TensorOptions().dtype(w.dtype));  // none of it
    int64_t offset = 0;
    if (range) {
      if (range->offset < 0 || range->numel < 0 ||
          range->offset + range->numel > numel_of(w.shape)) {
        return fmt::format("'{}' is {} there; this run asks for its elements {} to {}", name,
                           c10::str(c10::IntArrayRef(w.shape)), range->offset,
                           range->offset + range->numel);
      }
      // One piece holding exactly the range (a load at the saving world size): taken as it is.
      const auto exact = std::find_if(w.pieces.begin(), w.pieces.end(), [&](const Piece& p) {
        return p.offset == range->offset && p.tensor->numel() == range->numel;
      });
      if (exact != w.pieces.end()) {
        part = exact->tensor->reshape({-1});
      } else {
        part = at::empty({range->numel}, at::TensorOptions().dtype(w.dtype));
        if (std::string gap = fill(name, w, *range, part); !gap.empty()) return gap;
      }
      offset = range->offset;
    }
    out.tensors.emplace_back(name, part);
    out.shards.emplace_back(name, ShardPlacement{w.shape, offset});
  }
  return "";
}

}  // namespace ddp::state
