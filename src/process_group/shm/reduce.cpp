// Reduction kernels: blocks of elements accumulated in a small buffer that stays in L1, so the
// destination may alias a source and the loops vectorise.
#include "process_group/shm/reduce.h"

#include <algorithm>
#include <cstdint>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include "base/check.h"

namespace ddp::shm {
namespace {

constexpr size_t kBlock = 1024;  // elements per accumulation block (4-8 KiB of accumulators)

template <typename T>
struct Acc {
  using type = T;
};
template <>
struct Acc<c10::Half> {
  using type = float;
};
template <>
struct Acc<c10::BFloat16> {
  using type = float;
};

template <typename T, Reduce kOp>
void reduce_typed(T* dst, const T* const* srcs, int n, size_t count) {
  using A = typename Acc<T>::type;
  A acc[kBlock];
  for (size_t base = 0; base < count; base += kBlock) {
    const size_t m = std::min(kBlock, count - base);
    const T* s0 = srcs[0] + base;
    for (size_t i = 0; i < m; ++i) acc[i] = static_cast<A>(s0[i]);
    for (int p = 1; p < n; ++p) {
      const T* s = srcs[p] + base;
      for (size_t i = 0; i < m; ++i) {
        const A v = static_cast<A>(s[i]);
        if constexpr (kOp == Reduce::kMax) {
          acc[i] = v > acc[i] ? v : acc[i];
        } else if constexpr (kOp == Reduce::kMin) {
          acc[i] = v < acc[i] ? v : acc[i];
        } else {
          acc[i] = acc[i] + v;
        }
      }
    }
    if constexpr (kOp == Reduce::kAvg) {
      const A inv = static_cast<A>(n);
      for (size_t i = 0; i < m; ++i) acc[i] = acc[i] / inv;
    }
    T* d = dst + base;
    for (size_t i = 0; i < m; ++i) d[i] = static_cast<T>(acc[i]);
  }
}

// bool: sum and max are logical or, min is logical and (bytes 0/1 either way).
void reduce_bool(uint8_t* dst, const uint8_t* const* srcs, int n, size_t count, Reduce op) {
  for (size_t i = 0; i < count; ++i) {
    bool v = srcs[0][i] != 0;
    for (int p = 1; p < n; ++p) v = op == Reduce::kMin ? (v && srcs[p][i]) : (v || srcs[p][i]);
    dst[i] = v ? 1 : 0;
  }
}

template <typename T>
void dispatch_op(Reduce op, void* dst, const void* const* srcs, int n, size_t count) {
  auto d = static_cast<T*>(dst);
  auto s = reinterpret_cast<const T* const*>(srcs);
  switch (op) {
    case Reduce::kSum: return reduce_typed<T, Reduce::kSum>(d, s, n, count);
    case Reduce::kAvg: return reduce_typed<T, Reduce::kAvg>(d, s, n, count);
    case Reduce::kMax: return reduce_typed<T, Reduce::kMax>(d, s, n, count);
    case Reduce::kMin: return reduce_typed<T, Reduce::kMin>(d, s, n, count);
  }
}

}  // namespace

void reduce(DType dtype, Reduce op, void* dst, const void* const* srcs, int n, size_t count) {
  switch (dtype) {
    case DType::kU8: return dispatch_op<uint8_t>(op, dst, srcs, n, count);
    case DType::kI8: return dispatch_op<int8_t>(op, dst, srcs, n, count);
    case DType::kI16: return dispatch_op<int16_t>(op, dst, srcs, n, count);
    case DType::kI32: return dispatch_op<int32_t>(op, dst, srcs, n, count);
    case DType::kI64: return dispatch_op<int64_t>(op, dst, srcs, n, count);
    case DType::kF16: return dispatch_op<c10::Half>(op, dst, srcs, n, count);
    case DType::kBF16: return dispatch_op<c10::BFloat16>(op, dst, srcs, n, count);
    case DType::kF32: return dispatch_op<float>(op, dst, srcs, n, count);
    case DType::kF64: return dispatch_op<double>(op, dst, srcs, n, count);
    case DType::kBool:
      return reduce_bool(static_cast<uint8_t*>(dst), reinterpret_cast<const uint8_t* const*>(srcs),
                         n, count, op);
    case DType::kOther: break;  // bytes of a type no kernel reduces (callers refuse it first)
  }
  DDP_ASSERT(false, "unknown shm dtype {}", static_cast<int>(dtype));
}

}  // namespace ddp::shm
