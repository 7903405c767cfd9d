// Byte strings as uint8 tensors and back: how serialized state (generator states, a sharded
// optimizer's or PowerSGD's state_dict) travels in checkpoints and collectives. Header-only,
// and the one header of src/base that needs ATen: ddp_base, which ddprun links, compiles none
// of it (no .cpp of base includes it).
#pragma once

#include <cstring>
#include <string>
#include <string_view>

#include <ATen/ATen.h>

namespace ddp {

inline at::Tensor bytes_tensor(std::string_view bytes) {
  at::Tensor t = at::empty({static_cast<int64_t>(bytes.size())}, at::kByte);
  if (!bytes.empty()) std::memcpy(t.data_ptr(), bytes.data(), bytes.size());
  return t;
}

// Any device, any layout: copied to the CPU, contiguous.
inline std::string tensor_bytes(const at::Tensor& t) {
  const at::Tensor c = t.to(at::kCPU).contiguous();
  return std::string(static_cast<const char*>(c.data_ptr()), c.nbytes());
}

}  // namespace ddp
