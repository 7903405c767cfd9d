#!/usr/bin/env bash
# Rehearses the GPU check on this CPU machine, end to end, as the GPU machine would see it: a clean
# clone of the committed branch, bundle.sh run in it, then only the files the device tool would
# carry (tracked + untracked not ignored; no .git) copied into a minimal Debian bookworm root that
# has a compiler, CMake, ninja, Python 3 and Debian's PyTorch, and none of fmt, CLI11,
# nlohmann-json, GoogleTest/GMock, Gloo, zlib or OpenSSL headers, nor the dataset: whatever the
# build needs beyond that must come from the bundle.
#
#   scripts/gpu-check/rehearse.sh [--keep-build] [REPORT_DIR]   # as root; REPORT_DIR default below
#
# Runs run.sh there twice: (1) all steps as on the device (GPU steps skipped: no GPU here), then
# (2) the GPU steps again with GPU_CHECK_DEVICE=cpu, so their plumbing (compare.py --device,
# torch_ddp.py, ddp-train) runs too; both with GPU_CHECK_QUICK=1 (small sizes; 2 shared cores)
# and -j2. The build is from scratch (no ccache in the root): its time is the figure to scale.
# --keep-build keeps the root's build-gpu/ from the last rehearsal (the tree is copied afresh
# around it): the second run on a warm device, which only rebuilds what changed.
#
# The root: /var/cache/ddp-cpp/gpucheck-root (DDP_GPUCHECK_ROOT), made once with debootstrap
# --variant=minbase, outside the source tree. libtorch-dev pulls zlib1g-dev (through
# libprotobuf-dev); it is removed with --force-depends, as the GPU image has no -dev packages.
# Mounted: /proc, /dev, /dev/pts, /dev/shm; unmounted on exit, failure and Ctrl-C included.
set -euo pipefail

HERE=$(cd "$(dirname "$0")" && pwd)
SRC=$(cd "$HERE/../.." && pwd)
CACHE=/var/cache/ddp-cpp
ROOT=${DDP_GPUCHECK_ROOT:-$CACHE/gpucheck-root}
KEEP_BUILD=0
[[ ${1:-} == --keep-build ]] && KEEP_BUILD=1 && shift
REPORTS=${1:-$CACHE/gpucheck-reports/$(date -u +%Y%m%dT%H%M)}
MIRROR=http://deb.debian.org/debian
# What the GPU image has, in Debian's terms: a toolchain, Python and a PyTorch (with its LibTorch
# CMake files); libopenblas so that Debian's LibTorch is not on the reference BLAS; procps (free).
PACKAGES=(g++ cmake ninja-build python3 python3-torch libtorch-dev libopenblas0-pthread procps)
# Our build dependencies, which the bundle replaces: none may be installed in the root.
ABSENT=(libfmt-dev libcli11-dev nlohmann-json3-dev googletest libgtest-dev libgmock-dev zlib1g-dev
        libssl-dev libgloo-dev dataset-fashion-mnist)
TREE_IN=/src/ddp-cpp

log() { echo "rehearse: $*" >&2; }
die() { log "ERROR: $*"; exit 1; }

[[ $(id -u) -eq 0 ]] || die "run as root (debootstrap, chroot, mount)"
case "$ROOT/" in "$SRC"/*) die "the root must be outside the source tree" ;; esac

mounts_below() {
  awk -v d="$(realpath -m "$1")" '{ if ($5 == d || index($5, d "/") == 1) print $5 }' \
    /proc/self/mountinfo | sort -r
}
unmount_below() {
  local m
  for m in $(mounts_below "$1"); do umount "$m" 2>/dev/null || umount -l "$m" || log "could not unmount $m"; done
}
in_root() {
  chroot "$ROOT" /usr/bin/env -i PATH=/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin HOME=/root \
    LANG=C.UTF-8 DEBIAN_FRONTEND=noninteractive "$@"
}

exec 9>"$ROOT.lock"
flock -n 9 || { log "waiting for another rehearsal"; flock 9; }
trap 'unmount_below "$ROOT"' EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
unmount_below "$ROOT"

# --- the root -----------------------------------------------------------------------------------
if [[ ! -f $ROOT/.ddp-debootstrap-done ]]; then
  [[ ! -e $ROOT ]] || die "$ROOT exists but is not a finished root: remove it (rm -rf --one-file-system)"
  command -v debootstrap >/dev/null || { apt-get update -q && apt-get install -y -q debootstrap; }
  rm -rf --one-file-system "$ROOT.new"
  log "debootstrap bookworm into $ROOT (a few minutes)"
  debootstrap --variant=minbase --components=main bookworm "$ROOT.new" "$MIRROR" \
    >"$CACHE/gpucheck-debootstrap.log" 2>&1 || die "debootstrap failed ($CACHE/gpucheck-debootstrap.log)"
  printf 'deb %s bookworm main\ndeb %s bookworm-updates main\ndeb %s-security bookworm-security main\n' \
    "$MIRROR" "$MIRROR" "$MIRROR" >"$ROOT.new/etc/apt/sources.list"
  printf '#!/bin/sh\nexit 101\n' >"$ROOT.new/usr/sbin/policy-rc.d" && chmod +x "$ROOT.new/usr/sbin/policy-rc.d"
  touch "$ROOT.new/.ddp-debootstrap-done"
  mv "$ROOT.new" "$ROOT"
fi
mount --bind "$ROOT" "$ROOT"
mount -t proc proc "$ROOT/proc"
mount --bind /dev "$ROOT/dev"
mount --bind /dev/pts "$ROOT/dev/pts"
mount --bind /dev/shm "$ROOT/dev/shm"
cp /etc/resolv.conf /etc/hosts "$ROOT/etc/"

missing=()
for p in "${PACKAGES[@]}"; do
  in_root dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  log "installing in the root: ${missing[*]}"
  in_root apt-get update -q >/dev/null
  in_root apt-get install -y -q --no-install-recommends "${missing[@]}" >"$CACHE/gpucheck-apt.log" 2>&1 ||
    die "apt-get install failed ($CACHE/gpucheck-apt.log)"
  in_root apt-get clean
fi
for p in "${ABSENT[@]}"; do
  if in_root dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    log "removing $p from the root (pulled in by ${PACKAGES[*]}; the GPU image has no -dev packages)"
    in_root dpkg --remove --force-depends "$p" >/dev/null
  fi
done
for h in fmt CLI nlohmann gtest gmock gloo openssl zlib.h; do
  [[ ! -e $ROOT/usr/include/$h ]] || die "$ROOT/usr/include/$h exists: the rehearsal would not prove the bundle"
done

# --- the tree, as it would travel ------------------------------------------------------------
work=$(mktemp -d /tmp/ddp-gpucheck-rehearsal.XXXXXX)
trap 'unmount_below "$ROOT"; rm -rf "$work"' EXIT
branch=$(git -C "$SRC" rev-parse --abbrev-ref HEAD)
git clone -q --branch "$branch" "$SRC" "$work/clone"
[[ -z $(git -C "$SRC" status --porcelain --untracked-files=no) ]] ||
  log "note: $SRC has uncommitted changes; the rehearsal uses the committed $branch ($(git -C "$work/clone" rev-parse --short HEAD))"
"$work/clone/scripts/gpu-check/bundle.sh"
if ((KEEP_BUILD)); then
  find "$ROOT$TREE_IN" -mindepth 1 -maxdepth 1 ! -name build-gpu -exec rm -rf {} + 2>/dev/null || true
else
  rm -rf "$ROOT$TREE_IN"
fi
mkdir -p "$ROOT$TREE_IN"
(cd "$work/clone" && git ls-files -z -co --exclude-standard | xargs -0 cp --parents -t "$ROOT$TREE_IN")
travel=$(du -sk --exclude=build-gpu "$ROOT$TREE_IN" | awk '{printf "%.1f MiB", $1 / 1024}')
log "tree copied into the root: $travel, $(find "$ROOT$TREE_IN" -path "$ROOT$TREE_IN/build-gpu" -prune -o -type f -print | wc -l) files, no .git$( ((KEEP_BUILD)) && echo "; build-gpu/ kept")"

# --- the runs --------------------------------------------------------------------------------
run_in_root() {  # REPORT_NAME [VAR=value...]
  local name=$1
  shift
  local start=$SECONDS rc=0
  in_root "$@" DDP_TORCH_PREFIX=/usr GPU_CHECK_QUICK=1 GPU_CHECK_JOBS=2 GPU_CHECK_BUDGET_S=5400 \
    nice -n 10 bash -c "cd $TREE_IN && exec scripts/gpu-check/run.sh /reports/$name" </dev/null || rc=$?
  log "$name: exit $rc after $((SECONDS - start)) s"
}
rm -rf "$ROOT/reports"
run_in_root device-as-is
run_in_root gpu-steps-on-cpu GPU_CHECK_DEVICE=cpu GPU_CHECK_STEPS=env,build,vs-pytorch,train-cuda
leftover=$(pgrep -f "$TREE_IN/build-gpu" || true)
[[ -z $leftover ]] || log "WARNING: processes left running: $leftover"
mkdir -p "$REPORTS"
cp -r "$ROOT/reports/." "$REPORTS/"
# What the root holds beyond debootstrap's minbase: what the packages above pulled in.
in_root dpkg-query -W -f='${Package} ${Version}\n' >"$REPORTS/root-packages.txt"
log "reports in $REPORTS (device-as-is/report.md, gpu-steps-on-cpu/report.md)"
