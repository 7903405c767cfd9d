#!/usr/bin/env bash
# Thread-safety rules for the whole tree, in two passes:
#   1. (grep, needs no compiler) No std::mutex, std::timed_mutex, std::recursive_mutex,
#      std::shared_mutex (nor their timed variants) or std::condition_variable(_any) is declared
#      in src/ or tools/ outside src/base/thread_annotations.h: every lock of ours is a
#      ddp::Mutex / TimedMutex with a CondVar, so that the members it guards can say so
#      (GUARDED_BY) and clang can check them. Each offending file:line is listed and the check
#      fails. Locking a mutex that is not ours (std::lock_guard<std::mutex> over LibTorch's
#      generator mutex) is allowed: it declares none.
#   2. Clang's thread-safety analysis over every source that uses
#      src/base/thread_annotations.h: each is compiled (syntax only) with clang++
#      -Wthread-safety -Werror, using the build's own flags (from `ninja -t compdb`). A
#      GUARDED_BY member touched without its mutex fails.
#   scripts/check-thread-safety.sh [BUILD_DIR]     (default: build)
# Exit 77 (ctest: skipped) when clang++ is not installed and pass 1 found nothing; exit 1 when
# either pass fails. Pass 2 checks each file with the build's own flags in C++17 mode (the
# analysis does not depend on the language version, and clang 14 with libstdc++ 12 rejects some
# of LibTorch 1.13's headers in C++20 mode: incomplete types in constexpr std::vector); a file
# that needs C++20 is checked again in the build's own mode. This order takes about half the
# CPU-seconds of the other (C++20 first: 163 CPU-s against 118 here). Where the build compiles a
# file with its precompiled LibTorch header, clang gets one of its own (made once per set of
# flags, in BUILD_DIR/thread-safety-pch): 145-148 against 78-80 CPU-s for the 29 files, two
# alternated pairs on a quiet machine, median ratio 0.54.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${1:-build}

# Pass 1. A line counts without its comment and its lock types' template arguments
# (lock_guard<std::mutex> locks a mutex, it declares none).
std_lock='std::(recursive_|shared_)?(timed_)?mutex|std::condition_variable'
raw_locks=$(grep -rnE --include='*.h' --include='*.hpp' --include='*.cpp' --include='*.cc' \
              "$std_lock" src tools |
            grep -v '^src/base/thread_annotations\.h:' |
            awk -v re="$std_lock" '{
              code = $0
              sub(/\/\/.*$/, "", code)
              gsub(/std::(lock_guard|unique_lock|scoped_lock|shared_lock)<[^>]*>/, "", code)
              if (code ~ re) print
            }' || true)
if [[ -n $raw_locks ]]; then
  echo "check-thread-safety: FAILED: standard mutexes or condition variables declared outside" \
       "src/base/thread_annotations.h; use ddp::Mutex / ddp::TimedMutex / ddp::CondVar and" \
       "GUARDED_BY (see that header):"
  printf '%s\n' "$raw_locks" | sed -E 's@^([^:]+:[0-9]+):[[:space:]]*@  \1: @; s@[[:space:]]+$@@'
fi

command -v clang++ >/dev/null || {
  echo "check-thread-safety: clang++ not installed: the analysis (pass 2) skipped"
  [[ -z $raw_locks ]] || exit 1
  exit 77
}
mapfile -t files < <(grep -rl --include='*.cpp' 'thread_annotations.h' src tools || true)
# Annotated headers reach their .cpp files through includes.
mapfile -t headers < <(grep -rl --include='*.h' 'thread_annotations.h' src tools | grep -v thread_annotations.h || true)
for h in "${headers[@]}"; do
  base=$(basename "$h")
  mapfile -t -O "${#files[@]}" files < <(grep -rl --include='*.cpp' "\"$(dirname "${h#src/}")/$base\"\|\"$base\"" src tools || true)
done
mapfile -t files < <(printf '%s\n' "${files[@]}" | sort -u)
if [[ -z ${files[0]:-} ]]; then
  echo "check-thread-safety: no annotated sources"
  [[ -z $raw_locks ]] || exit 1
  exit 0
fi
(cd "$BUILD_DIR" && ninja -t compdb) > "$BUILD_DIR/compdb-thread-safety.json"
analysis=0
python3 - "$BUILD_DIR/compdb-thread-safety.json" "$PWD" "${files[@]}" <<'PY' || analysis=$?
import json, os, shlex, subprocess, sys
from concurrent.futures import ThreadPoolExecutor
compdb, root, files = sys.argv[1], sys.argv[2], sys.argv[3:]
entries = {}
for e in json.load(open(compdb)):
    path = os.path.normpath(os.path.join(e["directory"], e["file"]))
    entries.setdefault(path, e)

def file_flags(f):
    """(directory, the build's flags for f less its outputs and GCC's header, that header or
    None), or None when f is not in the build."""
    e = entries.get(os.path.join(root, f))
    if e is None:
        return None
    args = shlex.split(e["command"])
    # The launcher before the compiler: "cmake -E env VAR=value ... ccache c++" (CMakeLists.txt).
    if len(args) > 2 and os.path.basename(args[0]) == "cmake" and args[1:3] == ["-E", "env"]:
        args = args[3:]
        while args and "=" in args[0] and not args[0].startswith("-"):
            args = args[1:]
    while args and os.path.basename(args[0]) in ("ccache", "c++", "g++", "gcc", "cc"):
        args = args[1:]
    # The build's flags less its outputs, and less GCC's precompiled LibTorch header (Note
    # [Precompiled LibTorch] in cmake/DdpHelpers.cmake): clang cannot read it. Its header is
    # kept, for clang's own (below).
    out, header, i = [], None, 0
    while i < len(args):
        a = args[i]
        if a == "-include" and i + 1 < len(args) and args[i + 1].endswith("cmake_pch.hxx"):
            header = args[i + 1]
            i += 2
            continue
        if a in ("-o", "-MT", "-MF"):
            i += 2
            continue
        if a not in ("-MD", "-Winvalid-pch"):
            out.append(a)
        i += 1
    return e["directory"], out, header

CLANG = ["clang++", "-Wthread-safety", "-Werror=thread-safety", "-Wno-c++20-designator",
         "-Wno-c++20-extensions"]

def cxx17(flags):
    return ["-std=c++17" if a.startswith("-std=") else a for a in flags]

def without_source(flags, f):
    """flags less "-c <f>": what every file of one target shares."""
    src = os.path.join(root, f)
    out, i = [], 0
    while i < len(flags):
        if flags[i] == "-c" and i + 1 < len(flags):
            i += 2
            continue
        if os.path.normpath(os.path.join(root, flags[i])) != src:
            out.append(flags[i])
        i += 1
    return out

# Clang's own precompiled header, one per set of flags whose files GCC compiles with one (the
# same LibTorch headers): parsed and instantiated once (-fpch-instantiate-templates) instead of
# once per file, which was most of this check's CPU. In C++17 mode, the mode checked first. A
# header clang cannot make leaves its files checked without one.
pch_dir = os.path.join(os.path.dirname(os.path.abspath(compdb)), "thread-safety-pch")
os.makedirs(pch_dir, exist_ok=True)
groups = {}
for f in files:
    got = file_flags(f)
    if got is not None and got[2] is not None:
        directory, flags, header = got
        key = (directory, header, tuple(cxx17(without_source(flags, f))))
        groups.setdefault(key, len(groups))

def make_pch(item):
    (directory, header, flags), n = item
    pch = os.path.join(pch_dir, f"{n}.pch")
    r = subprocess.run(CLANG + ["-x", "c++-header", "-fpch-instantiate-templates"] + list(flags)
                       + [header, "-o", pch], cwd=directory, capture_output=True, text=True)
    return (directory, header, flags), (pch if r.returncode == 0 else None), r.stderr[-2000:]

def check_file(f, pchs):
    """One file's verdict: (ok, what to print)."""
    got = file_flags(f)
    if got is None:
        return True, f"check-thread-safety: {f}: not in the build, skipped"
    directory, out, header = got
    def check(flags, pch=None):
        cmd = CLANG + ["-fsyntax-only"] + (["-include-pch", pch] if pch else []) + flags
        return subprocess.run(cmd, cwd=directory, capture_output=True, text=True)
    # C++17 first: clang 14 rejects some of LibTorch 1.13's headers in C++20 mode (with
    # libstdc++ 12), and that mode is slower where it does not. A file that C++17 cannot compile
    # (it uses C++20: 6 of the 29 here) is checked again with the build's own version, without
    # a precompiled header.
    flags17 = cxx17(out)
    pch = pchs.get((directory, header, tuple(without_source(flags17, f)))) if header else None
    r = check(flags17, pch)
    if r.returncode != 0 and "-Wthread-safety" not in r.stderr:
        own = check(out)
        if own.returncode == 0 or "-Wthread-safety" in own.stderr:
            r = own
    if r.returncode == 0:
        return True, f"check-thread-safety: {f}: ok"
    return False, f"check-thread-safety: {f}: FAILED\n{r.stderr[-4000:]}"

# One clang per core (a LibTorch file takes seconds even without code generation).
failed = 0
with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
    pchs = {}
    for key, pch, err in pool.map(make_pch, groups.items()):
        pchs[key] = pch
        if pch is None:
            print(f"check-thread-safety: no precompiled header for {key[1]} (files checked"
                  f" without it):\n{err}", flush=True)
    for ok, text in pool.map(lambda f: check_file(f, pchs), files):
        print(text, flush=True)
        failed += not ok
sys.exit(1 if failed else 0)
PY
[[ -z $raw_locks ]] || { echo "check-thread-safety: FAILED: standard mutexes declared (listed above)"; exit 1; }
exit "$analysis"
