// Small collectives of integers and byte strings (bytes_collectives.h).
#include "process_group/bytes_collectives.h"

#include <algorithm>
#include <cstring>

#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/tensor.h>
#include <ATen/ops/zeros.h>

#include "ddp/process_group.h"
#include "process_group/transport/transport.h"  // capabilities_of

namespace ddp {
namespace {

at::TensorOptions comm_options(ProcessGroup& g, at::ScalarType type) {
  auto o = at::TensorOptions().dtype(type);
  if (capabilities_of(g).cpu_tensors) return o;
  const int device = g.bound_device_id().value_or(g.local_rank());
  return o.device(c10::Device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(device)));
}

}  // namespace

int64_t broadcast_i64(ProcessGroup& g, int64_t value, int root) {
  at::Tensor t = at::tensor({value}, comm_options(g, at::kLong));
  g.broadcast(t, root).wait();
  return t.cpu().item<int64_t>();
}

std::string broadcast_bytes(ProcessGroup& g, const std::string& bytes, int64_t size, int root) {
  if (size == 0) return "";
  at::Tensor t = at::empty({size}, comm_options(g, at::kByte));
  if (g.rank() == root) {
    t.copy_(at::from_blob(const_cast<char*>(bytes.data()), {size}, at::kByte));
  }
  g.broadcast(t, root).wait();
  const at::Tensor c = t.cpu();
  return std::string(static_cast<const char*>(c.data_ptr()), static_cast<size_t>(size));
}

std::vector<int64_t> all_gather_i64(ProcessGroup& g, int64_t value) {
  at::Tensor in = at::tensor({value}, comm_options(g, at::kLong));
  std::vector<at::Tensor> out(g.size());
  for (auto& t : out) t = at::empty({1}, comm_options(g, at::kLong));
  g.all_gather(out, in).wait();
  std::vector<int64_t> values;
  for (auto& t : out) values.push_back(t.cpu().item<int64_t>());
  return values;
}

std::vector<std::string> all_gather_bytes(ProcessGroup& g, const std::string& mine) {
  const auto sizes = all_gather_i64(g, static_cast<int64_t>(mine.size()));
  const int64_t max = *std::max_element(sizes.begin(), sizes.end());
  at::Tensor in = at::zeros({max}, at::kByte);
  if (!mine.empty()) std::memcpy(in.data_ptr(), mine.data(), mine.size());
  in = in.to(comm_options(g, at::kByte).device());
  std::vector<at::Tensor> out(g.size());
  for (auto& t : out) t = at::empty({max}, comm_options(g, at::kByte));
  g.all_gather(out, in).wait();
  std::vector<std::string> all;
  for (int r = 0; r < g.size(); ++r) {
    const at::Tensor c = out[r].cpu();
    all.emplace_back(static_cast<const char*>(c.data_ptr()), static_cast<size_t>(sizes[r]));
  }
  return all;
}

}  // namespace ddp
