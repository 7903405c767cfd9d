#!/usr/bin/env bash
# Installs every Debian package ddp-cpp needs to build, test and run. Idempotent: packages
# already installed are not touched, and apt is not called at all when nothing is missing.
# Run as root (or with sudo available).
set -euo pipefail

PACKAGES=(
  # toolchain (lld: links our ~80 LibTorch programs in a ninth of GNU ld's time)
  g++ cmake ninja-build ccache lld
  # LibTorch (CPU, Gloo inside) and the Gloo headers its c10d headers include
  libtorch-dev libgloo-dev
  # a fast BLAS: Debian's alternatives prefer it over the reference BLAS once installed
  libopenblas0-pthread
  # libraries
  libcli11-dev libfmt-dev nlohmann-json3-dev zlib1g-dev libssl-dev
  # ddprun's etcd backend: etcd's JSON gateway over HTTP(S)
  libcurl4-openssl-dev
  # tests and benchmarks; python3-torch only as a cross-check (torchrun, PyTorch's DDP)
  libgtest-dev libgmock-dev libbenchmark-dev python3-torch openmpi-bin
  # multi-host tests: network namespaces, veth, tc (iproute2); unshare (util-linux)
  iproute2 util-linux
  # a real one-node Slurm cluster in the tests (tests/support/slurm.h)
  slurm-wlm munge
  # real etcd clusters in the tests of ddprun's etcd backend (tests/support/etcd.h)
  etcd-server
  # a Rust program that trains data-parallel through the C ABI (examples/rust), built with
  # Debian's rustc alone (no crates)
  rustc
  # the trainer's data and plots
  dataset-fashion-mnist gnuplot-nox
  # the tools' man pages, from their --help (cmake/ManPages.cmake); the Debian packages
  # (cpack -G DEB: dpkg-shlibdeps, dpkg-scanpackages; cmake/Packaging.cmake)
  help2man dpkg-dev
)

# The list alone, one a line (scripts/test-libtorch2.sh installs the same in its trixie root).
if [[ ${1:-} == --print-packages ]]; then
  printf '%s\n' "${PACKAGES[@]}"
  exit 0
fi

missing=()
for p in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if ((${#missing[@]})); then
  echo "install-deps: installing ${missing[*]}"
  SUDO=""
  if [[ $(id -u) -ne 0 ]]; then
    command -v sudo >/dev/null || { echo "install-deps: run as root (or install sudo)" >&2; exit 1; }
    SUDO=sudo
  fi
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -q
  $SUDO apt-get install -y -q --no-install-recommends "${missing[@]}"
fi

# Say which BLAS LibTorch will call (ddp::inspect_blas() checks again at run time).
blas=$(readlink -f /usr/lib/x86_64-linux-gnu/libblas.so.3 2>/dev/null || true)
case "$blas" in
  *openblas*) echo "install-deps: all packages present; BLAS: OpenBLAS ($blas)" ;;
  *) echo "install-deps: WARNING: libblas.so.3 is $blas, not OpenBLAS; LibTorch will be slow." \
          "Fix: update-alternatives --auto libblas.so.3-x86_64-linux-gnu" >&2 ;;
esac
