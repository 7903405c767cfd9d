#!/usr/bin/env bash
# The whole test suite, from a fresh machine: install, build, run every test; then the same suite
# against LibTorch 2.6 in a Debian trixie root (scripts/test-libtorch2.sh; skipped with
# DDP_SKIP_LIBTORCH2=1, or when not root). Fails if either fails.
# Extra arguments go to ctest (both runs), e.g. scripts/test.sh -L unit
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/build.sh
BUILD_DIR=${DDP_BUILD_DIR:-build}
# Serial: the collective and multi-process tests start several ranks each on a 2-core machine.
rc=0
(cd "$BUILD_DIR" && ctest --output-on-failure "$@") || rc=$?

if [[ ${DDP_SKIP_LIBTORCH2:-0} == 1 ]]; then
  echo "test.sh: LibTorch 2.x suite skipped (DDP_SKIP_LIBTORCH2=1)"
elif [[ $(id -u) -ne 0 ]]; then
  echo "test.sh: LibTorch 2.x suite skipped: scripts/test-libtorch2.sh needs root (debootstrap, chroot)"
else
  echo "test.sh: LibTorch 1.13 (bookworm) suite exit $rc; now the LibTorch 2.6 (trixie) suite"
  scripts/test-libtorch2.sh "$@" || rc=$?
fi
exit $rc
