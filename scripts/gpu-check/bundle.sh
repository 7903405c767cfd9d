#!/usr/bin/env bash
# Fills scripts/gpu-check/vendor/ with what the GPU machine lacks to build and exercise ddp-cpp:
# the headers of our Debian build dependencies, GoogleTest's sources, and Fashion-MNIST.
#
#   scripts/gpu-check/bundle.sh            # here, before calling the device (as root: apt)
#
# The GPU machine (scripts/gpu-check/run.sh) has CUDA, CMake, ninja, a compiler and a pip PyTorch,
# and no network: none of fmt, CLI11, nlohmann-json, GoogleTest, zlib/OpenSSL headers (maybe not
# Gloo's), nor Debian's dataset-fashion-mnist. Each comes from its Debian bookworm package,
# fetched with `apt-get download` (the local apt cache first) and unpacked with `dpkg-deb -x`:
#   vendor/include/        CLI11, nlohmann/json, zlib.h + zconf.h, OpenSSL 3.0 (arch headers merged)
#   vendor/fmt/include/    fmt 9, used header-only (FMT_HEADER_ONLY: no libfmt.so to carry)
#   vendor/gloo/include/   Gloo's headers, used only when the PyTorch lacks them (run.sh checks)
#   vendor/googletest/     GoogleTest + GoogleMock sources (run.sh builds them first, ~10 s)
#   vendor/data/fashion-mnist/   the 4 IDX .gz files (~30 MB, most of the bundle)
#   vendor/licenses/       each package's copyright file;  vendor/MANIFEST: versions and sizes
# Nothing is compiled here and no library binary is carried: zlib and libcrypto are linked from
# the machine's own libz.so.1 / libcrypto.so.3 (run.sh finds them).
#
# vendor/ is generated, not committed (the dataset alone is 30 MB) and not ignored: the device
# tool copies untracked files that git does not ignore, so it travels with the tree. Replaced
# whole on every run (built in vendor.new, then swapped). Prints the bundle's size and the size
# of everything that travels (the limit is 64 MiB).
set -euo pipefail

HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
VENDOR=${DDP_VENDOR_DIR:-$HERE/vendor}
PACKAGES=(libfmt-dev libcli11-dev nlohmann-json3-dev googletest zlib1g-dev libssl-dev libgloo-dev
          dataset-fashion-mnist)
LIMIT_MIB=64

log() { echo "bundle: $*" >&2; }
die() { log "ERROR: $*"; exit 1; }

command -v apt-get >/dev/null && command -v dpkg-deb >/dev/null || die "needs Debian's apt-get and dpkg-deb"
work=$(mktemp -d /tmp/ddp-gpu-bundle.XXXXXX)
trap 'rm -rf "$work"' EXIT

# --- 1. the .deb files: from the apt cache when the candidate version is there, else downloaded
updated=0
fetch() {
  local pkg=$1 version file
  version=$(apt-cache policy "$pkg" 2>/dev/null | awk '/Candidate:/ {print $2}')
  if [[ -z $version || $version == "(none)" ]] && ((updated == 0)); then
    log "apt-get update (no candidate for $pkg)"
    apt-get update -q >/dev/null
    updated=1
    version=$(apt-cache policy "$pkg" 2>/dev/null | awk '/Candidate:/ {print $2}')
  fi
  [[ -n $version && $version != "(none)" ]] || die "no Debian package $pkg"
  # Debian file names carry the version with ':' as '%3a'.
  file=$(ls /var/cache/apt/archives/"${pkg}_${version//:/%3a}"_*.deb 2>/dev/null | head -1 || true)
  if [[ -n $file ]]; then
    cp "$file" "$work/debs/"
  else
    (cd "$work/debs" && apt-get download -q "$pkg=$version" >/dev/null) ||
      die "apt-get download $pkg=$version failed"
  fi
  echo "$pkg $version" >>"$work/versions"
}
mkdir -p "$work/debs" "$work/x"
chmod 755 "$work" && chmod 777 "$work/debs"  # apt-get download writes as the _apt user
for p in "${PACKAGES[@]}"; do fetch "$p"; done
for deb in "$work"/debs/*.deb; do dpkg-deb -x "$deb" "$work/x"; done
x=$work/x

# --- 2. the bundle, assembled in vendor.new --------------------------------------------------
new=$VENDOR.new
rm -rf "$new"
mkdir -p "$new/include" "$new/fmt/include" "$new/gloo/include" "$new/googletest" \
         "$new/data/fashion-mnist" "$new/licenses"
cp -r "$x/usr/include/CLI" "$x/usr/include/nlohmann" "$new/include/"
cp "$x/usr/include/zlib.h" "$x/usr/include/zconf.h" "$new/include/"
cp -r "$x/usr/include/openssl" "$new/include/"
# OpenSSL's two per-architecture headers live in /usr/include/<triplet>/openssl on Debian.
cp "$x"/usr/include/*-linux-gnu/openssl/*.h "$new/include/openssl/"
cp -r "$x/usr/include/fmt" "$new/fmt/include/"
cp -r "$x/usr/include/gloo" "$new/gloo/include/"
# GoogleTest: what its CMake build needs (no docs, samples or its own tests).
src=$x/usr/src/googletest
cp "$src/CMakeLists.txt" "$new/googletest/"
for part in googletest googlemock; do
  mkdir -p "$new/googletest/$part"
  cp -r "$src/$part/CMakeLists.txt" "$src/$part/cmake" "$src/$part/include" "$src/$part/src" \
        "$new/googletest/$part/"
done
cp "$x"/usr/share/datasets/fashion-mnist/*.gz "$new/data/fashion-mnist/"
for p in "${PACKAGES[@]}"; do
  [[ -f $x/usr/share/doc/$p/copyright ]] && cp "$x/usr/share/doc/$p/copyright" "$new/licenses/$p"
done
[[ -f $new/licenses/googletest ]] || die "no copyright file for googletest"

{
  echo "# ddp-cpp GPU-check bundle, made by scripts/gpu-check/bundle.sh on $(date -u +%Y-%m-%dT%H:%MZ)"
  # The device's copy of the tree has no .git: run.sh names the commit from this line.
  echo "# tree: $(cd "$ROOT" && git rev-parse --short HEAD 2>/dev/null || echo '?')$(cd "$ROOT" &&
    [[ -n $(git status --porcelain --untracked-files=no 2>/dev/null) ]] && echo ' + uncommitted changes')"
  echo "# Debian bookworm packages (name version):"
  sed 's/^/  /' "$work/versions"
  echo "# sizes:"
  (cd "$new" && du -sk include fmt gloo googletest data licenses | awk '{printf "  %-12s %6d KiB\n", $2, $1}')
} >"$new/MANIFEST"

rm -rf "$VENDOR"
mv "$new" "$VENDOR"

# --- 3. sizes: the bundle, and all that travels (tracked + untracked files git does not ignore)
bundle_kib=$(du -sk "$VENDOR" | awk '{print $1}')
travel_kib=$(cd "$ROOT" && git ls-files -z -co --exclude-standard 2>/dev/null |
             xargs -0 -r du -skc 2>/dev/null | awk 'END {print $1}')
log "vendor: $(awk -v k="$bundle_kib" 'BEGIN {printf "%.1f MiB", k / 1024}') in $VENDOR"
# vendor/ is ignored by git (generated): it travels only because the device call names it in
# carry, so it counts beside the tree.
if [[ -n $travel_kib ]]; then
  (cd "$ROOT" && git check-ignore -q "$VENDOR/MANIFEST" 2>/dev/null) &&
    travel_kib=$((travel_kib + bundle_kib))
  log "all that travels to the device, vendor/ carried: $(awk -v k="$travel_kib" 'BEGIN {printf "%.1f MiB", k / 1024}') (limit $LIMIT_MIB MiB)"
  ((travel_kib < LIMIT_MIB * 1024)) || die "over the $LIMIT_MIB MiB the device tool carries"
fi
