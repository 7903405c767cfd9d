// Collectives composed from a transport's all_reduce, all_gather and broadcast, for transports
// without native rooted collectives (Capabilities::rooted_collectives false: shm, shm+gloo).
//
// Note [Composed collectives]
// Gloo and NCCL have reduce, gather, scatter and all-to-all of their own; the shared-memory
// transport and the hierarchy do not, and ProcessGroup composes them, inside the one numbered
// collective the user issued (one sequence number, one flight record, the transport's own
// timeout, desync and dead-peer checks):
//   reduce      an all_reduce: every rank gets the reduction, root's is the one PyTorch
//               promises (the others' tensor is unspecified there too);
//   gather      an all_gather into scratch tensors on the other ranks;
//   scatter     a broadcast of root's inputs, laid end to end; each rank keeps its own part;
//   all_to_all  an all_gather of every rank's whole input; each rank keeps the chunks meant for
//               it. Uneven splits are padded to the largest split of any rank, which
//               ProcessGroup learns first with an all_reduce (max) of its own (a second
//               sequence number, before the all_to_all's).
// On one host these move the data through shared memory, where the extra bytes cost memory
// bandwidth only; an all_to_all moves size() times what a native one does and holds size()
// inputs at once, so a large all-to-all across hosts is better on Gloo. Results are exact:
// moving never rounds, and reduce is the transport's all_reduce (bit-identical on every rank).
#pragma once

#include <functional>
#include <vector>

#include <ATen/core/Tensor.h>

#include "process_group/transport/transport.h"

namespace ddp::composed {

// `started`, with `after` run once its own local step (if any) has.
Started followed_by(Started started, std::function<void()> after);

// What the transport's primitive started, with the local step that finishes the collective.
// `call` is the composed collective's (its op, root, count and sequence number).
Started reduce(Transport& t, const CollectiveDesc& call, at::Tensor& tensor);
// outputs: size() tensors on root, empty elsewhere.
Started gather(Transport& t, const CollectiveDesc& call, int rank, int size,
               std::vector<at::Tensor>& outputs, const at::Tensor& input);
// inputs: size() tensors on root, empty elsewhere.
Started scatter(Transport& t, const CollectiveDesc& call, int rank, int size, at::Tensor& output,
                const std::vector<at::Tensor>& inputs);
// Flat contiguous tensors of size() equal chunks.
Started all_to_all(Transport& t, const CollectiveDesc& call, int rank, int size, at::Tensor& output,
                   const at::Tensor& input);

}  // namespace ddp::composed
