// Which CUDA device a rank uses (Note [Device binding]).
#include "process_group/cuda_device.h"

#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/cuda.h>

#include "base/check.h"
#include "ddp/env.h"
#include "ddp/error.h"

namespace ddp {

int visible_cuda_devices() { return static_cast<int>(torch::cuda::device_count()); }

std::optional<int> choose_cuda_device(std::optional<int> requested, int local_rank, int visible,
                                      bool needs_cuda, int rank) {
  const std::optional<std::string> mask = env_knob("CUDA_VISIBLE_DEVICES");
  const std::string seen =
      fmt::format("{} CUDA device{} visible{}", visible, visible == 1 ? " is" : "s are",
                  mask ? fmt::format(" (CUDA_VISIBLE_DEVICES={})", *mask) : "");
  if (requested) {
    DDP_CHECK(visible > 0, ConfigError,
              "[rank {}] InitOptions::device_id {} does not exist: {} (a CPU-only LibTorch, no "
              "GPU, or CUDA_VISIBLE_DEVICES hides them). Leave device_id unset on the CPU.",
              rank, *requested, seen);
    DDP_CHECK(*requested >= 0 && *requested < visible, ConfigError,
              "[rank {}] InitOptions::device_id {} does not exist: {}. Choose a device in 0..{}, "
              "or leave device_id unset to use LOCAL_RANK.",
              rank, *requested, seen, visible - 1);
    return requested;
  }
  if (!needs_cuda) return std::nullopt;
  DDP_CHECK(visible > 0, ConfigError,
            "[rank {}] the nccl backend needs a GPU, but {}. Use backend 'gloo' (or 'auto') for "
            "CPU tensors.",
            rank, seen);
  DDP_CHECK(local_rank < visible, ConfigError,
            "[rank {}] the nccl backend needs one GPU per rank, but LOCAL_RANK {} has none: {}. "
            "Start at most {} rank{} per node (ddprun --nproc-per-node gpu), or set "
            "InitOptions::device_id.",
            rank, local_rank, seen, visible, visible == 1 ? "" : "s");
  return local_rank;
}

void bind_cuda_device(int index) {
  c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)
      ->setDevice(c10::Device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(index)));
}

}  // namespace ddp
