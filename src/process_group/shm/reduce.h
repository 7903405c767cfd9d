// Reduction kernels of the shared-memory transport.
#pragma once

#include <cstddef>

#include "process_group/shm/types.h"

namespace ddp::shm {

// dst[i] = srcs[0][i] (op) srcs[1][i] (op) ... (op) srcs[n-1][i], always in rank order, so every
// rank that reduces the same slice gets the same bits. Half and bfloat16 accumulate in float32
// and round once; kAvg divides the sum by n (floating types only). `dst` may alias one source.
void reduce(DType dtype, Reduce op, void* dst, const void* const* srcs, int n, size_t count);

}  // namespace ddp::shm
