// An LD_PRELOAD library for test_ft: a worker dies inside its optimizer's step, after the others
// counted its commit vote. It defines torch::optim::SGD::step, which the dynamic linker binds
// first for the calls a program makes to it directly (a local SGD, as examples/ft_train holds),
// and forwards every call to LibTorch's own, found past this library (RTLD_NEXT), but one. With
// DDP_TEST_DIE_IN_OPTIMIZER_STEP=<n>:<marker>, the first process of the job to make its n-th
// call and create <marker> (O_EXCL: one worker, never its replacement) writes its pid there,
// lets LibTorch change the parameters, and SIGKILLs itself before the step returns: what it
// changed dies with it, and its program never logs the step. The program is not rebuilt for it.
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

namespace {

using RealStep = at::Tensor (*)(torch::optim::SGD*, torch::optim::Optimizer::LossClosure);

// A member function's calling convention is a free function's with `this` first, the result's
// address where the platform puts it (the Itanium C++ ABI on x86-64 and AArch64).
RealStep real_step() {
  static const RealStep real = [] {
    void* f = ::dlsym(RTLD_NEXT, "_ZN5torch5optim3SGD4stepESt8functionIFN2at6TensorEvEE");
    if (f == nullptr) {
      std::fprintf(stderr, "die_in_optimizer_step: LibTorch's SGD::step not found: %s\n",
                   ::dlerror());
      std::abort();
    }
    return reinterpret_cast<RealStep>(f);
  }();
  return real;
}

// <n>:<marker> from the environment; n is 0 when unset.
struct Plan {
  long n = 0;
  std::string marker;
};
const Plan& plan() {
  static const Plan p = [] {
    Plan out;
    const char* v = std::getenv("DDP_TEST_DIE_IN_OPTIMIZER_STEP");
    if (v == nullptr) return out;
    const char* colon = std::strchr(v, ':');
    if (colon == nullptr) return out;
    out.n = std::strtol(v, nullptr, 10);
    out.marker = colon + 1;
    return out;
  }();
  return p;
}

std::atomic<long> calls{0};

}  // namespace

at::Tensor torch::optim::SGD::step(LossClosure closure) {
  const long call = ++calls;
  const Plan& p = plan();
  if (p.n <= 0 || call != p.n) return real_step()(this, std::move(closure));
  const int fd = ::open(p.marker.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) return real_step()(this, std::move(closure));  // another worker died already
  const std::string pid = std::to_string(::getpid()) + "\n";
  if (::write(fd, pid.data(), pid.size()) != static_cast<ssize_t>(pid.size())) std::abort();
  ::close(fd);
  real_step()(this, std::move(closure));
  ::kill(::getpid(), SIGKILL);
  ::pause();
  std::abort();
}
