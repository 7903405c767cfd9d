#!/usr/bin/env bash
# ddprun --cpu-bind cores against none (Note [CPU binding] in tools/ddprun/cpu_bind.h), side by
# side: N ranks of `ddp-bench train` (classic-cnn and mlp-1024) and of `ddp-bench collectives`
# (all_reduce over shm, 4 MiB, after the smaller sizes warm its buffers), on an idle machine and with another job on the cores (one
# unpinned busy process, as a neighbour's job would be), alternating the two bindings for R
# rounds; medians, and the ratio cores/none (above 1: binding wins).
#
# Usage: benchmarks/cpu_bind.sh [-n N] [-r ROUNDS] [-s STEPS] [-o OUT_PREFIX]
#   defaults: -n 2 -r 5 -s 60; writes OUT_PREFIX.csv (every run: condition, binding, what,
#   value) and prints the table (default prefix: cpu_bind). Tools from $DDP_BUILD_DIR (default
#   build/), else PATH.
set -euo pipefail

n=2 rounds=5 steps=60 out=cpu_bind
while getopts "n:r:s:o:h" opt; do
  case $opt in
    n) n=$OPTARG ;; r) rounds=$OPTARG ;; s) steps=$OPTARG ;; o) out=$OPTARG ;;
    *) sed -n '2,12p' "$0"; exit 2 ;;
  esac
done

root=$(cd "$(dirname "$0")/.." && pwd)
source "$root/benchmarks/tools.sh"  # tool: the built binary, else the installed one
bench=$(tool tools/ddp_bench/ddp-bench ddp-bench)
ddprun=$(tool tools/ddprun/ddprun ddprun)

raw=$out.csv
echo "condition,binding,what,value" > "$raw"
tmp=$(mktemp -d)
hog=
cleanup() { [[ -n $hog ]] && kill "$hog" 2>/dev/null; rm -rf "$tmp"; }
trap cleanup EXIT

# One measurement: appends "condition,binding,what,value" rows.
measure() {  # measure CONDITION BINDING
  local cond=$1 bind=$2 model
  for model in classic-cnn mlp-1024; do
    rm -f "$tmp/train.csv"
    env -u OMP_NUM_THREADS "$ddprun" --standalone --nproc-per-node "$n" --cpu-bind "$bind" \
        "$bench" train --model "$model" --steps "$steps" --warmup 10 --csv "$tmp/train.csv" \
        >/dev/null 2>&1
    awk -F, -v c="$cond" -v b="$bind" -v m="$model" 'NR > 1 { print c "," b "," m " samples/s," $8 }' \
        "$tmp/train.csv" >> "$raw"
  done
  rm -f "$tmp/coll.csv"
  env -u OMP_NUM_THREADS "$ddprun" --standalone --nproc-per-node "$n" --cpu-bind "$bind" \
      "$bench" collectives --backend shm --ops all_reduce --min-bytes 256K --max-bytes 4M \
      --iters 50 --csv "$tmp/coll.csv" >/dev/null 2>&1
  awk -F, -v c="$cond" -v b="$bind" '$1 == "shm" && $5 == 4194304 { print c "," b ",all_reduce 4 MiB busbw GB/s," $10 }' \
      "$tmp/coll.csv" >> "$raw"
}

echo "# cpu_bind.sh: $n ranks, $rounds rounds, train $steps steps; $(nproc) CPUs: $(lscpu | sed -n 's/^Model name: *//p')"
for cond in idle busy; do
  if [[ $cond == busy ]]; then
    sh -c 'while :; do :; done' &
    hog=$!
  fi
  for ((r = 1; r <= rounds; r++)); do
    if ((r % 2)); then order=(none cores); else order=(cores none); fi
    for bind in "${order[@]}"; do measure "$cond" "$bind"; done
    echo "# $cond: round $r/$rounds done"
  done
  if [[ -n $hog ]]; then kill "$hog"; wait "$hog" 2>/dev/null || true; hog=; fi
done

# Medians (upper middle) per condition, binding and measurement; ratio cores / none.
echo
printf '%-6s %-32s %12s %12s %8s\n' condition measurement none cores ratio
awk -F, 'NR > 1 { v[$1 "|" $3 "|" $2] = v[$1 "|" $3 "|" $2] " " $4; keys[$1 "|" $3] = 1 }
  function median(list,   a, n, i, j, t) {
    n = split(list, a, " ")
    for (i = 1; i <= n; i++) for (j = i + 1; j <= n; j++) if (a[j] + 0 < a[i] + 0) { t = a[i]; a[i] = a[j]; a[j] = t }
    return n ? a[int(n / 2) + 1] : "nan"
  }
  END {
    for (k in keys) {
      split(k, p, "|")
      none = median(v[k "|none"]); cores = median(v[k "|cores"])
      printf "%-9s %-32s %12.2f %12.2f %8.3f\n", p[1], p[2], none, cores, cores / none
    }
  }' "$raw" | sort
echo "# every run: $raw"
