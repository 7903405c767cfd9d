// The one place that knows which LibTorch version we are built against.
//
// c10d's API moved between 1.13 (Debian bookworm's libtorch-dev) and 2.x (trixie's 2.6, the CUDA
// builds; scripts/test-libtorch2.sh runs the whole suite against 2.6): in 1.13 a
// backend such as ProcessGroupGloo *is* a c10d::ProcessGroup; from 2.0 on it is a c10d::Backend
// that a ProcessGroup dispatches to. Collective signatures on the backend object are the same in
// both, so the rest of ddp-cpp talks to `c10d_compat::Backend` and never names a version.
#pragma once

#include <chrono>
#include <string>

#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <torch/csrc/distributed/c10d/Types.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <torch/version.h>

#include "ddp/config.h"

#if TORCH_VERSION_MAJOR >= 2
#include <torch/csrc/distributed/c10d/Backend.hpp>
#else
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#endif

namespace ddp::c10d_compat {

#if TORCH_VERSION_MAJOR >= 2
using Backend = ::c10d::Backend;
#else
using Backend = ::c10d::ProcessGroup;
#endif

// LibTorch 1.13's ProcessGroupGloo refuses bfloat16 in every collective ("Invalid scalar
// type"); 2.x moves and reduces it.
inline constexpr bool kGlooTakesBFloat16 = TORCH_VERSION_MAJOR >= 2;

// The key under which torch::optim::Optimizer::state() keeps a parameter's state: the address
// of its TensorImpl printed as a string in 1.13, the TensorImpl pointer itself from 2.0 on.
#if TORCH_VERSION_MAJOR >= 2
using OptimizerStateKey = void*;
#else
using OptimizerStateKey = std::string;
#endif
OptimizerStateKey optimizer_state_key(const at::Tensor& param);

// Note [c10d::Store across versions]
// c10d::Store grew after 1.13: 2.x adds clone() (pure virtual: a new handle on the same store,
// usable from another thread) and virtuals with defaults (append, multiGet, multiSet,
// queuePush/Pop/Len...). Stores of ours derive from StoreBase and implement clone_store();
// StoreBase maps clone() onto it where c10d::Store has one.
class StoreBase : public ::c10d::Store {
 public:
  explicit StoreBase(std::chrono::milliseconds timeout) : ::c10d::Store(timeout) {}
  // A new handle on the same underlying store.
  virtual c10::intrusive_ptr<::c10d::Store> clone_store() = 0;
  // Deliberately without `override`: it overrides c10d::Store::clone() on LibTorch 2.x and is
  // an ordinary extra method on 1.13, which has no clone().
  c10::intrusive_ptr<::c10d::Store> clone() { return clone_store(); }
};

// A TCPStore, server or client, on any LibTorch; see Note [TCPStore and libuv].
c10::intrusive_ptr<::c10d::TCPStore> make_tcp_store(const std::string& host,
                                                    ::c10d::TCPStoreOptions options);

// How Gloo picks the network interface its pairs bind to.
struct GlooDeviceSpec {
  std::string interface;  // e.g. "eth0" (GLOO_SOCKET_IFNAME); wins when set
  std::string hostname;   // address to bind, e.g. "127.0.0.1" or this node's routable address
};

c10::intrusive_ptr<Backend> make_gloo(const c10::intrusive_ptr<::c10d::Store>& store, int rank,
                                      int size, std::chrono::milliseconds timeout,
                                      const GlooDeviceSpec& device);

#if DDP_WITH_NCCL
// NCCL on `device` (the rank's bound CUDA device: Note [Device binding]); where this LibTorch
// can, its communicator is created now, on that device (every rank of the group calls this),
// instead of lazily at the first collective.
c10::intrusive_ptr<Backend> make_nccl(const c10::intrusive_ptr<::c10d::Store>& store, int rank,
                                      int size, std::chrono::milliseconds timeout, int device);
#endif
// Aborts `backend`'s communicator where it has one (NCCL); every pending and later collective
// of it fails. No-op for other backends.
void abort(Backend& backend);

}  // namespace ddp::c10d_compat
