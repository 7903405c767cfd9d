// What ddp-bench puts in the buffers it sends, and what it expects back.
//
// Note [Verification pattern]
// Every element is a small integer, so every sum is exact in every dtype ddp-bench measures
// (float16 and bfloat16 included, up to 64 ranks) and results are checked for equality, not
// within a tolerance. The value of element j of a buffer that starts at element `offset` of its
// arena is ((offset + j) mod 4) + 1: a period-4 tile, which lets a whole arena be filled, and a
// result be checked, with one vectorised operation and no index tensor. Rank r shifts its input
// by r (all_gather and reduce_scatter results then show whose data landed where) and the u-th
// use of a buffer slot shifts it by u (a result left over from an earlier use is caught).
// Outputs and non-root broadcast buffers are zeroed before use: 0 never occurs in a result.
#pragma once

#include <cstdint>
#include <string>

#include <ATen/core/Tensor.h>

namespace ddp::bench {

// float32, float64, bfloat16, float16, int32, int64. Throws ddp::ConfigError otherwise.
at::ScalarType parse_dtype(const std::string& name);
std::string dtype_name(at::ScalarType type);

// The four values ((offset + k) mod 4) + 1, k = 0..3, as `type`.
at::Tensor tile(int64_t offset, at::ScalarType type);
// sum over s in [0, ranks) of tile(offset + s): what a sum over ranks of shifted tiles gives.
at::Tensor summed_tile(int64_t offset, int ranks, at::ScalarType type);

// flat[j] = tile4[j mod 4] for a 1-D tensor `flat`.
void fill_periodic(at::Tensor flat, const at::Tensor& tile4);
// Whether flat[j] == tile4[j mod 4] for every j.
bool matches_periodic(const at::Tensor& flat, const at::Tensor& tile4);

}  // namespace ddp::bench
