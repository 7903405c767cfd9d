// ProcessGroup: collectives over a c10d backend, each numbered, bounded and checked.
#include <ATen/ATen.h>
#include <fmt/format.h>
#include <fmt/ranges.h>  // fmt::join

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include <optional>

#include "base/check.h"
#include "process_group/internal.h"
#include "process_group/shm_setup.h"

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

// c10d's messages may carry a C++ backtrace after their first line.
std::string first_line(const std::string& text) { return text.substr(0, text.find('\n')); }

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

shm::Reduce to_shm(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return shm::Reduce::kSum;
    case ReduceOp::kAvg: return shm::Reduce::kAvg;
    case ReduceOp::kMax: return shm::Reduce::kMax;
    case ReduceOp::kMin: return shm::Reduce::kMin;
  }
  DDP_ASSERT(false, "unknown ReduceOp {}", static_cast<int>(op));
}

std::optional<shm::DType> to_shm(at::ScalarType t) {
  switch (t) {
    case at::kByte: return shm::DType::kU8;
    case at::kChar: return shm::DType::kI8;
    case at::kShort: return shm::DType::kI16;
    case at::kInt: return shm::DType::kI32;
    case at::kLong: return shm::DType::kI64;
    case at::kHalf: return shm::DType::kF16;
    case at::kBFloat16: return shm::DType::kBF16;
    case at::kFloat: return shm::DType::kF32;
    case at::kDouble: return shm::DType::kF64;
    case at::kBool: return shm::DType::kBool;
    default: return std::nullopt;
  }
}

// The shared-memory transport moves CPU memory; it works on a contiguous version of `t` (`t`
// itself when it already is; else a copy that `then` writes back).
at::Tensor shm_buffer(const detail::ProcessGroupImpl& pg, const char* op, const at::Tensor& t) {
  DDP_CHECK(t.device().is_cpu(), Error,
            "[rank {}] {} #{}: the shm backend moves CPU tensors, this one is on {}; use "
            "backend 'nccl' (or 'auto') for CUDA tensors",
            pg.env.rank, op, pg.seq + 1, t.device().str());
  return t.is_contiguous() ? t : t.contiguous();
}

// What a shm collective that only copies (broadcast, all_gather) moves: elements of a dtype it
// knows (so errors say "3 x Long"), else the bytes.
std::pair<size_t, shm::DType> shm_extent(const at::Tensor& t) {
  if (auto dtype = to_shm(t.scalar_type())) return {static_cast<size_t>(t.numel()), *dtype};
  return {static_cast<size_t>(t.numel()) * t.element_size(), shm::DType::kU8};
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

ProcessGroup::ProcessGroup(std::unique_ptr<detail::ProcessGroupImpl> impl)
    : impl_(std::move(impl)) {}
detail::ProcessGroupImpl& detail::impl_of(ProcessGroup& pg) { return *pg.impl_; }

// A rank whose group goes away while its peers may still be in a collective (its program
// returned early) says so first, before the transport's connections close: over Gloo the peers
// otherwise see only "Connection closed by peer" (shm's control block tells them anyway).
ProcessGroup::~ProcessGroup() {
  if (impl_ && impl_->reporter && impl_->backend) {
    try {
      // Calls go to the store under the prefix, whose own timeout bounds them.
      if (auto* prefixed = dynamic_cast<::c10d::PrefixStore*>(impl_->diag_store.get())) {
        prefixed->getUnderlyingStore()->setTimeout(kDepartLimit);
      }
    } catch (const std::exception&) {
    }
    impl_->reporter->depart();
  }
}

int ProcessGroup::rank() const { return impl_->env.rank; }
int ProcessGroup::size() const { return impl_->env.world_size; }
int ProcessGroup::local_rank() const { return impl_->env.local_rank; }
int ProcessGroup::local_size() const { return impl_->env.local_world_size; }
const std::string& ProcessGroup::backend() const { return impl_->backend_name; }
std::chrono::milliseconds ProcessGroup::timeout() const { return impl_->timeout; }
const DistEnv& ProcessGroup::env() const { return impl_->env; }
uint64_t ProcessGroup::last_sequence_number() const { return impl_->seq.load(); }

namespace {

// The names of collectives as fingerprints encode them.
constexpr const char* kOpNames[] = {"all_reduce", "broadcast", "all_gather", "reduce_scatter",
                                    "barrier"};
int op_code(const std::string& op) {
  for (int i = 0; i < 5; ++i) {
    if (op == kOpNames[i]) return i;
  }
  return -1;
}

// A collective's fingerprint (DDP_DEBUG=detail): sequence number, op, dtype, element count,
// number of dimensions, the first two sizes, and the op's parameter (reduce op or root).
constexpr int64_t kFingerprintWords = 8;
at::Tensor fingerprint(const detail::WorkState& s, const at::Tensor* t, int64_t extra) {
  at::Tensor fp = at::full({kFingerprintWords}, -1, at::kLong);
  int64_t* w = fp.data_ptr<int64_t>();
  w[0] = static_cast<int64_t>(s.seq);
  w[1] = op_code(s.op);
  if (t != nullptr) {
    w[2] = static_cast<int64_t>(t->scalar_type());
    w[3] = t->numel();
    w[4] = t->dim();
    if (t->dim() > 0) w[5] = t->size(0);
    if (t->dim() > 1) w[6] = t->size(1);
  }
  w[7] = extra;
  return fp;
}

// "broadcast #12 (1 x Long, shape [1, ...], root 0)"
std::string describe_fingerprint(const int64_t* w) {
  const char* op = w[1] >= 0 && w[1] < 5 ? kOpNames[w[1]] : "?";
  if (w[2] < 0) return fmt::format("{} #{}", op, w[0]);
  std::string shape = w[4] == 0
                          ? "[]"
                          : fmt::format("[{}{}{}]", w[5], w[4] > 1 ? fmt::format(", {}", w[6]) : "",
                                        w[4] > 2 ? ", ..." : "");
  std::string extra;
  if (w[1] == 0 || w[1] == 3) extra = fmt::format(", {}", to_string(static_cast<ReduceOp>(w[7])));
  if (w[1] == 1) extra = fmt::format(", root {}", w[7]);
  return fmt::format("{} #{} ({} x {}, shape {}{})", op, w[0], w[3],
                     c10::toString(static_cast<at::ScalarType>(w[2])), shape, extra);
}

// DDP_DEBUG=detail: every rank shares the fingerprint of the collective it is about to issue
// (an all_gather of kFingerprintWords int64 over the group's Gloo backend, outside the
// numbering), so that ranks issuing different collectives fail here, naming both calls,
// instead of computing a wrong result or hanging.
void compare_fingerprints(detail::ProcessGroupImpl& pg, detail::WorkState& s, const at::Tensor* t,
                          int64_t extra) {
  const int n = pg.env.world_size;
  at::Tensor mine = fingerprint(s, t, extra);
  std::vector<std::vector<at::Tensor>> out(1);
  for (int r = 0; r < n; ++r) out[0].push_back(at::empty({kFingerprintWords}, at::kLong));
  std::vector<at::Tensor> in{mine};
  try {
    pg.backend->allgather(out, in)->wait(pg.timeout);
  } catch (const c10::Error& e) {
    std::exception_ptr error = std::make_exception_ptr(TimeoutError(fmt::format(
        "[rank {}] {} #{} ({}): the ranks' fingerprints (DDP_DEBUG=detail) did not arrive "
        "within {:.1f} s: {}. A peer rank has not reached this collective.",
        s.rank, s.op, s.seq, s.detail, std::chrono::duration<double>(pg.timeout).count(),
        e.what_without_backtrace())));
    if (s.recorder) s.recorder->finish(s.seq, false);
    std::rethrow_exception(explain_failure(s, error));
  }
  const int64_t* w = mine.data_ptr<int64_t>();
  for (int r = 0; r < n; ++r) {
    const int64_t* theirs = out[0][r].data_ptr<int64_t>();
    if (std::equal(w, w + kFingerprintWords, theirs)) continue;
    if (s.recorder) s.recorder->finish(s.seq, false);
    throw CollectiveError(fmt::format(
        "[rank {}] {} #{} desync: rank {} issued {}, rank {} issued {}\n"
        "Every rank must issue the same collectives in the same order, with the same dtypes, "
        "shapes and parameters (found by DDP_DEBUG=detail before running the collective).",
        s.rank, s.op, s.seq, s.rank, describe_fingerprint(w), r, describe_fingerprint(theirs)));
  }
}

// Issues one collective: numbers it, records it (Note [Flight recorder]), checks its
// fingerprint under DDP_DEBUG=detail, starts it through `start` (which stores the transport's
// handle in the state), and records how to finish it. `t` describes the data (null for a
// barrier); `extra` is the op's parameter (reduce op, root).
// User errors found before anything is sent (bad shapes, bad root) are thrown here, naming
// the operation and its sequence number.
template <typename Start>
detail::WorkState* issue(detail::ProcessGroupImpl& pg, std::shared_ptr<detail::WorkState>& state,
                         const char* op, std::string detail, const at::Tensor* t, int64_t extra,
                         Start&& start) {
  state = std::make_shared<detail::WorkState>();
  state->op = op;
  state->detail = std::move(detail);
  state->rank = pg.env.rank;
  state->timeout = pg.timeout;
  state->issued = std::chrono::steady_clock::now();
  state->recorder = pg.recorder;
  state->reporter = pg.reporter;
  // Numbering and starting are one step, so that threads sharing the group hand collectives to
  // the transport in the order of their sequence numbers.
  std::lock_guard<std::mutex> lock(pg.issue_mu);
  state->seq = ++pg.seq;
  if (pg.recorder) {
    pg.recorder->issue(state->seq, op, t != nullptr ? c10::toString(t->scalar_type()) : "-",
                       t != nullptr ? t->numel() : 0, flight::take_note(&pg));
  }
  if (pg.check_fingerprints) compare_fingerprints(pg, *state, t, extra);
  try {
    start(*state);
  } catch (const Error&) {
    if (pg.recorder) pg.recorder->finish(state->seq, false);
    throw;
  } catch (const std::exception& e) {
    if (pg.recorder) pg.recorder->finish(state->seq, false);
    throw CollectiveError(fmt::format("[rank {}] {} #{} ({}) could not start: {}", pg.env.rank, op,
                                      state->seq, state->detail, e.what()));
  }
  return state.get();
}
}  // namespace

// Note [Hierarchical collectives] (make.cpp): one op of this host's shm group that reduces
// inside the host, then this rank's slice over its rail (Gloo, one rank per host), then shares
// the slices inside the host.
Work ProcessGroup::hierarchical_all_reduce(at::Tensor& tensor, ReduceOp op,
                                           const std::string& detail) {
  detail::ProcessGroupImpl& pg = *impl_;
  const auto dtype = to_shm(tensor.scalar_type());
  DDP_CHECK(dtype, Error, "[rank {}] all_reduce #{}: the shm+gloo backend cannot reduce {} tensors",
            pg.env.rank, pg.seq + 1, c10::toString(tensor.scalar_type()));
  at::Tensor buf = shm_buffer(pg, "all_reduce", tensor);
  shm::Placement placement = pg.local_shm->find(buf.data_ptr(), buf.numel() * buf.element_size());
  // Sums travel between hosts (kAvg divides once at the end); Gloo in LibTorch 1.13 cannot
  // reduce bfloat16, so such slices cross in float32.
  const ReduceOp across = op == ReduceOp::kAvg ? ReduceOp::kSum : op;
  const bool widen = tensor.scalar_type() == at::kBFloat16;
  auto make_body = [&](uint64_t seq) {
    return [shm = pg.local_shm.get(), rail = pg.rail, buf, dtype = *dtype, op, across, widen,
            placement, local = pg.shm_peers, n = pg.env.world_size, rank = pg.env.rank,
            peers = pg.rail_peers, timeout = pg.timeout, detail, seq]() mutable {
      const size_t count = static_cast<size_t>(buf.numel());
      const size_t es = buf.element_size();
      char* data = static_cast<char*>(buf.data_ptr());
      shm->all_reduce_here(data, count, dtype, to_shm(across), placement);
      const size_t per = (count + local.size - 1) / local.size;
      auto slice = [&](int p) {
        const size_t lo = std::min(count, per * p);
        return std::pair<size_t, size_t>{lo, std::min(count, lo + per)};
      };
      const auto [lo, hi] = slice(local.rank);
      if (hi > lo) {
        at::Tensor mine =
            buf.view(-1).narrow(0, static_cast<int64_t>(lo), static_cast<int64_t>(hi - lo));
        std::vector<at::Tensor> wire{widen ? mine.to(at::kFloat) : mine};
        ::c10d::AllreduceOptions opts;
        opts.reduceOp = to_c10d(across);
        std::string failure;
        try {
          rail->allreduce(wire, opts)->wait(timeout);
        } catch (const c10::Error& e) {
          failure = e.what_without_backtrace();
        } catch (const std::exception& e) {
          failure = e.what();
        }
        DDP_CHECK(failure.empty(), CollectiveError,
                  "[rank {}] all_reduce #{} ({}) failed between hosts: this rank exchanges its "
                  "slice with rank{} {} (the same local rank on the other host{}), and that "
                  "failed: {}. A rank on another host has exited, or the network between the "
                  "hosts is down: look for that rank's own error.",
                  rank, seq, detail, peers.size() > 1 ? "s" : "", fmt::join(peers, ", "),
                  peers.size() > 1 ? "s" : "", first_line(failure));
        if (widen) mine.copy_(wire[0]);
        shm->restart_deadline();
      }
      for (int p = 0; p < local.size; ++p) {
        const auto [plo, phi] = slice(p);
        if (phi > plo) shm->broadcast_here(data + plo * es, (phi - plo) * es, p);
      }
      if (op == ReduceOp::kAvg) buf.div_(n);
    };
  };
  std::shared_ptr<detail::WorkState> state;
  issue(pg, state, "all_reduce", detail, &tensor, static_cast<int64_t>(op),
        [&](detail::WorkState& s) {
          s.shm_group = pg.local_shm;
          shm::Fingerprint fp{shm::OpKind::kAllReduce, *dtype, to_shm(op), 0,
                              static_cast<uint64_t>(buf.numel())};
          s.shm_op = pg.local_shm->run(s.seq, fp, make_body(s.seq), std::move(placement));
        });
  if (!buf.is_same(tensor)) state->then = [tensor, buf]() mutable { tensor.copy_(buf); };
  return Work(std::move(state));
}

Work ProcessGroup::all_reduce(at::Tensor& tensor, ReduceOp op) {
  detail::ProcessGroupImpl& pg = *impl_;
  DDP_CHECK(tensor.defined(), Error, "[rank {}] all_reduce #{}: the tensor is undefined",
            pg.env.rank, pg.seq + 1);
  DDP_CHECK(op != ReduceOp::kAvg || at::isFloatingType(tensor.scalar_type()), Error,
            "[rank {}] all_reduce #{} (avg): averaging needs a floating-point tensor, got {}",
            pg.env.rank, pg.seq + 1, c10::toString(tensor.scalar_type()));
  std::shared_ptr<detail::WorkState> state;
  const std::string detail = fmt::format("{}, {}", to_string(op), shape_of(tensor));
  if (pg.local_shm) return hierarchical_all_reduce(tensor, op, detail);
  if (pg.shm) {
    const auto dtype = to_shm(tensor.scalar_type());
    DDP_CHECK(dtype, Error, "[rank {}] all_reduce #{}: the shm backend cannot reduce {} tensors",
              pg.env.rank, pg.seq + 1, c10::toString(tensor.scalar_type()));
    at::Tensor buf = shm_buffer(pg, "all_reduce", tensor);
    shm::Placement placement = pg.shm->find(buf.data_ptr(), buf.numel() * buf.element_size());
    issue(pg, state, "all_reduce", detail, &tensor, static_cast<int64_t>(op),
          [&](detail::WorkState& s) {
            s.shm_group = pg.shm;
            s.shm_op = pg.shm->all_reduce(s.seq, buf.data_ptr(), buf.numel(), *dtype, to_shm(op),
                                          std::make_shared<at::Tensor>(buf), std::move(placement));
          });
    if (!buf.is_same(tensor)) state->then = [tensor, buf]() mutable { tensor.copy_(buf); };
    return Work(std::move(state));
  }
  const bool avg_here = op == ReduceOp::kAvg && !c10d_compat::backend_supports_avg(pg.backend_name);
  issue(pg, state, "all_reduce", detail, &tensor, static_cast<int64_t>(op),
        [&](detail::WorkState& s) {
          std::vector<at::Tensor> tensors{tensor};
          ::c10d::AllreduceOptions opts;
          opts.reduceOp = to_c10d(avg_here ? ReduceOp::kSum : op);
          s.work = pg.backend->allreduce(tensors, opts);
        });
  if (avg_here) {
    const int n = pg.env.world_size;
    state->then = [tensor, n]() mutable { tensor.div_(n); };
  }
  return Work(std::move(state));
}

Work ProcessGroup::broadcast(at::Tensor& tensor, int root) {
  detail::ProcessGroupImpl& pg = *impl_;
  DDP_CHECK(tensor.defined(), Error, "[rank {}] broadcast #{}: the tensor is undefined",
            pg.env.rank, pg.seq + 1);
  DDP_CHECK(root >= 0 && root < pg.env.world_size, Error,
            "[rank {}] broadcast #{}: root rank {} is not in this group of {} ranks", pg.env.rank,
            pg.seq + 1, root, pg.env.world_size);
  std::shared_ptr<detail::WorkState> state;
  const std::string detail = fmt::format("from rank {}, {}", root, shape_of(tensor));
  if (pg.shm) {
    at::Tensor buf = shm_buffer(pg, "broadcast", tensor);
    issue(pg, state, "broadcast", detail, &tensor, root, [&](detail::WorkState& s) {
      s.shm_group = pg.shm;
      const auto [count, dtype] = shm_extent(buf);
      s.shm_op = pg.shm->broadcast(s.seq, buf.data_ptr(), count, dtype, root,
                                   std::make_shared<at::Tensor>(buf));
    });
    if (!buf.is_same(tensor)) state->then = [tensor, buf]() mutable { tensor.copy_(buf); };
    return Work(std::move(state));
  }
  issue(pg, state, "broadcast", detail, &tensor, root, [&](detail::WorkState& s) {
    std::vector<at::Tensor> tensors{tensor};
    ::c10d::BroadcastOptions opts;
    opts.rootRank = root;
    opts.rootTensor = 0;
    s.work = pg.backend->broadcast(tensors, opts);
  });
  return Work(std::move(state));
}

Work ProcessGroup::all_gather(std::vector<at::Tensor>& outputs, const at::Tensor& input) {
  detail::ProcessGroupImpl& pg = *impl_;
  const int n = pg.env.world_size;
  DDP_CHECK(input.defined(), Error, "[rank {}] all_gather #{}: the input is undefined", pg.env.rank,
            pg.seq + 1);
  DDP_CHECK(static_cast<int>(outputs.size()) == n, Error,
            "[rank {}] all_gather #{}: expected {} output tensors (one per rank), got {}",
            pg.env.rank, pg.seq + 1, n, outputs.size());
  for (size_t r = 0; r < outputs.size(); ++r) {
    DDP_CHECK(outputs[r].defined() && outputs[r].sizes() == input.sizes() &&
                  outputs[r].scalar_type() == input.scalar_type(),
              Error, "[rank {}] all_gather #{}: outputs[{}] must match the input ({} {})",
              pg.env.rank, pg.seq + 1, r, dims(input), c10::toString(input.scalar_type()));
  }
  std::shared_ptr<detail::WorkState> state;
  if (pg.shm) {
    auto keep = std::make_shared<std::vector<at::Tensor>>();
    keep->push_back(shm_buffer(pg, "all_gather", input));
    std::vector<void*> out_ptrs;
    for (const at::Tensor& o : outputs) {
      keep->push_back(shm_buffer(pg, "all_gather", o));
      out_ptrs.push_back(keep->back().data_ptr());
    }
    issue(pg, state, "all_gather", shape_of(input), &input, -1, [&](detail::WorkState& s) {
      s.shm_group = pg.shm;
      const auto [count, dtype] = shm_extent(input);
      s.shm_op =
          pg.shm->all_gather(s.seq, std::move(out_ptrs), (*keep)[0].data_ptr(), count, dtype, keep);
    });
    state->then = [outputs, keep]() mutable {
      for (size_t r = 0; r < outputs.size(); ++r) {
        if (!(*keep)[r + 1].is_same(outputs[r])) outputs[r].copy_((*keep)[r + 1]);
      }
    };
    return Work(std::move(state));
  }
  issue(pg, state, "all_gather", shape_of(input), &input, -1, [&](detail::WorkState& s) {
    std::vector<std::vector<at::Tensor>> out{outputs};
    std::vector<at::Tensor> in{input};
    s.work = pg.backend->allgather(out, in);
  });
  return Work(std::move(state));
}

Work ProcessGroup::reduce_scatter(at::Tensor& output, const std::vector<at::Tensor>& inputs,
                                  ReduceOp op) {
  detail::ProcessGroupImpl& pg = *impl_;
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
  std::shared_ptr<detail::WorkState> state;
  const std::string detail = fmt::format("{}, {}", to_string(op), shape_of(output));
  if (pg.shm) {
    const auto dtype = to_shm(output.scalar_type());
    DDP_CHECK(dtype, Error,
              "[rank {}] reduce_scatter #{}: the shm backend cannot reduce {} tensors", pg.env.rank,
              pg.seq + 1, c10::toString(output.scalar_type()));
    auto keep = std::make_shared<std::vector<at::Tensor>>();
    keep->push_back(shm_buffer(pg, "reduce_scatter", output));
    std::vector<const void*> in_ptrs;
    for (const at::Tensor& t : inputs) {
      keep->push_back(shm_buffer(pg, "reduce_scatter", t));
      in_ptrs.push_back(keep->back().data_ptr());
    }
    issue(pg, state, "reduce_scatter", detail, &output, static_cast<int64_t>(op),
          [&](detail::WorkState& s) {
            s.shm_group = pg.shm;
            s.shm_op = pg.shm->reduce_scatter(s.seq, (*keep)[0].data_ptr(), std::move(in_ptrs),
                                              output.numel(), *dtype, to_shm(op), keep);
          });
    if (!(*keep)[0].is_same(output)) {
      state->then = [output, keep]() mutable { output.copy_((*keep)[0]); };
    }
    return Work(std::move(state));
  }
  // Gloo has no reduce_scatter: an all-to-all sends inputs[j] to rank j (the bandwidth of a
  // ring reduce-scatter), then each rank reduces the n chunks it received.
  // send/recv: [n, numel]; recv row i is rank i's contribution to this rank's output.
  at::Tensor send = at::stack(inputs).reshape({n, -1});
  at::Tensor recv = at::empty_like(send);
  issue(pg, state, "reduce_scatter", detail, &output, static_cast<int64_t>(op),
        [&](detail::WorkState& s) {
          std::vector<int64_t> equal_splits;  // empty: equal split along dim 0
          ::c10d::AllToAllOptions opts;
          s.work = pg.backend->alltoall_base(recv, send, equal_splits, equal_splits, opts);
        });
  state->then = [output, recv, op, n]() mutable {
    at::Tensor reduced = reduce_rows(recv, op);
    if (op == ReduceOp::kAvg) reduced.div_(n);
    output.copy_(reduced.view(output.sizes()));
  };
  return Work(std::move(state));
}

Work ProcessGroup::barrier() {
  detail::ProcessGroupImpl& pg = *impl_;
  std::shared_ptr<detail::WorkState> state;
  issue(pg, state, "barrier", fmt::format("{} ranks", pg.env.world_size), nullptr, -1,
        [&](detail::WorkState& s) {
          if (pg.shm) {
            s.shm_group = pg.shm;
            s.shm_op = pg.shm->barrier(s.seq);
            return;
          }
          ::c10d::BarrierOptions opts;
          s.work = pg.backend->barrier(opts);
        });
  return Work(std::move(state));
}

at::Tensor ProcessGroup::comm_buffer(int64_t numel, const at::TensorOptions& options) {
  detail::ProcessGroupImpl& pg = *impl_;
  DDP_CHECK(numel >= 0, Error, "[rank {}] comm_buffer: numel {} is negative", pg.env.rank, numel);
  const uint64_t id = ++pg.comm_buffers;
  shm::Group* group = pg.shared_memory();
  if (group == nullptr || !options.device().is_cpu() || numel == 0 || pg.shm_peers.size == 1) {
    return at::zeros({numel}, options);
  }
  const size_t bytes =
      static_cast<size_t>(numel) * c10::elementSize(c10::typeMetaToScalarType(options.dtype()));
  std::shared_ptr<shm::SharedBuffer> buffer =
      make_shared_buffer(*pg.store, *group, pg.shm_peers, id, bytes);
  if (!buffer) return at::zeros({numel}, options);
  char* mine = buffer->base[pg.shm_peers.rank];  // zeroed: a fresh memfd
  return at::from_blob(
      mine, {numel}, [buffer](void*) mutable { buffer.reset(); }, options);
}

bool ProcessGroup::is_comm_buffer(const at::Tensor& t) const {
  shm::Group* group = impl_->shared_memory();
  if (group == nullptr || !t.defined() || !t.device().is_cpu() || !t.is_contiguous()) return false;
  return group->find(t.data_ptr(), t.numel() * t.element_size()).buffer != nullptr;
}

}  // namespace ddp
