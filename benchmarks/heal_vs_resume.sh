#!/usr/bin/env bash
# Healing against reading a checkpoint (issue 33): how long a worker that starts again takes to
# get the job's state, per model, on one host.
#   heal    ddprun --ft ... ddp-train --ft, a worker SIGKILLed every KILL_EVERY_S seconds: its
#           replacement receives the state live from a survivor (ft::Manager's note "healed:
#           step S's state (X MB) from rank R of quorum Q, in T ms": the encoding, the two
#           broadcasts, the decoding and the restore)
#   resume  ddp-train --resume auto after a run that wrote a checkpoint ("resumed from ... (read
#           and restored in T ms)": the newest valid checkpoint found, read, checked, restored)
# Both start from a process that runs already; what comes before (the process's start, LibTorch,
# the dataset, the rendezvous) is the same for both and not counted. The restart path also
# restarts every worker and trains the steps since the checkpoint again (benchmarks/chaos.sh
# measures that whole cost). Medians over every healing / every round.
#
# Usage: benchmarks/heal_vs_resume.sh [-m "mlp cnn resnet"] [-n NPROC] [-k KILL_EVERY_S]
#                                     [-r ROUNDS] [-o OUT_PREFIX]
#   defaults: -m "mlp cnn resnet" -n 2 -k 6 -r 3 -o heal_vs_resume; writes OUT_PREFIX.csv (every
#   figure) and OUT_PREFIX_summary.csv. Tools come from $DDP_BUILD_DIR (default build/), else
#   PATH. Bounded: every run is under `timeout`.
set -euo pipefail

models="mlp cnn resnet" nproc=2 every=6 rounds=3 out=heal_vs_resume
while getopts "m:n:k:r:o:h" opt; do
  case $opt in
    m) models=$OPTARG ;; n) nproc=$OPTARG ;; k) every=$OPTARG ;; r) rounds=$OPTARG ;;
    o) out=$OPTARG ;;
    *) sed -n '2,20p' "$0"; exit 2 ;;
  esac
done

root=$(cd "$(dirname "$0")/.." && pwd)
source "$root/benchmarks/tools.sh"  # tool: the built binary, else the installed one
train=$(tool tools/ddp_train/ddp-train ddp-train)
ddprun=$(tool tools/ddprun/ddprun ddprun)
work=$(mktemp -d /tmp/ddp-heal.XXXXXX)
trap 'rm -rf "$work"' EXIT

raw=$out.csv summary=${out}_summary.csv
echo "model,path,round,ms,mb" > "$raw"

common=(--epochs 1 --train-subset 60000 --test-subset 500 --log-every 100000 --no-plots)

# heal: one run of `rounds` kills; a row per healing.
heal() {
  local model=$1 dir=$work/ft-$RANDOM log=$work/ft-$RANDOM.log
  timeout 600 "$ddprun" --ft --standalone --nproc-per-node "$nproc" --max-restarts 1000 \
    "$train" --ft --model "$model" "${common[@]}" --min-step-ms 100 --output-dir "$dir" \
    > "$log" 2>&1 &
  local pid=$! launcher
  sleep 1
  launcher=$(pgrep -P "$pid" -x ddprun || echo "$pid")
  for ((k = 0; k < rounds; k++)); do
    sleep "$every"
    mapfile -t workers < <(pgrep -P "$launcher" || true)
    ((${#workers[@]} > 0)) || break
    kill -9 "${workers[RANDOM % ${#workers[@]}]}" 2>/dev/null || true
  done
  sleep "$every"  # the last one healed; the job (minutes long) is stopped here
  kill "$pid" 2>/dev/null || true
  wait "$pid" 2>/dev/null || true
  sed -n 's/.*healed: step [0-9]*.s state (\([0-9.]*\) MB) from rank .* in \([0-9]*\) ms.*/\2,\1/p' \
    "$log" | awk -v m="$model" -F, '{ printf "%s,heal,%d,%s,%s\n", m, NR - 1, $1, $2 }' |
    tee -a "$raw"
  rm -rf "$dir" "$log"
}

# resume: a run that writes a checkpoint, then `rounds` runs that resume from it.
resume() {
  local model=$1 dir=$work/resume-$RANDOM
  timeout 600 "$ddprun" --standalone --nproc-per-node "$nproc" "$train" --model "$model" \
    "${common[@]}" --max-steps 5 --checkpoint-every 5 --output-dir "$dir" > /dev/null 2>&1
  for ((k = 0; k < rounds; k++)); do
    timeout 600 "$ddprun" --standalone --nproc-per-node "$nproc" "$train" --model "$model" \
      "${common[@]}" --max-steps 6 --resume auto --output-dir "$dir" 2>&1 |
      sed -n 's/.*read and restored in \([0-9]*\) ms.*/\1/p' | head -1 |
      awk -v m="$model" -v k="$k" '{ printf "%s,resume,%d,%s,\n", m, k, $1 }' | tee -a "$raw"
  done
  rm -rf "$dir"
}

echo "# heal_vs_resume.sh: models $models, $nproc workers, $rounds kills / resumes each"
for model in $models; do
  heal "$model"
  resume "$model"
done

# The median (upper middle) of one model's figures on one path.
median() {
  awk -F, -v m="$1" -v p="$2" '$1 == m && $2 == p { print $4 }' "$raw" | sort -g |
    awk '{ x[NR] = $1 } END { if (NR) print x[int(NR / 2) + 1]; else print "nan" }'
}
{
  echo "model,state_mb,heal_ms,resume_ms"
  for model in $models; do
    mb=$(awk -F, -v m="$model" '$1 == m && $2 == "heal" { print $5; exit }' "$raw")
    echo "$model,${mb:-nan},$(median "$model" heal),$(median "$model" resume)"
  done
} > "$summary"
cat "$summary"
