# shellcheck shell=bash
# Debian roots made with debootstrap, shared by scripts/test-libtorch2.sh (a trixie root with
# LibTorch 2.x) and scripts/test-deb.sh (a clean bookworm root for our .debs). Sourced, not run;
# the caller defines log() and die().
#
# A root is made once into ROOT.new and renamed to ROOT when complete (the marker file
# .ddp-debootstrap-done): a killed debootstrap never leaves a root that looks finished. Mounts
# go on top of it while a script runs and come off on exit (unmount_below in an EXIT trap).

# Anything still mounted at or below a path (deepest first).
mounts_below() {
  local dir
  dir=$(realpath -m "$1")
  awk -v d="$dir" '{ gsub(/\\040/, " ", $5); if ($5 == d || index($5, d "/") == 1) print $5 }' \
    /proc/self/mountinfo | sort -r
}

unmount_below() {
  local m
  for m in $(mounts_below "$1"); do
    umount "$m" 2>/dev/null || umount -l "$m" 2>/dev/null || log "could not unmount $m"
  done
}

# Installs debootstrap on the host when it is missing. Under a lock: scripts/test.sh prepares
# both roots at once, and on a fresh machine two apt-gets at once fail on apt's own lock
# ("Could not get lock /var/lib/apt/lists/lock"); the second caller waits (at most 10 min: an
# apt-get that never ends must not hold the other caller forever), then finds it.
ensure_debootstrap() {
  command -v debootstrap >/dev/null && return
  (
    flock -w 600 8 || { log "waited 600 s for another installation of debootstrap"; exit 1; }
    command -v debootstrap >/dev/null && exit 0
    log "installing debootstrap"
    DEBIAN_FRONTEND=noninteractive apt-get update -q &&
      DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends debootstrap
  ) 8>/run/lock/ddp-cpp-debootstrap.lock || die "could not install debootstrap"
}

# make_root ROOT SUITE MIRROR COMPONENTS LOG SOURCES
# Creates ROOT (debootstrap --variant=minbase) unless it is already complete. SOURCES is the
# root's /etc/apt/sources.list. No daemon starts inside it while packages install (policy-rc.d).
make_root() {
  local root=$1 suite=$2 mirror=$3 components=$4 logfile=$5 sources=$6
  [[ -f $root/.ddp-debootstrap-done ]] && return
  [[ -e $root ]] && die "$root exists but is not a finished root: remove it (rm -rf --one-file-system)"
  ensure_debootstrap
  local new=$root.new script=$suite start=$SECONDS
  unmount_below "$new"
  [[ -z $(mounts_below "$new") ]] || die "cannot clear $new: still mounted"
  rm -rf --one-file-system "$new"
  # An older debootstrap may predate a newer suite's script; new suites bootstrap like sid.
  [[ -e /usr/share/debootstrap/scripts/$suite ]] || script=/usr/share/debootstrap/scripts/sid
  log "creating the $suite root in $root (debootstrap, a few minutes)"
  debootstrap --variant=minbase --components="${components// /,}" "$suite" "$new" "$mirror" \
    "$script" >"$logfile" 2>&1 || { tail -20 "$logfile" >&2; die "debootstrap failed ($logfile)"; }
  unmount_below "$new"
  printf '%s\n' "$sources" >"$new/etc/apt/sources.list"
  printf '#!/bin/sh\nexit 101\n' >"$new/usr/sbin/policy-rc.d"
  chmod +x "$new/usr/sbin/policy-rc.d"
  touch "$new/.ddp-debootstrap-done"
  mv "$new" "$root"
  log "root created in $((SECONDS - start)) s"
}

# mount_system ROOT: the root as a mount of its own, first (the mounts below go on top of it;
# `ip netns exec` runs `mount --make-rslave /`, which fails on a / that is not a mount), then
# /proc, /sys, /dev, /dev/pts, /dev/shm, and the host's resolv.conf and hosts.
mount_system() {
  local root=$1
  mountpoint -q "$root" || mount --bind "$root" "$root"
  mount -t proc proc "$root/proc"
  mount --bind /sys "$root/sys"
  mount --bind /dev "$root/dev"
  mount --bind /dev/pts "$root/dev/pts"
  mount --bind /dev/shm "$root/dev/shm"
  cp /etc/resolv.conf "$root/etc/resolv.conf" 2>/dev/null || true
  cp /etc/hosts "$root/etc/hosts"
}
