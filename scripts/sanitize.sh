#!/usr/bin/env bash
# The tests again under sanitizers: ASan+UBSan in build-asan/, TSan in build-tsan/ (cmake
# -DDDP_SANITIZE=...; our targets only, LibTorch as Debian ships it). Configures each build
# folder, builds only the executables the chosen tests run, runs them with ctest (serially, like
# scripts/test.sh) and prints how long each build and run took. Fails if any test fails; a
# sanitizer report fails its test. Note [Sanitizers] below says what is set and why.
# Usage: scripts/sanitize.sh [asan|tsan|all] [--torch-free] [--build] [ctest arguments...]
#   default: all, labels unit and collective (store, shm, reducer, hang reports among them)
#   --torch-free: only the tests that never load LibTorch (the store's protocol and server,
#     ddprun's restart and elastic rounds over a real agent store, the etcd backend against real
#     etcd members, env, completion): minutes,
#     not an hour; what scripts/test.sh runs
#   --build: configure and build only, run nothing (scripts/test.sh builds niced beside the
#     LibTorch 2.6 suite, then runs the tests once that suite is done)
#   DDP_SANITIZE_TESTS=REGEX narrows the tests before anything is built, e.g. 'store|shm'
#   extra arguments go to ctest, e.g. --repeat until-fail:3
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
supp=$root/scripts/sanitizers

mode=all
if [[ ${1:-} =~ ^(asan|tsan|all)$ ]]; then mode=$1; shift; fi
torch_free=0
if [[ ${1:-} == --torch-free ]]; then torch_free=1; shift; fi
build_only=0
if [[ ${1:-} == --build ]]; then build_only=1; shift; fi
case $mode in
  asan) modes=(asan) ;;
  tsan) modes=(tsan) ;;
  all) modes=(asan tsan) ;;
esac

# Note [Sanitizers]
# Our code is instrumented, LibTorch (Debian's libtorch-dev), Gloo, OpenMP and OpenBLAS are not:
# - ASan sees every heap block (malloc is intercepted everywhere) but checks only our accesses.
#   Leaks are checked at exit (detect_leaks=1): LibTorch's registries and thread pools stay
#   reachable from globals and live threads, so none of the tests run needed a suppression and
#   lsan.supp is empty; a LibTorch leak would go there by library, never by one of our frames.
#   check_initialization_order catches static-init order bugs across our files.
# - UBSan: -fno-sanitize-recover=all (CMake), so the first report aborts the test.
# - TSan sees our accesses and every pthread call, but not the atomics inside LibTorch or
#   libgomp: a hand-off that LibTorch synchronizes with its own atomics (a c10 refcount, a
#   c10::ivalue::Future) or an OpenMP barrier looks like a race to it. tsan.supp says for each
#   entry which reports it covers and what it hides (LibTorch's side has no symbols, so the main
#   entry names its library: it hides only races against LibTorch's own free or pthread calls). OMP_NUM_THREADS=1 keeps LibTorch's kernels
#   on the calling thread: TSan cannot follow libgomp's barriers at all, and one thread per
#   rank is how the tests run ranks as threads anyway.
# - -O1 -g1 (RelWithDebInfo's flags replaced; CMAKE_BUILD_TYPE set by hand keeps its own): the
#   level ASan's manual suggests, and line tables only, which is all a report's stack needs.
#   Their compile takes about half the CPU of -O2 -g (tools/ddprun/args.cpp under ASan+UBSan,
#   quiet, 3 alternated pairs: 24.3 against 48.4 CPU-s, median ratio 0.54); the torch-free builds took 288 s (ASan+UBSan) and 81 s (TSan) from an
#   empty cache here, against ~10 min of both cores for the two at -O2 -g. The torch-free tests
#   (--torch-free: what scripts/test.sh runs) build at -O0 -g1: about a quarter less compile
#   again (tools/ddprun/elastic.cpp under ASan+UBSan: 3.0-3.8 against 4.7 CPU-s), and they wait
#   on peers and deadlines, so their speed does not matter; ASan and TSan check as much there.
#   Switching a build folder between the two rebuilds it.
asan_env=(
  "ASAN_OPTIONS=detect_leaks=1:check_initialization_order=1:strict_init_order=1:abort_on_error=0:halt_on_error=1"
  "LSAN_OPTIONS=suppressions=$supp/lsan.supp:print_suppressions=0"
  "UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1"
)
tsan_env=(
  "TSAN_OPTIONS=suppressions=$supp/tsan.supp:print_suppressions=0:halt_on_error=0:exitcode=66:second_deadlock_stack=1:history_size=4"
  "OMP_NUM_THREADS=1"
)

# Tests that link neither libddp nor LibTorch (checked with ldd after the build).
torch_free_tests='test_env|test_blas|test_allocator|test_completion|test_ddprun_args|test_ddprun_quorum|test_store_protocol|test_ddprun_rounds|test_elastic_rounds|test_ddprun_round_store|test_etcd'

# The chosen tests of a configured build folder, as "name<TAB>target" lines: labels unit or
# collective, run straight from an executable of this build (not scripts such as
# check_readme_examples.sh, which have nothing to instrument).
select_tests() {
  (cd "$1" && ctest --show-only=json-v1) | python3 -c '
import glob, json, os, re, sys
build, only, torch_free = sys.argv[1], sys.argv[2], sys.argv[3]
# ctest lists no command for an executable not built yet: the commands come from the test files.
commands = {}
for f in glob.glob(build + "/**/CTestTestfile.cmake", recursive=True):
    for name, exe in re.findall(r"^add_test\((\S+) \"([^\"]+)\"", open(f).read(), re.M):
        commands[name] = exe
for t in json.load(sys.stdin)["tests"]:
    props = {p["name"]: p["value"] for p in t.get("properties", [])}
    exe = commands.get(t["name"], "")
    if not {"unit", "collective"} & set(props.get("LABELS", [])) or not exe.startswith(build + "/"):
        continue
    target = os.path.basename(exe)
    if torch_free and not re.fullmatch(torch_free, target):
        continue
    if only and not re.search(only, t["name"]):
        continue
    print(t["name"] + "\t" + target)
' "$root/$1" "${DDP_SANITIZE_TESTS:-}" "$([[ $torch_free == 1 ]] && echo "$torch_free_tests")"
}

# -O1, or -O0 for the torch-free tests (Note [Sanitizers]).
opt=-O1
((torch_free)) && opt=-O0
rc=0
summary=()
for m in "${modes[@]}"; do
  dir=build-$m
  if [[ $m == asan ]]; then flags=address,undefined; env=("${asan_env[@]}"); else flags=thread; env=("${tsan_env[@]}"); fi
  start=$SECONDS
  cmake -S . -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=${CMAKE_BUILD_TYPE:-RelWithDebInfo} \
    -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="$opt -g1 -DNDEBUG" -DDDP_SANITIZE=$flags >/dev/null
  mapfile -t tests < <(select_tests "$dir")
  ((${#tests[@]})) || { echo "sanitize.sh: $m: no test selected" >&2; exit 1; }
  names=() targets=()
  for t in "${tests[@]}"; do names+=("${t%%$'\t'*}"); targets+=("${t##*$'\t'}"); done
  mapfile -t targets < <(printf '%s\n' "${targets[@]}" | sort -u)
  echo "sanitize.sh: $m: building ${targets[*]}"
  cmake --build "$dir" -j"$(nproc)" --target "${targets[@]}"
  built=$((SECONDS - start))
  if ((torch_free)); then
    for t in "${targets[@]}"; do
      exe=$(find "$dir/tests" -name "$t" -type f -perm -u+x | head -n 1)
      if ldd "$exe" | grep -q 'libtorch\|libddp\.so'; then
        echo "sanitize.sh: $t links LibTorch; take it out of torch_free_tests" >&2
        exit 1
      fi
    done
  fi
  if ((build_only)); then
    summary+=("sanitize.sh: $m: ${#targets[@]} programs built in ${built} s")
    continue
  fi
  regex="^($(printf '%s\n' "${names[@]}" | sed 's/[.]/[.]/g' | paste -sd'|'))\$"
  start=$SECONDS
  status=0
  (cd "$dir" && env "${env[@]}" ctest --output-on-failure -R "$regex" "$@") || status=$?
  ran=$((SECONDS - start))
  ((status)) && rc=1
  summary+=("sanitize.sh: $m: ${#names[@]} tests, build ${built} s, run ${ran} s, exit $status")
done
printf '%s\n' "${summary[@]}"
exit $rc
