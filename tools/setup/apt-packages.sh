#!/usr/bin/env bash
# Install the machine packages the test bed needs, only those missing. Debian 12, as root.
set -euo pipefail
# systemd only for systemd-analyze (units are verified before they are installed); python3-venv
# for the repo-local virtualenv on a bare Debian 12 (its python3 has no ensurepip without it). LXC itself
# runs inside the Proxmox-like test host, from the test-host image, not on this machine. prometheus
# only for promtool: the monitoring role's alerting rules and dashboard are tested with it (the
# server the package also brings is stopped below if its install started it). shellcheck for
# ansible-test sanity's shellcheck test (make lint). openssh-client: Ansible reaches the pod test
# host (molecule/pod) over SSH, with a key and a known-hosts entry the test bed makes.
wanted=(podman runc debootstrap fuse-overlayfs slirp4netns uidmap iproute2 systemd python3-venv prometheus shellcheck openssh-client)
missing=()
for p in "${wanted[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "apt packages present"
  exit 0
fi
if [ "$(id -u)" != 0 ]; then
  echo "missing packages: ${missing[*]}; run as root (or install them) and retry" >&2
  exit 1
fi
echo "installing: ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
if [[ " ${missing[*]} " == *" prometheus "* ]] && [ -x /etc/init.d/prometheus ]; then
  /etc/init.d/prometheus stop >/dev/null 2>&1 || true
fi
