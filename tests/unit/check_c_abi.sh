#!/usr/bin/env bash
# libddp's exported C functions (nm -D: defined text symbols named ddp_*) must be exactly the
# functions include/ddp/c_api.h declares and tests/unit/c_api_signatures.c pins: a function
# added, removed or renamed without the other two fails here.
#   check_c_abi.sh LIBDDP C_API_H SIGNATURES_C
set -euo pipefail
lib=$1 header=$2 pins=$3
exported=$(nm -D --defined-only "$lib" | awk '$2 == "T" && $3 ~ /^ddp_/ {print $3}' | sort)
declared=$(grep -oE '^[a-z0-9_ *]*[ *](ddp_[a-z0-9_]+)\(' "$header" | grep -oE 'ddp_[a-z0-9_]+\($' |
           tr -d '(' | sort -u)
pinned=$(grep -oE '(= |^ +)ddp_[a-z0-9_]+;' "$pins" | grep -oE 'ddp_[a-z0-9_]+' | sort -u)
status=0
if [[ $exported != "$declared" ]]; then
  echo "check_c_abi: libddp exports and c_api.h declares different functions:" >&2
  diff <(echo "$exported") <(echo "$declared") | sed 's/^</  exported only:/; s/^>/  declared only:/' >&2 || true
  status=1
fi
if [[ $declared != "$pinned" ]]; then
  echo "check_c_abi: c_api.h declares and c_api_signatures.c pins different functions:" >&2
  diff <(echo "$declared") <(echo "$pinned") | sed 's/^</  declared only:/; s/^>/  pinned only:/' >&2 || true
  status=1
fi
count=$(echo "$exported" | wc -l)
((status == 0)) && echo "check_c_abi: $count functions exported, declared and pinned alike"
exit $status
