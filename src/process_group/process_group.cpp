// ProcessGroup: what every collective shares whatever transport carries it (Note [Transports]):
// argument checks, numbering, the CollectiveDesc, flight records, DDP_DEBUG=detail's call
// comparison; the transport moves the data.
#include <algorithm>
#include <thread>

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <fmt/ranges.h>  // fmt::join

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include "base/check.h"
#include "process_group/composed.h"
#include "process_group/desync.h"
#include "process_group/internal.h"
#include "process_group/shm_setup.h"
#include "process_group/transport/tensors.h"

namespace ddp {
namespace {

std::string dims(const at::Tensor& t) { return fmt::format("[{}]", fmt::join(t.sizes(), ", ")); }

// What `t` is to a collective: its dtype, and its count in elements (in bytes for a type the
// transports do not know, which they move as bytes).
CollectiveDesc describe(Collective op, const at::Tensor& t) {
  CollectiveDesc call;
  call.op = op;
  call.dtype = transport::dtype_of(t.scalar_type());
  call.count =
      static_cast<uint64_t>(t.numel()) * (call.dtype == DType::kOther ? t.element_size() : 1);
  return call;
}

// Checks what the transport cannot move or reduce before the collective takes a number, so
// that a refused call leaves the numbering of every rank as it was. `along`: another tensor of
// the same call (a backend pair moves a call's tensors on one side: Note [Backend pairs]).
void check_supported(const detail::ProcessGroupImpl& pg, const CollectiveDesc& call,
                     const at::Tensor& t, const at::Tensor& along = at::Tensor()) {
  DDP_CHECK(!pg.caps().routed_by_device || !along.defined() ||
                along.device().type() == t.device().type(),
            Error,
            "[rank {}] {} #{}: with the backend pair '{}' a collective's tensors must all be on "
            "one device type, which picks the backend; this call has tensors on {} and on {}",
            pg.env.rank, name(call.op), pg.seq + 1, pg.caps().name, along.device().str(),
            t.device().str());
  const Capabilities& caps = pg.caps_for(t);
  const bool cuda = t.device().is_cuda();
  // Tensors of the other device are staged (Note [Staging tensors]).
  DDP_CHECK(cuda ? caps.cuda_tensors || caps.cpu_tensors
                 : caps.cpu_tensors || pg.cuda_device.has_value(),
            Error,
            "[rank {}] {} #{}: the {} backend moves {} tensors, this one is on {}; use backend "
            "'{}' (or 'auto') for {} tensors",
            pg.env.rank, name(call.op), pg.seq + 1, caps.name, caps.cpu_tensors ? "CPU" : "CUDA",
            t.device().str(), cuda ? "nccl" : "gloo", cuda ? "CUDA" : "CPU");
  const bool reducing = call.op == Collective::kAllReduce ||
                        call.op == Collective::kReduceScatter || call.op == Collective::kReduce;
  DDP_CHECK(!reducing || caps.can_reduce(call.dtype), Error,
            "[rank {}] {} #{}: the {} backend cannot reduce {} tensors; convert them before "
            "the call (to float32, say)",
            pg.env.rank, name(call.op), pg.seq + 1, caps.name, c10::toString(t.scalar_type()));
}

// Note [Staging tensors]
// A transport moves the tensors of the devices its capabilities name; a tensor of the other
// device is staged, so that one group takes both, as PyTorch 2.x's default group does (it pairs
// cpu:gloo with cuda:nccl):
// - CUDA tensors on the CPU transports (shm, shm+gloo) go through pinned host memory, as c10d's
//   Gloo does: copied into a pinned host tensor before the collective starts (a copy that waits
//   for the tensor's stream, so the data is final); the transport's local completion step copies
//   the results back to the device, non_blocking on the current stream (the caching host
//   allocator keeps the pinned block until that copy is done).
// - CPU tensors on a CUDA-only transport (NCCL): the small host values that DDP (shape checks,
//   bucket order, unused-parameter bitmaps, join), checkpoints, metrics and users reduce are
//   copied to the rank's bound device (Note [Device binding]) and back in wait(). A host tensor's
//   value is needed on the host, so that wait() blocks the CPU until the GPU has completed the
//   collective: it polls the collective's CUDA event, bounded by the group's timeout (a blocking
//   device-to-host copy behind a stuck collective would wait forever). Past it, wait() fails;
//   the collective stays in flight, and the group's next collective aborts the communicator
//   (Note [GPU completion]).
// Transports that take both (a CUDA LibTorch's Gloo) get tensors as they are.
class Staging {
 public:
  explicit Staging(const detail::ProcessGroupImpl& pg)
      : to_host_(!pg.caps().cuda_tensors),
        to_device_(!pg.caps().cpu_tensors && pg.cuda_device.has_value()),
        device_(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(pg.cuda_device.value_or(0))),
        rank_(pg.env.rank),
        timeout_(pg.timeout) {}
  // `t` itself, or its staged copy (`copy_in`: with its values; else uninitialised) whose result
  // goes back to `t` (`copy_back`) when the collective completes. `contiguous`: a tensor that
  // is not is staged too, on its own device.
  at::Tensor stage(const at::Tensor& t, bool copy_in, bool copy_back, bool contiguous = false) {
    at::Tensor s;
    if (to_host_ && t.device().is_cuda()) {
      s = at::empty(t.sizes(), t.options().device(at::kCPU).pinned_memory(true));
    } else if (to_device_ && t.device().is_cpu()) {
      s = at::empty(t.sizes(), t.options().device(device_));
    } else if (contiguous && !t.is_contiguous()) {
      s = at::empty(t.sizes(), t.options());
    } else {
      return t;
    }
    if (copy_in) s.copy_(t);
    if (copy_back) back_.emplace_back(t, s);
    return s;
  }
  // `started` with the copies back appended to its completion step.
  Started finish(const CollectiveDesc& call, Started started) {
    if (back_.empty()) return started;
    started.then = [then = std::move(started.then), back = std::move(back_),
                    pending = started.pending, to_host = to_host_, rank = rank_, call,
                    timeout = timeout_]() mutable {
      if (then) then();
      if (!to_host && pending) wait_on_host(*pending, rank, call, timeout);
      for (auto& [mine, staged] : back) mine.copy_(staged, /*non_blocking=*/to_host);
    };
    return started;
  }

 private:
  // Until the GPU has completed `pending`, polling its event; throws past `timeout`.
  static void wait_on_host(const Pending& pending, int rank, const CollectiveDesc& call,
                           std::chrono::milliseconds timeout) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    auto pause = std::chrono::microseconds(20);
    while (!pending.is_completed()) {
      DDP_CHECK(std::chrono::steady_clock::now() < deadline, TimeoutError,
                "[rank {}] {} did not complete on the GPU within the timeout ({:.1f} s), so its "
                "result could not be copied back to the CPU tensor: a peer rank has not reached "
                "it (stuck, dead, or issuing collectives in a different order)",
                rank, call.describe(), std::chrono::duration<double>(timeout).count());
      std::this_thread::sleep_for(pause);
      pause = std::min(pause * 2, std::chrono::microseconds(1000));
    }
  }

  const bool to_host_;    // CUDA tensors go to pinned host memory (a CPU transport)
  const bool to_device_;  // CPU tensors go to device_ (a CUDA-only transport)
  const c10::Device device_;
  const int rank_;
  const std::chrono::milliseconds timeout_;
  std::vector<std::pair<at::Tensor, at::Tensor>> back_;  // (the caller's tensor, its staged copy)
};

// DDP_DEBUG=detail: every rank shares the CollectiveDesc of the collective it is about to issue
// (through the transport, outside the numbering), so that ranks issuing different collectives
// fail here, naming both calls, instead of computing a wrong result or hanging.
void compare_calls(detail::ProcessGroupImpl& pg, detail::WorkState& s) {
  std::optional<std::vector<CollectiveDesc>> all;
  try {
    all = pg.transport->gather_calls(s.call, pg.timeout);
  } catch (const std::exception& e) {
    const std::string why = dynamic_cast<const c10::Error*>(&e) != nullptr
                                ? static_cast<const c10::Error&>(e).what_without_backtrace()
                                : e.what();
    std::exception_ptr error = std::make_exception_ptr(TimeoutError(fmt::format(
        "[rank {}] {}: the ranks' calls (DDP_DEBUG=detail) did not arrive within {:.1f} s: {}. "
        "A peer rank has not reached this collective.",
        s.rank, s.call.describe(), std::chrono::duration<double>(pg.timeout).count(), why)));
    if (s.recorder) s.recorder->finish(s.call.seq, false);
    std::rethrow_exception(explain_failure(s, error));
  }
  if (!all) return;
  for (int r = 0; r < static_cast<int>(all->size()); ++r) {
    const CollectiveDesc& theirs = (*all)[r];
    if (theirs == s.call) continue;
    if (s.recorder) s.recorder->finish(s.call.seq, false);
    throw CollectiveError(desync_error(s.rank, s.call.describe(), r, theirs.describe(),
                                       "found by DDP_DEBUG=detail before running the collective"));
  }
}

// Note [GPU completion]: marks the group's collectives whose CUDA events fired completed; when
// one has run past the timeout on the GPU, aborts the transport (NCCL's communicator abort) and
// fails this and every later collective, naming the stuck one, instead of queueing behind it.
void check_in_flight(detail::ProcessGroupImpl& pg) REQUIRES(pg.issue_mu) {
  if (pg.aborted.empty() && pg.inflight->size() > 0) {
    if (std::optional<CollectiveDesc> stuck = pg.inflight->sweep(pg.recorder.get(), pg.timeout)) {
      if (pg.recorder) pg.recorder->finish(stuck->seq, false);
      pg.transport->abort();
      pg.aborted = fmt::format(
          "{} did not complete on the GPU within the timeout ({:.1f} s) and the {} "
          "communicator was aborted: a peer rank has not reached it (stuck, dead, or issuing "
          "collectives in a different order). Every later collective of this group fails; form "
          "a new group (or restart the job: ddp-train resumes from its last checkpoint).",
          stuck->describe(), std::chrono::duration<double>(pg.timeout).count(), pg.caps().name);
    }
  }
  DDP_CHECK(pg.aborted.empty(), TimeoutError, "[rank {}] {}", pg.env.rank, pg.aborted);
}

// Issues one collective: numbers it, records it (Note [Flight recorder]), compares it across
// ranks under DDP_DEBUG=detail, starts it through `start` (the transport), and keeps how to
// finish it. User errors found before anything is sent are thrown here, naming the call.
template <typename Start>
std::shared_ptr<detail::WorkState> issue(detail::ProcessGroupImpl& pg, CollectiveDesc call,
                                         Start&& start) {
  auto state = std::make_shared<detail::WorkState>();
  state->rank = pg.env.rank;
  state->timeout = pg.timeout;
  state->issued = std::chrono::steady_clock::now();
  state->recorder = pg.recorder;
  state->reporter = pg.reporter;
  state->inflight = pg.inflight;
  // Numbering and starting are one step, so that threads sharing the group hand collectives to
  // the transport in the order of their sequence numbers.
  MutexLock lock(&pg.issue_mu);
  check_in_flight(pg);
  call.seq = ++pg.seq;
  state->call = call;
  if (pg.recorder) pg.recorder->issue(call, flight::take_note(&pg));
  if (pg.check_calls) compare_calls(pg, *state);
  try {
    Started started = start(state->call);
    state->pending = std::move(started.pending);
    state->then = std::move(started.then);
  } catch (const Error&) {
    if (pg.recorder) pg.recorder->finish(call.seq, false);
    throw;
  } catch (const std::exception& e) {
    if (pg.recorder) pg.recorder->finish(call.seq, false);
    throw CollectiveError(
        fmt::format("[rank {}] {} could not start: {}", pg.env.rank, call.describe(), e.what()));
  }
  return state;
}

void check_root(const detail::ProcessGroupImpl& pg, Collective op, int root) {
  DDP_CHECK(root >= 0 && root < pg.env.world_size, Error,
            "[rank {}] {} #{}: root rank {} is not in this group of {} ranks", pg.env.rank,
            name(op), pg.seq + 1, root, pg.env.world_size);
}

// Checks the per-rank list of a rooted collective: size() tensors like `like` on root (what
// PyTorch calls gather_list / scatter_list), none elsewhere.
void check_rooted_list(const detail::ProcessGroupImpl& pg, Collective op, int root,
                       const std::vector<at::Tensor>& list, const char* what,
                       const at::Tensor& like) {
  const int n = pg.env.world_size;
  if (pg.env.rank != root) {
    DDP_CHECK(list.empty(), Error,
              "[rank {}] {} #{}: {} must be empty on every rank but the root ({}); this rank "
              "passed {} tensors",
              pg.env.rank, name(op), pg.seq + 1, what, root, list.size());
    return;
  }
  DDP_CHECK(static_cast<int>(list.size()) == n, Error,
            "[rank {}] {} #{}: the root needs {} {} (one per rank), got {}", pg.env.rank, name(op),
            pg.seq + 1, n, what, list.size());
  for (size_t r = 0; r < list.size(); ++r) {
    DDP_CHECK(list[r].defined() && list[r].sizes() == like.sizes() &&
                  list[r].scalar_type() == like.scalar_type(),
              Error, "[rank {}] {} #{}: {}[{}] must match {} {}", pg.env.rank, name(op), pg.seq + 1,
              what, r, dims(like), c10::toString(like.scalar_type()));
  }
}

// Elements per row along dim 0 (1 for a 0-dim tensor).
int64_t row_numel(const at::Tensor& t) {
  int64_t row = 1;
  for (int64_t d = 1; d < t.dim(); ++d) row *= t.size(d);
  return row;
}

// all_to_all_single's split sizes along dim 0, checked, in elements (empty: none were given).
std::vector<int64_t> element_splits(const detail::ProcessGroupImpl& pg,
                                    const std::vector<int64_t>& splits, const at::Tensor& t,
                                    const char* what) {
  const int n = pg.env.world_size;
  const int64_t rows = t.dim() == 0 ? 1 : t.size(0);
  if (splits.empty()) {
    DDP_CHECK(rows % n == 0, Error,
              "[rank {}] all_to_all #{}: the {} has {} rows along dim 0, not divisible by the "
              "{} ranks; pass its split sizes",
              pg.env.rank, pg.seq + 1, what, rows, n);
    return {};
  }
  DDP_CHECK(static_cast<int>(splits.size()) == n, Error,
            "[rank {}] all_to_all #{}: {} split sizes given, one per rank ({}) is needed",
            pg.env.rank, pg.seq + 1, splits.size(), n);
  int64_t sum = 0;
  for (int64_t v : splits) {
    DDP_CHECK(v >= 0, Error, "[rank {}] all_to_all #{}: split size {} is negative", pg.env.rank,
              pg.seq + 1, v);
    sum += v;
  }
  DDP_CHECK(sum == rows, Error,
            "[rank {}] all_to_all #{}: the {} split sizes [{}] add up to {}, but it has {} rows "
            "along dim 0",
            pg.env.rank, pg.seq + 1, what, fmt::join(splits, ", "), sum, rows);
  std::vector<int64_t> out;
  for (int64_t v : splits) out.push_back(v * row_numel(t));
  return out;
}

// Equal chunks written out as splits.
std::vector<int64_t> equal_splits(int64_t total, int n) {
  return std::vector<int64_t>(static_cast<size_t>(n), total / n);
}

bool all_equal(const std::vector<int64_t>& v) {
  return std::adjacent_find(v.begin(), v.end(), std::not_equal_to<>()) == v.end();
}

// all_to_all on flat contiguous tensors (staged by the caller, whose `staging` copies `out`
// back), splits in elements (empty: equal chunks). `after` runs once the result is back in the
// caller's tensor.
std::shared_ptr<detail::WorkState> all_to_all_flat(ProcessGroup& self, Staging& staging,
                                                   at::Tensor out, at::Tensor in,
                                                   std::vector<int64_t> out_splits,
                                                   std::vector<int64_t> in_splits,
                                                   std::function<void()> after = {}) {
  detail::ProcessGroupImpl& pg = detail::impl_of(self);
  const int n = pg.env.world_size;
  const int rank = pg.env.rank;
  if (!out_splits.empty() && !in_splits.empty() && all_equal(out_splits) && all_equal(in_splits) &&
      out_splits[0] == in_splits[0]) {
    out_splits.clear();
    in_splits.clear();
  }
  // Only one side given: the other is equal chunks (PyTorch's rule).
  if (out_splits.empty() != in_splits.empty()) {
    if (out_splits.empty()) out_splits = equal_splits(out.numel(), n);
    if (in_splits.empty()) in_splits = equal_splits(in.numel(), n);
  }
  const bool even = in_splits.empty();
  CollectiveDesc call = describe(Collective::kAllToAll, in);
  const uint64_t unit = call.dtype == DType::kOther ? in.element_size() : 1;  // count's unit
  call.count = even ? call.count / n : 0;
  check_supported(pg, call, in);
  check_supported(pg, call, out, in);
  auto finish = [&](const CollectiveDesc& c, Started started) {
    started = staging.finish(c, std::move(started));
    return after ? composed::followed_by(std::move(started), std::move(after)) : started;
  };
  if (pg.caps_for(in).rooted_collectives) {
    return issue(pg, call, [&](const CollectiveDesc& c) {
      return finish(c, pg.transport->all_to_all(c, out, in, out_splits, in_splits));
    });
  }
  if (even) {
    return issue(pg, call, [&](const CollectiveDesc& c) {
      return finish(c, composed::all_to_all(*pg.transport, c, rank, n, out, in));
    });
  }
  // Uneven over a transport without all-to-all: every chunk padded to the largest split of any
  // rank (Note [Composed collectives]).
  int64_t largest = 0;
  for (int64_t v : out_splits) largest = std::max(largest, v);
  for (int64_t v : in_splits) largest = std::max(largest, v);
  at::Tensor global = at::full({1}, largest, at::kLong);
  self.all_reduce(global, ReduceOp::kMax).wait();
  const int64_t chunk = global.item<int64_t>();
  at::Tensor send = at::zeros({n * chunk}, in.options());
  for (int j = 0, from = 0; j < n; from += in_splits[j], ++j) {
    send.narrow(0, j * chunk, in_splits[j]).copy_(in.narrow(0, from, in_splits[j]));
  }
  at::Tensor recv = at::empty({n * chunk}, out.options());
  call.count = static_cast<uint64_t>(chunk) * unit;
  return issue(pg, call, [&](const CollectiveDesc& c) {
    Started started = composed::all_to_all(*pg.transport, c, rank, n, recv, send);
    started = composed::followed_by(std::move(started), [out, recv, out_splits, chunk]() mutable {
      int64_t to = 0;
      for (size_t j = 0; j < out_splits.size(); to += out_splits[j], ++j) {
        out.narrow(0, to, out_splits[j])
            .copy_(recv.narrow(0, static_cast<int64_t>(j) * chunk, out_splits[j]));
      }
    });
    return finish(c, std::move(started));
  });
}

// The checks of isend and irecv, before the call takes its number on its channel.
void check_p2p(const detail::ProcessGroupImpl& pg, Collective op, const at::Tensor& t, int peer,
               int tag) {
  const int me = pg.env.rank;
  DDP_CHECK(t.defined(), Error, "[rank {}] {}: the tensor is undefined", me, name(op));
  DDP_CHECK(peer >= 0 && peer < pg.env.world_size && peer != me, Error,
            "[rank {}] {}: {} rank {} is not another rank of this group of {} ranks", me, name(op),
            op == Collective::kSend ? "destination" : "source", peer, pg.env.world_size);
  DDP_CHECK(tag >= 0 && tag < kTagLimit, Error,
            "[rank {}] {} {} rank {}: tag {} is outside 0 to {}", me, name(op),
            op == Collective::kSend ? "to" : "from", peer, tag, kTagLimit - 1);
  const Capabilities& caps = pg.caps_for(t);
  const bool cuda = t.device().is_cuda();
  DDP_CHECK(cuda ? caps.cuda_tensors || caps.cpu_tensors
                 : caps.cpu_tensors || pg.cuda_device.has_value(),
            Error, "[rank {}] {}: the {} backend moves {} tensors, this one is on {}", me, name(op),
            caps.name, caps.cpu_tensors ? "CPU" : "CUDA", t.device().str());
}

// isend and irecv (Note [Point to point] in mailbox.h): numbered on their channel, started by
// the transport, or by the mailbox where it has none.
std::shared_ptr<detail::WorkState> point_to_point(detail::ProcessGroupImpl& pg, Collective op,
                                                  const at::Tensor& tensor, int peer, int tag) {
  check_p2p(pg, op, tensor, peer, tag);
  const bool sending = op == Collective::kSend;
  CollectiveDesc call = describe(op, tensor);
  call.root = peer;
  call.tag = tag;
  Staging staging(pg);
  at::Tensor t = staging.stage(tensor, sending, !sending, /*contiguous=*/true);
  auto state = std::make_shared<detail::WorkState>();
  state->rank = pg.env.rank;
  state->timeout = pg.timeout;
  // Not the group's: its in-flight works complete records of the collectives' ring by number.
  state->inflight = std::make_shared<flight::InFlight>();
  // Numbering and starting are one step, so that the calls of a channel start in their order.
  MutexLock lock(&pg.p2p_mu);
  uint64_t& count = (sending ? pg.p2p_sent : pg.p2p_received)[{peer, tag}];
  call.seq = count + 1;
  state->call = call;
  state->issued = std::chrono::steady_clock::now();
  Started started;
  try {
    if (pg.caps_for(t).point_to_point) {
      started = sending ? pg.transport->send(call, t) : pg.transport->recv(call, t);
    } else {
      if (!pg.mailbox) {
        // The transport outlives the mailbox (~ProcessGroupImpl resets the mailbox first).
        pg.mailbox = std::make_unique<Mailbox>(pg.store, pg.env.rank, pg.timeout,
                                               [t = pg.transport.get()](int peer) {
                                                 return t->peer_gone(peer);
                                               });
      }
      if (sending) {
        pg.mailbox->send(call, t);
      } else {
        started.pending = pg.mailbox->recv(call, t);
      }
    }
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    throw CollectiveError(
        fmt::format("[rank {}] {} could not start: {}", pg.env.rank, call.describe(), e.what()));
  }
  count = call.seq;  // only a call that started takes its number
  started = staging.finish(call, std::move(started));
  state->pending = std::move(started.pending);
  state->then = std::move(started.then);
  return state;
}

}  // namespace

const Capabilities& capabilities_of(ProcessGroup& pg) { return detail::impl_of(pg).caps(); }
const Capabilities& capabilities_of(ProcessGroup& pg, c10::DeviceType device) {
  return detail::impl_of(pg).transport->capabilities_for(device);
}

ProcessGroup::~ProcessGroup() = default;

// A rank whose group goes away while its peers may still be in a collective (its program
// returned early) says so first, before the transport's connections close: over Gloo the peers
// otherwise see only "Connection closed by peer" (shm's control block tells them anyway).
detail::ProcessGroupImpl::~ProcessGroupImpl() {
  {
    // Its messages not yet taken are waited for first (Note [Point to point]).
    MutexLock lock(&p2p_mu);
    mailbox.reset();
  }
  if (reporter && transport && !caps().announces_departure) {
    try {
      // Calls go to the store under the prefix, whose own timeout bounds them.
      if (auto* prefixed = dynamic_cast<::c10d::PrefixStore*>(diag_store.get())) {
        prefixed->getUnderlyingStore()->setTimeout(kDepartLimit);
      }
    } catch (const std::exception&) {
    }
    reporter->depart();
  }
}

int ProcessGroup::rank() const { return detail::impl_of(*this).env.rank; }
int ProcessGroup::size() const { return detail::impl_of(*this).env.world_size; }
int ProcessGroup::local_rank() const { return detail::impl_of(*this).env.local_rank; }
int ProcessGroup::local_size() const { return detail::impl_of(*this).env.local_world_size; }
const std::string& ProcessGroup::backend() const { return detail::impl_of(*this).caps().name; }
std::chrono::milliseconds ProcessGroup::timeout() const { return detail::impl_of(*this).timeout; }
const DistEnv& ProcessGroup::env() const { return detail::impl_of(*this).env; }
uint64_t ProcessGroup::last_sequence_number() const { return detail::impl_of(*this).seq.load(); }
std::optional<int> ProcessGroup::bound_device_id() const {
  return detail::impl_of(*this).cuda_device;
}

Work ProcessGroup::all_reduce(at::Tensor& tensor, ReduceOp op) {
  detail::ProcessGroupImpl& pg = detail::impl_of(*this);
  DDP_CHECK(tensor.defined(), Error, "[rank {}] all_reduce #{}: the tensor is undefined",
            pg.env.rank, pg.seq + 1);
  CollectiveDesc call = describe(Collective::kAllReduce, tensor);
  call.reduce = op;
  DDP_CHECK(op != ReduceOp::kAvg || at::isFloatingType(tensor.scalar_type()), Error,
            "[rank {}] all_reduce #{} (avg): averaging needs a floating-point tensor, got {}",
            pg.env.rank, pg.seq + 1, c10::toString(tensor.scalar_type()));
  check_supported(pg, call, tensor);
  Staging staging(pg);
  at::Tensor t = staging.stage(tensor, true, true);
  return Work(issue(pg, call,
                    [&](const CollectiveDesc& c) {
                      return staging.finish(c, pg.transport->all_reduce(c, t));
                    }),
              tensor);
}

Work ProcessGroup::broadcast(at::Tensor& tensor, int root) {
  detail::ProcessGroupImpl& pg = detail::impl_of(*this);
  DDP_CHECK(tensor.defined(), Error, "[rank {}] broadcast #{}: the tensor is undefined",
            pg.env.rank, pg.seq + 1);
  DDP_CHECK(root >= 0 && root < pg.env.world_size, Error,
            "[rank {}] broadcast #{}: root rank {} is not in this group of {} ranks", pg.env.rank,
            pg.seq + 1, root, pg.env.world_size);
  CollectiveDesc call = describe(Collective::kBroadcast, tensor);
  call.root = root;
  check_supported(pg, call, tensor);
  Staging staging(pg);
  at::Tensor t = staging.stage(tensor, true, true);
  return Work(issue(pg, call,
                    [&](const CollectiveDesc& c) {
                      return staging.finish(c, pg.transport->broadcast(c, t));
                    }),
              tensor);
}

Work ProcessGroup::all_gather(std::vector<at::Tensor>& outputs, const at::Tensor& input) {
  detail::ProcessGroupImpl& pg = detail::impl_of(*this);
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
  const CollectiveDesc call = describe(Collective::kAllGather, input);
  check_supported(pg, call, input);
  for (const at::Tensor& o : outputs) check_supported(pg, call, o, input);
  Staging staging(pg);
  const at::Tensor in = staging.stage(input, true, false);
  std::vector<at::Tensor> out;
  for (const at::Tensor& o : outputs) out.push_back(staging.stage(o, false, true));
  return Work(issue(pg, call, [&](const CollectiveDesc& c) {
    return staging.finish(c, pg.transport->all_gather(c, out, in));
  }));
}

Work ProcessGroup::reduce_scatter(at::Tensor& output, const std::vector<at::Tensor>& inputs,
                                  ReduceOp op) {
  detail::ProcessGroupImpl& pg = detail::impl_of(*this);
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
  CollectiveDesc call = describe(Collective::kReduceScatter, output);
  call.reduce = op;
  check_supported(pg, call, output);
  for (const at::Tensor& t : inputs) check_supported(pg, call, t, output);
  Staging staging(pg);
  at::Tensor out = staging.stage(output, false, true);
  std::vector<at::Tensor> in;
  for (const at::Tensor& t : inputs) in.push_back(staging.stage(t, true, false));
  return Work(issue(pg, call,
                    [&](const CollectiveDesc& c) {
                      return staging.finish(c, pg.transport->reduce_scatter(c, out, in));
                    }),
              output);
}

Work ProcessGroup::barrier() {
  detail::ProcessGroupImpl& pg = detail::impl_of(*this);
  return Work(issue(pg, CollectiveDesc{},
                    [&](const CollectiveDesc& c) { return pg.transport->barrier(c); }));
}

Work ProcessGroup::reduce(at::Tensor& tensor, int root, ReduceOp op) {
  detail::ProcessGroupImpl& pg = detail::impl_of(*this);
  DDP_CHECK(tensor.defined(), Error, "[rank {}] reduce #{}: the tensor is undefined", pg.env.rank,
            pg.seq + 1);
  check_root(pg, Collective::kReduce, root);
  DDP_CHECK(op != ReduceOp::kAvg || at::isFloatingType(tensor.scalar_type()), Error,
            "[rank {}] reduce #{} (avg): averaging needs a floating-point tensor, got {}",
            pg.env.rank, pg.seq + 1, c10::toString(tensor.scalar_type()));
  CollectiveDesc call = describe(Collective::kReduce, tensor);
  call.reduce = op;
  call.root = root;
  check_supported(pg, call, tensor);
  Staging staging(pg);
  at::Tensor t = staging.stage(tensor, true, true, /*contiguous=*/true);
  return Work(issue(pg, call,
                    [&](const CollectiveDesc& c) {
                      return staging.finish(c, pg.caps_for(t).rooted_collectives
                                                   ? pg.transport->reduce(c, t)
                                                   : composed::reduce(*pg.transport, c, t));
                    }),
              tensor);
}

Work ProcessGroup::gather(std::vector<at::Tensor>& outputs, const at::Tensor& input, int root) {
  detail::ProcessGroupImpl& pg = detail::impl_of(*this);
  DDP_CHECK(input.defined(), Error, "[rank {}] gather #{}: the input is undefined", pg.env.rank,
            pg.seq + 1);
  check_root(pg, Collective::kGather, root);
  check_rooted_list(pg, Collective::kGather, root, outputs, "outputs", input);
  CollectiveDesc call = describe(Collective::kGather, input);
  call.root = root;
  check_supported(pg, call, input);
  for (const at::Tensor& o : outputs) check_supported(pg, call, o, input);
  Staging staging(pg);
  const at::Tensor in = staging.stage(input, true, false, true);
  std::vector<at::Tensor> out;
  for (const at::Tensor& o : outputs) out.push_back(staging.stage(o, false, true, true));
  return Work(issue(pg, call, [&](const CollectiveDesc& c) {
    return staging.finish(c, pg.caps_for(in).rooted_collectives
                                 ? pg.transport->gather(c, out, in)
                                 : composed::gather(*pg.transport, c, pg.env.rank,
                                                    pg.env.world_size, out, in));
  }));
}

Work ProcessGroup::scatter(at::Tensor& output, const std::vector<at::Tensor>& inputs, int root) {
  detail::ProcessGroupImpl& pg = detail::impl_of(*this);
  DDP_CHECK(output.defined(), Error, "[rank {}] scatter #{}: the output is undefined", pg.env.rank,
            pg.seq + 1);
  check_root(pg, Collective::kScatter, root);
  check_rooted_list(pg, Collective::kScatter, root, inputs, "inputs", output);
  CollectiveDesc call = describe(Collective::kScatter, output);
  call.root = root;
  check_supported(pg, call, output);
  for (const at::Tensor& t : inputs) check_supported(pg, call, t, output);
  Staging staging(pg);
  at::Tensor out = staging.stage(output, false, true, true);
  std::vector<at::Tensor> in;
  for (const at::Tensor& t : inputs) in.push_back(staging.stage(t, true, false, true));
  return Work(issue(pg, call,
                    [&](const CollectiveDesc& c) {
                      return staging.finish(c,
                                            pg.caps_for(out).rooted_collectives
                                                ? pg.transport->scatter(c, out, in)
                                                : composed::scatter(*pg.transport, c, pg.env.rank,
                                                                    pg.env.world_size, out, in));
                    }),
              output);
}

Work ProcessGroup::all_to_all_single(at::Tensor& output, const at::Tensor& input,
                                     const std::vector<int64_t>& output_split_sizes,
                                     const std::vector<int64_t>& input_split_sizes) {
  detail::ProcessGroupImpl& pg = detail::impl_of(*this);
  DDP_CHECK(input.defined() && output.defined(), Error,
            "[rank {}] all_to_all #{}: the {} is undefined", pg.env.rank, pg.seq + 1,
            input.defined() ? "output" : "input");
  DDP_CHECK(input.dim() >= 1 && output.dim() >= 1, Error,
            "[rank {}] all_to_all #{}: the input and the output need at least one dimension "
            "(split along dim 0); got {} and {}",
            pg.env.rank, pg.seq + 1, dims(input), dims(output));
  DDP_CHECK(input.scalar_type() == output.scalar_type() && row_numel(input) == row_numel(output),
            Error,
            "[rank {}] all_to_all #{}: the input ({} {}) and the output ({} {}) need the same "
            "dtype and the same sizes past dim 0",
            pg.env.rank, pg.seq + 1, dims(input), c10::toString(input.scalar_type()), dims(output),
            c10::toString(output.scalar_type()));
  std::vector<int64_t> out_splits = element_splits(pg, output_split_sizes, output, "output");
  std::vector<int64_t> in_splits = element_splits(pg, input_split_sizes, input, "input");
  Staging staging(pg);
  at::Tensor in = staging.stage(input, true, false, true).view({-1});
  at::Tensor out = staging.stage(output, false, true, true).view({-1});
  return Work(all_to_all_flat(*this, staging, out, in, out_splits, in_splits), output);
}

Work ProcessGroup::all_to_all(std::vector<at::Tensor>& outputs,
                              const std::vector<at::Tensor>& inputs) {
  detail::ProcessGroupImpl& pg = detail::impl_of(*this);
  const int n = pg.env.world_size;
  DDP_CHECK(static_cast<int>(outputs.size()) == n && static_cast<int>(inputs.size()) == n, Error,
            "[rank {}] all_to_all #{}: expected {} outputs and {} inputs (one per rank), got {} "
            "and {}",
            pg.env.rank, pg.seq + 1, n, n, outputs.size(), inputs.size());
  std::vector<at::Tensor> flat_in;
  std::vector<int64_t> out_splits, in_splits;
  for (int r = 0; r < n; ++r) {
    DDP_CHECK(inputs[r].defined() && outputs[r].defined() &&
                  inputs[r].scalar_type() == inputs[0].scalar_type() &&
                  outputs[r].scalar_type() == inputs[0].scalar_type() &&
                  inputs[r].device() == inputs[0].device() &&
                  outputs[r].device() == inputs[0].device(),
              Error,
              "[rank {}] all_to_all #{}: every input and output must be defined, of one dtype "
              "and on one device ({} on {}, as inputs[0]); inputs[{}] or outputs[{}] is not",
              pg.env.rank, pg.seq + 1, c10::toString(inputs[0].scalar_type()),
              inputs[0].device().str(), r, r);
    flat_in.push_back(inputs[r].reshape({-1}));
    in_splits.push_back(inputs[r].numel());
    out_splits.push_back(outputs[r].numel());
  }
  int64_t received = 0;
  for (int64_t v : out_splits) received += v;
  at::Tensor out_flat = at::empty({received}, outputs[0].options());
  Staging staging(pg);
  at::Tensor in = staging.stage(at::cat(flat_in), true, false);
  at::Tensor out = staging.stage(out_flat, false, true);
  return Work(
      all_to_all_flat(*this, staging, out, in, out_splits, in_splits,
                      [outputs, out_flat, out_splits]() mutable {
                        int64_t from = 0;
                        for (size_t i = 0; i < outputs.size(); from += out_splits[i], ++i) {
                          outputs[i].copy_(
                              out_flat.narrow(0, from, out_splits[i]).view(outputs[i].sizes()));
                        }
                      }));
}

Work ProcessGroup::all_gather_into_tensor(at::Tensor& output, const at::Tensor& input) {
  detail::ProcessGroupImpl& pg = detail::impl_of(*this);
  const int n = pg.env.world_size;
  DDP_CHECK(input.defined() && output.defined(), Error,
            "[rank {}] all_gather #{}: the {} is undefined", pg.env.rank, pg.seq + 1,
            input.defined() ? "output" : "input");
  DDP_CHECK(output.numel() == n * input.numel() && output.scalar_type() == input.scalar_type() &&
                output.is_contiguous(),
            Error,
            "[rank {}] all_gather #{} (into a tensor): the output must be a contiguous {} tensor "
            "of {} x {} elements (size() times the input's {}); got {} {}{}",
            pg.env.rank, pg.seq + 1, c10::toString(input.scalar_type()), n, input.numel(),
            dims(input), dims(output), c10::toString(output.scalar_type()),
            output.is_contiguous() ? "" : ", not contiguous");
  at::Tensor rows = output.view({n, -1});
  std::vector<at::Tensor> outputs;
  for (int r = 0; r < n; ++r) outputs.push_back(rows[r].view(input.sizes()));
  return Work(all_gather(outputs, input).state_, output);
}

Work ProcessGroup::reduce_scatter_tensor(at::Tensor& output, const at::Tensor& input, ReduceOp op) {
  detail::ProcessGroupImpl& pg = detail::impl_of(*this);
  const int n = pg.env.world_size;
  DDP_CHECK(input.defined() && output.defined(), Error,
            "[rank {}] reduce_scatter #{}: the {} is undefined", pg.env.rank, pg.seq + 1,
            input.defined() ? "output" : "input");
  DDP_CHECK(input.numel() == n * output.numel() && output.scalar_type() == input.scalar_type(),
            Error,
            "[rank {}] reduce_scatter #{} (of a tensor): the input must be a {} tensor of {} x {} "
            "elements (size() times the output's {}); got {} {}",
            pg.env.rank, pg.seq + 1, c10::toString(output.scalar_type()), n, output.numel(),
            dims(output), dims(input), c10::toString(input.scalar_type()));
  at::Tensor rows = input.contiguous().view({n, -1});
  std::vector<at::Tensor> inputs;
  for (int r = 0; r < n; ++r) inputs.push_back(rows[r].view(output.sizes()));
  return Work(reduce_scatter(output, inputs, op).state_, output);
}

Work ProcessGroup::isend(const at::Tensor& tensor, int dst, int tag) {
  return Work(point_to_point(detail::impl_of(*this), Collective::kSend, tensor, dst, tag), tensor);
}

Work ProcessGroup::irecv(at::Tensor& tensor, int src, int tag) {
  return Work(point_to_point(detail::impl_of(*this), Collective::kRecv, tensor, src, tag), tensor);
}

void ProcessGroup::send(const at::Tensor& tensor, int dst, int tag) {
  isend(tensor, dst, tag).wait();
}

int ProcessGroup::recv(at::Tensor& tensor, int src, int tag) {
  irecv(tensor, src, tag).wait();
  return src;
}

at::Tensor ProcessGroup::comm_buffer(int64_t numel, const at::TensorOptions& options) {
  detail::ProcessGroupImpl& pg = detail::impl_of(*this);
  DDP_CHECK(numel >= 0, Error, "[rank {}] comm_buffer: numel {} is negative", pg.env.rank, numel);
  const uint64_t id = ++pg.comm_buffers;
  at::Tensor shared = pg.transport->comm_buffer(id, numel, options);
  return shared.defined() ? shared : at::zeros({numel}, options);
}

bool ProcessGroup::is_comm_buffer(const at::Tensor& t) const {
  return detail::impl_of(*this).transport->is_comm_buffer(t);
}

}  // namespace ddp
