// Which CUDA device a rank uses, and binding it.
//
// Note [Device binding]
// As in PyTorch, one rank drives one GPU, and the rank's CUDA device is chosen before anything
// touches CUDA on its behalf: make_process_group binds the calling thread to the device
// (cudaSetDevice through c10's device guard) before it forms the NCCL communicator, so that the
// ranks of a node use cuda:0, cuda:1, ... instead of all landing on cuda:0. The device is
// InitOptions::device_id when set, else LOCAL_RANK (torchrun's convention, which ddprun
// follows; ddprun --nproc-per-node gpu starts one rank per visible device). With NCCL the device
// must exist (a rank without one fails at once, naming LOCAL_RANK and the visible count). With
// the CPU transports a rank binds a device only when asked to (device_id): binding creates the
// device's CUDA context (CUDA 12 does so in cudaSetDevice), memory a CPU job should not pay on
// every GPU of the node. ProcessGroup::bound_device_id() reports the binding; DDP and the
// checkpoints use it.
// CUDA is reached through LibTorch's device-generic interfaces only (torch::cuda::device_count,
// c10's DeviceGuardImpl registry), so this file compiles against CPU and CUDA LibTorch alike.
#pragma once

#include <optional>

namespace ddp {

// The CUDA devices this process sees (CUDA_VISIBLE_DEVICES applied); 0 on a CPU-only LibTorch
// or without a GPU.
int visible_cuda_devices();

// Note [Device binding]: the device index rank `rank` binds, or nullopt for none. `requested`:
// InitOptions::device_id; `needs_cuda`: the backend moves CUDA tensors (nccl). Throws
// ddp::ConfigError naming the rank when the device cannot exist.
std::optional<int> choose_cuda_device(std::optional<int> requested, int local_rank, int visible,
                                      bool needs_cuda, int rank);

// Makes `index` the calling thread's current CUDA device.
void bind_cuda_device(int index);

}  // namespace ddp
