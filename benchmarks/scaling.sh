#!/usr/bin/env bash
# Scaling on one host, measured with separate processes: 1 process x 1 thread, 1 process x N
# intra-op threads (the real alternative on one CPU host) and N ranks x 1 thread (DDP under
# ddprun), alternating for R rounds; medians, then
#   scaling efficiency = throughput(N ranks) / (N x throughput(1 x 1))
#   ratio              = throughput(N ranks) / throughput(1 x N threads)
# (`ddp-bench train --compare` measures the same three inside one N-rank job.)
#
# Usage: benchmarks/scaling.sh [-n N] [-m MODEL] [-r ROUNDS] [-s STEPS] [-w WARMUP]
#                              [-b GLOBAL_BATCH] [-B BACKEND] [-o OUT_PREFIX]
#   defaults: -n 2 -m classic-cnn -r 3 -s 100 -w 10 -b 128, backend: the library's default;
#   writes OUT_PREFIX.csv (every run, ddp-bench's columns) and OUT_PREFIX_summary.csv
#   (default prefix: scaling). Tools come from $DDP_BUILD_DIR (default build/), else PATH.
set -euo pipefail

n=2 model=classic-cnn rounds=3 steps=100 warmup=10 batch=128 backend="" out=scaling
while getopts "n:m:r:s:w:b:B:o:h" opt; do
  case $opt in
    n) n=$OPTARG ;; m) model=$OPTARG ;; r) rounds=$OPTARG ;; s) steps=$OPTARG ;;
    w) warmup=$OPTARG ;; b) batch=$OPTARG ;; B) backend=$OPTARG ;; o) out=$OPTARG ;;
    *) sed -n '2,16p' "$0"; exit 2 ;;
  esac
done

root=$(cd "$(dirname "$0")/.." && pwd)
source "$root/benchmarks/tools.sh"  # tool: the built binary, else the installed one
bench=$(tool tools/ddp_bench/ddp-bench ddp-bench)
ddprun=$(tool tools/ddprun/ddprun ddprun)

raw=$out.csv summary=${out}_summary.csv
rm -f "$raw"
common=(train --model "$model" --batch-size "$batch" --steps "$steps" --warmup "$warmup"
        --csv "$raw")
[[ -n $backend ]] && common+=(--backend "$backend")

echo "# scaling.sh: $model, global batch $batch, $steps steps after $warmup warm-up, $rounds rounds, N = $n"
for ((r = 1; r <= rounds; r++)); do
  echo "# round $r/$rounds"
  OMP_NUM_THREADS=1 "$bench" "${common[@]}" --threads 1 --label w1x1 | grep -v '^#' || true
  OMP_NUM_THREADS=$n "$bench" "${common[@]}" --threads "$n" --label "w1x$n" | grep -v '^#' || true
  OMP_NUM_THREADS=1 "$ddprun" --standalone --nproc-per-node "$n" "$bench" "${common[@]}" \
      --threads 1 --label "w${n}x1" | grep -v '\] #' || true
done

# Median samples/s (column 8) of one label: the upper middle value, as ddp-bench's median.
median() {
  awk -F, -v label="$1" '$1 == label { print $8 }' "$raw" | sort -g |
    awk '{ v[NR] = $1 } END { if (NR) print v[int(NR / 2) + 1]; else print "nan" }'
}
one=$(median w1x1) threaded=$(median "w1x$n") ddp=$(median "w${n}x1")
eff=$(awk -v d="$ddp" -v o="$one" -v n="$n" 'BEGIN { printf "%.3f", d / (n * o) }')
ratio=$(awk -v d="$ddp" -v t="$threaded" 'BEGIN { printf "%.3f", d / t }')

{
  echo "configuration,samples_per_s"
  echo "1 process x 1 thread,$one"
  echo "1 process x $n threads,$threaded"
  echo "$n ranks x 1 thread,$ddp"
  echo "scaling efficiency,$eff"
  echo "ratio to 1 process x $n threads,$ratio"
} > "$summary"

echo "#"
echo "# medians of $rounds rounds (samples/s):"
printf '  %-26s %10.1f\n' "1 process x 1 thread" "$one" "1 process x $n threads" "$threaded" \
    "$n ranks x 1 thread" "$ddp"
echo "# scaling efficiency at $n ranks: $eff = $ddp / ($n x $one)"
echo "# $n ranks x 1 thread vs 1 process x $n threads: ${ratio}x"
echo "# csv: $raw (every run), $summary"
