// What the transports share about tensors: LibTorch's dtypes as ours, and the contiguous CPU
// memory the shared-memory steps move.
#pragma once

#include <ATen/ATen.h>

#include "process_group/collective.h"

namespace ddp::transport {

// DType::kOther for a type no kernel of ours knows (complex, quantized...).
DType dtype_of(at::ScalarType t);

// `t` itself when it is contiguous, else a contiguous copy (the caller copies results back).
// Throws ddp::Error for a tensor that is not on the CPU, naming the call and the backend.
at::Tensor cpu_contiguous(const at::Tensor& t, const CollectiveDesc& call, int rank,
                          const std::string& backend);

// `t` (contiguous) as a flat tensor of bytes, sharing its memory.
at::Tensor bytes_of(const at::Tensor& t);

}  // namespace ddp::transport
