#!/usr/bin/env bash
# Installs the build into a temporary prefix, as a user would, then:
#   1. runs the installed tools (ddprun, ddp-train) with LD_LIBRARY_PATH unset: they must find
#      libddp.so through their install RPATH ($ORIGIN/../lib), from a prefix the loader does
#      not search by default;
#   2. builds and runs a consumer project that uses find_package(ddp) +
#      target_link_libraries(app ddp::ddp);
#   3. builds and runs a C program against the installed C ABI (include/ddp/c_api.h and
#      libddp, no LibTorch flags).
# Usage: check_install.sh <build dir> <source dir of the consumer>
set -euo pipefail
build=$1
consumer=$2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
prefix=$work/prefix
cmake --install "$build" --prefix "$prefix" >/dev/null

for tool in ddprun ddp-train; do
  test -x "$prefix/bin/$tool" || { echo "check_install: $tool was not installed in $prefix/bin"; exit 1; }
  if ! env -u LD_LIBRARY_PATH "$prefix/bin/$tool" --help >"$work/$tool.out" 2>&1; then
    echo "check_install: the installed $tool --help failed:"
    cat "$work/$tool.out"
    exit 1
  fi
  echo "check_install: installed $tool --help: OK ($(head -n 1 "$work/$tool.out"))"
done

launcher=()
command -v ccache >/dev/null && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
cmake -S "$consumer" -B "$work/build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
      -DCMAKE_PREFIX_PATH="$prefix" "${launcher[@]}" >/dev/null
cmake --build "$work/build" >/dev/null
env -u LD_LIBRARY_PATH "$work/build/consumer"

# 3. A C program against the installed C ABI: the header and libddp, no LibTorch flags.
lib=$(dirname "$(find "$prefix" -name libddp.so -print -quit)")
cat >"$work/c_consumer.c" <<'EOF'
#include <stdio.h>

#include "ddp/c_api.h"

int main(void) {
  printf("check_install: a C program against the installed C ABI: ddp-cpp %s, C ABI %d\n",
         ddp_version(), ddp_abi_version());
  return ddp_abi_version() == DDP_C_API_VERSION ? 0 : 1;
}
EOF
cc -std=c11 -Wall -Werror -I"$prefix/include" "$work/c_consumer.c" -L"$lib" -lddp \
   -Wl,-rpath,"$lib" -o "$work/c_consumer"
env -u LD_LIBRARY_PATH "$work/c_consumer"
