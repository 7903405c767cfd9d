// Version-specific construction of c10d backends (see compat.h).
#include "c10d/compat.h"

#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#if DDP_WITH_NCCL
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

namespace ddp::c10d_compat {

c10::intrusive_ptr<Backend> make_gloo(const c10::intrusive_ptr<::c10d::Store>& store, int rank,
                                      int size, std::chrono::milliseconds timeout,
                                      const GlooDeviceSpec& device) {
  auto options = ::c10d::ProcessGroupGloo::Options::create(timeout);
  if (!device.interface.empty()) {
    options->devices.push_back(
        ::c10d::ProcessGroupGloo::createDeviceForInterface(device.interface));
  } else {
    options->devices.push_back(::c10d::ProcessGroupGloo::createDeviceForHostname(device.hostname));
  }
  // Gloo runs collectives on its own worker threads; 2 keep one bucket's all-reduce in flight
  // while the next starts, without oversubscribing small CPU machines.
  options->threads = 2;
  return c10::make_intrusive<::c10d::ProcessGroupGloo>(store, rank, size, options);
}

#if DDP_WITH_NCCL
c10::intrusive_ptr<Backend> make_nccl(const c10::intrusive_ptr<::c10d::Store>& store, int rank,
                                      int size, std::chrono::milliseconds timeout) {
  auto options = ::c10d::ProcessGroupNCCL::Options::create();
  options->timeout = timeout;
  return c10::make_intrusive<::c10d::ProcessGroupNCCL>(store, rank, size, options);
}
#endif

bool backend_supports_avg(const std::string& backend_name) { return backend_name == "nccl"; }

bool backend_reduces(const std::string& backend_name, c10::ScalarType dtype) {
  if (backend_name == "nccl" || backend_name == "shm") return true;  // shm: float32 accumulation
  return dtype != c10::ScalarType::BFloat16;  // Gloo: every other dtype ddp-cpp uses
}

}  // namespace ddp::c10d_compat
