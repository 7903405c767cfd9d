// Keeping replicas identical: checking that ranks hold the same parameters, and copying rank
// 0's tensors to every rank in a few large messages.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "ddp/process_group.h"

namespace ddp::detail {

// Copies `root`'s tensors into every rank's `tensors` (same count, shapes, dtypes on all
// ranks): tensors of one dtype are flattened into chunks of at most `chunk_bytes` and each
// chunk is one broadcast. Safe on parameters that require grad.
void broadcast_coalesced(ProcessGroup& group, const std::vector<at::Tensor>& tensors, int root,
                         int64_t chunk_bytes);

// Throws ddp::Error on every rank unless every rank has the same parameters as rank 0: count,
// names, shapes, dtypes, in the same order. The message names the first difference (on the
// ranks that differ) or the ranks that differ (on the others). Collective.
void verify_same_parameters(ProcessGroup& group, const std::vector<at::Tensor>& params,
                            const std::vector<std::string>& names);

}  // namespace ddp::detail
