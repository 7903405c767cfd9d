// A LibTorch backend as a transport: Gloo (CPU tensors, any hosts) or NCCL (CUDA tensors).
#include <atomic>
#include <chrono>
#include <vector>

#include <fmt/format.h>

#include "base/check.h"
#include "process_group/internal.h"
#include "process_group/transport/c10d_ops.h"
#include "process_group/transport/tensors.h"  // bytes_of
#include "process_group/transport/transports.h"

namespace ddp {
namespace {

// How long a wait sleeps between looks at this host's peers (Note [Hang reports]).
constexpr std::chrono::seconds kPeerCheckInterval{1};

class C10dPending final : public Pending {
 public:
  C10dPending(c10::intrusive_ptr<::c10d::Work> work, bool on_stream)
      : work_(std::move(work)), on_stream_(on_stream) {}

  // NCCL (on_stream): c10d's wait without a timeout makes the caller's current CUDA stream wait
  // for the collective's and returns (the CPU does not block; DDP keeps computing); the group
  // completes it when its event fires, and bounds it by the timeout (Note [GPU completion]).
  // Gloo: bounded by the group's timeout (Gloo enforces it itself; the bound covers backends
  // that do not). With a hang reporter, in slices, looking at this host's peers in between: a
  // stopped or vanished peer fails the wait at once.
  void wait(const detail::WorkState& s) override {
    if (on_stream_) {
      work_->wait();
      return;
    }
    if (!s.reporter) {
      work_->wait(s.timeout);
      return;
    }
    const auto start = std::chrono::steady_clock::now();
    while (true) {
      const auto left = s.timeout - std::chrono::duration_cast<std::chrono::milliseconds>(
                                        std::chrono::steady_clock::now() - start);
      try {
        work_->wait(std::max(std::chrono::milliseconds(1),
                             std::min<std::chrono::milliseconds>(left, kPeerCheckInterval)));
        return;
      } catch (...) {
        // Either the collective failed, or only this slice of waiting ended.
        if (work_->isCompleted() || left <= kPeerCheckInterval) throw;
      }
      const std::string peer = s.reporter->check_local_peers();
      DDP_CHECK(peer.empty(), CollectiveError,
                "[rank {}] {} failed: {}; this rank stopped waiting for it after {:.1f} s (the "
                "timeout is {:.1f} s).",
                s.rank, s.call.describe(), peer,
                std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(),
                std::chrono::duration<double>(s.timeout).count());
    }
  }

  bool is_completed() const override { return work_->isCompleted(); }
  bool on_stream() const override { return on_stream_; }

 private:
  const c10::intrusive_ptr<::c10d::Work> work_;
  const bool on_stream_;
};

// Note [Gloo point to point]
// Gloo aborts the process (an enforce on its own thread) when a message is larger than the
// buffer its recv posted, so a send and a recv of different sizes, a user's mistake, would end
// the job without a word. Over Gloo each message therefore goes as a header (its element count
// and dtype) and then its data, each on a slot of its own: bit 30 header or data, the tag in
// bits 16-29 (tags below kTagLimit), and the message's number on its channel (mod 2^16) below,
// so that no message can be taken for another, whatever order the recvs are waited in. A recv
// takes the header, then the data: into its tensor when they match, else into scratch, and
// fails naming both sizes; both ranks go on. So a recv posts its data's recv only once the
// header came, in wait(). A Gloo send completes only once the peer posted the matching recv;
// were a send's Work to wait for its data too, two ranks that exchange (isend, irecv, then wait
// for the send first, as PyTorch allows) would each wait for a data recv that the other posts
// only in a wait it has not reached. A send's Work therefore waits for its header alone (the
// peer posted its irecv), and its data goes from a copy, in the background: the transport keeps
// those sends until they complete, and destroying it waits for them, bounded by the timeout
// (or not at all for a peer that is gone: Gloo fails them). NCCL matches messages between two
// ranks in call order and ignores tags, as in PyTorch; its messages go as they are.
int gloo_slot(bool header, int tag, uint64_t number) {
  return (header ? 1 << 30 : 0) | tag << 16 | static_cast<int>(number & 0xffff);
}

// A recv over Gloo (Note [Gloo point to point]).
class GlooRecv final : public Pending {
 public:
  GlooRecv(c10::intrusive_ptr<c10d_compat::Backend> backend, const CollectiveDesc& call,
           at::Tensor into)
      : backend_(std::move(backend)), call_(call), into_(std::move(into)),
        header_(at::empty({2}, at::kLong)),
        header_work_(
            c10d_ops::recv(*backend_, header_, call.root, gloo_slot(true, call.tag, call.seq))) {}

  void wait(const detail::WorkState& s) override {
    C10dPending(header_work_, false).wait(s);
    const int64_t count = header_[0].item<int64_t>();
    const int64_t dtype = header_[1].item<int64_t>();
    const bool fits =
        count == static_cast<int64_t>(call_.count) && dtype == static_cast<int64_t>(call_.dtype);
    const DType sent = static_cast<DType>(dtype);
    at::Tensor data =
        fits ? into_ : at::empty({count * static_cast<int64_t>(element_size(sent))}, at::kByte);
    data_work_ =
        c10d_ops::recv(*backend_, data, call_.root, gloo_slot(false, call_.tag, call_.seq));
    C10dPending(data_work_, false).wait(s);
    received_.store(true, std::memory_order_release);
    DDP_CHECK(fits, CollectiveError,
              "[rank {}] {} failed: rank {} sent {} x {}; a send and its recv must have the same "
              "dtype and number of elements",
              s.rank, call_.describe(), call_.root, count, name(sent));
  }
  // Only wait() takes the data (its recv is posted once the header has come), so a look from
  // another thread reads a flag, not data_work_.
  bool is_completed() const override { return received_.load(std::memory_order_acquire); }

 private:
  const c10::intrusive_ptr<c10d_compat::Backend> backend_;
  const CollectiveDesc call_;
  const at::Tensor into_;
  const at::Tensor header_;
  const c10::intrusive_ptr<::c10d::Work> header_work_;
  c10::intrusive_ptr<::c10d::Work> data_work_;  // set by wait(), on the thread that waits
  std::atomic<bool> received_{false};            // the data arrived (wait() set it)
};

class C10dTransport final : public Transport {
 public:
  C10dTransport(std::string name, c10::intrusive_ptr<c10d_compat::Backend> backend, int size,
                std::chrono::milliseconds timeout)
      : backend_(std::move(backend)), size_(size), timeout_(timeout) {
    caps_.name = std::move(name);
    caps_.rooted_collectives = true;
    caps_.point_to_point = true;
    if (caps_.name == "nccl") {
      caps_.reduced_dtypes = Capabilities::all_dtypes_but({DType::kOther});
      caps_.reducible_dtypes = Capabilities::all_dtypes_but({});  // NCCL says what it refuses
      caps_.native_avg = true;
      caps_.can_abort = true;
      caps_.cpu_tensors = false;
      caps_.cuda_tensors = true;
    } else if (c10d_compat::kGlooTakesBFloat16) {
      caps_.reduced_dtypes = Capabilities::all_dtypes_but({DType::kOther});
      caps_.reducible_dtypes = Capabilities::all_dtypes_but({});  // Gloo says what it refuses
      caps_.cuda_tensors = DDP_WITH_NCCL;  // a CUDA LibTorch's Gloo stages them itself
    } else {
      // Gloo in LibTorch 1.13 cannot sum bfloat16 (nor move it: see as_gloo_moves).
      caps_.reduced_dtypes = Capabilities::all_dtypes_but({DType::kBF16, DType::kOther});
      caps_.reducible_dtypes = Capabilities::all_dtypes_but({DType::kBF16});
      caps_.cuda_tensors = DDP_WITH_NCCL;
    }
  }

  // NCCL: its communicator aborted now, while CUDA is up, rather than by c10d's destructor,
  // which also warns that destroy_process_group() was not called (ours was).
  ~C10dTransport() override {
    drain_sends();
    abort();
  }

  const Capabilities& capabilities() const override { return caps_; }

  void abort() override {
    if (caps_.can_abort) c10d_compat::abort(*backend_);
  }

  Started all_reduce(const CollectiveDesc& call, at::Tensor& tensor) override {
    const bool avg_here = call.reduce == ReduceOp::kAvg && !caps_.native_avg;
    Started out;
    out.pending =
        pending(c10d_ops::all_reduce(*backend_, tensor, avg_here ? ReduceOp::kSum : call.reduce));
    if (avg_here) out.then = [tensor, n = size_]() mutable { tensor.div_(n); };
    return out;
  }

  Started broadcast(const CollectiveDesc& call, at::Tensor& tensor) override {
    return {pending(c10d_ops::broadcast(*backend_, as_gloo_moves(tensor), call.root)), {}};
  }

  Started all_gather(const CollectiveDesc&, std::vector<at::Tensor>& outputs,
                     const at::Tensor& input) override {
    std::vector<at::Tensor> out;
    for (const at::Tensor& o : outputs) out.push_back(as_gloo_moves(o));
    return {pending(c10d_ops::all_gather(*backend_, out, as_gloo_moves(input))), {}};
  }

  // Gloo has no reduce_scatter: an all-to-all sends inputs[j] to rank j (the bandwidth of a
  // ring reduce-scatter), then each rank reduces the n chunks it received.
  Started reduce_scatter(const CollectiveDesc& call, at::Tensor& output,
                         const std::vector<at::Tensor>& inputs) override {
    const int n = size_;
    at::Tensor send = at::stack(inputs).reshape({n, -1});
    at::Tensor recv = at::empty_like(send);
    Started out;
    out.pending = pending(c10d_ops::all_to_all(*backend_, recv, send));
    out.then = [output, recv, op = call.reduce, n]() mutable {
      at::Tensor reduced = c10d_ops::reduce_rows(recv, op);
      if (op == ReduceOp::kAvg) reduced.div_(n);
      output.copy_(reduced.view(output.sizes()));
    };
    return out;
  }

  Started barrier(const CollectiveDesc&) override {
    return {pending(c10d_ops::barrier(*backend_)), {}};
  }

  Started reduce(const CollectiveDesc& call, at::Tensor& tensor) override {
    const bool avg_here = call.reduce == ReduceOp::kAvg && !caps_.native_avg;
    Started out;
    out.pending = pending(
        c10d_ops::reduce(*backend_, tensor, call.root, avg_here ? ReduceOp::kSum : call.reduce));
    if (avg_here) out.then = [tensor, n = size_]() mutable { tensor.div_(n); };
    return out;
  }

  Started gather(const CollectiveDesc& call, std::vector<at::Tensor>& outputs,
                 const at::Tensor& input) override {
    std::vector<at::Tensor> out;
    for (const at::Tensor& o : outputs) out.push_back(as_gloo_moves(o));
    return {pending(c10d_ops::gather(*backend_, out, as_gloo_moves(input), call.root)), {}};
  }

  Started scatter(const CollectiveDesc& call, at::Tensor& output,
                  const std::vector<at::Tensor>& inputs) override {
    std::vector<at::Tensor> in;
    for (const at::Tensor& t : inputs) in.push_back(as_gloo_moves(t));
    return {pending(c10d_ops::scatter(*backend_, as_gloo_moves(output), in, call.root)), {}};
  }

  Started all_to_all(const CollectiveDesc&, at::Tensor& output, const at::Tensor& input,
                     const std::vector<int64_t>& output_splits,
                     const std::vector<int64_t>& input_splits) override {
    at::Tensor recv = as_gloo_moves(output);
    at::Tensor send = as_gloo_moves(input);
    // Moved as bytes (bfloat16 on LibTorch 1.13's Gloo): splits in bytes.
    const int64_t scale = send.element_size() == input.element_size() ? 1 : input.element_size();
    auto scaled = [scale](std::vector<int64_t> splits) {
      for (int64_t& s : splits) s *= scale;
      return splits;
    };
    return {pending(c10d_ops::all_to_all(*backend_, recv, send, scaled(output_splits),
                                         scaled(input_splits))),
            {}};
  }

  Started send(const CollectiveDesc& call, const at::Tensor& tensor) override {
    if (caps_.name == "nccl") {
      return {pending(c10d_ops::send(*backend_, tensor, call.root, call.tag)), {}};
    }
    at::Tensor header = at::empty({2}, at::kLong);
    header[0] = static_cast<int64_t>(call.count);
    header[1] = static_cast<int64_t>(call.dtype);
    auto h =
        pending(c10d_ops::send(*backend_, header, call.root, gloo_slot(true, call.tag, call.seq)));
    // The data from a copy, kept here until sent (Note [Gloo point to point]).
    auto data = c10d_ops::send(*backend_, as_gloo_moves(tensor.clone(at::MemoryFormat::Contiguous)),
                               call.root, gloo_slot(false, call.tag, call.seq));
    MutexLock lock(&sends_mu_);
    std::erase_if(sends_, [](const auto& w) { return w->isCompleted(); });
    sends_.push_back(std::move(data));
    return {h, {}};
  }

  Started recv(const CollectiveDesc& call, at::Tensor& tensor) override {
    if (caps_.name == "nccl") {
      return {pending(c10d_ops::recv(*backend_, tensor, call.root, call.tag)), {}};
    }
    return {std::make_shared<GlooRecv>(backend_, call, as_gloo_moves(tensor)), {}};
  }

  std::optional<std::vector<CollectiveDesc>> gather_calls(
      const CollectiveDesc& mine, std::chrono::milliseconds timeout) override {
    if (!caps_.cpu_tensors) return std::nullopt;  // NCCL would need CUDA tensors
    return c10d_ops::gather_calls(*backend_, mine, size_, timeout);
  }

 private:
  // What only moves bytes needs no dtype Gloo knows: on LibTorch 1.13 a (contiguous) bfloat16
  // tensor goes as its bytes (Gloo there knows no 16-bit integer either).
  at::Tensor as_gloo_moves(const at::Tensor& t) const {
    if (c10d_compat::kGlooTakesBFloat16 || caps_.name == "nccl" ||
        t.scalar_type() != at::kBFloat16 || !t.is_contiguous()) {
      return t;
    }
    return transport::bytes_of(t);
  }

  std::shared_ptr<Pending> pending(c10::intrusive_ptr<::c10d::Work> work) const {
    return c10d_pending(std::move(work), caps_.cuda_tensors && !caps_.cpu_tensors);
  }

  // Waits for the data of the sends not yet received, all of them within one timeout from now;
  // a failed one (its peer gone) is let go.
  void drain_sends() {
    MutexLock lock(&sends_mu_);
    const auto deadline = std::chrono::steady_clock::now() + timeout_;
    for (auto& w : sends_) {
      try {
        const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
            deadline - std::chrono::steady_clock::now());
        if (left.count() <= 0) break;
        if (!w->isCompleted()) w->wait(left);
      } catch (const std::exception&) {
        // Not received: its recv fails (or timed out) on the peer, which says so.
      }
    }
    sends_.clear();
  }

  const c10::intrusive_ptr<c10d_compat::Backend> backend_;
  const int size_;
  const std::chrono::milliseconds timeout_;
  Capabilities caps_;
  Mutex sends_mu_;
  // Gloo sends whose data may not have gone yet (Note [Gloo point to point]).
  std::vector<c10::intrusive_ptr<::c10d::Work>> sends_ GUARDED_BY(sends_mu_);
};

}  // namespace

std::shared_ptr<Pending> c10d_pending(c10::intrusive_ptr<::c10d::Work> work, bool on_stream) {
  return std::make_shared<C10dPending>(std::move(work), on_stream);
}

std::unique_ptr<Transport> make_c10d_transport(std::string name,
                                               c10::intrusive_ptr<c10d_compat::Backend> backend,
                                               int size, std::chrono::milliseconds timeout) {
  return std::make_unique<C10dTransport>(std::move(name), std::move(backend), size, timeout);
}

}  // namespace ddp
