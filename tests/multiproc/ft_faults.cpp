// An LD_PRELOAD library for test_ft: a worker of examples/ft_train (unchanged, not rebuilt) dies
// at a chosen point of per-step fault tolerance. It defines functions that the program, or
// libddp, calls through the dynamic linker (a call to another library's exported function), so
// the linker binds this library's definition first; each forwards to the real one, found past
// this library (RTLD_NEXT), but at the point chosen, where the process writes its pid into a
// marker file and SIGKILLs itself. The marker is created with O_EXCL: one worker of the job
// dies, never its replacement (the variables are inherited by what ddprun starts again).
//   DDP_TEST_DIE_IN_OPTIMIZER_STEP=<n>:<marker>  inside torch::optim::SGD::step, the n-th call:
//     after the commit vote; LibTorch changes the parameters, then the process dies before
//     the step returns (its program never logs the step).
//   DDP_TEST_DIE_WHILE_HEALING=<marker>  the replica sending its state to one behind (the
//     healing of ddp::ft::Manager): encode_checkpoint() of a step past 0 arms it, and it dies
//     entering the broadcast of the state's bytes, after their size: the receivers wait for
//     bytes that never come.
#include <dlfcn.h>
#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include <torch/optim/sgd.h>

#include "ddp/checkpoint.h"
#include "ddp/process_group.h"

namespace {

template <typename F>
F real(const char* mangled) {
  void* f = ::dlsym(RTLD_NEXT, mangled);
  if (f == nullptr) {
    std::fprintf(stderr, "ft_faults: %s not found past this library: %s\n", mangled, ::dlerror());
    std::abort();
  }
  return reinterpret_cast<F>(f);
}

// Whether this process is the one to die: the first to create `marker`, which then holds its pid.
bool claim(const std::string& marker) {
  const int fd = ::open(marker.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) return false;  // another worker died already
  const std::string pid = std::to_string(::getpid()) + "\n";
  if (::write(fd, pid.data(), pid.size()) != static_cast<ssize_t>(pid.size())) std::abort();
  ::close(fd);
  return true;
}

[[noreturn]] void die() {
  ::kill(::getpid(), SIGKILL);
  for (;;) ::pause();
}

const char* variable(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? v : nullptr;
}

std::atomic<long> optimizer_steps{0};
std::atomic<int> armed{0};  // broadcasts left before the state's bytes (DIE_WHILE_HEALING)

}  // namespace

// A member function's calling convention is a free function's with `this` first and the
// result's address where the platform passes it (the Itanium C++ ABI, on x86-64 and AArch64):
// the real member is called through such a pointer.
at::Tensor torch::optim::SGD::step(LossClosure closure) {
  using Step = at::Tensor (*)(torch::optim::SGD*, LossClosure);
  static const Step step = real<Step>("_ZN5torch5optim3SGD4stepESt8functionIFN2at6TensorEvEE");
  const long call = ++optimizer_steps;
  const char* plan = variable("DDP_TEST_DIE_IN_OPTIMIZER_STEP");  // <n>:<marker>
  const char* colon = plan != nullptr ? std::strchr(plan, ':') : nullptr;
  if (colon == nullptr || call != std::strtol(plan, nullptr, 10) || !claim(colon + 1)) {
    return step(this, std::move(closure));
  }
  step(this, std::move(closure));
  die();
}

std::string ddp::encode_checkpoint(const Snapshot& snapshot, const CheckpointMeta& meta) {
  using Encode = std::string (*)(const Snapshot&, const CheckpointMeta&);
  static const Encode encode =
      real<Encode>("_ZN3ddp17encode_checkpointB5cxx11ERKNS_8SnapshotERKNS_14CheckpointMetaE");
  // The healing's size broadcast, then its bytes'. Step 0: the job's initial sync, not a heal.
  if (variable("DDP_TEST_DIE_WHILE_HEALING") != nullptr && meta.step > 0) armed = 2;
  return encode(snapshot, meta);
}

ddp::Work ddp::ProcessGroup::broadcast(at::Tensor& tensor, int root) {
  using Broadcast = Work (*)(ProcessGroup*, at::Tensor&, int);
  static const Broadcast broadcast =
      real<Broadcast>("_ZN3ddp12ProcessGroup9broadcastERN2at6TensorEi");
  if (armed > 0 && --armed == 0 && claim(variable("DDP_TEST_DIE_WHILE_HEALING"))) die();
  return broadcast(this, tensor, root);
}
