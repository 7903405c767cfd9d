#!/usr/bin/env bash
# README.md shows only programs the build compiles: every ```cpp block is preceded by the line
#   <!-- example: examples/NAME/main.cpp -->
# and its text is exactly that file, which examples/CMakeLists.txt builds. Fails (with a diff)
# when a block and its file differ, a block has no marker, or the file is not built.
# Usage: check_readme_examples.sh <source dir>
set -euo pipefail
root=$1
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# Split README.md into one file per ```cpp block; list "line<TAB>block file<TAB>marker" per
# block (the marker last: it may be empty).
awk -v out="$work" '
  in_block && /^```/ { in_block = 0; close(file); prev = ""; next }
  in_block { print > file; next }
  /^```(cpp|c\+\+)[[:space:]]*$/ {
    ++n; file = out "/block" n
    printf "%d\t%s\t%s\n", NR, file, (prev ~ /^<!-- example: .* -->$/ ? prev : "") > out "/list"
    printf "" > file
    in_block = 1; next
  }
  { prev = $0 }
' "$root/README.md"

status=0
blocks=0
while IFS=$'\t' read -r line block marker; do
  blocks=$((blocks + 1))
  if [[ -z $marker ]]; then
    echo "README.md:$line: a \`\`\`cpp block without '<!-- example: examples/NAME/main.cpp -->'" \
         "on the line before it; README programs must be complete files under examples/"
    status=1
    continue
  fi
  path=${marker#<!-- example: }
  path=${path% -->}
  if [[ ! -f $root/$path ]]; then
    echo "README.md:$line: the marker names $path, which does not exist"
    status=1
    continue
  fi
  if ! grep -q "${path#examples/}" "$root/examples/CMakeLists.txt"; then
    echo "README.md:$line: $path is not built by examples/CMakeLists.txt"
    status=1
  fi
  if ! diff -u --label "$path" --label "README.md:$line" "$root/$path" "$block"; then
    echo "README.md:$line: the block differs from $path (diff above); change both together"
    status=1
  else
    echo "README.md:$line: identical to $path"
  fi
done < <(cat "$work/list" 2>/dev/null)
echo "$blocks C++ block(s) checked"
exit $status
