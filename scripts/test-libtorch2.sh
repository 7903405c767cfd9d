#!/usr/bin/env bash
# The whole test suite against LibTorch 2.x: Debian trixie's libtorch-dev 2.6 (with trixie's
# python3-torch 2.6 and Gloo), inside a trixie root made with debootstrap on this bookworm machine.
#
#   scripts/test-libtorch2.sh [ctest arguments, e.g. -L unit]
#   scripts/test-libtorch2.sh --shell [command...]   a shell (or one command) inside the root,
#                                                    source tree mounted, e.g. to run python3
#   scripts/test-libtorch2.sh --prepare              create/update the root only
#   scripts/test-libtorch2.sh --build                the root and the build, no ctest (test.sh
#                                                    runs it niced beside the bookworm suite)
#
# Run as root. What it does, each step skipped when already done (idempotent):
#   1. apt-get installs debootstrap on the host (if missing);
#   2. creates the trixie root in $DDP_TRIXIE_ROOT (default /var/cache/ddp-cpp/trixie-root,
#      outside the source tree, kept between runs);
#   3. installs there the packages of scripts/install-deps.sh (--print-packages), under trixie's
#      names (trixie_name below);
#   4. bind-mounts the source tree at /src/ddp-cpp inside the root (not a copy), plus /proc,
#      /sys, /dev, /dev/pts, /dev/shm and a host ccache folder ($DDP_TRIXIE_CCACHE);
#   5. configures and builds there into /var/build/ddp-cpp (inside the root: never the bookworm
#      build/), -j2 at most, through ccache;
#   6. runs ctest there: unit, collective, multiproc and package, against LibTorch 2.6 and, for
#      the cross-checks (sampler, model_state.pt, torchrun), trixie's python3-torch 2.6. The
#      tests whose checks do not depend on LibTorch's version (label version-neutral: torch-free
#      code, ddprun across hosts, checks of the source tree; DDP_VERSION_NEUTRAL_TESTS in
#      CMakeLists.txt) ran against 1.13 and are neither built nor run here, nor are the
#      benchmarks built, and the tree compiles at -O1, unless DDP_LIBTORCH2_ALL=1.
# Everything it mounted is unmounted on exit, failure and Ctrl-C included. Runs are serialised
# by a lock next to the root.
set -euo pipefail

SRC=$(cd "$(dirname "$0")/.." && pwd)
CACHE=${DDP_LIBTORCH2_CACHE:-/var/cache/ddp-cpp}
# The flavour of LibTorch: cpu (libtorch-dev, this script) or cuda (libtorch-cuda-dev with NCCL
# and the CUDA toolkit from contrib/non-free; scripts/test-cuda.sh sets it). Each flavour has its
# own root, ccache and build folder: the two LibTorch packages conflict.
FLAVOR=${DDP_TRIXIE_FLAVOR:-cpu}
case $FLAVOR in
  cpu) suffix= ;;
  cuda) suffix=-cuda ;;
  *) echo "test-libtorch2: DDP_TRIXIE_FLAVOR must be cpu or cuda, not '$FLAVOR'" >&2; exit 2 ;;
esac
ROOT=${DDP_TRIXIE_ROOT:-$CACHE/trixie$suffix-root}
CCACHE_HOST=${DDP_TRIXIE_CCACHE:-$CACHE/ccache-trixie$suffix}
MIRROR=${DDP_TRIXIE_MIRROR:-http://deb.debian.org/debian}
SUITE=trixie
JOBS=${DDP_JOBS:-2}
# Paths inside the root.
SRC_IN=/src/ddp-cpp
BUILD_IN=/var/build/ddp-cpp
CCACHE_IN=/var/cache/ccache

NAME=${DDP_SCRIPT_NAME:-test-libtorch2}
log() { echo "$NAME: $*" >&2; }
die() { log "ERROR: $*"; exit 1; }
# mounts_below, unmount_below, make_root, mount_system
source "$SRC/scripts/lib/debian-root.sh"

mode=test
case "${1:-}" in
  --shell) mode=shell; shift ;;
  --prepare) mode=prepare; shift ;;
  --build) mode=build; shift ;;
  -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
esac

[[ $(id -u) -eq 0 ]] || die "run as root (debootstrap, chroot and mount need it)"
case "$ROOT" in /|"") die "DDP_TRIXIE_ROOT must be a dedicated folder" ;; esac
case "$ROOT/" in "$SRC"/*) die "the trixie root must be outside the source tree ($SRC)" ;; esac

# A package of install-deps.sh under its trixie name (the same for every package so far; a rename
# goes here, e.g.  libfoo1) echo libfoo1t64 ;;). The cuda flavour swaps LibTorch and PyTorch for
# their CUDA builds.
trixie_name() {
  case "$FLAVOR:$1" in
    cuda:libtorch-dev) echo libtorch-cuda-dev ;;
    cuda:python3-torch) echo python3-torch-cuda ;;
    cuda:libgloo-dev) echo libgloo-cuda-dev ;;
    # The real Slurm cluster (tests/slurm) and the etcd clusters (ddprun's etcd backend) serve
    # version-neutral tests, which run in the bookworm suite only.
    # So does the Rust program through the C ABI (examples/rust).
    *:slurm-wlm | *:munge | *:etcd-server | *:rustc) echo "" ;;
    *) echo "$1" ;;
  esac
}
# Packages only the cuda flavour needs: NCCL's headers and the CUDA toolkit LibTorch's CMake
# files look for (nvcc, cudart, cuBLAS, ...).
EXTRA_PACKAGES=()
[[ $FLAVOR == cuda ]] && EXTRA_PACKAGES=(libnccl-dev nvidia-cuda-toolkit)
COMPONENTS=main
[[ $FLAVOR == cuda ]] && COMPONENTS="main contrib non-free"

mkdir -p "$CACHE" "$CCACHE_HOST"
exec 9>"$ROOT.lock"
if ! flock -n 9; then
  log "waiting for another run to release $ROOT.lock"
  flock 9
fi

# --- 1. debootstrap on the host (if missing); 2. the trixie root (if not made yet) -------------
trap 'unmount_below "$ROOT"; unmount_below "$ROOT.new"' EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
unmount_below "$ROOT"  # left over by a run that was killed -9

make_root "$ROOT" "$SUITE" "$MIRROR" main "$CACHE/debootstrap.log" \
  "deb $MIRROR $SUITE $COMPONENTS
deb $MIRROR $SUITE-updates $COMPONENTS"

# --- 4. mounts ---------------------------------------------------------------------------------
mkdir -p "$ROOT$SRC_IN" "$ROOT$CCACHE_IN" "$ROOT$BUILD_IN"
mount_system "$ROOT"
mount --bind "$SRC" "$ROOT$SRC_IN"
mount --bind "$CCACHE_HOST" "$ROOT$CCACHE_IN"

in_root() {
  chroot "$ROOT" /usr/bin/env -i \
    PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LANG=C.UTF-8 \
    TERM="${TERM:-dumb}" DEBIAN_FRONTEND=noninteractive CI="${CI:-}" \
    CCACHE_DIR=$CCACHE_IN CCACHE_BASEDIR=$SRC_IN CCACHE_MAXSIZE=${DDP_TRIXIE_CCACHE_SIZE:-3G} \
    "$@"
}

# The cuda flavour: trixie's CUDA LibTorch depends on nvidia-cudnn, an installer that downloads
# cuDNN from NVIDIA at install time (no network to it here). A local package of that name
# providing a stub libcudnn.so.9 stands in (Note [cuDNN stand-in] in scripts/cudnn-standin.sh).
install_cudnn_standin() {
  if in_root dpkg-query -W -f='${Version}' nvidia-cudnn 2>/dev/null | grep -q 'ddp.standin'; then
    return
  fi
  log "building the cuDNN stand-in (Note [cuDNN stand-in])"
  in_root apt-get update -q >/dev/null
  local lib
  lib=$(in_root apt-cache depends libtorch-cuda-dev | awk '/Depends: libtorch-cuda-[0-9]/ {print $2; exit}')
  [[ -n $lib ]] || die "cannot find the library package of libtorch-cuda-dev"
  rm -rf "$ROOT/tmp/cudnn-standin" && mkdir -p "$ROOT/tmp/cudnn-standin"
  in_root bash -c "cd /tmp/cudnn-standin && apt-get download -q $lib" >/dev/null
  "$SRC/scripts/cudnn-standin.sh" "$ROOT/tmp/cudnn-standin/nvidia-cudnn-standin.deb" \
    "$ROOT"/tmp/cudnn-standin/"$lib"_*.deb
  in_root dpkg -i /tmp/cudnn-standin/nvidia-cudnn-standin.deb >/dev/null
  in_root apt-mark hold nvidia-cudnn >/dev/null
  rm -rf "$ROOT/tmp/cudnn-standin"
}

# --- 3. packages -------------------------------------------------------------------------------
packages=("${EXTRA_PACKAGES[@]}")
for p in $("$SRC/scripts/install-deps.sh" --print-packages); do
  name=$(trixie_name "$p")
  if [[ -n $name ]]; then packages+=("$name"); fi
done
[[ $FLAVOR == cuda ]] && install_cudnn_standin
missing=()
for p in "${packages[@]}"; do
  in_root dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" ||
    missing+=("$p")
done
if ((${#missing[@]})); then
  log "installing in the root: ${missing[*]}"
  start=$SECONDS
  in_root apt-get update -q
  in_root apt-get install -y -q --no-install-recommends "${missing[@]}"
  in_root apt-get clean
  log "packages installed in $((SECONDS - start)) s"
fi
log "$(in_root dpkg-query -W -f='${Package} ${Version}\n' "$(trixie_name libtorch-dev)" \
  "$(trixie_name python3-torch)" "$(trixie_name libgloo-dev)" | tr '\n' ' ')"

case $mode in
  prepare) exit 0 ;;
  shell)
    if (($#)); then in_root bash -c 'cd "$0" && exec "$@"' "$SRC_IN" "$@"
    else in_root bash -c "cd $SRC_IN && exec bash -i"; fi
    exit ;;
esac

# --- 5. build ----------------------------------------------------------------------------------
start=$SECONDS
cmake_args=(-G Ninja -DCMAKE_BUILD_TYPE=Release)
ctest_args=()
if [[ ${DDP_LIBTORCH2_ALL:-0} == 1 ]]; then
  cmake_args+=(-DDDP_VERSION_NEUTRAL_TESTS=ON)
else
  # The benchmarks run no test; their LibTorch calls are ddp-train's and the examples' (built
  # here). Without them the tree is about 6 % smaller (200 of its ~3,700 compiler-seconds). And
  # -O1, not -O3: this tree checks our code against LibTorch 2.6's headers and behaviour, not
  # its speed (the benchmarks and the 1.13 tree's -O2 do), and compiles in about two thirds of
  # the time (the test files already did: DDP_TEST_OPTIMIZE).
  cmake_args+=(-DDDP_VERSION_NEUTRAL_TESTS=OFF -DDDP_BUILD_BENCHMARKS=OFF
               "-DCMAKE_CXX_FLAGS_RELEASE=-O1 -DNDEBUG")
  ctest_args=(-LE version-neutral)
fi
[[ $FLAVOR == cuda ]] && cmake_args+=(-DDDP_WITH_NCCL=ON)
in_root cmake -S "$SRC_IN" -B "$BUILD_IN" "${cmake_args[@]}" >/dev/null
in_root cmake --build "$BUILD_IN" -j"$JOBS"
log "built in $((SECONDS - start)) s"
if [[ $mode == build ]]; then exit 0; fi

# --- 6. the suite ------------------------------------------------------------------------------
start=$SECONDS
rc=0
in_root bash -c 'cd "$0" && exec ctest --output-on-failure "$@"' "$BUILD_IN" "${ctest_args[@]}" \
  "$@" || rc=$?
log "ctest ran in $((SECONDS - start)) s (exit $rc)"
exit $rc
