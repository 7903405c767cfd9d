// Tensors as the transports move them (tensors.h).
#include "process_group/transport/tensors.h"

#include "base/check.h"
#include "ddp/error.h"

namespace ddp::transport {

DType dtype_of(at::ScalarType t) {
  switch (t) {
    case at::kByte: return DType::kU8;
    case at::kChar: return DType::kI8;
    case at::kShort: return DType::kI16;
    case at::kInt: return DType::kI32;
    case at::kLong: return DType::kI64;
    case at::kHalf: return DType::kF16;
    case at::kBFloat16: return DType::kBF16;
    case at::kFloat: return DType::kF32;
    case at::kDouble: return DType::kF64;
    case at::kBool: return DType::kBool;
    default: return DType::kOther;
  }
}

at::Tensor cpu_contiguous(const at::Tensor& t, const CollectiveDesc& call, int rank,
                          const std::string& backend) {
  DDP_CHECK(t.device().is_cpu(), Error,
            "[rank {}] {}: the {} backend moves CPU tensors, this one is on {}; use backend "
            "'nccl' (or 'auto') for CUDA tensors",
            rank, call.describe(), backend, t.device().str());
  return t.is_contiguous() ? t : t.contiguous();
}

at::Tensor bytes_of(const at::Tensor& t) {
  DDP_ASSERT(t.is_contiguous(), "bytes_of needs a contiguous tensor");
  return at::from_blob(
      t.data_ptr(), {static_cast<int64_t>(t.numel() * t.element_size())}, [keep = t](void*) {},
      t.options().dtype(at::kByte));
}

}  // namespace ddp::transport
