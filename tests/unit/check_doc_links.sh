#!/usr/bin/env bash
# README.md and docs/*.md link only to what exists. For every relative markdown link or image,
# [text](path) or [text](path#anchor), outside code blocks and `code spans`:
#   - path names a file or folder, relative to the file that links (a leading '/': to the root);
#   - an anchor into a markdown file (or into the linking file itself, [text](#anchor)) is the
#     slug of one of its headings, as GitHub makes them: the heading's text (a link in it counts
#     as its text) lowercased, every character but letters, digits, ' ', '-' and '_' dropped,
#     each space turned into '-'; a repeated heading gets -1, -2, ... (ASCII letters only).
# External links (http, https, mailto) are not checked. Prints each broken link as
# FILE:LINE: target (why), then "N link(s) checked"; exits 1 when any is broken.
# Usage: check_doc_links.sh <source dir>
set -euo pipefail
root=$1
cd "$root"

# links FILE: "LINE<TAB>TARGET" for every inline link or image outside code. A code span may
# run over several lines of a paragraph (never past a blank line or a fence).
links() {
  awk '
    /^[ \t]*(```|~~~)/ { fence = !fence; in_span = 0; next }
    fence { next }
    /^[ \t]*$/ { in_span = 0; next }
    {
      line = (in_span ? "`" : "") $0
      gsub(/`[^`]*`/, "", line)             # whole code spans
      in_span = index(line, "`") > 0         # one left open: it goes on on the next line
      if (in_span) line = substr(line, 1, index(line, "`") - 1)
      while (match(line, /\]\([^)[:space:]]+([ \t]+"[^"]*")?\)/)) {
        target = substr(line, RSTART + 2, RLENGTH - 3)
        sub(/[ \t].*/, "", target)           # a title: [text](path "title")
        sub(/^</, "", target); sub(/>$/, "", target)
        print NR "\t" target
        line = substr(line, RSTART + RLENGTH)
      }
    }' "$1"
}

# slugs FILE: the anchor of every heading outside code blocks.
slugs() {
  awk '
    /^[ \t]*(```|~~~)/ { fence = !fence; next }
    fence || !/^#+[ \t]/ { next }
    {
      h = $0
      sub(/^#+[ \t]+/, "", h); sub(/[ \t]+#+[ \t]*$/, "", h); sub(/[ \t]+$/, "", h)
      while (match(h, /\[[^]]*\]\([^)]*\)/)) {   # [text](url) -> text
        text = substr(h, RSTART + 1, RLENGTH - 1); sub(/\]\(.*/, "", text)
        h = substr(h, 1, RSTART - 1) text substr(h, RSTART + RLENGTH)
      }
      h = tolower(h)
      gsub(/[^a-z0-9 _-]/, "", h)
      gsub(/ /, "-", h)
      print (h in seen) ? h "-" seen[h] : h
      seen[h]++
    }' "$1"
}

status=0
checked=0
for file in README.md docs/*.md; do
  [[ -f $file ]] || continue
  dir=$(dirname "$file")
  while IFS=$'\t' read -r line target; do
    case $target in http://* | https://* | mailto:*) continue ;; esac
    checked=$((checked + 1))
    path=${target%%#*}
    anchor=
    [[ $target == *'#'* ]] && anchor=${target#*#}
    if [[ -z $path ]]; then
      dest=$file
    elif [[ $path == /* ]]; then
      dest=.$path
    else
      dest=$dir/$path
      dest=${dest#./}
    fi
    if [[ ! -e $dest ]]; then
      echo "$file:$line: $target (no such file or folder: $dest)"
      status=1
    elif [[ -n $anchor && $dest == *.md ]] && ! slugs "$dest" | grep -qxF -- "$anchor"; then
      echo "$file:$line: $target (no heading of $dest has the anchor '$anchor')"
      status=1
    fi
  done < <(links "$file")
done
echo "$checked link(s) checked"
exit $status
