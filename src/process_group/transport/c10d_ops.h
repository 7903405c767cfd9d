// The calls a transport makes on a LibTorch backend (c10d), one line each for the c10d
// transport and the hierarchy's rails.
#pragma once

#include <chrono>
#include <memory>
#include <vector>

#include "c10d/compat.h"
#include "process_group/transport/transport.h"

namespace ddp::c10d_ops {

::c10d::ReduceOp to_c10d(ReduceOp op);

c10::intrusive_ptr<::c10d::Work> all_reduce(c10d_compat::Backend& b, const at::Tensor& t,
                                            ReduceOp op);
c10::intrusive_ptr<::c10d::Work> broadcast(c10d_compat::Backend& b, const at::Tensor& t, int root);
c10::intrusive_ptr<::c10d::Work> all_gather(c10d_compat::Backend& b,
                                            std::vector<at::Tensor>& outputs,
                                            const at::Tensor& input);
// recv and send are [n, ...]: row j of send goes to rank j, row i of recv comes from rank i.
// With splits (sizes along dim 0, one per rank), chunk j of send goes to rank j.
c10::intrusive_ptr<::c10d::Work> all_to_all(c10d_compat::Backend& b, at::Tensor& recv,
                                            at::Tensor& send, std::vector<int64_t> recv_splits = {},
                                            std::vector<int64_t> send_splits = {});
// root's `t` receives the reduction.
c10::intrusive_ptr<::c10d::Work> reduce(c10d_compat::Backend& b, const at::Tensor& t, int root,
                                        ReduceOp op);
// root's outputs[r] receives rank r's input; `outputs` is empty on the other ranks.
c10::intrusive_ptr<::c10d::Work> gather(c10d_compat::Backend& b,
                                        const std::vector<at::Tensor>& outputs,
                                        const at::Tensor& input, int root);
// `output` receives root's inputs[rank]; `inputs` is empty on the other ranks.
c10::intrusive_ptr<::c10d::Work> scatter(c10d_compat::Backend& b, const at::Tensor& output,
                                         const std::vector<at::Tensor>& inputs, int root);
c10::intrusive_ptr<::c10d::Work> barrier(c10d_compat::Backend& b);
// `t` (contiguous) to or from rank `peer`, matched by `tag`.
c10::intrusive_ptr<::c10d::Work> send(c10d_compat::Backend& b, const at::Tensor& t, int peer,
                                      int tag);
c10::intrusive_ptr<::c10d::Work> recv(c10d_compat::Backend& b, const at::Tensor& t, int peer,
                                      int tag);

// Reduces the rows of `chunks` ([n, ...]) into one, as `op` asks (kAvg is a sum here).
at::Tensor reduce_rows(const at::Tensor& chunks, ReduceOp op);

// Every rank's `mine` (an all_gather of CollectiveDesc::kWords int64 words, outside any
// numbering), waited for within `timeout`. Throws what the backend throws.
std::vector<CollectiveDesc> gather_calls(c10d_compat::Backend& b, const CollectiveDesc& mine,
                                         int size, std::chrono::milliseconds timeout);

}  // namespace ddp::c10d_ops
