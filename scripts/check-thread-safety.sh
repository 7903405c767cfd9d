#!/usr/bin/env bash
# Clang's thread-safety analysis over every source that uses src/base/thread_annotations.h:
# each is compiled (syntax only) with clang++ -Wthread-safety -Werror, using the build's own
# flags (from `ninja -t compdb`). A GUARDED_BY member touched without its mutex fails.
#   scripts/check-thread-safety.sh [BUILD_DIR]     (default: build)
# Exit 77 (ctest: skipped) when clang++ is not installed. Each file is checked with the build's
# own flags; one that clang 14 cannot compile in C++20 mode for another reason (with libstdc++
# 12 it rejects some of LibTorch 1.13's headers: incomplete types in constexpr std::vector) is
# checked again in C++17 mode: the analysis does not depend on the language version.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${1:-build}
command -v clang++ >/dev/null || { echo "check-thread-safety: clang++ not installed: skipped"; exit 77; }
mapfile -t files < <(grep -rl --include='*.cpp' 'thread_annotations.h' src tools || true)
# Annotated headers reach their .cpp files through includes.
mapfile -t headers < <(grep -rl --include='*.h' 'thread_annotations.h' src tools | grep -v thread_annotations.h || true)
for h in "${headers[@]}"; do
  base=$(basename "$h")
  mapfile -t -O "${#files[@]}" files < <(grep -rl --include='*.cpp' "\"$(dirname "${h#src/}")/$base\"\|\"$base\"" src tools || true)
done
mapfile -t files < <(printf '%s\n' "${files[@]}" | sort -u)
[[ -n ${files[0]:-} ]] || { echo "check-thread-safety: no annotated sources"; exit 0; }
(cd "$BUILD_DIR" && ninja -t compdb) > "$BUILD_DIR/compdb-thread-safety.json"
python3 - "$BUILD_DIR/compdb-thread-safety.json" "$PWD" "${files[@]}" <<'PY'
import json, os, shlex, subprocess, sys
compdb, root, files = sys.argv[1], sys.argv[2], sys.argv[3:]
entries = {}
for e in json.load(open(compdb)):
    path = os.path.normpath(os.path.join(e["directory"], e["file"]))
    entries.setdefault(path, e)
failed = 0
for f in files:
    e = entries.get(os.path.join(root, f))
    if e is None:
        print(f"check-thread-safety: {f}: not in the build, skipped")
        continue
    args = shlex.split(e["command"])
    while args and os.path.basename(args[0]) in ("ccache", "c++", "g++", "gcc", "cc"):
        args = args[1:]
    out, skip = [], False
    for a in args:
        if skip:
            skip = False
            continue
        if a in ("-o", "-MT", "-MF"):
            skip = True
            continue
        if a == "-MD":
            continue
        out.append(a)
    def check(flags):
        cmd = ["clang++", "-fsyntax-only", "-Wthread-safety", "-Werror=thread-safety",
               "-Wno-c++20-designator", "-Wno-c++20-extensions"] + flags
        return subprocess.run(cmd, cwd=e["directory"], capture_output=True, text=True)
    # The build's own language version first; files whose LibTorch 1.13 headers clang 14
    # rejects in C++20 mode (an error that is not the analysis's) get a second try in C++17.
    r = check(out)
    if r.returncode != 0 and "-Wthread-safety" not in r.stderr:
        r17 = check(["-std=c++17" if a.startswith("-std=") else a for a in out])
        if r17.returncode == 0 or "-Wthread-safety" in r17.stderr:
            r = r17
    status = "ok" if r.returncode == 0 else "FAILED"
    print(f"check-thread-safety: {f}: {status}")
    if r.returncode != 0:
        failed += 1
        print(r.stderr[-4000:])
sys.exit(1 if failed else 0)
PY
