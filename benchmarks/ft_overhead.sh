#!/usr/bin/env bash
# The steady-state cost of per-step fault tolerance (issue 33): ddp-train's training throughput
# with --ft (each step under ddp::ft::Manager: the quorum check, the commit vote, rank 0's
# record of each commit) against the same job without it, no failure injected. Three variants
# per model and world size, alternated within each round (their order rotates every round),
# medians over the rounds:
#   plain      ddprun ddp-train                    (the prefetching loader, --workers 1)
#   plain-w0   ddprun ddp-train --workers 0        (batches loaded in the training thread, as
#                                                   the --ft loop does: isolates the vote)
#   ft         ddprun --ft ddp-train --ft
# The figure is each epoch line's "samples/s" (the epoch's training samples over its training
# time, evaluation excluded).
#
# Usage: benchmarks/ft_overhead.sh [-m "mlp cnn"] [-n "2 4"] [-r ROUNDS] [-s TRAIN_SUBSET]
#                                  [-o OUT_PREFIX]
#   defaults: -m "mlp cnn" -n "2 4" -r 3 -s 12000 -o ft_overhead; writes OUT_PREFIX.csv (every
#   run) and OUT_PREFIX_summary.csv (medians and ratios). Tools come from $DDP_BUILD_DIR
#   (default build/), else PATH. Run it on a quiet machine.
set -euo pipefail

models="mlp cnn" worlds="2 4" rounds=3 subset=12000 out=ft_overhead
while getopts "m:n:r:s:o:h" opt; do
  case $opt in
    m) models=$OPTARG ;; n) worlds=$OPTARG ;; r) rounds=$OPTARG ;; s) subset=$OPTARG ;;
    o) out=$OPTARG ;;
    *) sed -n '2,19p' "$0"; exit 2 ;;
  esac
done

root=$(cd "$(dirname "$0")/.." && pwd)
source "$root/benchmarks/tools.sh"  # tool: the built binary, else the installed one
train=$(tool tools/ddp_train/ddp-train ddp-train)
ddprun=$(tool tools/ddprun/ddprun ddprun)
work=$(mktemp -d /tmp/ddp-ft-overhead.XXXXXX)
trap 'rm -rf "$work"' EXIT

raw=$out.csv summary=${out}_summary.csv
echo "model,world,variant,round,samples_per_s" > "$raw"

# One run; prints its epoch's samples/s.
run() {
  local model=$1 world=$2 variant=$3 dir=$work/run-$RANDOM
  local launch=("$ddprun" --standalone --nproc-per-node "$world")
  local flags=(--model "$model" --epochs 1 --train-subset "$subset" --test-subset 1000
               --log-every 100000 --no-plots --output-dir "$dir")
  case $variant in
    plain) ;;
    plain-w0) flags+=(--workers 0) ;;
    ft) launch=("$ddprun" --ft --standalone --nproc-per-node "$world"); flags+=(--ft) ;;
  esac
  "${launch[@]}" "$train" "${flags[@]}" 2>&1 |
    sed -n 's/.*epoch 1\/1: .* \([0-9.]*\) samples\/s.*/\1/p' | head -1
  rm -rf "$dir"
}

variants=(plain plain-w0 ft)
echo "# ft_overhead.sh: models $models, worlds $worlds, $rounds rounds, $subset training samples"
for model in $models; do
  for world in $worlds; do
    for ((r = 0; r < rounds; r++)); do
      for ((k = 0; k < ${#variants[@]}; k++)); do
        v=${variants[$(((k + r) % ${#variants[@]}))]}
        s=$(run "$model" "$world" "$v")
        echo "$model,$world,$v,$r,${s:-nan}" | tee -a "$raw"
      done
    done
  done
done

# The median of one configuration's runs (the upper middle value).
median() {
  awk -F, -v m="$1" -v w="$2" -v v="$3" '$1 == m && $2 == w && $3 == v { print $5 }' "$raw" |
    sort -g | awk '{ x[NR] = $1 } END { if (NR) print x[int(NR / 2) + 1]; else print "nan" }'
}
{
  echo "model,world,plain,plain_w0,ft,ft_over_plain,ft_over_plain_w0"
  for model in $models; do
    for world in $worlds; do
      p=$(median "$model" "$world" plain) p0=$(median "$model" "$world" plain-w0)
      f=$(median "$model" "$world" ft)
      awk -v m="$model" -v w="$world" -v p="$p" -v p0="$p0" -v f="$f" \
        'BEGIN { printf "%s,%s,%s,%s,%s,%.3f,%.3f\n", m, w, p, p0, f, f / p, f / p0 }'
    done
  done
} > "$summary"
cat "$summary"
