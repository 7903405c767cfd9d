#!/usr/bin/env bash
# shellcheck disable=SC2054  # ddp-bench takes comma-separated lists as one argument
# The GPU check: build ddp-cpp against the machine's pip PyTorch, then test and measure it, in one
# command that fits the device tool's 10 minutes, writing a report as it goes.
#
#   scripts/gpu-check/bundle.sh                 # first, on the Debian machine (fills vendor/)
#   GPU_CHECK_PACK="$OUT/gpu-check.tgz" scripts/gpu-check/run.sh /tmp/gpu-check
#                                               # (device tool: carry ["scripts/gpu-check/vendor"],
#                                               # which git ignores)
#                                               # on the GPU machine, from the repository root
#
# Steps, in order; each under its own `timeout`, each failure recorded without stopping the others:
#   env          the header: GPU (nvidia-smi), driver, torch, CUDA, NCCL, CPU, nproc, compilers
#   build        configure against the PyTorch, vendored deps (bundle.sh), then build only ddp,
#                ddprun, ddp-train, ddp-bench and the gpu-labelled tests (GoogleTest built first)
#   gpu-tests    ctest -L gpu --output-on-failure ("no gpu tests" when the tree has none)
#   vs-pytorch   GPU, world size 1: our DDP vs PyTorch's DDP (step-time ratio) and vs no DDP
#                (our overhead; goal <= 3%): benchmarks/vs_pytorch/compare.py --device cuda
#   train-cuda   ddp-train --device cuda --epochs 1: accuracy, samples/s
#   train-cpu    the same with --device cpu (DDP_BACKEND=shm: auto on a GPU machine binds a GPU
#                per rank, Note [auto on a GPU])
#   collectives  CPU: ddp-bench collectives, all_reduce over gloo, shm, shm-inplace at 2-16 ranks
#   scaling      CPU: ddp-bench train --compare at 2-16 ranks (scaling efficiency, vs 1 process x
#                N threads, share of the communication-free ceiling)
# GPU steps are skipped, with the reason, when no GPU is usable (no nvidia-smi, or
# torch.cuda.is_available() false). The report (REPORT_DIR/report.md, rewritten after every step,
# so a command killed at its limit still returns what was done) has the header, one line per step
# (result, wall time) and each step's results; raw logs and CSVs sit next to it.
#
# Time: the whole command stays within GPU_CHECK_BUDGET_S (570 s): the build takes what it needs,
# each later step at most its cap (together 670 s; the budget stops them first), and a step with less than 15 s left is
# skipped as "no time left". The build folder (build-gpu/, ignored by git) stays on a warm
# machine: a second run rebuilds nothing and has the whole budget for the steps.
#
# Knobs (environment):
#   GPU_CHECK_PACK       a .tgz the report folder is packed into after every step, report.md
#                        copied beside it: give REPORT_DIR outside $OUT and GPU_CHECK_PACK
#                        inside (the device tool returns 8 files; a report has ~25)
#   GPU_CHECK_STEPS      comma-separated subset of the steps above (default: all)
#   GPU_CHECK_BUDGET_S   total seconds (570)          GPU_CHECK_JOBS   build jobs (nproc)
#   GPU_CHECK_COMPARE_ARGS  more arguments for the vs-pytorch step's compare.py (for instance
#                        --gradient-as-bucket-view, which sets it on both sides)
#   GPU_CHECK_QUICK=1    small sizes (the rehearsal on 2 cores): subsets, fewer steps, 2-4 ranks
#   GPU_CHECK_DEVICE=cpu run the GPU steps on the CPU (rehearsing them where there is no GPU)
#   GPU_CHECK_BUILD_DIR  (build-gpu)                  DDP_VENDOR_DIR   (scripts/gpu-check/vendor)
#   GPU_CHECK_FMT=torch  compile against the fmt inside torch/include instead of the vendored
#                        fmt 9 (if LibTorch's headers need theirs); GPU_CHECK_RECONFIGURE=1 too
#   DDP_TORCH_PREFIX     the folder holding Torch/TorchConfig.cmake's parent (default: PyTorch's
#                        torch.utils.cmake_prefix_path; Debian's points nowhere: pass /usr there)
set -uo pipefail

SELF=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/$(basename "${BASH_SOURCE[0]}")
HERE=$(dirname "$SELF")
ROOT=$(cd "$HERE/../.." && pwd)

# Step caps in seconds, after the build (gpu-tests includes a gdb rerun of failed cases).
declare -A CAP=([env]=15 [gpu-tests]=240 [vs-pytorch]=140 [train-cuda]=45 [train-cpu]=60
                [collectives]=80 [scaling]=90)
ALL_STEPS=(env build gpu-tests vs-pytorch train-cuda train-cpu collectives scaling)

log() { echo "gpu-check: $*" >&2; }
secs() { date +%s; }

# Kills, by pid, every process whose environment holds MARK (NAME=VALUE), and says how many.
kill_marked() {
  local mark=$1 p pids=()
  for p in /proc/[0-9]*; do
    [[ ${p#/proc/} == "$BASHPID" ]] && continue
    { tr '\0' '\n' <"$p/environ"; } 2>/dev/null | grep -qxF "$mark" && pids+=("${p#/proc/}")
  done
  ((${#pids[@]} == 0)) || kill -KILL "${pids[@]}" 2>/dev/null
  echo "${#pids[@]}"
}

# bounded VAR SECONDS COMMAND...: COMMAND under timeout, and afterwards none of its processes
# left. timeout signals only its own process group, but ddprun's workers run in groups of their
# own, and ddp-train, on SIGTERM, first finishes its step and writes a checkpoint: such leftovers
# would run into the next command (or step) and compete with what it measures. Every process of
# COMMAND carries VAR=<unique> in its environment, which finds them. VAR: one name per nesting
# level (a step, a command inside a step), so that an outer sweep finds an inner one's too.
bounded() {
  local var=$1 cap=$2 mark rc left
  shift 2
  mark="$var=$$.$BASHPID.$RANDOM"
  env "$mark" timeout -k 12 "$cap" "$@"
  rc=$?
  left=$(kill_marked "$mark")
  ((left == 0)) || echo "gpu-check: killed $left process(es) left by: $*" >&2
  return $rc
}

# --- the steps (each runs as `run.sh --step NAME`, in its own process, under timeout) ----------
# A step writes REPORT/NAME.md (its results, markdown) and may exit 3 after writing its reason to
# REPORT/NAME.skip (skipped). Raw output goes to REPORT/NAME.log (the driver redirects it).

skip() { echo "$*" >"$R/$STEP.skip"; exit 3; }
md() { echo "$*" >>"$R/$STEP.md"; }
py() { "$PYTHON" "$@"; }

# Where the GPU steps run: cuda, or the CPU when rehearsing (GPU_CHECK_DEVICE=cpu); skips the
# step when it needs a GPU that is not there.
gpu_step_device() {
  if [[ $GC_DEVICE == cpu ]]; then
    md "_Rehearsal: GPU_CHECK_DEVICE=cpu, this GPU step ran on the CPU._"
    md ""
    echo cpu
  elif [[ -n $GC_NO_GPU ]]; then
    skip "no GPU: $GC_NO_GPU"
  else
    echo cuda
  fi
}

step_env() {
  row() { printf '| %s | %s |\n' "$1" "${2:-?}" >>"$R/env.md"; }
  printf '| what | value |\n|---|---|\n' >"$R/env.md"
  row "date (UTC)" "$(date -u +'%Y-%m-%d %H:%M')"
  row "GPU" "$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader \
                2>/dev/null | paste -sd ';' - || true)${GC_NO_GPU:+none usable: $GC_NO_GPU}"
  row "CPU" "$(awk -F': ' '/^model name/ {print $2; exit}' /proc/cpuinfo), nproc $(nproc)"
  row "memory" "$(free -g 2>/dev/null | awk '/^Mem:/ {print $2 " GiB"}')"
  row "python" "$(py --version 2>&1) ($PYTHON)"
  row "torch" "$(py - <<'EOF' 2>&1 | tail -1
import torch
cuda = torch.version.cuda
parts = [torch.__version__, f"CUDA {cuda}" if cuda else "CPU-only",
         f"C++11 ABI {int(torch._C._GLIBCXX_USE_CXX11_ABI)}"]
if torch.cuda.is_available():
    parts.append(torch.cuda.get_device_name(0))
    try:
        parts.append("NCCL " + ".".join(map(str, torch.cuda.nccl.version())))
    except Exception as e:  # noqa: BLE001 -- the header reports whatever is there
        parts.append(f"NCCL ? ({e})")
    parts.append(f"cuDNN {torch.backends.cudnn.version()}")
print(", ".join(parts))
EOF
)"
  row "CUDA toolkit" "$(nvcc --version 2>/dev/null | tail -1 || echo none)"
  row "compiler" "$(c++ --version 2>/dev/null | head -1)"
  row "cmake, ninja" "$(cmake --version | head -1 | awk '{print $3}'), $(ninja --version 2>/dev/null)"
  row "LibTorch CMake prefix" "$GC_TORCH_PREFIX"
  row "mode" "$([[ $GC_QUICK == 1 ]] && echo quick || echo full), GPU steps on ${GC_DEVICE}, budget ${GC_BUDGET} s"
  { nvidia-smi 2>&1 || true; echo; nvidia-smi topo -m 2>&1 || true; } >"$R/nvidia-smi.log"
}

# The C++ flags and CMake cache entries that replace the Debian -dev packages.
build_settings() {
  local abi torch_inc gloo_from nccl_inc
  abi=$(py -c 'import torch; print(int(torch._C._GLIBCXX_USE_CXX11_ABI))') || return 1
  torch_inc=$(py -c 'import os, torch; print(os.path.join(os.path.dirname(torch.__file__), "include"))')
  CXXFLAGS_GC="-D_GLIBCXX_USE_CXX11_ABI=$abi"
  # Gloo: LibTorch's c10d headers include <gloo/...>; a pip wheel may or may not ship them.
  gloo_from=vendored
  for d in "$torch_inc" /usr/include /usr/local/include; do
    [[ -f $d/gloo/algorithm.h ]] && gloo_from=$d && break
  done
  [[ $gloo_from == vendored ]] && CXXFLAGS_GC+=" -isystem $GC_VENDOR/gloo/include"
  # NCCL: a CUDA PyTorch's ProcessGroupNCCL.hpp includes <nccl.h>, which pip keeps in its nvidia
  # packages (or the CUDA image in its include folders).
  NCCL_GC=""
  if [[ $(py -c 'import torch; print(torch.version.cuda or "")') != "" ]]; then
    nccl_inc=$(py - <<'EOF'
import glob, os, sys
dirs = ["/usr/include", "/usr/local/cuda/include", "/usr/local/include"]
try:
    import nvidia
    for base in nvidia.__path__:
        dirs += sorted(os.path.dirname(p) for p in glob.glob(os.path.join(base, "**", "nccl.h"), recursive=True))
except ImportError:
    pass
for d in dirs:
    if os.path.isfile(os.path.join(d, "nccl.h")):
        print(d)
        break
EOF
)
    if [[ -n $nccl_inc ]]; then
      [[ $nccl_inc == /usr/include ]] || CXXFLAGS_GC+=" -isystem $nccl_inc"
      NCCL_GC="on (nccl.h from $nccl_inc)"
    else
      NCCL_GC="OFF: no nccl.h found (pip's nvidia packages, /usr/include, /usr/local/cuda/include)"
    fi
  fi
  # zlib and libcrypto: the vendored headers, the machine's libraries by full path (no -dev
  # symlinks there).
  find_lib() {  # NAME SONAME: the unversioned symlink if any, else the soname from ldconfig
    local n
    for n in /usr/lib/x86_64-linux-gnu/$1 /usr/lib64/$1 /usr/lib/$1; do [[ -e $n ]] && echo "$n" && return; done
    /sbin/ldconfig -p 2>/dev/null | awk -v s="$2" '$1 == s && /x86-64/ {print $NF; exit}'
  }
  ZLIB_GC=$(find_lib libz.so libz.so.1)
  CRYPTO_GC=$(find_lib libcrypto.so libcrypto.so.3)
  SSL_GC=$(find_lib libssl.so libssl.so.3)
  [[ -n $ZLIB_GC ]] || { echo "no libz.so.1 on this machine" >&2; return 1; }
  [[ -n $CRYPTO_GC ]] || { echo "no libcrypto.so.3 (OpenSSL 3) on this machine" >&2; return 1; }
  GLOO_GC=$gloo_from
  TORCH_INC_GC=$torch_inc
}

# Note [Source mtimes]: ninja rebuilds what is newer than its outputs, and a tree laid anew for
# each command (the device tool's copy; the rehearsal's) makes every file new. So the build
# folder keeps each source's content hash and mtime as a build starts, and before the next build
# a file whose content is unchanged gets that mtime back: a rerun rebuilds only what changed, or
# what the last build did not finish (recorded before the build, so a build cut off by the
# time limit counts too).
# The whole tree is covered (sources, CMake files, the vendored headers), less build folders,
# .git and the dataset.
source_mtimes() {  # save|restore
  py - "$1" "$ROOT" "$GC_BUILD/.gpu-check-mtimes.json" <<'EOF'
import hashlib, json, os, sys
mode, root, manifest = sys.argv[1:]
def files():
    for d, dirs, names in os.walk(root):
        rel = os.path.relpath(d, root)
        if rel == ".":
            dirs[:] = [x for x in dirs if not x.startswith("build") and x not in (".git", "runs")]
        dirs[:] = [x for x in dirs if os.path.join(rel, x) != "scripts/gpu-check/vendor/data"]
        for n in names:
            yield os.path.normpath(os.path.join(rel, n))
def digest(rel):
    with open(os.path.join(root, rel), "rb") as f:
        return hashlib.sha1(f.read()).hexdigest()
if mode == "save":
    out = {rel: [digest(rel), os.stat(os.path.join(root, rel)).st_mtime_ns] for rel in files()}
    json.dump(out, open(manifest, "w"))
    print(f"source mtimes: {len(out)} files recorded")
else:
    old = json.load(open(manifest)) if os.path.exists(manifest) else {}
    kept = 0
    for rel in files():
        if rel in old and old[rel][0] == digest(rel):
            os.utime(os.path.join(root, rel), ns=(old[rel][1], old[rel][1]))
            kept += 1
    print(f"source mtimes: {kept} unchanged files given their last build's mtime"
          + ("" if old else " (no earlier build here)"))
EOF
}

# ctest names of the gpu-labelled tests (a FAULT split's NAME.fault is the executable NAME).
gpu_test_targets() {
  (cd "$GC_BUILD" && ctest -N -L gpu 2>/dev/null) | awk '/Test +#[0-9]+:/ {print $3}' |
    sed 's/\..*$//' | sort -u  # test_x.fault, test_gpu.<Case>: the target test_x
}

step_build() {
  local t0 t_gtest t_conf t_build targets=() extra=() name
  mkdir -p "$GC_BUILD"
  build_settings || { md "could not work out the build settings (see build.log)"; return 1; }
  {
    md "| setting | value |"
    md "|---|---|"
    md "| LibTorch | $GC_TORCH_PREFIX |"
    md "| C++ flags | \`$CXXFLAGS_GC\` |"
    md "| Gloo headers | $GLOO_GC |"
    [[ -n $NCCL_GC ]] && md "| NCCL backend | $NCCL_GC |"
    local torch_fmt=""
    [[ -f $TORCH_INC_GC/fmt/core.h ]] &&
      torch_fmt="torch/include has fmt $(awk '/define FMT_VERSION/ {print $3; exit}' "$TORCH_INC_GC/fmt/core.h")"
    if [[ ${GPU_CHECK_FMT:-} == torch ]]; then
      md "| fmt | GPU_CHECK_FMT=torch: ${torch_fmt:-none in torch/include!}, header-only |"
    else
      md "| fmt | vendored fmt 9, header-only${torch_fmt:+; $torch_fmt, shadowed by ours (-I)} |"
    fi
    md "| zlib, libcrypto | $ZLIB_GC, $CRYPTO_GC (headers vendored) |"
  }
  source_mtimes restore
  source_mtimes save
  t0=$(secs)
  # GoogleTest from the vendored sources, once per build folder.
  local gtest=$GC_BUILD/_gtest
  if [[ ! -f $gtest/install/lib/cmake/GTest/GTestConfig.cmake ]]; then
    echo "== GoogleTest =="
    cmake -S "$GC_VENDOR/googletest" -B "$gtest/build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
      -DCMAKE_INSTALL_PREFIX="$gtest/install" -DCMAKE_INSTALL_LIBDIR=lib \
      -DCMAKE_POSITION_INDEPENDENT_CODE=ON -DCMAKE_CXX_FLAGS="$CXXFLAGS_GC" \
      -DCMAKE_POLICY_VERSION_MINIMUM=3.5 >/dev/null &&
      cmake --build "$gtest/build" -j"$GC_JOBS" >/dev/null &&
      cmake --install "$gtest/build" >/dev/null || { md "GoogleTest build failed"; return 1; }
  fi
  t_gtest=$(($(secs) - t0))
  t0=$(secs)
  [[ -z $NCCL_GC || $NCCL_GC == on* ]] || extra+=(-DDDP_WITH_NCCL=OFF)
  # Configured once per build folder (a rerun on the warm machine goes straight to the build,
  # which reconfigures by itself when a CMakeLists.txt changed); GPU_CHECK_RECONFIGURE=1 forces it.
  if [[ -f $GC_BUILD/CMakeCache.txt && -z ${GPU_CHECK_RECONFIGURE:-} ]]; then
    echo "== configure: kept ($GC_BUILD/CMakeCache.txt) =="
    # Regenerated now if a CMakeLists.txt changed, so that the gpu tests listed below are this
    # tree's (a test added since the last run would otherwise be missed and not built).
    ninja -C "$GC_BUILD" build.ninja || { md "regenerating the build files failed (build.log)"; return 1; }
  else
    echo "== configure =="
    cmake -S "$ROOT" -B "$GC_BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release \
      -DCMAKE_PREFIX_PATH="$GC_TORCH_PREFIX" \
      -DDDP_GPU_CHECK_VENDOR="$GC_VENDOR" \
      -DDDP_GPU_CHECK_FMT_INCLUDE="$([[ ${GPU_CHECK_FMT:-} == torch ]] && echo "$TORCH_INC_GC")" \
      -Dfmt_DIR="$HERE/cmake/fmt" -DCLI11_DIR="$HERE/cmake/CLI11" \
      -Dnlohmann_json_DIR="$HERE/cmake/nlohmann_json" \
      -DGTest_DIR="$gtest/install/lib/cmake/GTest" \
      -DZLIB_INCLUDE_DIR="$GC_VENDOR/include" -DZLIB_LIBRARY="$ZLIB_GC" \
      -DOPENSSL_INCLUDE_DIR="$GC_VENDOR/include" -DOPENSSL_CRYPTO_LIBRARY="$CRYPTO_GC" \
      ${SSL_GC:+-DOPENSSL_SSL_LIBRARY="$SSL_GC"} \
      -DCMAKE_CXX_FLAGS="$CXXFLAGS_GC" \
      -DCMAKE_EXE_LINKER_FLAGS=-Wl,--no-as-needed -DCMAKE_SHARED_LINKER_FLAGS=-Wl,--no-as-needed \
      "${extra[@]}" || { md "configure failed (build.log)"; return 1; }
  fi
  t_conf=$(($(secs) - t0))
  # Only what the steps run: the tools and the gpu-labelled tests (their add_dependencies come
  # along: ddprun, workers).
  targets=(ddp ddprun ddp-train ddp-bench)
  # The list into a variable first: `ninja ... | grep -q` under pipefail fails when grep stops
  # reading before ninja has written a list longer than the pipe holds (the GPU machine's did).
  local known
  known=$(ninja -C "$GC_BUILD" -t targets all 2>/dev/null)
  while read -r name; do
    [[ -n $name ]] || continue
    if grep -q "^$name:" <<<"$known"; then
      targets+=("$name")
    else
      md "gpu test $name is not a build target (a script?): not built here"
    fi
  done < <(gpu_test_targets)
  echo "== build: ${targets[*]} =="
  t0=$(secs)
  cmake --build "$GC_BUILD" -j"$GC_JOBS" --target "${targets[@]}" || {
    md "| build | FAILED after $(($(secs) - t0)) s (build.log) |"
    md ""
    md "The first errors:"
    md '```'
    grep -m 8 -B 2 -A 6 -E "error:|Error [0-9]|undefined reference" "$R/build.log" | head -80 >>"$R/$STEP.md"
    md '```'
    return 1
  }
  t_build=$(($(secs) - t0))
  md "| targets | ${targets[*]} |"
  md "| time | GoogleTest ${t_gtest} s, configure ${t_conf} s, build ${t_build} s at -j$GC_JOBS |"
}

step_gpu_tests() {
  local n
  n=$( (cd "$GC_BUILD" && ctest -N -L gpu) | awk '/Total Tests:/ {print $3}')
  [[ ${n:-0} -gt 0 ]] || skip "no gpu tests: ctest -N -L gpu lists none in this tree"
  [[ -z $GC_NO_GPU ]] || md "_No GPU here ($GC_NO_GPU): the tests' own skips apply._"
  local rc=0
  (cd "$GC_BUILD" && ctest -L gpu --output-on-failure) || rc=$?
  md '```'
  grep -E "tests passed|tests failed|^ +[0-9]+ - |Test +#[0-9]+: .*(Passed|Failed|Skipped|Timeout|Not Run)" \
    "$R/gpu-tests.log" >>"$R/$STEP.md" || true
  md '```'
  ((rc == 0)) || stacks_of_failed_tests
  return $rc
}

# A failed gpu case runs once more under gdb (where the machine has it), its stacks written to
# REPORT/gdb-<test>.log: a crash's own backtrace lacks the frames' files and lines.
stacks_of_failed_tests() {
  local gdb  # the CUDA toolkit's cuda-gdb where there is no gdb
  gdb=$(command -v gdb || command -v cuda-gdb || ls /usr/local/cuda/bin/cuda-gdb 2>/dev/null) ||
    { md "_no gdb on this machine: no stacks of the failed cases_"; return 0; }
  py - "$GC_BUILD" "$R" "$gdb" <<'EOF' || md "_gdb rerun failed (see gpu-tests.log)_"
import json, os, subprocess, sys
build, report, gdb_path = sys.argv[1:4]
failed_log = os.path.join(build, "Testing", "Temporary", "LastTestsFailed.log")
failed = {line.split(":", 1)[1].strip() for line in open(failed_log) if ":" in line}
tests = json.loads(subprocess.run(["ctest", "--show-only=json-v1", "-L", "gpu"], cwd=build,
                                  capture_output=True, text=True, check=True).stdout)["tests"]
for test in tests:
    if test["name"] not in failed or "command" not in test:
        continue
    env, cwd = dict(os.environ), build
    for prop in test.get("properties", []):
        if prop["name"] == "ENVIRONMENT":
            env.update(kv.split("=", 1) for kv in prop["value"])
        elif prop["name"] == "WORKING_DIRECTORY":
            cwd = prop["value"]
    gdb = [gdb_path, "-batch", "-nx", "-ex", "set pagination off", "-ex", "set print thread-events off",
           "-ex", "handle SIGPIPE nostop noprint", "-ex", "run", "-ex", "thread apply all bt 40",
           "--args"] + test["command"]
    out = os.path.join(report, f"gdb-{test['name']}.log")
    with open(out, "w") as f:
        try:
            subprocess.run(gdb, env=env, cwd=cwd, stdout=f, stderr=subprocess.STDOUT, timeout=120)
        except subprocess.TimeoutExpired:
            f.write("\ngpu-check: gdb run stopped after 120 s\n")
    print(f"stacks of {test['name']}: {out}")
EOF
  md "_failed cases rerun under gdb: gdb-<test>.log beside this report_"
}

step_vs_pytorch() {
  local dev pairs=2 steps=200 warmup=20 models=classic-cnn,mlp-1024
  dev=$(gpu_step_device) || exit $?
  [[ $GC_QUICK == 1 ]] && pairs=1 steps=20 warmup=3 models=mlp-1024
  py "$ROOT/benchmarks/vs_pytorch/compare.py" --device "$dev" --nproc 1 --backends auto \
    --models $models --pairs $pairs --steps $steps --warmup $warmup \
    --python "$PYTHON" --build-dir "$GC_BUILD" --data-dir "$GC_DATA" --timeout 30 \
    --csv "$R/vs_pytorch.csv" --summary-csv "$R/vs_pytorch_summary.csv" $GC_COMPARE_ARGS
  local rc=$?
  [[ -f $R/vs_pytorch_summary.csv ]] || return 1
  md "World size 1 on $dev, global batch 128, $steps timed steps after $warmup, $pairs alternating pair(s), medians${GC_COMPARE_ARGS:+, compare.py given: $GC_COMPARE_ARGS}. Step-time ratio = our step time / PyTorch's (< 1: ours faster); overhead = our DDP's step time over the same training without DDP (ddp-bench --no-ddp), goal <= 3%."
  md ""
  py - "$R/vs_pytorch_summary.csv" >>"$R/$STEP.md" <<'EOF'
import csv, sys
rows = list(csv.DictReader(open(sys.argv[1])))
print("| model | ours (samples/s) | PyTorch | step-time ratio ours/PyTorch | no DDP | our DDP overhead | <= 3% |")
print("|---|---|---|---|---|---|---|")
for r in rows:
    ours = float(r["ours_samples_per_s"] or 0); theirs = float(r["pytorch_samples_per_s"] or 0)
    ceil = float(r.get("ceiling_samples_per_s") or 0)
    ratio = f"{theirs / ours:.3f}" if ours and theirs else "n/a"
    over = (ceil / ours - 1) if ours and ceil else None
    print(f"| {r['model']} | {ours:.1f} | {theirs:.1f} | {ratio} | {ceil:.1f} | "
          + (f"{100 * over:+.1f}% | {'met' if over <= 0.03 else 'NOT met'} |" if over is not None else "n/a | n/a |"))
EOF
  return $rc
}

# ddp-train, world size 1, one epoch on DEVICE; writes train-DEVICE.tsv (accuracy, samples/s, s).
train_on() {
  local dev=$1 out=$GC_BUILD/gpu-check-runs/$STEP args=()
  [[ $GC_QUICK == 1 ]] && args+=(--train-subset 2048 --test-subset 1024)
  rm -rf "$out"
  local env=()
  [[ $dev == cpu ]] && env=(DDP_BACKEND=shm)
  env "${env[@]}" "$GC_BUILD/tools/ddp_train/ddp-train" --device "$dev" --epochs 1 \
    --data-dir "$GC_DATA" --output-dir "$out" --no-plots "${args[@]}"
  local rc=$?
  cp "$out/metrics.csv" "$R/$STEP-metrics.csv" 2>/dev/null
  local done_line epoch_line header_line
  header_line=$(grep -E "^ddp-train: .* over " "$R/$STEP.log" | head -1 | sed -E 's/, batch .*//')
  done_line=$(grep -E "done: test accuracy" "$R/$STEP.log" | tail -1)
  epoch_line=$(grep -E "epoch 1/1: test loss" "$R/$STEP.log" | tail -1)
  md "\`ddp-train --device $dev --epochs 1${args[*]:+ ${args[*]}}\`$([[ $dev == cpu ]] && echo " (DDP_BACKEND=shm)"):"
  md ""
  md "    ${header_line:-no header line}"
  md "    ${epoch_line:-no epoch line}"
  md "    ${done_line:-no final line (exit $rc)}"
  local acc sps wall
  acc=$(sed -nE 's/.*test accuracy ([0-9.]+)%.*/\1/p' <<<"$epoch_line")
  sps=$(sed -nE 's/.* ([0-9.]+) samples\/s.*/\1/p' <<<"$epoch_line")
  wall=$(sed -nE 's/.*steps, ([0-9.]+) s.*/\1/p' <<<"$done_line")
  printf '%s\t%s\t%s\t%s\n' "$dev" "${acc:-}" "${sps:-}" "${wall:-}" >"$R/$STEP.tsv"
  return $rc
}

step_train_cuda() {
  local dev
  dev=$(gpu_step_device) || exit $?
  train_on "$dev"
}

step_train_cpu() { train_on cpu; }

worlds() { if [[ $GC_QUICK == 1 ]]; then echo 2 4; else echo 2 4 8 16; fi; }

step_collectives() {
  local w rc=0 args=(--backend gloo,shm,shm-inplace --ops all_reduce --min-bytes 1K
                     --max-bytes 16M --iters 10 --warmup 3)
  [[ $GC_QUICK == 1 ]] && args=(--backend gloo,shm,shm-inplace --ops all_reduce --min-bytes 1K
                                --max-bytes 1M --iters 5 --warmup 2 --ring-bytes 4M)
  local deadline=$(($(secs) + GC_STEP_CAP - 15)) left
  for w in $(worlds); do
    left=$((deadline - $(secs)))
    ((left >= 5)) || { echo "== $w ranks: no time left in the step =="; rc=1; break; }
    echo "== $w ranks =="
    bounded GC_CMD_MARK "$left" "$GC_BUILD/tools/ddprun/ddprun" --standalone --nproc-per-node "$w" \
      "$GC_BUILD/tools/ddp_bench/ddp-bench" collectives "${args[@]}" \
      --csv "$R/collectives_w$w.csv" || { echo "== $w ranks: exit $? =="; rc=1; }
    collectives_summary "${args[*]}"
  done
  return $rc
}

# REPORT/collectives.md from the CSVs so far (rewritten after each world size).
collectives_summary() {
  : >"$R/$STEP.md"
  md "all_reduce, float32, CPU, ranks on one host: median time (us) per size; shm-inplace is how DDP's buckets are reduced. Speedup = gloo / shm-inplace. \`ddp-bench collectives $1\`"
  md ""
  # shellcheck disable=SC2046  # the world sizes, one argument each
  py - "$R" $(worlds) >>"$R/$STEP.md" <<'EOF'
import csv, os, sys
folder, worlds = sys.argv[1], sys.argv[2:]
print("| ranks | size | gloo | shm | shm-inplace | speedup | wrong |")
print("|---|---|---|---|---|---|---|")
for w in worlds:
    path = os.path.join(folder, f"collectives_w{w}.csv")
    if not os.path.exists(path):
        print(f"| {w} | - | no result | | | | |")
        continue
    rows = [r for r in csv.DictReader(open(path)) if r["op"] == "all_reduce"]
    sizes = sorted({int(r["bytes"]) for r in rows})
    for size in [s for s in sizes if s in (4096, 65536, 1 << 20, 16 << 20)] or sizes[-1:]:
        t = {r["backend"]: float(r["time_us"]) for r in rows if int(r["bytes"]) == size}
        wrong = sum(int(r["wrong"]) for r in rows if int(r["bytes"]) == size)
        sp = t["gloo"] / t["shm-inplace"] if t.get("gloo") and t.get("shm-inplace") else None
        label = f"{size >> 20} MiB" if size >= 1 << 20 else f"{size >> 10} KiB"
        cell = lambda b: f"{t[b]:.1f}" if b in t else "-"
        print(f"| {w} | {label} | {cell('gloo')} | {cell('shm')} | {cell('shm-inplace')} | "
              + (f"{sp:.1f}x" if sp else "-") + f" | {wrong} |")
EOF
}

step_scaling() {
  local w rc=0 args=(--device cpu --backend shm --model classic-cnn --compare --steps 40
                     --warmup 5)
  [[ $GC_QUICK == 1 ]] && args=(--device cpu --backend shm --model mlp-1024 --compare
                                --steps 6 --warmup 2)
  local deadline=$(($(secs) + GC_STEP_CAP - 15)) left
  for w in $(worlds); do
    left=$((deadline - $(secs)))
    ((left >= 5)) || { echo "== $w ranks: no time left in the step =="; rc=1; break; }
    echo "== $w ranks =="
    bounded GC_CMD_MARK "$left" "$GC_BUILD/tools/ddprun/ddprun" --standalone --nproc-per-node "$w" \
      "$GC_BUILD/tools/ddp_bench/ddp-bench" train "${args[@]}" --data-dir "$GC_DATA" \
      --csv "$R/scaling.csv" --label "w$w" || { echo "== $w ranks: exit $? =="; rc=1; }
    scaling_summary "${args[*]}"
  done
  return $rc
}

# REPORT/scaling.md from the log so far (rewritten after each world size).
scaling_summary() {
  : >"$R/$STEP.md"
  md "CPU, N ranks x 1 thread over shm, global batch 128, $(sed -nE 's/.*--model ([^ ]+).*/\1/p' <<<"$1"). Efficiency = N-rank throughput / (N x 1 process x 1 thread); vs threads = N ranks / 1 process x N threads; ceiling = N ranks training without any gradient exchange. \`ddp-bench train $1\`"
  md ""
  py - "$R/scaling.log" >>"$R/$STEP.md" <<'EOF'
import re, sys
text = open(sys.argv[1]).read()
print("| ranks | DDP samples/s | scaling efficiency | vs 1 process x N threads | share of the ceiling |")
print("|---|---|---|---|---|")
parts = re.split(r"^== (\d+) ranks ==$", text, flags=re.M)
for w, body in zip(parts[1::2], parts[2::2]):
    eff = re.search(r"scaling efficiency at \d+ ranks: ([0-9.]+) = ([0-9.]+)", body)
    thr = re.search(r"vs 1 process x \d+ threads: ([0-9.]+)x", body)
    ceil = re.search(r"DDP reaches ([0-9.]+)% of the communication-free ceiling", body)
    if not eff:
        print(f"| {w} | failed (scaling.log) | | | |")
        continue
    print(f"| {w} | {eff.group(2)} | {eff.group(1)} | {thr.group(1) + 'x' if thr else '-'} | "
          f"{ceil.group(1) + '%' if ceil else '-'} |")
EOF
}

# --- the driver ---------------------------------------------------------------------------------

write_report() {
  local f="$R/report.md" s
  {
    echo "# ddp-cpp GPU check"
    echo
    local tree
    # --dirty: the device tool's copy can carry a .git older than the files it copied (seen:
    # the session's first commit, with files several commits newer); say so rather than
    # name a commit the tree is not.
    tree=$(cd "$ROOT" && git describe --always --dirty=" (files differ from this commit)" \
             --abbrev=7 2>/dev/null ||
      sed -n 's/^# tree: /a tree without .git, whose bundle was made at /p' "$GC_VENDOR/MANIFEST")
    echo "\`scripts/gpu-check/run.sh\` at ${tree:-?}, started" \
      "$(date -u -d "@$GC_START" +'%Y-%m-%d %H:%M UTC'), $(($(secs) - GC_START)) s so far."
    echo
    [[ -f $R/env.md ]] && cat "$R/env.md" && echo
    echo "| step | result | wall |"
    echo "|---|---|---|"
    cat "$R/steps.tsv" 2>/dev/null | awk -F'\t' '{printf "| %s | %s | %s s |\n", $1, $2, $3}'
    echo
    for s in "${ALL_STEPS[@]}"; do
      [[ $s != env && -s $R/$s.md ]] || continue
      echo "## $s"
      echo
      cat "$R/$s.md"
      echo
    done
    if [[ -f $R/train-cuda.tsv && -f $R/train-cpu.tsv ]]; then
      echo "## train: cuda vs cpu"
      echo
      cat "$R/train-cuda.tsv" "$R/train-cpu.tsv" | awk -F'\t' '
        BEGIN {print "| device | test accuracy | samples/s | wall |"; print "|---|---|---|---|"}
        {printf "| %s | %s%% | %s | %s s |\n", $1, $2, $3, $4; sps[NR] = $3; acc[NR] = $2}
        END {if (sps[1] > 0 && sps[2] > 0)
               printf "\nsamples/s, train-cuda / train-cpu: %.1fx; test accuracy difference: %+.2f points\n",
                      sps[1] / sps[2], acc[1] - acc[2]}'
      echo
    fi
    echo "Raw logs and CSVs: $(cd "$R" && find . -maxdepth 1 -type f \( -name '*.log' -o -name '*.csv' \) -printf '%f\n' | sort | tr '\n' ' ')"
  } >"$f.tmp" && mv "$f.tmp" "$f"
}

run_step() {
  local name=$1 cap status rc t0 wall left
  case ",$GC_STEPS," in *",$name,"*) ;; *) return 0 ;; esac
  left=$((GC_BUDGET - ($(secs) - GC_START)))
  if [[ $name == build ]]; then
    cap=$((left - 10))
  else
    cap=${CAP[$name]}
    ((cap > left - 5)) && cap=$((left - 5))
  fi
  rm -f "$R/$name.md" "$R/$name.skip"
  if [[ $name != env && $name != build && -n $GC_BUILD_FAILED ]]; then
    status="skipped: $GC_BUILD_FAILED"; wall=0
  elif ((cap < 15)); then
    status="skipped: no time left (GPU_CHECK_BUDGET_S=$GC_BUDGET; run again: the build is kept)"
    wall=0
  else
    log "$name (at most $cap s)"
    t0=$(secs)
    # stdin from /dev/null: timeout runs the step in a background process group, where a
    # program that touches an inherited terminal would stop (SIGTTIN) until the timeout.
    GC_STEP_CAP=$cap bounded GC_STEP_MARK "$cap" bash "$SELF" --step "$name" </dev/null \
      >"$R/$name.log" 2>&1
    rc=$?
    wall=$(($(secs) - t0))
    case $rc in
      0) status=ok ;;
      3) status="skipped: $(cat "$R/$name.skip" 2>/dev/null)" ;;
      124 | 137) status="TIMED OUT after $cap s" ;;
      *) status="FAILED (exit $rc; $name.log)" ;;
    esac
    if [[ $name == build && $rc != 0 ]]; then
      GC_BUILD_FAILED="the build failed"
      [[ $rc == 124 || $rc == 137 ]] &&
        GC_BUILD_FAILED="the build did not finish in time (run again: it goes on where it stopped)"
    fi
  fi
  log "$name: $status ($wall s)"
  printf '%s\t%s\t%s\n' "$name" "$status" "$wall" >>"$R/steps.tsv"
  write_report
  pack_report
}

# GPU_CHECK_PACK=FILE.tgz: the whole report folder packed into FILE after every step, and
# report.md copied beside it (the device tool returns at most 8 files: `$OUT/gpu-check.tgz`).
pack_report() {
  local p=${GPU_CHECK_PACK:-}
  [[ -n $p ]] || return 0
  mkdir -p "$(dirname "$p")" &&
    tar czf "$p.part" -C "$(dirname "$R")" "$(basename "$R")" && mv "$p.part" "$p" &&
    cp "$R/report.md" "$(dirname "$p")/report.md"
}

main() {
  [[ $# -ge 1 && $1 != -h && $1 != --help ]] || { sed -n '3,/^set -uo/p' "$SELF" | sed '$d; s/^# \{0,1\}//'; exit 2; }
  mkdir -p "$1" || exit 1
  export R GC_START GC_BUDGET GC_STEPS GC_QUICK GC_DEVICE GC_BUILD GC_VENDOR GC_DATA GC_JOBS GC_COMPARE_ARGS \
         GC_TORCH_PREFIX GC_NO_GPU PYTHON
  R=$(cd "$1" && pwd)
  GC_START=$(secs)
  GC_BUDGET=${GPU_CHECK_BUDGET_S:-570}
  GC_STEPS=${GPU_CHECK_STEPS:-$(IFS=,; echo "${ALL_STEPS[*]}")}
  GC_QUICK=${GPU_CHECK_QUICK:-0}
  GC_COMPARE_ARGS=${GPU_CHECK_COMPARE_ARGS:-}
  GC_DEVICE=${GPU_CHECK_DEVICE:-cuda}
  GC_BUILD=$(realpath -m "${GPU_CHECK_BUILD_DIR:-$ROOT/build-gpu}")
  GC_VENDOR=${DDP_VENDOR_DIR:-$HERE/vendor}
  GC_DATA=$GC_VENDOR/data/fashion-mnist
  GC_JOBS=${GPU_CHECK_JOBS:-$(nproc)}
  GC_BUILD_FAILED=""
  PYTHON=$(command -v python3 || echo python3)
  [[ -d /usr/local/cuda/bin ]] && export PATH=/usr/local/cuda/bin:$PATH
  rm -f "$R"/*.md "$R"/*.skip "$R"/*.tsv  # a previous run's, in the same folder
  : >"$R/steps.tsv"
  [[ -f $GC_VENDOR/MANIFEST ]] || log "WARNING: no bundle in $GC_VENDOR: run scripts/gpu-check/bundle.sh first (the build will fail)"
  GC_TORCH_PREFIX=${DDP_TORCH_PREFIX:-$("$PYTHON" -c 'import torch; print(torch.utils.cmake_prefix_path)' 2>/dev/null)}
  GC_NO_GPU=""
  if ! command -v nvidia-smi >/dev/null; then
    GC_NO_GPU="nvidia-smi not found"
  elif ! nvidia-smi -L >/dev/null 2>&1; then
    GC_NO_GPU="nvidia-smi -L failed"
  elif ! "$PYTHON" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    GC_NO_GPU="torch.cuda.is_available() is False"
  fi
  if [[ -z ${TORCH_CUDA_ARCH_LIST:-} && -z $GC_NO_GPU ]]; then  # spares LibTorch's CMake a probe
    TORCH_CUDA_ARCH_LIST=$("$PYTHON" -c 'import torch; print("%d.%d" % torch.cuda.get_device_capability())' 2>/dev/null) &&
      export TORCH_CUDA_ARCH_LIST
  fi
  log "report in $R; budget $GC_BUDGET s; steps $GC_STEPS${GC_NO_GPU:+; no GPU: $GC_NO_GPU}"
  local s
  for s in "${ALL_STEPS[@]}"; do run_step "$s"; done
  log "done in $(($(secs) - GC_START)) s: $R/report.md"
  ! grep -qE $'\t(FAILED|TIMED OUT)' "$R/steps.tsv"
}

if [[ ${1:-} == --step ]]; then
  STEP=$2
  R=${R:?}
  : >"$R/$STEP.md"
  "step_${STEP//-/_}"
  exit $?
fi
main "$@"
