# Copyright: sglang-fleet contributors
# Apache License 2.0 (see LICENSE)
"""Files and state: atomic writes, and the one owner of the two per-instance records the retune
relies on - the desired settings the server role installs (``DESIRED_DIR/NAME.json``) and the last
good settings an instance was proven to serve (``STATE_DIR/instances/NAME/last-good.json``), what a
rollback starts again."""

from __future__ import annotations

import contextlib
import grp
import hashlib
import json
import os
import pwd
import tempfile
import time
from typing import Any


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def owner_ids(owner: str, group: str) -> tuple[int, int]:
    return pwd.getpwnam(owner).pw_uid, grp.getgrnam(group).gr_gid


def write_atomic(path: str, content: str, mode: int, owner: str = "root", group: str = "root") -> None:
    """Write via a temporary file in the same directory and rename, so a reader (systemd, a
    crash) never sees a half-written unit or secrets file. The mode is set before any byte
    is written, so a secret is never world-readable even for an instant."""
    directory = os.path.dirname(path)
    os.makedirs(directory, mode=0o755, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".sglang-fleet-")
    try:
        os.fchmod(fd, mode)
        uid, gid = owner_ids(owner, group)
        os.fchown(fd, uid, gid)
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(content)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def file_state(path: str) -> dict[str, Any]:
    try:
        st = os.stat(path)
        with open(path, "rb") as handle:
            data = handle.read()
    except FileNotFoundError:
        return {"exists": False}
    return {
        "exists": True,
        "sha256": sha256(data),
        "text": data.decode("utf-8", "replace"),
        "mode": st.st_mode & 0o7777,
        "uid": st.st_uid,
        "gid": st.st_gid,
    }


def load_json(path: str) -> dict[str, Any] | None:
    """A JSON record; None when absent, ``{"_corrupt": True}`` when unreadable as JSON."""
    try:
        with open(path, encoding="utf-8") as handle:
            return json.load(handle)
    except FileNotFoundError:
        return None
    except ValueError:
        return {"_corrupt": True}


class StateFiles:
    """The desired-settings records and the last good settings of a host's instances."""

    def __init__(self, state_dir: str, desired_dir: str):
        self.state_dir = state_dir
        self.desired_dir = desired_dir

    # -- desired settings (written by the server role, through op_apply) --------------------

    def desired_path(self, name: str) -> str:
        return os.path.join(self.desired_dir, f"{name}.json")

    def is_desired_path(self, path: str) -> bool:
        return os.path.dirname(path) == self.desired_dir and path.endswith(".json")

    def desired(self, name: str) -> dict[str, Any] | None:
        return load_json(self.desired_path(name))

    # -- last good settings -------------------------------------------------------------------

    def last_good_path(self, name: str) -> str:
        return os.path.join(self.state_dir, "instances", name, "last-good.json")

    def has_last_good(self, name: str) -> bool:
        return os.path.exists(self.last_good_path(name))

    def last_good(self, name: str) -> dict[str, Any] | None:
        return load_json(self.last_good_path(name))

    def write_last_good(self, inst: dict[str, Any], unit_path: str, unit_text: str) -> None:
        """Record ``inst``'s settings (name, unit, argv, env, expected /server_info, fingerprint)
        and the unit file they run from as the instance's last good settings."""
        record = {
            "name": inst["name"],
            "unit": inst["unit"],
            "unit_path": unit_path,
            "unit_text": unit_text,
            "argv": inst["argv"],
            "env": inst.get("env") or {},
            "expected_server_info": inst.get("expected_server_info") or {},
            "fingerprint": inst.get("fingerprint"),
            "recorded_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        text = json.dumps(record, indent=2, sort_keys=True) + "\n"
        write_atomic(self.last_good_path(inst["name"]), text, 0o644)
