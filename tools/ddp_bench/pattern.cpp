// What ddp-bench sends and expects (see Note [Verification pattern] in pattern.h).
#include "pattern.h"

#include <algorithm>

#include <ATen/ATen.h>
#include <fmt/format.h>

#include "ddp/error.h"

namespace ddp::bench {
namespace {

struct DtypeName {
  const char* name;
  at::ScalarType type;
};
constexpr DtypeName kDtypes[] = {
    {"float32", at::kFloat}, {"float64", at::kDouble}, {"bfloat16", at::kBFloat16},
    {"float16", at::kHalf},  {"int32", at::kInt},      {"int64", at::kLong},
};

int64_t mod4(int64_t v) { return ((v % 4) + 4) % 4; }

}  // namespace

at::ScalarType parse_dtype(const std::string& name) {
  for (const auto& d : kDtypes) {
    if (name == d.name) return d.type;
  }
  throw ConfigError(
      fmt::format("--dtype '{}': choose float32, float64, bfloat16, float16, "
                  "int32 or int64",
                  name));
}

std::string dtype_name(at::ScalarType type) {
  for (const auto& d : kDtypes) {
    if (type == d.type) return d.name;
  }
  return c10::toString(type);
}

at::Tensor tile(int64_t offset, at::ScalarType type) {
  at::Tensor t = at::empty({4}, at::kLong);
  for (int64_t k = 0; k < 4; ++k) t[k] = mod4(offset + k) + 1;
  return t.to(type);
}

at::Tensor summed_tile(int64_t offset, int ranks, at::ScalarType type) {
  at::Tensor sum = at::zeros({4}, at::kLong);
  for (int s = 0; s < ranks; ++s) sum += tile(offset + s, at::kLong);
  return sum.to(type);
}

void fill_periodic(at::Tensor flat, const at::Tensor& tile4) {
  const int64_t n = flat.numel();
  const int64_t whole = n / 4;
  if (whole > 0) flat.narrow(0, 0, whole * 4).view({whole, 4}).copy_(tile4.expand({whole, 4}));
  if (n % 4 != 0) flat.narrow(0, whole * 4, n % 4).copy_(tile4.narrow(0, 0, n % 4));
}

bool matches_periodic(const at::Tensor& flat, const at::Tensor& tile4) {
  // In blocks, so the comparison's temporary stays small (and recycled by malloc) however
  // large the buffer is.
  constexpr int64_t kBlockRows = int64_t{1} << 18;  // x 4 elements
  const int64_t n = flat.numel();
  const int64_t whole = n / 4;
  const at::Tensor rows = flat.narrow(0, 0, whole * 4).view({whole, 4});
  const at::Tensor expected = tile4.unsqueeze(0);
  for (int64_t start = 0; start < whole; start += kBlockRows) {
    const int64_t len = std::min(kBlockRows, whole - start);
    if (!rows.narrow(0, start, len).eq(expected).all().item<bool>()) return false;
  }
  return n % 4 == 0 || flat.narrow(0, whole * 4, n % 4).equal(tile4.narrow(0, 0, n % 4));
}

}  // namespace ddp::bench
