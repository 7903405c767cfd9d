#!/usr/bin/env bash
# The main job, from a fresh machine: install, build, then launch it on 2 processes.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/build.sh
BUILD_DIR=${DDP_BUILD_DIR:-build}
exec "$BUILD_DIR"/tools/ddprun/ddprun --standalone --nproc-per-node 2 "$BUILD_DIR"/examples/allreduce
