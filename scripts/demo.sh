#!/usr/bin/env bash
# The main job, from a fresh machine: install, build the two programs it runs (ddprun and
# ddp-train, not the tests or benchmarks), then train the default model on Fashion-MNIST with
# 2 processes (ddp-train's defaults: see ddp-train --help).
# Extra arguments go to ddp-train, e.g. scripts/demo.sh --epochs 1
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/build.sh --target ddprun ddp-train
BUILD_DIR=${DDP_BUILD_DIR:-build}
exec "$BUILD_DIR"/tools/ddprun/ddprun --standalone --nproc-per-node 2 \
     "$BUILD_DIR"/tools/ddp_train/ddp-train "$@"
