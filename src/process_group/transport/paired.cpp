// A backend per device type ("cpu:gloo,cuda:nccl"): two transports, each collective routed by
// the device of its tensors.
//
// Note [Backend pairs]
// PyTorch 2.x takes a backend per device type in one group ("cpu:gloo,cuda:nccl") and sends each
// collective to the backend of its tensors' device. A group of ours with a pair holds two
// transports formed over the same ranks (the CPU one as InitOptions::backend would form it
// alone: shm, shm+gloo or Gloo by locality; the CUDA one NCCL, or a second Gloo group under keys
// of its own). Both share the group's numbering, flight records, checks and errors (ProcessGroup
// stays one group: every rank issues the same collectives in the same order, so the routing is
// the same on every rank). A collective's tensors must all be on one device type: each side
// moves only its own, with no staging (that is what a single backend does for the other
// device's tensors, Note [Staging tensors]). What does not name a device goes to the CPU side:
// barrier (as Gloo's in PyTorch's pair), DDP_DEBUG=detail's call comparison (NCCL cannot),
// backend tuned's route; comm buffers go by the device asked for. Capabilities are per side
// (capabilities_for); capabilities() is what both do (a dtype both reduce natively, an average
// both take inside), for the callers that ask once for any tensor (the comm hooks).
#include <fmt/format.h>

#include "base/check.h"
#include "process_group/transport/transports.h"

namespace ddp {
namespace {

class PairedTransport final : public Transport {
 public:
  PairedTransport(std::unique_ptr<Transport> cpu, std::unique_ptr<Transport> cuda)
      : cpu_(std::move(cpu)), cuda_(std::move(cuda)) {
    const Capabilities& a = cpu_->capabilities();
    const Capabilities& b = cuda_->capabilities();
    caps_.name = fmt::format("cpu:{},cuda:{}", a.name, b.name);
    caps_.reduced_dtypes = a.reduced_dtypes & b.reduced_dtypes;
    caps_.reducible_dtypes = a.reducible_dtypes & b.reducible_dtypes;
    caps_.native_avg = a.native_avg && b.native_avg;
    caps_.in_place_comm_buffers = a.in_place_comm_buffers;
    caps_.can_abort = a.can_abort || b.can_abort;
    caps_.checks_calls = a.checks_calls && b.checks_calls;
    caps_.announces_departure = a.announces_departure && b.announces_departure;
    caps_.rooted_collectives = a.rooted_collectives && b.rooted_collectives;
    caps_.point_to_point = a.point_to_point && b.point_to_point;
    caps_.cpu_tensors = true;
    caps_.cuda_tensors = true;
    caps_.routed_by_device = true;
    // Each side takes its own device's tensors as they are (no staging into the other).
    cpu_caps_ = a;
    cpu_caps_.cuda_tensors = false;
    cpu_caps_.cpu_tensors = true;
    cuda_caps_ = b;
    cuda_caps_.cpu_tensors = false;
    cuda_caps_.cuda_tensors = true;
  }

  const Capabilities& capabilities() const override { return caps_; }
  const Capabilities& capabilities_for(c10::DeviceType device) const override {
    return device == c10::DeviceType::CUDA ? cuda_caps_ : cpu_caps_;
  }

  Started all_reduce(const CollectiveDesc& call, at::Tensor& tensor) override {
    return side(tensor).all_reduce(call, tensor);
  }
  Started broadcast(const CollectiveDesc& call, at::Tensor& tensor) override {
    return side(tensor).broadcast(call, tensor);
  }
  Started all_gather(const CollectiveDesc& call, std::vector<at::Tensor>& outputs,
                     const at::Tensor& input) override {
    return side(input).all_gather(call, outputs, input);
  }
  Started reduce_scatter(const CollectiveDesc& call, at::Tensor& output,
                         const std::vector<at::Tensor>& inputs) override {
    return side(output).reduce_scatter(call, output, inputs);
  }
  Started barrier(const CollectiveDesc& call) override { return cpu_->barrier(call); }
  Started reduce(const CollectiveDesc& call, at::Tensor& tensor) override {
    return side(tensor).reduce(call, tensor);
  }
  Started gather(const CollectiveDesc& call, std::vector<at::Tensor>& outputs,
                 const at::Tensor& input) override {
    return side(input).gather(call, outputs, input);
  }
  Started scatter(const CollectiveDesc& call, at::Tensor& output,
                  const std::vector<at::Tensor>& inputs) override {
    return side(output).scatter(call, output, inputs);
  }
  Started all_to_all(const CollectiveDesc& call, at::Tensor& output, const at::Tensor& input,
                     const std::vector<int64_t>& output_splits,
                     const std::vector<int64_t>& input_splits) override {
    return side(input).all_to_all(call, output, input, output_splits, input_splits);
  }
  Started send(const CollectiveDesc& call, const at::Tensor& tensor) override {
    return side(tensor).send(call, tensor);
  }
  Started recv(const CollectiveDesc& call, at::Tensor& tensor) override {
    return side(tensor).recv(call, tensor);
  }

  std::string peer_gone(int peer) const override {
    std::string why = cpu_->peer_gone(peer);
    return why.empty() ? cuda_->peer_gone(peer) : why;
  }
  std::optional<std::vector<CollectiveDesc>> gather_calls(
      const CollectiveDesc& mine, std::chrono::milliseconds timeout) override {
    return cpu_->gather_calls(mine, timeout);
  }
  void abort() override {
    cpu_->abort();
    cuda_->abort();
  }
  at::Tensor comm_buffer(uint64_t id, int64_t numel, const at::TensorOptions& options) override {
    return (options.device().is_cuda() ? cuda_ : cpu_)->comm_buffer(id, numel, options);
  }
  bool is_comm_buffer(const at::Tensor& t) const override {
    return (t.device().is_cuda() ? cuda_ : cpu_)->is_comm_buffer(t);
  }
  RouteTuning* route_tuning() override { return cpu_->route_tuning(); }

 private:
  Transport& side(const at::Tensor& t) { return t.device().is_cuda() ? *cuda_ : *cpu_; }

  std::unique_ptr<Transport> cpu_;
  std::unique_ptr<Transport> cuda_;
  Capabilities caps_;       // what both do
  Capabilities cpu_caps_;   // the CPU side's, CPU tensors only
  Capabilities cuda_caps_;  // the CUDA side's, CUDA tensors only
};

}  // namespace

std::unique_ptr<Transport> make_paired_transport(std::unique_ptr<Transport> cpu,
                                                 std::unique_ptr<Transport> cuda) {
  return std::make_unique<PairedTransport>(std::move(cpu), std::move(cuda));
}

}  // namespace ddp
