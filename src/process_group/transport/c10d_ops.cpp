// The c10d calls of the transports (c10d_ops.h).
#include "process_group/transport/c10d_ops.h"

#include "base/check.h"

namespace ddp::c10d_ops {

::c10d::ReduceOp to_c10d(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return ::c10d::ReduceOp::SUM;
    case ReduceOp::kAvg: return ::c10d::ReduceOp::AVG;
    case ReduceOp::kMax: return ::c10d::ReduceOp::MAX;
    case ReduceOp::kMin: return ::c10d::ReduceOp::MIN;
  }
  DDP_ASSERT(false, "unknown ReduceOp {}", static_cast<int>(op));
}

c10::intrusive_ptr<::c10d::Work> all_reduce(c10d_compat::Backend& b, const at::Tensor& t,
                                            ReduceOp op) {
  std::vector<at::Tensor> tensors{t};
  ::c10d::AllreduceOptions opts;
  opts.reduceOp = to_c10d(op);
  return b.allreduce(tensors, opts);
}

c10::intrusive_ptr<::c10d::Work> broadcast(c10d_compat::Backend& b, const at::Tensor& t, int root) {
  std::vector<at::Tensor> tensors{t};
  ::c10d::BroadcastOptions opts;
  opts.rootRank = root;
  opts.rootTensor = 0;
  return b.broadcast(tensors, opts);
}

c10::intrusive_ptr<::c10d::Work> all_gather(c10d_compat::Backend& b,
                                            std::vector<at::Tensor>& outputs,
                                            const at::Tensor& input) {
  std::vector<std::vector<at::Tensor>> out{outputs};
  std::vector<at::Tensor> in{input};
  return b.allgather(out, in);
}

c10::intrusive_ptr<::c10d::Work> all_to_all(c10d_compat::Backend& b, at::Tensor& recv,
                                            at::Tensor& send, std::vector<int64_t> recv_splits,
                                            std::vector<int64_t> send_splits) {
  ::c10d::AllToAllOptions opts;  // empty splits: equal split along dim 0
  return b.alltoall_base(recv, send, recv_splits, send_splits, opts);
}

c10::intrusive_ptr<::c10d::Work> reduce(c10d_compat::Backend& b, const at::Tensor& t, int root,
                                        ReduceOp op) {
  std::vector<at::Tensor> tensors{t};
  ::c10d::ReduceOptions opts;
  opts.reduceOp = to_c10d(op);
  opts.rootRank = root;
  opts.rootTensor = 0;
  return b.reduce(tensors, opts);
}

c10::intrusive_ptr<::c10d::Work> gather(c10d_compat::Backend& b,
                                        const std::vector<at::Tensor>& outputs,
                                        const at::Tensor& input, int root) {
  std::vector<std::vector<at::Tensor>> out;
  if (!outputs.empty()) out.push_back(outputs);
  std::vector<at::Tensor> in{input};
  ::c10d::GatherOptions opts;
  opts.rootRank = root;
  return b.gather(out, in, opts);
}

c10::intrusive_ptr<::c10d::Work> scatter(c10d_compat::Backend& b, const at::Tensor& output,
                                         const std::vector<at::Tensor>& inputs, int root) {
  std::vector<at::Tensor> out{output};
  std::vector<std::vector<at::Tensor>> in;
  if (!inputs.empty()) in.push_back(inputs);
  ::c10d::ScatterOptions opts;
  opts.rootRank = root;
  return b.scatter(out, in, opts);
}

c10::intrusive_ptr<::c10d::Work> barrier(c10d_compat::Backend& b) {
  ::c10d::BarrierOptions opts;
  return b.barrier(opts);
}

c10::intrusive_ptr<::c10d::Work> send(c10d_compat::Backend& b, const at::Tensor& t, int peer,
                                      int tag) {
  std::vector<at::Tensor> tensors{t};
  return b.send(tensors, peer, tag);
}

c10::intrusive_ptr<::c10d::Work> recv(c10d_compat::Backend& b, const at::Tensor& t, int peer,
                                      int tag) {
  std::vector<at::Tensor> tensors{t};
  return b.recv(tensors, peer, tag);
}

at::Tensor reduce_rows(const at::Tensor& chunks, ReduceOp op) {
  switch (op) {
    case ReduceOp::kMax: return std::get<0>(chunks.max(0));
    case ReduceOp::kMin: return std::get<0>(chunks.min(0));
    default: return chunks.sum(0);
  }
}

std::vector<CollectiveDesc> gather_calls(c10d_compat::Backend& b, const CollectiveDesc& mine,
                                         int size, std::chrono::milliseconds timeout) {
  constexpr auto kWords = static_cast<int64_t>(CollectiveDesc::kWords);
  at::Tensor words = at::empty({kWords}, at::kLong);
  const auto w = mine.to_words();
  std::copy(w.begin(), w.end(), words.data_ptr<int64_t>());
  std::vector<at::Tensor> out;
  for (int r = 0; r < size; ++r) out.push_back(at::empty({kWords}, at::kLong));
  all_gather(b, out, words)->wait(timeout);
  std::vector<CollectiveDesc> calls;
  for (const at::Tensor& t : out)
    calls.push_back(CollectiveDesc::from_words(t.data_ptr<int64_t>()));
  return calls;
}

}  // namespace ddp::c10d_ops
