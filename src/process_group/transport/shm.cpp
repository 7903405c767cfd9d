// The shared-memory transport: every rank of the group on this host (Note [Shared-memory
// collectives] in shm/group.h).
#include "process_group/transport/shm_pending.h"
#include "process_group/transport/tensors.h"
#include "process_group/transport/transports.h"

#include "base/check.h"
#include "ddp/error.h"

namespace ddp {
namespace {

using transport::cpu_contiguous;
using transport::dtype_of;

class ShmTransport final : public Transport {
 public:
  ShmTransport(std::shared_ptr<shm::Group> group, ShmCommBuffers buffers)
      : group_(std::move(group)), buffers_(std::move(buffers)) {
    caps_.name = "shm";
    caps_.reduced_dtypes = Capabilities::all_dtypes_but({DType::kOther});
    caps_.reducible_dtypes = caps_.reduced_dtypes;
    caps_.native_avg = true;  // the kernel divides as it writes the sum
    caps_.in_place_comm_buffers = true;
    caps_.can_abort = true;  // the abort word: peers fail now, later collectives fail too
    caps_.checks_calls = true;
    caps_.announces_departure = true;  // the control block's `left` word
  }

  const Capabilities& capabilities() const override { return caps_; }
  at::Tensor comm_buffer(uint64_t id, int64_t numel, const at::TensorOptions& options) override {
    return buffers_.make(id, numel, options);
  }
  bool is_comm_buffer(const at::Tensor& t) const override { return buffers_.holds(t); }

  Started all_reduce(const CollectiveDesc& call, at::Tensor& tensor) override {
    at::Tensor buf = cpu_contiguous(tensor, call, group_->me(), caps_.name);
    shm::Placement placement = group_->find(buf.data_ptr(), buf.numel() * buf.element_size());
    Started out;
    out.pending =
        pending(group_->all_reduce(call.seq, buf.data_ptr(), call.count, call.dtype, call.reduce,
                                   std::make_shared<at::Tensor>(buf), std::move(placement)));
    out.then = copy_back(tensor, buf);
    return out;
  }

  Started broadcast(const CollectiveDesc& call, at::Tensor& tensor) override {
    at::Tensor buf = cpu_contiguous(tensor, call, group_->me(), caps_.name);
    Started out;
    out.pending = pending(group_->broadcast(call.seq, buf.data_ptr(), call.count, call.dtype,
                                            call.root, std::make_shared<at::Tensor>(buf)));
    out.then = copy_back(tensor, buf);
    return out;
  }

  Started all_gather(const CollectiveDesc& call, std::vector<at::Tensor>& outputs,
                     const at::Tensor& input) override {
    auto keep = std::make_shared<std::vector<at::Tensor>>();
    keep->push_back(cpu_contiguous(input, call, group_->me(), caps_.name));
    std::vector<void*> out_ptrs;
    for (const at::Tensor& o : outputs) {
      keep->push_back(cpu_contiguous(o, call, group_->me(), caps_.name));
      out_ptrs.push_back(keep->back().data_ptr());
    }
    Started out;
    out.pending = pending(group_->all_gather(call.seq, std::move(out_ptrs), (*keep)[0].data_ptr(),
                                             call.count, call.dtype, keep));
    out.then = [outputs, keep]() mutable {
      for (size_t r = 0; r < outputs.size(); ++r) {
        if (!(*keep)[r + 1].is_same(outputs[r])) outputs[r].copy_((*keep)[r + 1]);
      }
    };
    return out;
  }

  Started reduce_scatter(const CollectiveDesc& call, at::Tensor& output,
                         const std::vector<at::Tensor>& inputs) override {
    auto keep = std::make_shared<std::vector<at::Tensor>>();
    keep->push_back(cpu_contiguous(output, call, group_->me(), caps_.name));
    std::vector<const void*> in_ptrs;
    for (const at::Tensor& t : inputs) {
      keep->push_back(cpu_contiguous(t, call, group_->me(), caps_.name));
      in_ptrs.push_back(keep->back().data_ptr());
    }
    Started out;
    out.pending =
        pending(group_->reduce_scatter(call.seq, (*keep)[0].data_ptr(), std::move(in_ptrs),
                                       call.count, call.dtype, call.reduce, keep));
    out.then = copy_back(output, (*keep)[0]);
    return out;
  }

  Started barrier(const CollectiveDesc& call) override {
    return {pending(group_->barrier(call.seq)), {}};
  }

  std::string peer_gone(int peer) const override { return group_->peer_gone(peer); }

 private:
  std::shared_ptr<Pending> pending(std::shared_ptr<shm::Op> op) {
    return std::make_shared<ShmPending>(group_, std::move(op));
  }

  static std::function<void()> copy_back(const at::Tensor& user, const at::Tensor& buf) {
    if (buf.is_same(user)) return {};
    return [user, buf]() mutable { user.copy_(buf); };
  }

  const std::shared_ptr<shm::Group> group_;
  const ShmCommBuffers buffers_;
  Capabilities caps_;
};

}  // namespace

void ShmPending::wait(const detail::WorkState&) {
  group_->wait(*op_);  // bounded inside, with errors that say who is behind
}

bool ShmPending::is_completed() const { return op_->done.load(); }

std::unique_ptr<Transport> make_shm_transport(std::shared_ptr<shm::Group> group,
                                              ShmCommBuffers buffers) {
  return std::make_unique<ShmTransport>(std::move(group), std::move(buffers));
}

}  // namespace ddp
