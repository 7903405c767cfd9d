#!/usr/bin/env bash
# Every figure of docs/performance.md's "Measured on one host" section, in one run, into one
# folder: run it on a quiet machine (nothing else using the cores), after scripts/build.sh. Each
# step prints its command and writes its output to OUT/<step>.txt (and CSV/PNG where the tool
# makes them).
#
#   benchmarks/readme_figures.sh [-o OUT] [-p PAIRS] [-q]
#     -o OUT    output folder (default: figures-<date>)
#     -p PAIRS  alternating pairs for the PyTorch comparison (default 5)
#     -q        quick: fewer pairs, steps and iterations (a check that everything runs)
# Steps: 1. all_reduce sweep, 2 ranks, gloo / shm / shm-inplace, with the memcpy floor;
#        2. our DDP against PyTorch's on identical work, with the communication-free ceiling
#           (the same malloc settings on both sides); 2b. a program written as the README
#           teaches (benchmarks/user_program) against PyTorch's DDP as its users run it (no
#           malloc settings on either side);
#        3. DDP at 2 ranks against 1 process x 1 and x 2 threads, both comparison models;
#        4. DDP's overhead at world size 1;
#        5. the same comparison as 2 while two busy loops share the cores (a loaded machine);
#        6. ddp-train's default demo over gloo and over the default transport (time, accuracy).
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
build=${DDP_BUILD_DIR:-$root/build}
out=figures-$(date +%Y%m%d-%H%M) pairs=5 quick=0
while getopts "o:p:qh" opt; do
  case $opt in
    o) out=$OPTARG ;; p) pairs=$OPTARG ;; q) quick=1 ;;
    *) sed -n '2,17p' "$0"; exit 2 ;;
  esac
done
mkdir -p "$out"
ddprun=$build/tools/ddprun/ddprun
bench=$build/tools/ddp_bench/ddp-bench
train=$build/tools/ddp_train/ddp-train
for t in "$ddprun" "$bench" "$train" "$build/benchmarks/bench_ddp" "$build/benchmarks/user_program"; do
  [[ -x $t ]] || { echo "readme_figures.sh: $t is missing: run scripts/build.sh" >&2; exit 1; }
done
iters=30 steps=150 warmup=15 epochs=3
if ((quick)); then iters=3 steps=10 warmup=2 pairs=1 epochs=1; fi
# PyTorch's processes return freed memory to the kernel at every step unless told otherwise,
# which costs it more than its DDP does; ours calls ddp::retain_freed_memory(). Both sides get
# the same settings, so the comparison is about DDP.
same_malloc=(env MALLOC_MMAP_THRESHOLD_=33554432 MALLOC_TRIM_THRESHOLD_=2147483647)

step() {  # step NAME COMMAND...: runs it, output to the terminal and OUT/NAME.txt
  local name=$1
  shift
  echo "## $name: $*" | tee "$out/$name.txt"
  "$@" 2>&1 | tee -a "$out/$name.txt"
}

cpu=$(awk -F': ' '/^model name/ {print $2; exit}' /proc/cpuinfo)
echo "# readme_figures.sh: $(date -Iseconds) on $(hostname), $cpu, $(nproc) cores; load: $(cut -d' ' -f1-3 /proc/loadavg)" |
  tee "$out/0-machine.txt"
echo "# the single-core memcpy floor of this machine is step 1's 'memcpy' row (allreduce.csv)" |
  tee -a "$out/0-machine.txt"
step 1-allreduce "$ddprun" --standalone --nproc-per-node 2 "$bench" collectives \
  --backend gloo,shm,shm-inplace --ops all_reduce --min-bytes 8 --max-bytes 16M \
  --iters "$iters" --csv "$out/allreduce.csv" --png "$out/allreduce.png"
step 2-vs-pytorch "${same_malloc[@]}" "$root/benchmarks/vs_pytorch/compare.py" \
  --pairs "$pairs" --steps "$steps" --warmup "$warmup" --backends shm,gloo \
  --build-dir "$build" --csv "$out/vs_pytorch.csv"
step 2b-user-program "$root/benchmarks/vs_pytorch/compare.py" --ours user-program \
  --pairs "$pairs" --steps "$steps" --warmup "$warmup" --backends auto \
  --build-dir "$build" --csv "$out/user_program.csv"
for model in classic-cnn mlp-1024; do
  step "3-scaling-$model" "$ddprun" --standalone --nproc-per-node 2 "$bench" train \
    --model "$model" --compare --repeats 3 --steps "$steps" --warmup "$warmup" \
    --csv "$out/scaling.csv" --png "$out/scaling-$model.png"
done
step 4-overhead "$build/benchmarks/bench_ddp" overhead
busy=()
for _ in 1 2; do
  sh -c 'while :; do :; done' &
  busy+=($!)
done
trap 'kill "${busy[@]}" 2>/dev/null || true' EXIT
step 5-vs-pytorch-loaded "${same_malloc[@]}" "$root/benchmarks/vs_pytorch/compare.py" \
  --pairs "$(( pairs > 3 ? 3 : pairs ))" --steps "$steps" --warmup "$warmup" \
  --backends shm,gloo --no-ceiling --build-dir "$build" --csv "$out/vs_pytorch_loaded.csv"
kill "${busy[@]}" 2>/dev/null || true
wait 2>/dev/null || true
for backend in gloo auto; do
  step "6-demo-$backend" "$ddprun" --standalone --nproc-per-node 2 --backend "$backend" \
    "$train" --epochs "$epochs" --output-dir "$out/demo-$backend"
done
echo "# done: $out"
