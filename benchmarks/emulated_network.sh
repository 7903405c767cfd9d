#!/usr/bin/env bash
# Data-parallel training across hosts joined by a slow network, emulated on this machine: each
# host a Linux network namespace with its own hostname (as tests/support/netns.h builds them),
# all on one bridge, every host's link shaped by tc netem (rate and one-way delay on its
# egress, so each direction of each host's link carries at most RATE). One ddprun per host
# (--nnodes H --nproc-per-node P) runs `ddp-bench train` in each configuration below, and
# PyTorch's DDP (benchmarks/vs_pytorch/torch_ddp.py, the same workload, Gloo) as the reference;
# configurations alternate within each round; medians over rounds, and each one's ratio to
# flat Gloo with no hook (ours).
#
#   configuration       what
#   gloo                flat Gloo between all ranks, no hook (the reference ratio 1.00)
#   auto                the default: shm inside a host, Gloo between hosts (the hierarchy)
#   tuned               backend tuned: the hierarchy, its all_reduces over flat Gloo from the
#                       size where that measured faster as the group formed (Note [Choosing
#                       the all_reduce route])
#   auto+bf16           the hierarchy with the bf16 hook (half the bytes)
#   gloo+powersgd       flat Gloo with PowerSGD rank 1 (compressing from the third step)
#   auto+powersgd       the hierarchy with PowerSGD rank 1
#   auto+zero           the hierarchy with ZeroRedundancyOptimizer (SGD state sharded)
#   auto+zero-overlap   the same with overlap_with_ddp (stepped in DDP's hook; not default)
#   pytorch             PyTorch's DistributedDataParallel over Gloo, no hook
#   no-ddp              ours without DDP: each rank trains alone (the compute, no exchange)
#   pytorch-no-ddp      PyTorch without DDP, likewise
#
# Inputs of the performance model (benchmarks/perf_model.py) come out beside the runs: per link,
# a `ddp-bench collectives` sweep across the hosts (gloo and shm+gloo; all_reduce, broadcast,
# all_gather; float32, and bfloat16 on shm+gloo) in OUT_PREFIX.collectives.csv (-C skips it), and
# every ddp-bench run's bucket profile (bucket bytes, launch times) in OUT_PREFIX.buckets.csv.
#
# The cores are shared by every host (H x P ranks on this machine's CPUs), so compute is slower
# than on real hosts: read the ratios, measured side by side, not the absolute throughputs.
#
# Usage: benchmarks/emulated_network.sh [-H HOSTS] [-p RANKS_PER_HOST] [-l "1gbit 10gbit"]
#          [-d DELAY] [-m "classic-cnn mlp-1024"] [-c "gloo auto ..."] [-r ROUNDS] [-s STEPS]
#          [-o OUT_PREFIX] [-C] [-P]
#   -P pins each host's processes to its own CPU (host k on CPU k mod CPUs): hosts then do not
#   take each other's cores, though a host's ranks share its one.
#   defaults: -H 2 -p 2 -l "1gbit 10gbit" -d 0.2ms -r 3 -s 30, all models and configurations;
#   writes OUT_PREFIX.csv (every run: link, model, configuration, round, samples/s, and the
#   per-step breakdown in ms: step, data, forward, backward, comm, optimizer) and prints
#   the table (default prefix: emulated_network). Root only (ip netns, tc, unshare). Tools from
#   $DDP_BUILD_DIR (default build/), else PATH; PyTorch from /usr/bin/python3 (python3-torch).
set -euo pipefail

hosts=2 per=2 links="1gbit 10gbit" delay=0.2ms rounds=3 steps=30 out=emulated_network
models="classic-cnn mlp-1024"
configs="gloo auto tuned auto+bf16 gloo+powersgd auto+powersgd auto+zero pytorch no-ddp"
configs+=" pytorch-no-ddp"
sweep=1 pin_hosts=0
while getopts "H:p:l:d:m:c:r:s:o:CPh" opt; do
  case $opt in
    H) hosts=$OPTARG ;; p) per=$OPTARG ;; l) links=$OPTARG ;; d) delay=$OPTARG ;;
    m) models=$OPTARG ;; c) configs=$OPTARG ;; r) rounds=$OPTARG ;; s) steps=$OPTARG ;;
    o) out=$OPTARG ;; C) sweep=0 ;; P) pin_hosts=1 ;;
    *) sed -n '2,42p' "$0"; exit 2 ;;
  esac
done
die() { echo "emulated_network.sh: $*" >&2; exit 1; }
[[ $(id -u) -eq 0 ]] || die "needs root (ip netns, tc, unshare)"
command -v tc >/dev/null && command -v ip >/dev/null || die "needs iproute2 (ip, tc)"

root=$(cd "$(dirname "$0")/.." && pwd)
source "$root/benchmarks/tools.sh"  # tool: the built binary, else the installed one
bench=$(tool tools/ddp_bench/ddp-bench ddp-bench)
ddprun=$(tool tools/ddprun/ddprun ddprun)
python=/usr/bin/python3
torch_ddp=$root/benchmarks/vs_pytorch/torch_ddp.py

tag="ddpe$$"
subnet=$((1 + $$ % 250))
addr() { echo "10.198.$subnet.$(($1 + 1))"; }
ns() { echo "${tag}h$1"; }
tmp=$(mktemp -d)

cleanup() {
  local n
  for n in $(ip netns list | cut -d' ' -f1 | grep "^$tag" || true); do
    ip netns pids "$n" | xargs -r kill -9 2>/dev/null || true
    ip netns del "$n" 2>/dev/null || true
  done
  [[ -n ${KEEP_TMP:-} ]] && echo "# logs kept in $tmp" >&2 || rm -rf "$tmp"
}
trap cleanup EXIT

# The hosts: namespaces on a bridge in a switch namespace.
ip netns add "${tag}sw"
ip -n "${tag}sw" link add br0 type bridge
ip -n "${tag}sw" link set br0 up
for ((k = 0; k < hosts; k++)); do
  ip netns add "$(ns $k)"
  ip link add "${tag}v$k" type veth peer name "${tag}p$k"
  ip link set "${tag}v$k" netns "$(ns $k)"
  ip link set "${tag}p$k" netns "${tag}sw"
  ip -n "${tag}sw" link set "${tag}p$k" master br0
  ip -n "${tag}sw" link set "${tag}p$k" up
  ip -n "$(ns $k)" addr add "$(addr $k)/24" dev "${tag}v$k"
  ip -n "$(ns $k)" link set "${tag}v$k" up
  ip -n "$(ns $k)" link set lo up
done

# Delay needs the kernel's netem qdisc; where it is missing (this VM's kernel has no sch_netem),
# links are shaped by rate only (tbf, as tests/support/netns.h) and the header says so.
netem=1
tc qdisc add dev lo root netem delay 1ms 2>/dev/null && tc qdisc del dev lo root || netem=0
shape() {  # shape RATE: every host's egress
  local k
  for ((k = 0; k < hosts; k++)); do
    if ((netem)); then
      tc -n "$(ns $k)" qdisc replace dev "${tag}v$k" root netem delay "$delay" rate "$1" \
         limit 100000
    else
      tc -n "$(ns $k)" qdisc replace dev "${tag}v$k" root tbf rate "$1" burst 256kb \
         latency 50ms
    fi
  done
}

port=29650
# run_job LABEL LAUNCHER WORKER...: one launcher per host (ddprun, or PyTorch's torchrun for
# PyTorch's side: ddprun's multi-node agent store is ddp-cpp's own, not a TCPStore that
# PyTorch's env:// can join), each in its namespace under its own hostname, with
# GLOO_SOCKET_IFNAME naming the host's link (PyTorch's Gloo falls back to loopback when the
# hostname does not resolve); waits for all (at most 600 s). Rank 0 appends to $tmp/run.csv.
run_job() {
  local label=$1 launcher=$2 k pids=() rc=0 launch
  shift 2
  port=$((port + 1))
  for ((k = 0; k < hosts; k++)); do
    if [[ $launcher == torchrun ]]; then
      launch=("$python" -m torch.distributed.run --redirects 1 --tee 1)
    else
      launch=("$ddprun")
    fi
    pin=()  # -P: each host on its own CPUs (host k on CPU k mod CPUs), as real hosts are
    ((pin_hosts)) && pin=(taskset -c "$((k % $(nproc)))")
    timeout 600 ip netns exec "$(ns $k)" unshare --uts sh -c 'hostname "$0" && exec "$@"' \
      "$(ns $k)" "${pin[@]}" env -u OMP_NUM_THREADS OMP_NUM_THREADS=1 \
      GLOO_SOCKET_IFNAME="${tag}v$k" "${launch[@]}" --nnodes "$hosts" --nproc_per_node "$per" --node_rank "$k" \
      --master_addr "$(addr 0)" --master_port "$port" "$@" >"$tmp/$label.host$k.log" 2>&1 &
    pids+=($!)
  done
  for k in "${pids[@]}"; do wait "$k" || rc=$?; done
  if ((rc != 0)); then
    echo "# $label failed (exit $rc); host 0's log:" >&2
    tail -5 "$tmp/$label.host0.log" >&2
  fi
  return 0
}

# measure LINK MODEL CONFIG ROUND: appends "link,model,config,round,samples/s" to $raw.
raw=$out.csv
echo "link,model,configuration,round,samples_per_s,step_ms,data_ms,forward_ms,backward_ms,comm_ms,optimizer_ms" \
  > "$raw"
buckets=$out.buckets.csv
echo "link,model,configuration,round,bucket_bytes,launched_ms,last_gradient_ms" > "$buckets"
measure() {
  local link=$1 model=$2 config=$3 round=$4 backend hook args
  rm -f "$tmp/run.csv"
  if [[ $config == pytorch* ]]; then
    args=()
    [[ $config == *-no-ddp ]] && args+=(--no-ddp)
    run_job "$config" torchrun "$torch_ddp" --model "$model" --steps "$steps" --warmup 5 \
      "${args[@]}" --label "$config" --csv "$tmp/run.csv"
  elif [[ $config == no-ddp ]]; then
    run_job "$config" ddprun "$bench" train --model "$model" --steps "$steps" --warmup 5 \
      --backend gloo --no-ddp --label "$config" --csv "$tmp/run.csv"
  else
    backend=${config%%+*}
    hook=none
    args=()
    case $config in
      *+bf16) hook=bf16 ;;
      *+powersgd) hook=powersgd:1 ;;
      *+zero) args+=(--zero) ;;
      *+zero-overlap) args+=(--zero-overlap) ;;
    esac
    run_job "$config" ddprun "$bench" train --model "$model" --steps "$steps" --warmup 5 \
      --backend "$backend" --comm-hook "$hook" "${args[@]}" --label "$config" \
      --csv "$tmp/run.csv"
  fi
  # samples/s and the per-step breakdown (ms: step, data, forward, backward, comm, optimizer)
  local value=nan,,,,,,
  [[ -s $tmp/run.csv ]] &&
    value=$(awk -F, 'NR > 1 { v = $8; for (i = 9; i <= 14; i++) v = v "," $i } END { print v }' \
      "$tmp/run.csv")
  echo "$link,$model,$config,$round,$value" >> "$raw"
  # "# LABEL: buckets B0,B1 bytes; launched at L0,L1 ms; last gradient at G ms" (ddp-bench train)
  sed -n 's/.*: buckets \([0-9,]*\) bytes; launched at \([-0-9.,]*\) ms; last gradient at \([0-9.]*\) ms$/\1 \2 \3/p' \
    "$tmp/$config.host0.log" | tail -1 | while read -r b l g; do
    echo "$link,$model,$config,$round,\"$b\",\"$l\",$g" >> "$buckets"
  done
}

# sweep LINK: the collectives across the hosts on this link (the model's alpha-beta fit).
collectives=$out.collectives.csv
((sweep)) && echo "link,backend,op,dtype,ranks,bytes,count,iters,time_us,algbw_gbps,busbw_gbps,wrong" \
  > "$collectives"
sweep_collectives() {
  local backend dtypes
  # The hierarchy as shm+gloo (the model's name for it is auto); bfloat16 there only: the bf16
  # hook's configurations run there.
  for backend in gloo shm+gloo; do
    dtypes=float32
    [[ $backend == shm+gloo ]] && dtypes=float32,bfloat16
    rm -f "$tmp/coll.csv"
    run_job collectives ddprun "$bench" collectives --backend "$backend" \
      --ops all_reduce,broadcast,all_gather --dtype "$dtypes" --min-bytes 4K --max-bytes 16M \
      --iters 10 --warmup 3 --csv "$tmp/coll.csv"
    [[ -s $tmp/coll.csv ]] && sed "1d; /^memcpy,/d; s/^/$1,/" "$tmp/coll.csv" >> "$collectives"
  done
  echo "# $1: collectives swept"
}

((netem)) || delay="none (no netem in this kernel)"
echo "# emulated_network.sh: $hosts hosts x $per ranks, links $links, delay $delay, $rounds" \
     "rounds, $steps steps; $(nproc) CPUs: $(lscpu | sed -n 's/^Model name: *//p')"
read -r -a config_list <<< "$configs"
for link in $links; do
  shape "$link"
  ((sweep)) && sweep_collectives "$link"
  for ((r = 1; r <= rounds; r++)); do
    # Alternate the order of the configurations from one round to the next.
    order=("${config_list[@]}")
    if ((r % 2 == 0)); then
      order=()
      for ((i = ${#config_list[@]} - 1; i >= 0; i--)); do order+=("${config_list[i]}"); done
    fi
    for model in $models; do
      for config in "${order[@]}"; do measure "$link" "$model" "$config" "$r"; done
    done
    echo "# $link: round $r/$rounds done"
  done
done

# Medians (upper middle) per link, model and configuration; ratio to flat Gloo (ours).
echo
printf '%-8s %-12s %-16s %12s %10s\n' link model configuration samples/s "vs gloo"
awk -F, 'NR > 1 { k = $1 "|" $2 "|" $3; v[k] = v[k] " " $5; order[k] = NR }
  function median(list,   a, n, i, j, t) {
    n = split(list, a, " ")
    for (i = 1; i <= n; i++) for (j = i + 1; j <= n; j++) if (a[j] + 0 < a[i] + 0) { t = a[i]; a[i] = a[j]; a[j] = t }
    return n ? a[int(n / 2) + 1] : "nan"
  }
  END {
    for (k in v) {
      split(k, p, "|")
      m = median(v[k]); base = median(v[p[1] "|" p[2] "|gloo"])
      printf "%-8s %-12s %-16s %12.1f %10.2f\n", p[1], p[2], p[3], m, (base > 0 ? m / base : 0)
    }
  }' "$raw" | sort -k1,1 -k2,2 -k4,4nr
echo "# every run: $raw; bucket profiles: $buckets"
((sweep)) && echo "# collectives: $collectives"
echo "# the model: /usr/bin/python3 benchmarks/perf_model.py --prefix $out"
