#!/usr/bin/env bash
# Install the collections of requirements.yml into .cache/collections without Galaxy (it may be
# unreachable): they are taken from the `ansible` package on PyPI, whose wheel carries them.
# Usage: collections.sh PYTHON DEST
set -euo pipefail
python=$1
dest=$2
ansible_version=12.3.0   # carries containers.podman 1.18.0 (requirements.yml)
stamp="$dest/.from-ansible-$ansible_version"
[ -f "$stamp" ] && { echo "collections present"; exit 0; }
cache=${SGLANG_FLEET_CACHE:-$HOME/.cache/sglang-fleet}
mkdir -p "$cache/wheels" "$dest"
wheel=$(ls "$cache"/wheels/ansible-"$ansible_version"-*.whl 2>/dev/null | head -1 || true)
if [ -z "$wheel" ]; then
  "$python" -m pip download -q --no-deps -d "$cache/wheels" "ansible==$ansible_version"
  wheel=$(ls "$cache"/wheels/ansible-"$ansible_version"-*.whl | head -1)
fi
"$python" - "$wheel" "$dest" <<'PY'
import sys, zipfile, pathlib
wheel, dest = sys.argv[1], pathlib.Path(sys.argv[2])
wanted = ("ansible_collections/containers/podman/",)
with zipfile.ZipFile(wheel) as z:
    members = [m for m in z.namelist() if m.startswith(wanted)]
    if not members:
        sys.exit(f"{wheel} does not carry {wanted}")
    z.extractall(dest, members)
print(f"extracted {len(members)} files for {', '.join(w.split('/')[1] + '.' + w.split('/')[2] for w in wanted)}")
PY
touch "$stamp"
