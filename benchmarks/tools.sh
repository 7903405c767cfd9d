# Sourced by the benchmark scripts: where ddp-bench and ddprun are.
#   tool RELATIVE_PATH NAME   prints $DDP_BUILD_DIR/RELATIVE_PATH (default build/) when built,
#                             else NAME on PATH (an installed ddp-tools), else fails naming both
# Needs $root (the source tree) set by the caller.
build=${DDP_BUILD_DIR:-$root/build}
tool() {
  if [[ -x $build/$1 ]]; then echo "$build/$1"
  elif command -v "$2" >/dev/null; then command -v "$2"
  else echo "$(basename "$0"): $2 not found in $build nor on PATH" >&2; exit 1; fi
}
