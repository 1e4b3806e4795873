#!/usr/bin/env bash
# Build (or reuse) the Debian 12 test-host image: systemd as PID 1, Python 3, an SSH server (for
# the pods, whose PID 1 it is: molecule/pod) and the simulated GPU host's software
# (tests/doubles/gpusim in /opt/sglang/venv, nvidia-smi on the PATH), and the system Python's
# cache of the code Ansible's modules import (tests/testbed/pyc_cache). Every
# Molecule scenario and the demo fleet share it. Two layers, each keyed by a hash: the rootfs
# (this recipe; its tarball is cached outside the repo) and the simulator (its source:
# tools/testhost/gpusim-hash.sh), so a change to the simulator rebuilds its layer once, here,
# instead of every test host installing it in prepare.
# Usage: build-image.sh [PYTHON]   (PYTHON builds the simulator's wheel; default python3)
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
cache=${SGLANG_FLEET_CACHE:-$HOME/.cache/sglang-fleet}
export CONTAINERS_CONF=${CONTAINERS_CONF:-$here/containers.conf}
python=${1:-python3}

packages=systemd,systemd-sysv,dbus,python3,python3-apt,python3-venv,python3-yaml,iproute2,procps,ca-certificates,lxc,debootstrap,rsync,openssh-server
# The system Python's cache of the code Ansible's modules import from their payloads (its
# docstring says why): imported at every start of python3 by a .pth file.
pyc_cache=$here/../../tests/testbed/pyc_cache/sglang_fleet_testbed_pyc.py
recipe_hash=$( { cat "$0"; echo "$packages"; } | sha256sum | cut -c1-12)
sim_hash=$("$here/gpusim-hash.sh")
pyc_hash=$(sha256sum <"$pyc_cache" | cut -c1-8)
base="localhost/sglang-fleet-testhost-base:$recipe_hash"
tag="localhost/sglang-fleet-testhost:$recipe_hash-$sim_hash-$pyc_hash"
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
  # sshd is for the pods, which start it themselves as PID 1: a systemd test host does not run it.
  # The host keys the package generated would be every container's: a pod makes its own at start.
  rm -f "$root"/etc/systemd/system/multi-user.target.wants/ssh.service \
    "$root"/etc/systemd/system/sshd.service "$root"/etc/ssh/ssh_host_*
  # Journald in a container: keep it in memory and small.
  mkdir -p "$root/etc/systemd/journald.conf.d"
  printf '[Journal]\nStorage=volatile\nRuntimeMaxUse=64M\n' >"$root/etc/systemd/journald.conf.d/testhost.conf"
  tar -C "$root" -czf "$tarball.tmp" . && mv "$tarball.tmp" "$tarball"
  rm -rf "$root"; trap - EXIT
fi

if ! podman image exists "$base"; then
  podman import \
    --change 'CMD ["/sbin/init"]' \
    --change 'ENV container=podman' \
    --change 'STOPSIGNAL SIGRTMIN+3' \
    "$tarball" "$base" >/dev/null
fi

# The simulator's layer: its wheel, built here, installed where the gpu_host role would put it.
build=sglang-fleet-testhost-build
wheels=$(mktemp -d)
trap 'rm -rf "$wheels"; podman rm --force --ignore --time 0 "$build" >/dev/null' EXIT
"$python" -m pip wheel --quiet --no-deps --no-build-isolation --wheel-dir "$wheels" "$here/../../tests/doubles/gpusim"
venv=/opt/sglang/venv
podman rm --force --ignore --time 0 "$build" >/dev/null
cp "$pyc_cache" "$wheels/"
podman run --name "$build" --volume "$wheels:/wheels:ro" "$base" /bin/sh -ec "
  install -m 0644 /wheels/sglang_fleet_testbed_pyc.py /usr/lib/python3/dist-packages/
  echo 'import sglang_fleet_testbed_pyc' > /usr/lib/python3/dist-packages/sglang_fleet_testbed_pyc.pth
  python3 -m venv $venv
  $venv/bin/pip install --quiet --no-index --no-deps /wheels/*.whl
  ln -sf $venv/bin/nvidia-smi $venv/bin/gpusim /usr/local/bin/
  echo $sim_hash > /opt/sglang/gpusim-source-hash"
podman commit --quiet --change 'CMD ["/sbin/init"]' "$build" "$tag" >/dev/null
podman tag "$tag" localhost/sglang-fleet-testhost:latest
echo "test-host image $tag built (simulator $sim_hash)"
