// Replica checks and coalesced broadcasts (see replica_sync.h).
#include "parallel/replica_sync.h"

#include <map>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>  // at::NoGradGuard: ATen.h stops including it in 2.x
#include <fmt/format.h>
#include <fmt/ranges.h>

#include "base/check.h"

namespace ddp::detail {
namespace {

// FNV-1a over 64-bit words: a cheap fingerprint; the slow path compares in full.
uint64_t fingerprint(const std::vector<int64_t>& words) {
  uint64_t h = 1469598103934665603ull;
  for (int64_t w : words) {
    h ^= static_cast<uint64_t>(w);
    h *= 1099511628211ull;
  }
  return h;
}

// [count, then per parameter: dtype, ndim, dims...]
std::vector<int64_t> shape_signature(const std::vector<at::Tensor>& params) {
  std::vector<int64_t> s{static_cast<int64_t>(params.size())};
  for (const auto& p : params) {
    s.push_back(static_cast<int64_t>(p.scalar_type()));
    s.push_back(p.dim());
    for (int64_t d : p.sizes()) s.push_back(d);
  }
  return s;
}

std::vector<int64_t> name_bytes(const std::vector<std::string>& names) {
  std::vector<int64_t> b;
  for (const auto& n : names) {
    for (unsigned char c : n) b.push_back(c);
    b.push_back(0);
  }
  return b;
}

// Broadcasts rank 0's `words` (its length known to all as `len0`).
std::vector<int64_t> rank0_words(ProcessGroup& group, const std::vector<int64_t>& mine,
                                 int64_t len0) {
  at::Tensor t = at::zeros({std::max<int64_t>(len0, 1)}, at::kLong);
  if (group.rank() == 0 && len0 > 0) {
    std::copy(mine.begin(), mine.end(), t.data_ptr<int64_t>());
  }
  group.broadcast(t, 0).wait();
  return std::vector<int64_t>(t.data_ptr<int64_t>(), t.data_ptr<int64_t>() + len0);
}

std::string describe(const at::Tensor& p) {
  return fmt::format("{} [{}]", c10::toString(p.scalar_type()), fmt::join(p.sizes(), ", "));
}

// On a rank whose shapes differ from rank 0's: the first difference, in words.
std::string first_shape_difference(const std::vector<at::Tensor>& params,
                                   const std::vector<std::string>& names,
                                   const std::vector<int64_t>& theirs) {
  const int64_t their_count = theirs.empty() ? 0 : theirs[0];
  size_t pos = 1;
  for (size_t i = 0; i < params.size(); ++i) {
    if (static_cast<int64_t>(i) >= their_count) {
      return fmt::format(
          "parameter #{} '{}' ({}) exists here but rank 0 has only {} "
          "parameters",
          i, names[i], describe(params[i]), their_count);
    }
    const int64_t dtype = theirs[pos], ndim = theirs[pos + 1];
    std::vector<int64_t> dims(theirs.begin() + pos + 2, theirs.begin() + pos + 2 + ndim);
    pos += 2 + ndim;
    if (dtype != static_cast<int64_t>(params[i].scalar_type()) || dims != params[i].sizes().vec()) {
      return fmt::format("parameter #{} '{}' is {} here but {} [{}] on rank 0", i, names[i],
                         describe(params[i]), c10::toString(static_cast<c10::ScalarType>(dtype)),
                         fmt::join(dims, ", "));
    }
  }
  return fmt::format("rank 0 has {} parameters, this rank {}", their_count, params.size());
}

std::string first_name_difference(const std::vector<std::string>& names,
                                  const std::vector<int64_t>& theirs) {
  std::vector<std::string> their_names(1);
  for (int64_t c : theirs) {
    if (c == 0)
      their_names.emplace_back();
    else
      their_names.back() += static_cast<char>(c);
  }
  for (size_t i = 0; i < names.size() && i < their_names.size(); ++i) {
    if (names[i] != their_names[i]) {
      return fmt::format("parameter #{} is named '{}' here but '{}' on rank 0", i, names[i],
                         their_names[i]);
    }
  }
  return "parameter names differ from rank 0";
}

}  // namespace

void broadcast_coalesced(ProcessGroup& group, const std::vector<at::Tensor>& tensors, int root,
                         int64_t chunk_bytes) {
  if (group.size() == 1 || tensors.empty()) return;
  at::NoGradGuard no_grad;
  std::map<at::ScalarType, std::vector<at::Tensor>> by_dtype;
  for (const auto& t : tensors) by_dtype[t.scalar_type()].push_back(t);
  for (auto& [dtype, group_tensors] : by_dtype) {
    size_t begin = 0;
    while (begin < group_tensors.size()) {
      size_t end = begin;
      int64_t bytes = 0;
      while (end < group_tensors.size() && (end == begin || bytes < chunk_bytes)) {
        bytes += group_tensors[end].numel() * group_tensors[end].element_size();
        ++end;
      }
      std::vector<at::Tensor> chunk(group_tensors.begin() + begin, group_tensors.begin() + end);
      std::vector<at::Tensor> flat_inputs;
      for (const auto& t : chunk) flat_inputs.push_back(t.reshape({-1}));
      at::Tensor flat = at::cat(flat_inputs);
      group.broadcast(flat, root).wait();
      if (group.rank() != root) {
        int64_t offset = 0;
        for (auto& t : chunk) {
          t.copy_(flat.narrow(0, offset, t.numel()).view(t.sizes()));
          offset += t.numel();
        }
      }
      begin = end;
    }
  }
}

void verify_same_parameters(ProcessGroup& group, const std::vector<at::Tensor>& params,
                            const std::vector<std::string>& names) {
  if (group.size() == 1) return;
  const auto shapes = shape_signature(params);
  const auto name_words = name_bytes(names);
  // Per rank: [signature length, signature fingerprint, names length, names fingerprint].
  at::Tensor mine =
      at::tensor({static_cast<int64_t>(shapes.size()), static_cast<int64_t>(fingerprint(shapes)),
                  static_cast<int64_t>(name_words.size()),
                  static_cast<int64_t>(fingerprint(name_words))},
                 at::kLong);
  std::vector<at::Tensor> all(group.size());
  for (auto& t : all) t = at::empty_like(mine);
  group.all_gather(all, mine).wait();

  std::vector<int> shape_differs, name_differs;
  for (int r = 1; r < group.size(); ++r) {
    if (!at::equal(all[r].narrow(0, 0, 2), all[0].narrow(0, 0, 2)))
      shape_differs.push_back(r);
    else if (!at::equal(all[r].narrow(0, 2, 2), all[0].narrow(0, 2, 2)))
      name_differs.push_back(r);
  }
  if (shape_differs.empty() && name_differs.empty()) return;

  // Slow path, taken by every rank alike: fetch rank 0's details and name the difference.
  const auto theirs_shapes = rank0_words(group, shapes, all[0][0].item<int64_t>());
  const auto theirs_names = rank0_words(group, name_words, all[0][2].item<int64_t>());
  const int me = group.rank();
  const bool i_differ_in_shape =
      std::find(shape_differs.begin(), shape_differs.end(), me) != shape_differs.end();
  const bool i_differ_in_name =
      std::find(name_differs.begin(), name_differs.end(), me) != name_differs.end();
  std::string detail;
  if (i_differ_in_shape)
    detail = first_shape_difference(params, names, theirs_shapes);
  else if (i_differ_in_name)
    detail = first_name_difference(names, theirs_names);
  else
    detail = "this rank matches rank 0";
  throw Error(fmt::format(
      "[rank {}] DistributedDataParallel: ranks hold different parameters, so gradients cannot "
      "be averaged: ranks [{}] differ from rank 0 in shapes/dtypes/count, ranks [{}] in names. "
      "Here: {}. Build the same model on every rank and register parameters in the same "
      "order.",
      me, fmt::join(shape_differs, ", "), fmt::join(name_differs, ", "), detail));
}

}  // namespace ddp::detail
