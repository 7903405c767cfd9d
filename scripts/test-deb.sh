#!/usr/bin/env bash
# The Debian packages, as a Debian user gets them: builds them (cpack -G DEB), installs them with
# `apt-get install ./<package>.deb` into a clean bookworm root, where apt must resolve every
# declared dependency from Debian's archive, then uses them there.
#
#   scripts/test-deb.sh              build the packages, test them in a throwaway root
#   scripts/test-deb.sh --prepare    create/refresh the cached clean root only (scripts/test.sh
#                                    runs this in the background while it builds)
#
# Run as root. The steps:
#   1. the clean root: debootstrap --variant=minbase bookworm in $DDP_DEB_ROOT (default
#      /var/cache/ddp-cpp/bookworm-deb-root), made once and never modified afterwards except
#      for its apt lists (refreshed when older than 6 h); Debian's .debs the tests need are
#      downloaded ahead into a host cache, /var/cache/ddp-cpp/deb-apt-archives, which is the
#      root's /var/cache/apt/archives: a warm run downloads nothing;
#   2. the packages: a build folder of their own ($DDP_DEB_BUILD_DIR, default build-deb/:
#      -DCMAKE_INSTALL_PREFIX=/usr, Release as scripts/build.sh, without tests, examples and
#      benchmarks; ccache shares the objects of build/), then cpack -G DEB there;
#   3. a throwaway root: an overlay on the clean root (its changes go to $DDP_DEB_ROOT.run.*,
#      removed on exit), with the .debs copied in and listed as a local apt source: nothing of
#      the source tree or of our builds is mounted there;
#   4. apt-get install --no-install-recommends ./ddp-tools_*.deb: only declared Depends come in,
#      libddp among them (from the local source). Then: no -dev package came in, every library
#      of the programs resolves (ldd), libddp.so from the libddp package, and ddprun, ddp-train
#      and ddp-bench --help run;
#   5. apt-get install --no-install-recommends ./libddp-dev_*.deb (LibTorch's -dev packages
#      come with it);
#   6. the test's own tools from Debian (g++, cmake, ninja, man-db, dataset-fashion-mnist), then:
#      man -w finds the three man pages in ddp-tools and man renders ddprun's;
#      tests/package/consumer builds with find_package(ddp) against /usr and runs; ddprun
#      --standalone --nproc-per-node 2 ddp-train --max-steps 20 trains on Debian's Fashion-MNIST
#      and writes its checkpoint.
# A dependency missing from a package fails step 4 or 6 (a library not found, find_package(Torch)
# failing); one that apt cannot resolve fails step 4 or 5. Runs are serialised by $DDP_DEB_ROOT.lock;
# every mount is undone on exit, failure and Ctrl-C included.
set -euo pipefail

SRC=$(cd "$(dirname "$0")/.." && pwd)
CACHE=/var/cache/ddp-cpp
ROOT=${DDP_DEB_ROOT:-$CACHE/bookworm-deb-root}
ARCHIVES=${DDP_DEB_ARCHIVES:-$CACHE/deb-apt-archives}
BUILD=${DDP_DEB_BUILD_DIR:-$SRC/build-deb}
MIRROR=${DDP_DEB_MIRROR:-http://deb.debian.org/debian}
SUITE=bookworm
JOBS=${DDP_JOBS:-2}
# What the checks themselves need in the root, after our packages: none of it may be needed by
# the packages' own checks of step 4.
TEST_PACKAGES=(g++ cmake ninja-build man-db dataset-fashion-mnist)
# Downloaded ahead only (never installed by --prepare): what our packages' Depends pull in.
PREFETCH=(libtorch-dev libtorch1.13 libfmt9 libssl3 zlib1g "${TEST_PACKAGES[@]}")

log() { echo "test-deb: $*" >&2; }
die() { log "ERROR: $*"; exit 1; }
# mounts_below, unmount_below, make_root, mount_system
source "$SRC/scripts/lib/debian-root.sh"

mode=test
case "${1:-}" in
  --prepare) mode=prepare ;;
  "") ;;
  -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
  *) die "unknown argument '$1' (--prepare, --help)" ;;
esac

[[ $(id -u) -eq 0 ]] || die "run as root (debootstrap, chroot and mount need it)"
case "$ROOT" in /|"") die "DDP_DEB_ROOT must be a dedicated folder" ;; esac
case "$ROOT/" in "$SRC"/*) die "the root must be outside the source tree ($SRC)" ;; esac

mkdir -p "$CACHE" "$ARCHIVES/partial"
exec 9>"$ROOT.lock"
if ! flock -n 9; then
  log "waiting for another run to release $ROOT.lock"
  flock 9
fi

run=  # the throwaway root's folder (step 3)
cleanup() {
  unmount_below "$ROOT"
  unmount_below "$ROOT.new"
  if [[ -n $run ]]; then
    unmount_below "$run"
    [[ -z $(mounts_below "$run") ]] && rm -rf --one-file-system "$run"
  fi
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
# Left over by a run that was killed -9 (the lock says no other run is using them).
unmount_below "$ROOT"
for old in "$ROOT".run.*; do
  [[ -d $old ]] || continue
  unmount_below "$old"
  rm -rf --one-file-system "$old"
done

# chroot into a root with a clean environment: in_root ROOT command...
in_root() {
  local root=$1
  shift
  chroot "$root" /usr/bin/env -i \
    PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LANG=C.UTF-8 \
    TERM=dumb DEBIAN_FRONTEND=noninteractive "$@"
}
apt_in() {  # apt_in ROOT apt-get arguments...
  local root=$1
  shift
  in_root "$root" apt-get -q -o Dpkg::Use-Pty=0 "$@"
}

# --- 1. the clean root --------------------------------------------------------------------------
make_root "$ROOT" "$SUITE" "$MIRROR" main "$CACHE/bookworm-deb-debootstrap.log" \
  "deb $MIRROR $SUITE main
deb $MIRROR $SUITE-updates main
deb ${MIRROR%/debian}/debian-security $SUITE-security main"

prepare_root() {
  mount_system "$ROOT"
  mount --bind "$ARCHIVES" "$ROOT/var/cache/apt/archives"
  local lists=$ROOT/var/lib/apt/lists/.ddp-updated
  if [[ -z $(find "$lists" -mmin -360 2>/dev/null) ]]; then
    log "refreshing the clean root's apt lists"
    apt_in "$ROOT" update >/dev/null
    touch "$lists"
  fi
  # Into the host's cache only; the root's installed packages do not change.
  local start=$SECONDS
  apt_in "$ROOT" install -y --download-only --no-install-recommends "${PREFETCH[@]}" >/dev/null ||
    die "downloading ${PREFETCH[*]} failed"
  apt_in "$ROOT" autoclean >/dev/null  # versions the archive no longer has
  log "Debian's packages for the test in $ARCHIVES ($(du -sh "$ARCHIVES" | cut -f1), $((SECONDS - start)) s)"
  unmount_below "$ROOT"
}
prepare_root
[[ $mode == prepare ]] && exit 0

# --- 2. the packages ----------------------------------------------------------------------------
# Without dpkg-shlibdeps cpack would make packages without their run-time Depends.
for t in dpkg-shlibdeps dpkg-scanpackages help2man; do
  command -v $t >/dev/null || die "$t is missing: run scripts/install-deps.sh"
done
start=$SECONDS
export CCACHE_BASEDIR=$SRC  # the same objects as build/, from another build folder
cmake -S "$SRC" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE="${CMAKE_BUILD_TYPE:-Release}" \
  -DCMAKE_INSTALL_PREFIX=/usr -DDDP_BUILD_TESTS=OFF -DDDP_BUILD_EXAMPLES=OFF \
  -DDDP_BUILD_BENCHMARKS=OFF >/dev/null
log "building $BUILD (-j$JOBS; minutes when ccache has not seen these sources)"
cmake --build "$BUILD" -j"$JOBS" >"$BUILD/build.log" 2>&1 ||
  { tail -40 "$BUILD/build.log" >&2; die "building $BUILD failed ($BUILD/build.log)"; }
rm -f "$BUILD"/*.deb
(cd "$BUILD" && cpack -G DEB >cpack.log 2>&1) || { cat "$BUILD/cpack.log" >&2; die "cpack failed"; }
debs=("$BUILD"/*.deb)
[[ -e ${debs[0]} ]] || die "cpack made no .deb in $BUILD"
log "packages built in $((SECONDS - start)) s:"
for d in "${debs[@]}"; do
  log "  $(basename "$d") ($(du -k "$d" | cut -f1) KiB): Depends: $(dpkg-deb -f "$d" Depends)"
done

# --- 3. the throwaway root ----------------------------------------------------------------------
run=$(mktemp -d "$ROOT.run.XXXXXX")
mkdir "$run/upper" "$run/work" "$run/root"
mount -t overlay overlay -o "lowerdir=$ROOT,upperdir=$run/upper,workdir=$run/work" "$run/root"
R=$run/root
mount_system "$R"
mount --bind "$ARCHIVES" "$R/var/cache/apt/archives"
# The .debs, and the same as a local apt source: installing ./ddp-tools_*.deb must pull libddp
# through its declared dependency (a local .deb named on the command line is installed whether
# another needs it or not, which would hide a missing one).
mkdir "$R/tmp/debs"
cp "${debs[@]}" "$R/tmp/debs/"
(cd "$R/tmp/debs" && dpkg-scanpackages --multiversion . >Packages 2>/dev/null)
echo "deb [trusted=yes] file:/tmp/debs ./" >"$R/etc/apt/sources.list.d/ddp-debs.list"
apt_in "$R" update -o Dir::Etc::sourcelist=sources.list.d/ddp-debs.list \
  -o Dir::Etc::sourceparts=- -o APT::Get::List-Cleanup=0 >/dev/null
deb_in() {  # deb_in PACKAGE: the path of its .deb inside the root
  local d=("$R"/tmp/debs/"$1"_*.deb)
  [[ -e ${d[0]} ]] || die "cpack made no $1 package"
  echo "/tmp/debs/${d[0]##*/}"
}
for p in libddp libddp-dev ddp-tools; do
  ! in_root "$R" dpkg-query -W "$p" >/dev/null 2>&1 || die "the clean root already has $p"
done
check() {  # check DESCRIPTION SCRIPT: runs SCRIPT in the throwaway root; its last line is shown
  local what=$1 out
  if ! out=$(in_root "$R" bash -c "$2" 2>&1); then
    echo "$out" | tail -30 >&2
    die "failed: $what"
  fi
  log "OK: $what${out:+ (${out##*$'\n'})}"
}
apt_install() {  # apt_install LOG_NAME PACKAGE_OR_DEB...: with Depends only (no Recommends)
  local name=$1 start=$SECONDS
  shift
  apt_in "$R" install -y --no-install-recommends "$@" >"$run/$name.log" 2>&1 ||
    { tail -30 "$run/$name.log" >&2; die "apt-get install $* failed"; }
  log "apt-get install $*: $(grep -c '^Setting up' "$run/$name.log") packages in $((SECONDS - start)) s"
}

# --- 4. the tools: what ddp-tools declares is all they need ------------------------------------
apt_install tools "$(deb_in ddp-tools)"
check "ddp-tools pulled libddp and no -dev package" '
  set -e
  dpkg-query -W libddp
  for p in libddp-dev libtorch-dev; do
    if dpkg-query -W -f="\${Status}" "$p" 2>/dev/null | grep -q "ok installed"; then
      echo "$p was installed for ddp-tools"; exit 1
    fi
  done'
check "every library of the programs resolves, libddp.so from the libddp package" '
  set -e
  for b in /usr/bin/ddprun /usr/bin/ddp-train /usr/bin/ddp-bench; do
    if ldd "$b" | grep "not found"; then echo "$b: a library is missing"; exit 1; fi
  done
  lib=$(realpath -e "$(ldd /usr/bin/ddp-train | awk "/libddp.so =>/ {print \$3}")")
  dpkg -L libddp | grep -qx "$lib"
  echo "libddp.so: $lib"'
check "ddprun, ddp-train, ddp-bench --help" '
  set -e
  for t in ddprun ddp-train ddp-bench; do "$t" --help >/dev/null; done'

# --- 5. the library for developers: what libddp-dev declares is all find_package(ddp) needs ----
apt_install dev "$(deb_in libddp-dev)"

# --- 6. the test's own tools, then the man pages, a consumer, a training run --------------------
apt_install test "${TEST_PACKAGES[@]}"
check "man pages: man -w ddprun ddp-train ddp-bench, from ddp-tools" '
  set -e
  for t in ddprun ddp-train ddp-bench; do
    page=$(man -w "$t")
    dpkg -S "$page" | grep -q "^ddp-tools:"
  done
  MANWIDTH=100 man ddprun 2>/dev/null | grep -q -- "--nproc-per-node"'
mkdir "$R/tmp/consumer"
cp "$SRC"/tests/package/consumer/{CMakeLists.txt,main.cpp} "$R/tmp/consumer/"
start=$SECONDS
check "find_package(ddp) from /usr: tests/package/consumer builds and runs" '
  set -e
  cmake -S /tmp/consumer -B /tmp/consumer/build -G Ninja -DCMAKE_BUILD_TYPE=Release
  cmake --build /tmp/consumer/build
  /tmp/consumer/build/consumer'
log "consumer: $((SECONDS - start)) s"
start=$SECONDS
check "ddprun --standalone --nproc-per-node 2 ddp-train --max-steps 20 (Fashion-MNIST)" '
  set -e
  cd /tmp
  ddprun --standalone --nproc-per-node 2 ddp-train --max-steps 20 --test-subset 1000 \
    --output-dir /tmp/train --no-plots >/tmp/train.log 2>&1 || { tail -30 /tmp/train.log; exit 1; }
  test -s /tmp/train/checkpoints/last.ckpt
  grep -a "done:.* 20 steps" /tmp/train.log'
log "training: $((SECONDS - start)) s"
log "PASS: $(printf '%s ' "${debs[@]##*/}")installed by apt into a clean $SUITE root and used there"
