#!/usr/bin/env bash
# The whole test suite, from a fresh machine: install, build, run every test; then the Debian
# packages installed by apt into a clean bookworm root (scripts/test-deb.sh; skipped with
# DDP_SKIP_DEB=1, or when not root); then the suite against LibTorch 2.6 in a Debian trixie root,
# all but its version-neutral tests (scripts/test-libtorch2.sh; skipped with DDP_SKIP_LIBTORCH2=1,
# or when not root). Fails if any fails.
# Extra arguments go to ctest (both runs), e.g. scripts/test.sh -L unit
set -euo pipefail
cd "$(dirname "$0")/.."

# Each phase's wall time, printed as it ends and again at the end, with how busy the CPUs were
# (all of them, from /proc/stat) and how much of that was niced work: what runs in the
# background (the trixie and sanitizer builds) beside the phase. On a machine that is busy all
# along, only less work makes the run shorter; idle time is where background work can go.
phases=()
phase_start=$SECONDS
cpu_now() {  # "busy niced all" jiffies so far
  local _ user nice system idle iowait irq softirq steal
  read -r _ user nice system idle iowait irq softirq steal _ </proc/stat
  echo "$((user + nice + system + irq + softirq + steal)) $nice $((user + nice + system + idle + iowait + irq + softirq + steal))"
}
phase_cpu=$(cpu_now)
phase_done() {
  local now busy niced all b0 n0 a0
  now=$(cpu_now)
  read -r busy niced all <<<"$now"
  read -r b0 n0 a0 <<<"$phase_cpu"
  local usage=""
  if ((all > a0)); then
    usage=$(printf 'CPU busy %3d%%, niced %3d%%' $((100 * (busy - b0) / (all - a0))) \
      $((100 * (niced - n0) / (all - a0))))
  fi
  phases+=("$(printf '%-44s %5d s  %s' "$1" $((SECONDS - phase_start)) "$usage")")
  echo "test.sh: $1: $((SECONDS - phase_start)) s${usage:+ ($usage)}" >&2
  phase_start=$SECONDS
  phase_cpu=$now
}

# Host packages first: apt must not run twice at once.
scripts/install-deps.sh
phase_done "host packages (apt)"

# The trixie root (debootstrap + packages: downloads and unpacking, ~10 min from scratch) is made
# and its tree built in the background, niced: the bookworm build takes the CPUs first, the
# trixie build fills what the bookworm suite leaves idle (most of its tests wait on other ranks,
# timeouts and processes), and the trixie suite at the end finds its build done.
# runs WHAT SKIP_VARIABLE SCRIPT [ARGS...]: 1 when the step runs, else 0 with the reason said.
runs() {
  local what=$1 var=$2 script=$3
  shift 3
  if [[ ${!var:-0} == 1 ]]; then
    echo "test.sh: $what skipped ($var=1)" >&2
  elif [[ $# -gt 0 ]]; then
    echo "test.sh: $what skipped (ctest arguments given)" >&2
  elif [[ $(id -u) -ne 0 ]]; then
    echo "test.sh: $what skipped: $script needs root (debootstrap, chroot)" >&2
  else
    echo 1
    return
  fi
  echo 0
}
libtorch2=$(runs "LibTorch 2.x suite" DDP_SKIP_LIBTORCH2 scripts/test-libtorch2.sh)
prepare_log=$(mktemp /tmp/ddp-libtorch2-prepare.XXXXXX)
prepare_pid=
if ((libtorch2)); then
  nice -n 19 scripts/test-libtorch2.sh --build >"$prepare_log" 2>&1 &
  prepare_pid=$!
fi
# Sanitizers, the torch-free part: ASan+UBSan and TSan over the store (protocol, epoll server,
# ddprun's restart and elastic rounds against a real agent store, etcd), env, allocator and
# completion tests; a few minutes (docs/testing.md: Sanitizers). The whole sanitizer suite
# rebuilds libddp twice and does not fit CI's hour: run scripts/sanitize.sh by hand. Only in a
# full run (no ctest arguments); DDP_SKIP_SANITIZE=1 skips it. Where the LibTorch 2.6 suite runs,
# its two builds (~5 min of both cores) follow the trixie build in the background, niced, in
# the CPU the suites leave idle, and its tests run beside the 2.6 suite (they wait on deadlines
# and peers, ~10 % of the CPUs, and none of them is in that suite: they are version-neutral).
sanitize=1
if [[ ${DDP_SKIP_SANITIZE:-0} == 1 || $# -gt 0 ]]; then
  echo "test.sh: sanitizer step skipped (DDP_SKIP_SANITIZE=1 or ctest arguments given)"
  sanitize=0
fi
# alive PID: running, not a zombie left for `wait` (a background job that ended).
alive() {
  local state
  state=$(cut -d' ' -f3 "/proc/$1/stat" 2>/dev/null) && [[ $state != Z ]]
}
sanitize_pid= sanitize_log=
bookworm_done=$(mktemp -u /tmp/ddp-bookworm-suite-done.XXXXXX)  # made when that suite ends
if ((sanitize && libtorch2)); then
  sanitize_log=$(mktemp /tmp/ddp-sanitize.XXXXXX)
  # A failed build shows in the tests' run, which builds what is left and says what failed.
  # The two sets of tests at once: they wait on deadlines and peers (about a fifth of a core
  # each), and whatever of them is left when the 2.6 suite ends is the run's last phase.
  (while alive "$prepare_pid"; do sleep 5; done
   nice -n 19 scripts/sanitize.sh all --torch-free --build
   while [[ ! -e $bookworm_done ]]; do sleep 2; done
   status=0
   scripts/sanitize.sh asan --torch-free >"$sanitize_log.asan" 2>&1 &
   asan_pid=$!
   scripts/sanitize.sh tsan --torch-free >"$sanitize_log.tsan" 2>&1 || status=1
   wait "$asan_pid" || status=1
   cat "$sanitize_log.asan" "$sanitize_log.tsan"
   rm -f "$sanitize_log.asan" "$sanitize_log.tsan"
   exit $status) >"$sanitize_log" 2>&1 &
  sanitize_pid=$!
fi
# The same for the Debian packages' clean bookworm root (debootstrap and downloads, ~1 min here).
deb=$(runs "Debian package test" DDP_SKIP_DEB scripts/test-deb.sh "$@")
deb_log=$(mktemp /tmp/ddp-deb-prepare.XXXXXX)
deb_pid=
if ((deb)); then
  scripts/test-deb.sh --prepare >"$deb_log" 2>&1 &
  deb_pid=$!
fi
deb_run_pid= deb_run_log=  # the package test's own run (below)
beside_pid= beside_log=    # the bookworm entries labelled `beside` (below)
waits_pid= waits_log=      # the bookworm entries labelled `waits` (below)
trap '[[ -n $prepare_pid ]] && kill "$prepare_pid" 2>/dev/null
      [[ -n $deb_pid ]] && kill "$deb_pid" 2>/dev/null
      [[ -n $sanitize_pid ]] && kill "$sanitize_pid" 2>/dev/null
      [[ -n $deb_run_pid ]] && kill "$deb_run_pid" 2>/dev/null
      [[ -n $beside_pid ]] && kill "$beside_pid" 2>/dev/null
      [[ -n $waits_pid ]] && kill "$waits_pid" 2>/dev/null
      rm -f "$prepare_log" "$deb_log" $sanitize_log $deb_run_log $beside_log $waits_log \
        "$bookworm_done"' EXIT

# Paths relative to the tree in ccache's keys: build-deb/ (scripts/test-deb.sh) reuses build/'s
# objects instead of compiling LibTorch code again (~7 min on 2 cores).
export CCACHE_BASEDIR=${CCACHE_BASEDIR:-$PWD}
scripts/build.sh  # its install-deps.sh finds everything installed
phase_done "bookworm build (LibTorch 1.13)"
BUILD_DIR=${DDP_BUILD_DIR:-build}
# Serial: the collective and multi-process tests start several ranks each on a 2-core machine.
# Where the LibTorch 2.6 suite runs, two kinds of version-neutral entries run beside it instead:
# - `waits`: the multi-host fault tests (test_elastic, test_multinode.fault), whose wall time is
#   mostly their own timed waits (cuts, step floors, rounds), about a quarter of the CPUs. They
#   start when this suite ends, at full priority: their hosts are network namespaces of their
#   own, so they share no port with the other suite, and their bounds keep their meaning.
# - `beside`: CPU work that waits on no peer or deadline (the thread-safety analysis, a compiler
#   run), niced, once the trixie build is done (that build is on the path, they are not).
rc=0
bookworm_args=()
if ((libtorch2)); then bookworm_args=(-LE '^(beside|waits)$'); fi
(cd "$BUILD_DIR" && ctest --output-on-failure "${bookworm_args[@]}" "$@") || rc=$?
phase_done "bookworm suite (ctest)"
touch "$bookworm_done"
if ((libtorch2)); then
  waits_log=$(mktemp /tmp/ddp-waits.XXXXXX)
  (cd "$BUILD_DIR" && exec ctest --output-on-failure -L '^waits$') >"$waits_log" 2>&1 &
  waits_pid=$!
fi

run_sanitizers() {
  if ((sanitize)); then
    scripts/sanitize.sh all --torch-free || rc=1
    phase_done "sanitizers (torch-free, ASan+UBSan, TSan)"
  fi
}
if ! ((libtorch2)); then run_sanitizers; fi

# The Debian packages: built in build-deb/ (ccache shares build/'s objects), installed by apt in
# a throwaway copy of the clean root, used there (a few minutes).
# prepared PID LOG WHAT: waits for a background --prepare; 0 when it succeeded, else shows the
# end of its log and returns its exit status.
prepared() {
  local status=0
  wait "$1" || status=$?
  if ((status)); then
    tail -n 40 "$2"
    echo "test.sh: preparing $3 failed (exit $status)" >&2
  fi
  return $status
}

# collect PID LOG WHAT: waits for a job that ran beside the LibTorch 2.6 suite, prints its log
# and folds its exit status into rc.
collect() {
  local status=0
  wait "$1" || status=$?
  cat "$2"
  if ((status)); then rc=1; fi
  phase_done "$3"
}

# Beside the LibTorch 2.6 suite when that runs (niced: its build comes from ccache, the rest is
# apt and dpkg, and one 20-step job on a port of its own), else here.
if ((deb)); then
  if prepared "$deb_pid" "$deb_log" "the Debian package test's root"; then
    if ! ((libtorch2)); then
      scripts/test-deb.sh || rc=1
      phase_done "Debian packages (build, install, use)"
    fi
  else
    rc=1
    deb=0
  fi
  deb_pid=
fi

if ((libtorch2)); then
  echo "test.sh: LibTorch 1.13 (bookworm) suite exit $rc; now the LibTorch 2.6 (trixie) suite"
  trixie_ready=0
  if prepared "$prepare_pid" "$prepare_log" "the trixie root and build"; then trixie_ready=1; fi
  prepare_pid=
  phase_done "waiting for the trixie root and build"
  # The niced jobs beside the 2.6 suite start once its build is done, not to slow that build.
  if ((deb)); then
    deb_run_log=$(mktemp /tmp/ddp-deb-run.XXXXXX)
    nice -n 10 scripts/test-deb.sh >"$deb_run_log" 2>&1 &
    deb_run_pid=$!
  fi
  beside_log=$(mktemp /tmp/ddp-beside.XXXXXX)
  (cd "$BUILD_DIR" && exec nice -n 10 ctest --output-on-failure -L '^beside$') >"$beside_log" 2>&1 &
  beside_pid=$!
  if ((trixie_ready)); then
    grep -a '^test-libtorch2:' "$prepare_log" || true
    scripts/test-libtorch2.sh "$@" || rc=$?
  else
    rc=1
  fi
  phase_done "trixie suite (LibTorch 2.6, ctest)"
  if [[ -n $waits_pid ]]; then
    collect "$waits_pid" "$waits_log" "bookworm entries labelled waits (beside the trixie suite)"
    waits_pid=
  fi
  if [[ -n $deb_run_pid ]]; then
    collect "$deb_run_pid" "$deb_run_log" "Debian packages (beside the trixie suite)"
    deb_run_pid=
  fi
  collect "$beside_pid" "$beside_log" "bookworm entries labelled beside (beside the trixie suite)"
  beside_pid=
  if [[ -n ${sanitize_pid:-} ]]; then
    collect "$sanitize_pid" "$sanitize_log" "sanitizer tests (beside the trixie suite)"
    sanitize_pid=
  else
    run_sanitizers
  fi
fi
echo "test.sh: exit $rc; the phases' wall times:" >&2
printf 'test.sh:   %s\n' "${phases[@]}" >&2
exit $rc
