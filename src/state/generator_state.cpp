// LibTorch's default generators as Stateful (ddp::default_generators()): "cpu" and "cuda:<i>",
// each the generator's state bytes; each rank's own.
#include <mutex>

#include <ATen/CPUGeneratorImpl.h>  // at::detail::getDefaultCPUGenerator
#include <ATen/Context.h>           // at::globalContext().defaultGenerator(cuda:i)
#include <fmt/format.h>
#include <torch/cuda.h>  // torch::cuda::device_count (0 on CPU builds)

#include "ddp/training_state.h"

namespace ddp {
namespace {

std::string cuda_name(int64_t i) { return fmt::format("cuda:{}", i); }

at::Generator cuda_generator(int64_t i) {
  return at::globalContext().defaultGenerator(
      c10::Device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(i)));
}

at::Tensor get_state(at::Generator gen) {
  std::lock_guard<std::mutex> lock(gen.mutex());  // generators are shared by all threads
  return gen.get_state();
}

void set_state(at::Generator gen, const at::Tensor& state) {
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_state(state);
}

class DefaultGenerators : public Stateful {
 public:
  // Ranks may draw different numbers (per-rank seeds): each keeps its own.
  StateScope scope() const override { return StateScope::kPerRank; }
  std::string kind() const override { return "generator"; }

  StateDict state_dict() override {
    StateDict s;
    s.tensors.emplace_back("cpu", get_state(at::detail::getDefaultCPUGenerator()));
    // On a CPU-only LibTorch there are none; with CUDA each device has its own default
    // generator (dropout on cuda:i draws from it).
    const int64_t cuda = static_cast<int64_t>(torch::cuda::device_count());
    for (int64_t i = 0; i < cuda; ++i) s.tensors.emplace_back(cuda_name(i), get_state(cuda_generator(i)));
    return s;
  }

  std::string check(const StateDict& saved, const LoadContext&) override {
    const at::Tensor* cpu = saved.find("cpu");
    if (!cpu || !cpu->defined() || cpu->scalar_type() != at::kByte) {
      return "it holds no CPU generator state";
    }
    const int64_t here = get_state(at::detail::getDefaultCPUGenerator()).numel();
    if (cpu->numel() != here) {
      return fmt::format("its CPU generator state has {} bytes; this LibTorch's has {}",
                         cpu->numel(), here);
    }
    return "";
  }

  // The CUDA generators only when the saved run had as many devices (another machine: they are
  // left alone).
  void load_state_dict(const StateDict& saved, const LoadContext&) override {
    set_state(at::detail::getDefaultCPUGenerator(), *saved.find("cpu"));
    const int64_t cuda = static_cast<int64_t>(torch::cuda::device_count());
    if (static_cast<int64_t>(saved.tensors.size()) - 1 != cuda) return;
    for (int64_t i = 0; i < cuda; ++i) {
      const at::Tensor* t = saved.find(cuda_name(i));
      if (t && t->defined()) set_state(cuda_generator(i), *t);
    }
  }
};

}  // namespace

std::shared_ptr<Stateful> default_generators() { return std::make_shared<DefaultGenerators>(); }

}  // namespace ddp
