#!/usr/bin/env bash
# Configures and builds ddp-cpp into build/ (installing dependencies first).
# Usage: scripts/build.sh [cmake --build arguments, e.g. --target ddprun]
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
BUILD_DIR=${DDP_BUILD_DIR:-build}
cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=${CMAKE_BUILD_TYPE:-Release} >/dev/null
cmake --build "$BUILD_DIR" -j"$(nproc)" "$@"
