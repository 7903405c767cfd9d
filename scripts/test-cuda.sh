#!/usr/bin/env bash
# The whole test suite against a CUDA build of LibTorch, on this machine's CPU: Debian trixie's
# libtorch-cuda-dev 2.6 with NCCL (libnccl-dev) and the CUDA toolkit 12.4 (contrib, non-free),
# in a trixie root of its own, ddp-cpp configured with DDP_WITH_NCCL=ON.
#
#   scripts/test-cuda.sh [ctest arguments, e.g. -L unit]
#   scripts/test-cuda.sh --shell [command...]   a shell (or one command) inside the root
#   scripts/test-cuda.sh --prepare              create/update the root only
#
# Run as root. The same steps and conventions as scripts/test-libtorch2.sh (it runs that script
# with DDP_TRIXIE_FLAVOR=cuda), with these differences:
#   - the root is $DDP_TRIXIE_ROOT, default /var/cache/ddp-cpp/trixie-cuda-root (about 9 GB:
#     CUDA LibTorch and the toolkit), its ccache /var/cache/ddp-cpp/ccache-trixie-cuda;
#   - apt sources include contrib and non-free; the packages are install-deps.sh's with
#     libtorch-cuda-dev, python3-torch-cuda and libgloo-cuda-dev in place of the CPU ones, plus
#     libnccl-dev and nvidia-cuda-toolkit;
#   - Debian's nvidia-cudnn (an installer that downloads from NVIDIA) is replaced by a local
#     stand-in package (Note [cuDNN stand-in] in scripts/cudnn-standin.sh);
#   - the build has DDP_WITH_NCCL=ON. No GPU is needed: tests labelled `gpu` skip, saying why;
#     every other test runs on the CPU against the CUDA LibTorch.
set -euo pipefail
DDP_TRIXIE_FLAVOR=cuda DDP_SCRIPT_NAME=test-cuda exec "$(dirname "$0")/test-libtorch2.sh" "$@"
