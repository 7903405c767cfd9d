#!/usr/bin/env bash
# A chaos loop (issue 33): ddp-train on one host with a worker SIGKILLed every N seconds, under
# per-step fault tolerance and under the restart path, each against the same job without
# failures. Effective training time = the time without failures / the time with them (1.0:
# failures cost nothing). The two paths:
#   ft        ddprun --ft ... ddp-train --ft              (a failure costs the step in flight;
#                                                          the dead worker alone starts again and
#                                                          is healed from the others)
#   restart   ddprun --max-restarts ... ddp-train --resume auto --checkpoint-every C
#                                                         (every worker starts again and resumes
#                                                          from the last checkpoint)
# The job paces its steps (--min-step-ms) so that the machine's noise moves it little; the
# killer picks one of ddprun's workers at random, and stops once the job ends. Bounded: every
# run is under `timeout`.
#
# Usage: benchmarks/chaos.sh [-n NPROC] [-e EPOCHS] [-k KILL_EVERY_S] [-c CHECKPOINT_EVERY]
#                            [-p MIN_STEP_MS] [-r ROUNDS] [-o OUT_PREFIX]
#   defaults: -n 3 -e 6 -k 8 -c 50 -p 40 -r 2 -o chaos; writes OUT_PREFIX.csv (every run) and
#   OUT_PREFIX_summary.csv. Tools come from $DDP_BUILD_DIR (default build/), else PATH.
set -euo pipefail

nproc=3 epochs=6 every=8 ckpt=50 pace=40 rounds=2 out=chaos
while getopts "n:e:k:c:p:r:o:h" opt; do
  case $opt in
    n) nproc=$OPTARG ;; e) epochs=$OPTARG ;; k) every=$OPTARG ;; c) ckpt=$OPTARG ;;
    p) pace=$OPTARG ;; r) rounds=$OPTARG ;; o) out=$OPTARG ;;
    *) sed -n '2,21p' "$0"; exit 2 ;;
  esac
done

root=$(cd "$(dirname "$0")/.." && pwd)
source "$root/benchmarks/tools.sh"  # tool: the built binary, else the installed one
train=$(tool tools/ddp_train/ddp-train ddp-train)
ddprun=$(tool tools/ddprun/ddprun ddprun)
work=$(mktemp -d /tmp/ddp-chaos.XXXXXX)
trap 'rm -rf "$work"' EXIT

raw=$out.csv summary=${out}_summary.csv
echo "path,failures,round,seconds,kills,exit,accuracy" > "$raw"

# Kills one of ddprun `$1`'s workers at random every `every` seconds until it exits; writes the
# number of kills so far to `$2`.
killer() {
  local launcher=$1 count=$2 kills=0
  echo 0 > "$count"
  while kill -0 "$launcher" 2>/dev/null; do
    sleep "$every"
    mapfile -t workers < <(pgrep -P "$launcher" || true)
    ((${#workers[@]} > 0)) || continue
    kill -9 "${workers[RANDOM % ${#workers[@]}]}" 2>/dev/null && kills=$((kills + 1))
    echo "$kills" > "$count"
  done
}

# One run: `path` ft|restart, `failures` on|off; appends its row.
run() {
  local path=$1 failures=$2 round=$3 dir=$work/run-$RANDOM log=$work/log-$RANDOM
  local launch=("$ddprun" --standalone --nproc-per-node "$nproc" --max-restarts 1000)
  local flags=(--model mlp --epochs "$epochs" --train-subset 12000 --test-subset 2000
               --min-step-ms "$pace" --log-every 100000 --no-plots --output-dir "$dir")
  if [[ $path == ft ]]; then
    launch+=(--ft); flags+=(--ft)
  else
    flags+=(--resume auto --checkpoint-every "$ckpt")
  fi
  local start=$EPOCHREALTIME
  timeout 900 "${launch[@]}" "$train" "${flags[@]}" > "$log" 2>&1 &
  local pid=$!
  local kills=0 killer_pid="" count=$work/kills-$RANDOM
  if [[ $failures == on ]]; then
    # The ddprun under timeout: its child.
    sleep 1
    local launcher
    launcher=$(pgrep -P "$pid" -x ddprun || echo "$pid")
    killer "$launcher" "$count" &
    killer_pid=$!
  fi
  local rc=0
  wait "$pid" || rc=$?
  local seconds  # the job's own time: not the killer's last sleep
  seconds=$(awk -v a="$start" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.1f", b - a }')
  if [[ -n $killer_pid ]]; then
    kill "$killer_pid" 2>/dev/null || true
    wait "$killer_pid" 2>/dev/null || true
    kills=$(cat "$count")
  fi
  local accuracy
  accuracy=$(sed -n 's/.*done: test accuracy \([0-9.]*\)%.*/\1/p' "$log" | tail -1)
  echo "$path,$failures,$round,$seconds,$kills,$rc,${accuracy:-nan}" | tee -a "$raw"
  rm -rf "$dir" "$log"
}

echo "# chaos.sh: $nproc workers, mlp, $epochs epochs, a worker SIGKILLed every ${every} s," \
     "checkpoints every $ckpt steps on the restart path, steps of at least $pace ms, $rounds rounds"
for ((r = 0; r < rounds; r++)); do
  for path in ft restart; do
    run "$path" off "$r"
    run "$path" on "$r"
  done
done

# Medians (upper middle) of the seconds of one path with failures on or off.
median() {
  awk -F, -v p="$1" -v f="$2" '$1 == p && $2 == f && $6 == 0 { print $4 }' "$raw" | sort -g |
    awk '{ x[NR] = $1 } END { if (NR) print x[int(NR / 2) + 1]; else print "nan" }'
}
{
  echo "path,seconds_without_failures,seconds_with_failures,effective_training_time"
  for path in ft restart; do
    off=$(median "$path" off) on=$(median "$path" on)
    awk -v p="$path" -v a="$off" -v b="$on" 'BEGIN { printf "%s,%s,%s,%.3f\n", p, a, b, a / b }'
  done
} > "$summary"
cat "$summary"
