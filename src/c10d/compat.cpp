// Version-specific construction of c10d backends (see compat.h).
#include "c10d/compat.h"

#include "ddp/env.h"

#include <cstdlib>  // std::getenv

#include <c10/util/string_utils.h>  // c10::guts::to_string (1.13)
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#if DDP_WITH_NCCL
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

namespace ddp::c10d_compat {
namespace {

// Sets TCPStoreOptions::useLibUV where this LibTorch has it (2.1 and later); false otherwise.
template <typename Options>
bool set_use_libuv(Options& options, bool on) {
  if constexpr (requires { options.useLibUV = on; }) {
    options.useLibUV = on;
    return true;
  } else {
    return false;
  }
}

// NCCL's eager communicator creation (2.3 and later); nothing where it does not exist.
template <typename Nccl>
void eager_connect(Nccl& nccl, const at::Device& device) {
  if constexpr (requires { nccl.eagerConnectSingleDevice(device); }) {
    nccl.eagerConnectSingleDevice(device);
  }
}

// ProcessGroupNCCL::abort() where this LibTorch has it (2.x).
template <typename Nccl>
void abort_if_able(Nccl& nccl) {
  if constexpr (requires { nccl.abort(); }) nccl.abort();
}

}  // namespace

// Note [TCPStore and libuv]
// From 2.4 on TCPStoreOptions::useLibUV defaults to true, and PyTorch's switch for it is the
// environment variable USE_LIBUV ("1" unless set). A LibTorch built without libuv, such as Debian
// trixie's 2.6, then refuses to construct any TCPStore, server or client ("use_libuv was
// requested but PyTorch was build without libuv support") instead of falling back, and whether
// libuv is compiled in is not exported. So: follow USE_LIBUV, and when libuv is refused for that
// reason, construct the classic store. Both speak one protocol, so the other side may be any
// LibTorch or torchrun's agent. (Debian's torchrun 2.6 has no such fallback: run it with
// USE_LIBUV=0.)
c10::intrusive_ptr<::c10d::TCPStore> make_tcp_store(const std::string& host,
                                                    ::c10d::TCPStoreOptions options) {
  if (set_use_libuv(options, env_knob("USE_LIBUV").value_or("1") == "1")) {
    try {
      return c10::make_intrusive<::c10d::TCPStore>(host, options);
    } catch (const std::exception& e) {
      if (std::string(e.what()).find("without libuv support") == std::string::npos) throw;
      set_use_libuv(options, false);
    }
  }
  return c10::make_intrusive<::c10d::TCPStore>(host, options);
}

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
                                      int size, std::chrono::milliseconds timeout, int device) {
  auto options = ::c10d::ProcessGroupNCCL::Options::create();
  options->timeout = timeout;
  auto nccl = c10::make_intrusive<::c10d::ProcessGroupNCCL>(store, rank, size, options);
  eager_connect(*nccl, at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(device)));
  return nccl;
}
#endif

void abort([[maybe_unused]] Backend& backend) {
#if DDP_WITH_NCCL
  if (auto* nccl = dynamic_cast<::c10d::ProcessGroupNCCL*>(&backend)) abort_if_able(*nccl);
#endif
}

OptimizerStateKey optimizer_state_key(const at::Tensor& param) {
#if TORCH_VERSION_MAJOR >= 2
  return param.unsafeGetTensorImpl();
#else
  return c10::guts::to_string(param.unsafeGetTensorImpl());
#endif
}

}  // namespace ddp::c10d_compat
