#!/usr/bin/env bash
# Build (or reuse) the Debian 12 test-host image: systemd as PID 1, Python 3, nothing else of
# ours. Every Molecule scenario and the demo fleet share it. The rootfs tarball is cached outside
# the repo, keyed by a hash of this recipe, so it is rebuilt only when the recipe changes.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
cache=${SGLANG_FLEET_CACHE:-$HOME/.cache/sglang-fleet}
export CONTAINERS_CONF=${CONTAINERS_CONF:-$here/containers.conf}

packages=systemd,systemd-sysv,dbus,python3,python3-apt,python3-venv,python3-yaml,iproute2,procps,ca-certificates,lxc,debootstrap,rsync
recipe_hash=$( { cat "$0"; echo "$packages"; } | sha256sum | cut -c1-12)
tag="localhost/sglang-fleet-testhost:$recipe_hash"
tarball="$cache/testhost-$recipe_hash.tar.gz"

if podman image exists "$tag"; then
  echo "test-host image $tag is current"
  podman tag "$tag" localhost/sglang-fleet-testhost:latest
  exit 0
fi

mkdir -p "$cache"
if [ ! -s "$tarball" ]; then
  mirror=$(awk '/^URIs:/ {print $2; exit}' /etc/apt/sources.list.d/debian.sources 2>/dev/null || true)
  mirror=${mirror:-http://deb.debian.org/debian}
  root=$(mktemp -d "$cache/rootfs.XXXXXX")
  trap 'rm -rf "$root"' EXIT
  echo "debootstrap bookworm from $mirror (about 90 s)"
  debootstrap --variant=minbase --include="$packages" bookworm "$root" "$mirror" >"$cache/debootstrap.log" 2>&1 \
    || { tail -20 "$cache/debootstrap.log"; exit 1; }
  chroot "$root" apt-get clean
  rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/*.bin "$root"/usr/share/doc/* "$root"/usr/share/man/*
  : > "$root/etc/machine-id"
  # mktemp made the directory 0700; as the tarball's "./" it would become every rootfs's "/".
  chmod 0755 "$root"
  # The LXC service would try to bring up lxcbr0 in every test host; only the Proxmox-style
  # scenario wants LXC, and it configures what it needs itself.
  rm -f "$root"/etc/systemd/system/multi-user.target.wants/lxc-net.service
  # Journald in a container: keep it in memory and small.
  mkdir -p "$root/etc/systemd/journald.conf.d"
  printf '[Journal]\nStorage=volatile\nRuntimeMaxUse=64M\n' >"$root/etc/systemd/journald.conf.d/testhost.conf"
  tar -C "$root" -czf "$tarball.tmp" . && mv "$tarball.tmp" "$tarball"
  rm -rf "$root"; trap - EXIT
fi

podman import \
  --change 'CMD ["/sbin/init"]' \
  --change 'ENV container=podman' \
  --change 'STOPSIGNAL SIGRTMIN+3' \
  "$tarball" "$tag" >/dev/null
podman tag "$tag" localhost/sglang-fleet-testhost:latest
echo "test-host image $tag built"
