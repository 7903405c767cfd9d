// ProcessGroup: collectives over a c10d backend, each numbered, bounded and checked.
#include <ATen/ATen.h>
#include <fmt/format.h>
#include <fmt/ranges.h>  // fmt::join

#include "base/check.h"
#include "process_group/internal.h"

namespace ddp {
namespace {

::c10d::ReduceOp to_c10d(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return ::c10d::ReduceOp::SUM;
    case ReduceOp::kAvg: return ::c10d::ReduceOp::AVG;
    case ReduceOp::kMax: return ::c10d::ReduceOp::MAX;
    case ReduceOp::kMin: return ::c10d::ReduceOp::MIN;
  }
  DDP_ASSERT(false, "unknown ReduceOp {}", static_cast<int>(op));
}

std::string dims(const at::Tensor& t) { return fmt::format("[{}]", fmt::join(t.sizes(), ", ")); }

std::string shape_of(const at::Tensor& t) {
  return fmt::format("{} x {}", t.numel(), c10::toString(t.scalar_type()));
}

// Reduces the rows of `chunks` ([n, ...]) into one, as `op` asks (kAvg is a sum here).
at::Tensor reduce_rows(const at::Tensor& chunks, ReduceOp op) {
  switch (op) {
    case ReduceOp::kMax: return std::get<0>(chunks.max(0));
    case ReduceOp::kMin: return std::get<0>(chunks.min(0));
    default: return chunks.sum(0);
  }
}

}  // namespace

const char* to_string(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return "sum";
    case ReduceOp::kAvg: return "avg";
    case ReduceOp::kMax: return "max";
    case ReduceOp::kMin: return "min";
  }
  return "?";
}

ProcessGroup::ProcessGroup(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
ProcessGroup::~ProcessGroup() = default;

int ProcessGroup::rank() const { return impl_->env.rank; }
int ProcessGroup::size() const { return impl_->env.world_size; }
int ProcessGroup::local_rank() const { return impl_->env.local_rank; }
int ProcessGroup::local_size() const { return impl_->env.local_world_size; }
const std::string& ProcessGroup::backend() const { return impl_->backend_name; }
std::chrono::milliseconds ProcessGroup::timeout() const { return impl_->timeout; }
const DistEnv& ProcessGroup::env() const { return impl_->env; }
uint64_t ProcessGroup::last_sequence_number() const { return impl_->seq.load(); }

// Issues one collective: numbers it, starts it through `start`, and records how to finish it.
// User errors found before anything is sent (bad shapes, bad root) are thrown here, naming
// the operation and its sequence number.
namespace {
template <typename Start>
Work::State* issue(ProcessGroup::Impl& pg, std::shared_ptr<Work::State>& state, const char* op,
                   std::string detail, Start&& start) {
  state = std::make_shared<Work::State>();
  state->op = op;
  state->detail = std::move(detail);
  state->seq = ++pg.seq;
  state->rank = pg.env.rank;
  state->timeout = pg.timeout;
  state->issued = std::chrono::steady_clock::now();
  try {
    state->work = start();
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    throw CollectiveError(fmt::format("[rank {}] {} #{} ({}) could not start: {}", pg.env.rank,
                                      op, state->seq, state->detail, e.what()));
  }
  return state.get();
}
}  // namespace

Work ProcessGroup::all_reduce(at::Tensor& tensor, ReduceOp op) {
  Impl& pg = *impl_;
  DDP_CHECK(tensor.defined(), Error, "[rank {}] all_reduce #{}: the tensor is undefined",
            pg.env.rank, pg.seq + 1);
  const bool avg_here = op == ReduceOp::kAvg && !c10d_compat::backend_supports_avg(pg.backend_name);
  DDP_CHECK(!avg_here || at::isFloatingType(tensor.scalar_type()), Error,
            "[rank {}] all_reduce #{} (avg): averaging needs a floating-point tensor, got {}",
            pg.env.rank, pg.seq + 1, c10::toString(tensor.scalar_type()));
  std::shared_ptr<Work::State> state;
  issue(pg, state, "all_reduce", fmt::format("{}, {}", to_string(op), shape_of(tensor)), [&] {
    std::vector<at::Tensor> tensors{tensor};
    ::c10d::AllreduceOptions opts;
    opts.reduceOp = to_c10d(avg_here ? ReduceOp::kSum : op);
    return pg.backend->allreduce(tensors, opts);
  });
  if (avg_here) {
    const int n = pg.env.world_size;
    state->then = [tensor, n]() mutable { tensor.div_(n); };
  }
  return Work(std::move(state));
}

Work ProcessGroup::broadcast(at::Tensor& tensor, int root) {
  Impl& pg = *impl_;
  DDP_CHECK(tensor.defined(), Error, "[rank {}] broadcast #{}: the tensor is undefined",
            pg.env.rank, pg.seq + 1);
  DDP_CHECK(root >= 0 && root < pg.env.world_size, Error,
            "[rank {}] broadcast #{}: root rank {} is not in this group of {} ranks", pg.env.rank,
            pg.seq + 1, root, pg.env.world_size);
  std::shared_ptr<Work::State> state;
  issue(pg, state, "broadcast", fmt::format("from rank {}, {}", root, shape_of(tensor)), [&] {
    std::vector<at::Tensor> tensors{tensor};
    ::c10d::BroadcastOptions opts;
    opts.rootRank = root;
    opts.rootTensor = 0;
    return pg.backend->broadcast(tensors, opts);
  });
  return Work(std::move(state));
}

Work ProcessGroup::all_gather(std::vector<at::Tensor>& outputs, const at::Tensor& input) {
  Impl& pg = *impl_;
  const int n = pg.env.world_size;
  DDP_CHECK(input.defined(), Error, "[rank {}] all_gather #{}: the input is undefined",
            pg.env.rank, pg.seq + 1);
  DDP_CHECK(static_cast<int>(outputs.size()) == n, Error,
            "[rank {}] all_gather #{}: expected {} output tensors (one per rank), got {}",
            pg.env.rank, pg.seq + 1, n, outputs.size());
  for (size_t r = 0; r < outputs.size(); ++r) {
    DDP_CHECK(outputs[r].defined() && outputs[r].sizes() == input.sizes() &&
                  outputs[r].scalar_type() == input.scalar_type(),
              Error, "[rank {}] all_gather #{}: outputs[{}] must match the input ({} {})",
              pg.env.rank, pg.seq + 1, r, dims(input), c10::toString(input.scalar_type()));
  }
  std::shared_ptr<Work::State> state;
  issue(pg, state, "all_gather", shape_of(input), [&] {
    std::vector<std::vector<at::Tensor>> out{outputs};
    std::vector<at::Tensor> in{input};
    return pg.backend->allgather(out, in);
  });
  return Work(std::move(state));
}

Work ProcessGroup::reduce_scatter(at::Tensor& output, const std::vector<at::Tensor>& inputs,
                                  ReduceOp op) {
  Impl& pg = *impl_;
  const int n = pg.env.world_size;
  DDP_CHECK(output.defined(), Error, "[rank {}] reduce_scatter #{}: the output is undefined",
            pg.env.rank, pg.seq + 1);
  DDP_CHECK(static_cast<int>(inputs.size()) == n, Error,
            "[rank {}] reduce_scatter #{}: expected {} input tensors (one per rank), got {}",
            pg.env.rank, pg.seq + 1, n, inputs.size());
  for (size_t r = 0; r < inputs.size(); ++r) {
    DDP_CHECK(inputs[r].defined() && inputs[r].sizes() == output.sizes() &&
                  inputs[r].scalar_type() == output.scalar_type(),
              Error, "[rank {}] reduce_scatter #{}: inputs[{}] must match the output ({} {})",
              pg.env.rank, pg.seq + 1, r, dims(output), c10::toString(output.scalar_type()));
  }
  DDP_CHECK(op != ReduceOp::kAvg || at::isFloatingType(output.scalar_type()), Error,
            "[rank {}] reduce_scatter #{} (avg): averaging needs a floating-point tensor",
            pg.env.rank, pg.seq + 1);
  // Gloo has no reduce_scatter: an all-to-all sends inputs[j] to rank j (the bandwidth of a
  // ring reduce-scatter), then each rank reduces the n chunks it received.
  // send/recv: [n, numel]; recv row i is rank i's contribution to this rank's output.
  at::Tensor send = at::stack(inputs).reshape({n, -1});
  at::Tensor recv = at::empty_like(send);
  std::shared_ptr<Work::State> state;
  issue(pg, state, "reduce_scatter", fmt::format("{}, {}", to_string(op), shape_of(output)), [&] {
    std::vector<int64_t> equal_splits;  // empty: equal split along dim 0
    ::c10d::AllToAllOptions opts;
    return pg.backend->alltoall_base(recv, send, equal_splits, equal_splits, opts);
  });
  state->then = [output, recv, op, n]() mutable {
    at::Tensor reduced = reduce_rows(recv, op);
    if (op == ReduceOp::kAvg) reduced.div_(n);
    output.copy_(reduced.view(output.sizes()));
  };
  return Work(std::move(state));
}

Work ProcessGroup::barrier() {
  Impl& pg = *impl_;
  std::shared_ptr<Work::State> state;
  issue(pg, state, "barrier", fmt::format("{} ranks", pg.env.world_size), [&] {
    ::c10d::BarrierOptions opts;
    return pg.backend->barrier(opts);
  });
  return Work(std::move(state));
}

}  // namespace ddp
