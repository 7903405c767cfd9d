#!/usr/bin/env bash
# The whole test suite, from a fresh machine: install, build, run every test.
# Extra arguments go to ctest, e.g. scripts/test.sh -L unit
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/build.sh
BUILD_DIR=${DDP_BUILD_DIR:-build}
cd "$BUILD_DIR"
# Serial: the collective and multi-process tests start several ranks each on a 2-core machine.
ctest --output-on-failure "$@"
