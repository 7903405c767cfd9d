// Note [Hierarchical collectives]
// Ranks on H hosts, L on each (L > 1): each host's ranks share a shm group; the ranks with the
// same local index l form a Gloo group across hosts (rail l, ranked by host). Every collective
// runs as one op of the host's shm group (so it keeps that group's order, numbering, desync and
// dead-peer checks, and a failure between hosts fails the host's group like any other), whose
// body mixes shm steps with one step over the rank's rail. Each rank carries 1/L of the traffic
// between hosts, and all L rails run at once:
//   all_reduce (n elements): reduce inside the host (in place when the tensor is a comm buffer);
//     local rank l all-reduces slice l (n/L) over its rail; each local rank shares its slice in
//     the host. Sums cross the rails (kAvg divides once at the end). Gloo in LibTorch 1.13
//     cannot reduce bfloat16, so a bfloat16 slice crosses as bytes (half a float32 ring's):
//     an all-to-all gives each host 1/H of every host's slice, it sums those H rows in float32
//     in host order and rounds once, and an all-gather shares the sums (bf16_rail_all_reduce).
//   broadcast (root on host R, local index r): the root shares the tensor inside host R; rail l
//     broadcasts slice l from host R; each other host's local ranks share their slices.
//   all_gather: rail l gathers its ranks' inputs (H of them); the host's ranks then share those
//     blocks (H x L inputs: every rank's).
//   reduce_scatter (output of n elements per rank): inside the host, local rank l receives the
//     host's reduction of every input meant for a rank of local index l (H x n elements); rail l
//     exchanges those rows (an all-to-all) and each rank reduces the H rows meant for it.
//   barrier: the host's ranks meet, then the rail's.
// Data between hosts per rank: all_reduce 2n/L (ring), broadcast n/L, all_gather (H-1) n,
// reduce_scatter (H-1) n: what flat Gloo moves per rank, or 1/L of it. Types the shm kernels do
// not know (complex...) are moved as bytes and not reduced (Gloo cannot reduce them either).
// DDP_DEBUG=detail's call comparison goes over flat Gloo on the whole group (the rails would see
// only one rank per host), and so do send and recv (between any two ranks), and float32/float64
// all_reduces from the size set by set_flat_route_from (Note [Choosing the all_reduce route]: backend tuned measures it; they then
// run on Gloo's thread, beside the host group's queue, in issue order on each).
#include <fmt/format.h>
#include <fmt/ranges.h>  // fmt::join

#include "base/check.h"
#include "process_group/transport/c10d_ops.h"
#include "process_group/transport/shm_pending.h"
#include "process_group/transport/tensors.h"
#include "process_group/transport/transports.h"

namespace ddp {
namespace {

using transport::bytes_of;
using transport::cpu_contiguous;

// c10d's messages may carry a C++ backtrace after their first line.
std::string first_line(const std::string& text) { return text.substr(0, text.find('\n')); }

// [lo, hi) of part p of `total` items split over `parts`.
std::pair<int64_t, int64_t> part(int64_t total, int parts, int p) {
  const int64_t per = (total + parts - 1) / parts;
  const int64_t lo = std::min(total, per * p);
  return {lo, std::min(total, lo + per)};
}

// What an op's body needs, shared with the transport: a body may still run (it is queued on the
// host group's executor) after the transport is gone.
struct Rails {
  std::shared_ptr<shm::Group> local;
  c10::intrusive_ptr<c10d_compat::Backend> rail;
  HierarchyLayout l;
  std::vector<int> rail_peers;  // the other ranks of this rail, one per other host

  // The step over this rank's rail, inside the shm op's body; its failure names the peers.
  template <typename Start>
  void step(const CollectiveDesc& call, const char* what, Start&& start) {
    std::string failure;
    try {
      start()->wait(local->timeout());
    } catch (const c10::Error& e) {
      failure = e.what_without_backtrace();
    } catch (const std::exception& e) {
      failure = e.what();
    }
    DDP_CHECK(failure.empty(), CollectiveError,
              "[rank {}] {} failed between hosts: this rank {} with rank{} {} (the same local "
              "rank on the other host{}), and that failed: {}. A rank on another host has "
              "exited, or the network between the hosts is down: look for that rank's own error.",
              l.rank, call.describe(), what, rail_peers.size() > 1 ? "s" : "",
              fmt::join(rail_peers, ", "), rail_peers.size() > 1 ? "s" : "", first_line(failure));
    local->restart_deadline();
  }
};

// A bfloat16 all-reduce over the rail without Gloo reducing bfloat16 (LibTorch 1.13 cannot),
// in bfloat16 bytes: the slice padded to H chunks; an all-to-all gives this host chunk `host` of
// every host's slice; it sums them in float32 in host order and rounds once; an all-gather
// shares every host's sums. Every rank ends with the same bytes.
void bf16_rail_all_reduce(Rails& r, const CollectiveDesc& call, at::Tensor& slice,
                          ReduceOp op) {
  const int hosts = r.l.hosts();
  const int64_t n = slice.numel();
  const int64_t chunk = (n + hosts - 1) / hosts;
  at::Tensor send = at::zeros({hosts, chunk}, slice.options());
  send.view(-1).narrow(0, 0, n).copy_(slice);
  at::Tensor received = at::empty({hosts, chunk}, slice.options());
  at::Tensor out_bytes = bytes_of(received).view({hosts, -1});
  at::Tensor in_bytes = bytes_of(send).view({hosts, -1});
  r.step(call, "exchanges its slice's chunks",
         [&] { return c10d_ops::all_to_all(*r.rail, out_bytes, in_bytes); });
  at::Tensor mine = c10d_ops::reduce_rows(received.to(at::kFloat), op).to(at::kBFloat16);
  at::Tensor gathered = at::empty({hosts, chunk}, slice.options());
  std::vector<at::Tensor> rows;
  for (int h = 0; h < hosts; ++h) rows.push_back(bytes_of(gathered[h]));
  r.step(call, "gathers its slice's sums",
         [&] { return c10d_ops::all_gather(*r.rail, rows, bytes_of(mine)); });
  slice.copy_(gathered.view(-1).narrow(0, 0, n));
}

class HierarchyTransport final : public Transport, public RouteTuning {
 public:
  HierarchyTransport(std::shared_ptr<shm::Group> local, ShmCommBuffers buffers,
                     c10::intrusive_ptr<c10d_compat::Backend> rail,
                     c10::intrusive_ptr<c10d_compat::Backend> flat, HierarchyLayout layout)
      : rails_(std::make_shared<Rails>(Rails{std::move(local), std::move(rail), layout, {}})),
        buffers_(std::move(buffers)),
        flat_(
            make_c10d_transport("gloo", std::move(flat), layout.size(), rails_->local->timeout())) {
    caps_.name = "shm+gloo";
    caps_.reduced_dtypes = Capabilities::all_dtypes_but({DType::kOther});
    caps_.reducible_dtypes = caps_.reduced_dtypes;  // Gloo reduces no type the kernels do not
    caps_.native_avg = true;                        // one division at the end of the op
    caps_.in_place_comm_buffers = true;
    caps_.point_to_point = true;  // over flat Gloo
    for (int h = 0; h < l_.hosts(); ++h) {
      if (h != l_.host) rails_->rail_peers.push_back(l_.rank_at[h][l_.local]);
    }
  }

  const Capabilities& capabilities() const override { return caps_; }
  at::Tensor comm_buffer(uint64_t id, int64_t numel, const at::TensorOptions& options) override {
    return buffers_.make(id, numel, options);
  }
  bool is_comm_buffer(const at::Tensor& t) const override { return buffers_.holds(t); }

  RouteTuning* route_tuning() override { return this; }
  void set_flat_route_from(uint64_t bytes) override { flat_from_ = bytes; }
  void force_route(std::optional<bool> flat) override { forced_ = flat; }
  uint64_t flat_route_from() const override { return flat_from_; }

  Started all_reduce(const CollectiveDesc& call, at::Tensor& tensor) override {
    if (takes_flat_route(call, tensor)) return flat_->all_reduce(call, tensor);
    at::Tensor buf = cpu_contiguous(tensor, call, l_.rank, caps_.name);
    shm::Placement placement = local_->find(buf.data_ptr(), buf.numel() * buf.element_size());
    const ReduceOp across = call.reduce == ReduceOp::kAvg ? ReduceOp::kSum : call.reduce;
    const bool widen = tensor.scalar_type() == at::kBFloat16;
    auto body = [r = rails_, call, buf, across, widen, placement]() mutable {
      const int64_t count = buf.numel();
      const size_t es = buf.element_size();
      char* data = static_cast<char*>(buf.data_ptr());
      r->local->all_reduce_here(data, count, call.dtype, across, placement);
      const auto [lo, hi] = part(count, r->l.per_host(), r->l.local);
      if (hi > lo) {
        at::Tensor mine = buf.view(-1).narrow(0, lo, hi - lo);
        if (widen) {
          bf16_rail_all_reduce(*r, call, mine, across);
        } else {
          r->step(call, "exchanges its slice",
                  [&] { return c10d_ops::all_reduce(*r->rail, mine, across); });
        }
      }
      for (int p = 0; p < r->l.per_host(); ++p) {
        const auto [plo, phi] = part(count, r->l.per_host(), p);
        if (phi > plo) r->local->broadcast_here(data + plo * es, (phi - plo) * es, p);
      }
      if (call.reduce == ReduceOp::kAvg) buf.div_(r->l.size());
    };
    Started out{run(call, std::move(body), std::move(placement)), {}};
    if (!buf.is_same(tensor)) out.then = [tensor, buf]() mutable { tensor.copy_(buf); };
    return out;
  }

  Started broadcast(const CollectiveDesc& call, at::Tensor& tensor) override {
    at::Tensor buf = cpu_contiguous(tensor, call, l_.rank, caps_.name);
    const int root_host = host_of(call.root);
    const int root_local = local_of(call.root);
    auto body = [r = rails_, call, buf, root_host, root_local]() mutable {
      at::Tensor bytes = bytes_of(buf);
      const int64_t total = bytes.numel();
      char* data = static_cast<char*>(buf.data_ptr());
      if (r->l.host == root_host) r->local->broadcast_here(data, total, root_local);
      const auto [lo, hi] = part(total, r->l.per_host(), r->l.local);
      if (hi > lo) {
        at::Tensor slice = bytes.narrow(0, lo, hi - lo);
        r->step(call, "receives its slice",
                [&] { return c10d_ops::broadcast(*r->rail, slice, root_host); });
      }
      if (r->l.host == root_host) return;
      for (int p = 0; p < r->l.per_host(); ++p) {
        const auto [plo, phi] = part(total, r->l.per_host(), p);
        if (phi > plo) r->local->broadcast_here(data + plo, phi - plo, p);
      }
    };
    Started out{run(call, std::move(body)), {}};
    if (!buf.is_same(tensor)) out.then = [tensor, buf]() mutable { tensor.copy_(buf); };
    return out;
  }

  Started all_gather(const CollectiveDesc& call, std::vector<at::Tensor>& outputs,
                     const at::Tensor& input) override {
    at::Tensor in = cpu_contiguous(input, call, l_.rank, caps_.name);
    const int64_t b = in.numel() * in.element_size();
    const int hosts = l_.hosts(), per_host = l_.per_host();
    // gathered[p][h]: the input of rank (host h, local index p).
    at::Tensor gathered = at::empty({per_host, hosts, b}, at::kByte);
    auto body = [r = rails_, call, in, b, gathered]() mutable {
      at::Tensor mine = gathered[r->l.local];  // [hosts, b]: this rail's inputs
      std::vector<at::Tensor> rows;
      for (int h = 0; h < r->l.hosts(); ++h) rows.push_back(mine[h]);
      r->step(call, "gathers its rail's inputs",
              [&] { return c10d_ops::all_gather(*r->rail, rows, bytes_of(in)); });
      std::vector<void*> blocks;
      for (int p = 0; p < r->l.per_host(); ++p) blocks.push_back(gathered[p].data_ptr());
      r->local->all_gather_here(blocks, mine.data_ptr(), static_cast<size_t>(r->l.hosts() * b));
    };
    Started out{run(call, std::move(body)), {}};
    out.then = [this, outputs, gathered]() mutable {
      for (int h = 0; h < l_.hosts(); ++h) {
        for (int p = 0; p < l_.per_host(); ++p) {
          at::Tensor& o = outputs[l_.rank_at[h][p]];
          at::Tensor src = gathered[p][h];
          if (o.is_contiguous()) {
            bytes_of(o).copy_(src);
          } else {
            at::Tensor tmp = o.contiguous();
            bytes_of(tmp).copy_(src);
            o.copy_(tmp);
          }
        }
      }
    };
    return out;
  }

  Started reduce_scatter(const CollectiveDesc& call, at::Tensor& output,
                         const std::vector<at::Tensor>& inputs) override {
    const int hosts = l_.hosts(), per_host = l_.per_host();
    const int64_t n = output.numel();
    const auto options = output.options().device(at::kCPU);
    // send[p][h]: the input meant for rank (host h, local index p).
    at::Tensor send = at::empty({per_host, hosts, n}, options);
    for (int h = 0; h < hosts; ++h) {
      for (int p = 0; p < per_host; ++p) {
        const at::Tensor& t = inputs[l_.rank_at[h][p]];
        DDP_CHECK(t.device().is_cpu(), Error,
                  "[rank {}] {}: the {} backend moves CPU tensors, this one is on {}", l_.rank,
                  call.describe(), caps_.name, t.device().str());
        send[p][h].copy_(t.reshape({-1}));
      }
    }
    const ReduceOp across = call.reduce == ReduceOp::kAvg ? ReduceOp::kSum : call.reduce;
    at::Tensor host_part = at::empty({hosts, n}, options);  // this host's rows for rail l
    at::Tensor received = at::empty({hosts, n}, options);   // every host's row for this rank
    auto body = [r = rails_, call, send, host_part, received, across, n]() mutable {
      std::vector<const void*> blocks;
      for (int p = 0; p < r->l.per_host(); ++p) blocks.push_back(send[p].data_ptr());
      r->local->reduce_scatter_here(host_part.data_ptr(), blocks,
                                    static_cast<size_t>(r->l.hosts() * n), call.dtype, across);
      at::Tensor out_bytes = bytes_of(received).view({r->l.hosts(), -1});
      at::Tensor in_bytes = bytes_of(host_part).view({r->l.hosts(), -1});
      r->step(call, "exchanges its rows",
              [&] { return c10d_ops::all_to_all(*r->rail, out_bytes, in_bytes); });
    };
    Started out{run(call, std::move(body)), {}};
    out.then = [output, received, across, avg = call.reduce == ReduceOp::kAvg,
                size = l_.size()]() mutable {
      at::Tensor reduced = c10d_ops::reduce_rows(received, across);
      if (avg) reduced.div_(size);
      output.copy_(reduced.view(output.sizes()));
    };
    return out;
  }

  Started barrier(const CollectiveDesc& call) override {
    auto body = [r = rails_, call] {
      r->local->barrier_here();
      r->step(call, "meets its rail", [&] { return c10d_ops::barrier(*r->rail); });
    };
    return {run(call, std::move(body)), {}};
  }

  std::optional<std::vector<CollectiveDesc>> gather_calls(
      const CollectiveDesc& mine, std::chrono::milliseconds timeout) override {
    return flat_->gather_calls(mine, timeout);
  }

  // Between two ranks, over flat Gloo (Gloo's pairs connect every two ranks of the group).
  Started send(const CollectiveDesc& call, const at::Tensor& tensor) override {
    return flat_->send(call, tensor);
  }
  Started recv(const CollectiveDesc& call, at::Tensor& tensor) override {
    return flat_->recv(call, tensor);
  }

 private:
  std::shared_ptr<Pending> run(const CollectiveDesc& call, std::function<void()> body,
                               shm::Placement placement = {}) {
    return std::make_shared<ShmPending>(local_, local_->run(call.seq, call, std::move(body),
                                                            std::move(placement)));
  }

  // Note [Choosing the all_reduce route]: flat Gloo takes float32 and float64 tensors (what the
  // route was measured with; gradients), on the CPU and contiguous (reduced in place), from the
  // chosen size on.
  bool takes_flat_route(const CollectiveDesc& call, const at::Tensor& t) const {
    const bool wanted = forced_.has_value()
                            ? *forced_
                            : static_cast<uint64_t>(t.numel()) * t.element_size() >= flat_from_;
    return wanted && (call.dtype == DType::kF32 || call.dtype == DType::kF64) &&
           t.device().is_cpu() && t.is_contiguous();
  }

  int host_of(int rank) const {
    for (int h = 0; h < l_.hosts(); ++h) {
      for (int p = 0; p < l_.per_host(); ++p) {
        if (l_.rank_at[h][p] == rank) return h;
      }
    }
    DDP_ASSERT(false, "rank {} is on no host", rank);
  }
  int local_of(int rank) const {
    for (const std::vector<int>& host : l_.rank_at) {
      for (int p = 0; p < static_cast<int>(host.size()); ++p) {
        if (host[p] == rank) return p;
      }
    }
    DDP_ASSERT(false, "rank {} is on no host", rank);
  }

  const std::shared_ptr<Rails> rails_;
  const std::shared_ptr<shm::Group>& local_ = rails_->local;
  const HierarchyLayout& l_ = rails_->l;
  const ShmCommBuffers buffers_;
  const std::unique_ptr<Transport> flat_;
  Capabilities caps_;
  // Set between collectives by the group's issuing thread, read when one is issued.
  uint64_t flat_from_ = kNever;
  std::optional<bool> forced_;
};

}  // namespace

std::unique_ptr<Transport> make_hierarchy_transport(std::shared_ptr<shm::Group> local,
                                                    ShmCommBuffers buffers,
                                                    c10::intrusive_ptr<c10d_compat::Backend> rail,
                                                    c10::intrusive_ptr<c10d_compat::Backend> flat,
                                                    HierarchyLayout layout) {
  return std::make_unique<HierarchyTransport>(std::move(local), std::move(buffers), std::move(rail),
                                              std::move(flat), std::move(layout));
}

}  // namespace ddp
