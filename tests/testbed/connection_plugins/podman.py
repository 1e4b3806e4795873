# The test bed's podman connection: containers.podman's own (1.18.0, which tools/setup installs),
# with pipelining, as the collection's later releases have it, and a cheaper way into a running
# container. A module costs one command with the module on its stdin, instead of mkdir, copy,
# chmod, exec and rm; the container's filesystem is mounted only for a task that copies a file.
#
# The command enters a privileged container (every systemd test host) by nsenter(1): the
# namespaces of the container's PID 1 (mount, UTS, IPC, network, PID, cgroup), its root and working
# directory, the container's own cgroups (each hierarchy's, as `podman exec` puts a command there)
# and environment, as root. That is what `podman exec` gives a root command in such a container,
# at about 1/50 of its CPU: each `podman exec` costs about 0.19 CPU-seconds on the 2-core test
# machines, and the scenarios run thousands of modules. A command as another user (ansible_user),
# an unprivileged or stopped container, or a machine without nsenter goes through `podman exec -i`.
# The container's PID 1, cgroups and environment are asked of podman once per container and kept
# in a file per container name, checked against the process's start time (a container made again
# under the same name is asked anew).
#
# Molecule's inventory names the connection `podman`; this plugin directory comes first on the
# test bed's connection plugin path (.config/molecule/config.yml, ansible.cfg), so that name
# resolves here.
from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import tempfile

from ansible.module_utils.common.text.converters import to_bytes, to_native
from ansible.plugins.connection import ensure_connect

from ansible_collections.containers.podman.plugins.connection.podman import (
    Connection as PodmanConnection,
)

DOCUMENTATION = """
name: podman
short_description: Run tasks in a podman container, with pipelining (test bed)
description:
  - containers.podman.podman with pipelining, a lazy mount and commands entered by nsenter.
author: sglang-fleet test bed
extends_documentation_fragment: []
options:
  remote_addr:
    description: The container's name or ID.
    default: inventory_hostname
    vars:
      - name: inventory_hostname
      - name: ansible_host
      - name: ansible_podman_host
  remote_user:
    description: The user in the container.
    vars:
      - name: ansible_user
  podman_executable:
    description: The podman executable.
    default: podman
    vars:
      - name: ansible_podman_executable
    env:
      - name: ANSIBLE_PODMAN_EXECUTABLE
  podman_extra_args:
    description: Extra arguments for podman.
    default: ""
    vars:
      - name: ansible_podman_extra_args
    env:
      - name: ANSIBLE_PODMAN_EXTRA_ARGS
  pipelining:
    description: Send modules on stdin instead of copying them.
    default: true
    type: boolean
    ini:
      - section: defaults
        key: pipelining
    env:
      - name: ANSIBLE_PIPELINING
    vars:
      - name: ansible_pipelining
"""

# Where each container's PID 1 and environment are kept between tasks (one file per name).
STATE_DIR = os.path.join(tempfile.gettempdir(), "sglang-fleet-testbed-containers")
NSENTER = shutil.which("nsenter")


def _start_time(pid: int) -> str | None:
    """The process's start time (clock ticks since boot, field 22 of /proc/PID/stat), or None."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _cgroup_procs(pid: int) -> list[str] | None:
    """The cgroup.procs file of the container's own cgroup in each hierarchy (PID 1's, less the
    init.scope that systemd moves itself into), or None when one cannot be found."""
    mounts = []  # (the mount's super options, its mount point); "cgroup2" for the unified one
    try:
        with open("/proc/self/mountinfo", encoding="utf-8") as f:
            for line in f:
                pre, _, post = line.partition(" - ")
                fstype, _, options = post.split()[:3]
                if fstype in ("cgroup", "cgroup2"):
                    mounts.append(({"cgroup2"} if fstype == "cgroup2" else set(options.split(",")), pre.split()[4]))
        with open(f"/proc/{pid}/cgroup", encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    procs = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if path == "/":
            continue  # a hierarchy the container has no cgroup of its own in
        wanted = set(controllers.split(",")) if controllers else {"cgroup2"}
        mount = next((point for options, point in mounts if wanted <= options), None)
        if mount is None:
            return None
        path = path.removesuffix("/init.scope")
        procs.append(os.path.join(mount, path.lstrip("/"), "cgroup.procs"))
    return procs


def _join_cgroups(procs: list[str]) -> None:
    """In the child before exec: move this process into the container's cgroups."""
    me = str(os.getpid())
    for path in procs:
        with open(path, "w", encoding="ascii") as f:
            f.write(me)


class Connection(PodmanConnection):
    transport = "podman"
    has_pipelining = True

    def _connect(self):
        # No mount up front: with pipelining most tasks never copy a file.
        super(PodmanConnection, self)._connect()
        self._connected = True

    def _mounted(self):
        if self._mount_point is None:
            rc, out, _ = self._podman("mount")
            # bytes, as the base class keeps it; False: podman cp, as when the mount fails there.
            self._mount_point = (out.strip() if rc == 0 else b"") or False
        return self._mount_point or None

    def _entry(self) -> dict | None:
        """The running privileged container's PID 1, its start time, cgroups and environment
        ({"pid", "start", "cgroup_procs", "env"}), or None."""
        name = self._container_id
        path = os.path.join(STATE_DIR, name.replace("/", "_"))
        try:
            with open(path, encoding="utf-8") as f:
                kept = json.load(f)
            if _start_time(kept["pid"]) == kept["start"]:
                return kept
        except (OSError, ValueError, KeyError, TypeError):
            pass
        fmt = "{{.HostConfig.Privileged}} {{.State.Pid}} {{json .Config.Env}}"
        rc, out, _ = self._podman("inspect", ["--format", fmt])
        if rc != 0:
            return None
        privileged, pid_s, env_s = [*to_native(out).strip().split(" ", 2), "", ""][:3]
        try:
            pid, env = int(pid_s), json.loads(env_s) or []
        except ValueError:
            return None
        start = _start_time(pid) if privileged == "true" and pid > 0 else None
        procs = _cgroup_procs(pid) if start is not None else None
        if procs is None:
            return None
        # As `podman exec` sets it for root: the image's environment less podman's own marker.
        env = [e for e in env if not e.startswith(("container_uuid=", "HOME="))] + ["HOME=/root"]
        kept = {"pid": pid, "start": start, "env": env, "cgroup_procs": procs}
        os.makedirs(STATE_DIR, mode=0o700, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=STATE_DIR)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(kept, f)
        os.replace(tmp, path)
        return kept

    @ensure_connect
    def exec_command(self, cmd, in_data=None, sudoable=False):
        entry = None if (self.user or NSENTER is None) else self._entry()
        if entry is None:
            return self._podman_exec(cmd, in_data, sudoable)
        super(PodmanConnection, self).exec_command(cmd, in_data=in_data, sudoable=sudoable)
        # Its namespaces, root and working directory; then only the container's environment.
        argv = [NSENTER, "-t", str(entry["pid"]), "-m", "-u", "-i", "-n", "-p", "-C", "-r", "-w"]
        argv += ["env", "-i", *entry["env"], *shlex.split(to_native(cmd, errors="surrogate_or_strict"))]
        try:
            p = subprocess.Popen(
                argv,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                preexec_fn=lambda: _join_cgroups(entry["cgroup_procs"]),  # noqa: PLW1509 (no threads here)
            )
        except (OSError, subprocess.SubprocessError):
            return self._podman_exec(cmd, in_data, sudoable)
        stdout, stderr = p.communicate(input=to_bytes(in_data or b"", errors="surrogate_or_strict"))
        return p.returncode, stdout, stderr

    def _podman_exec(self, cmd, in_data, sudoable):
        if in_data is None:
            return super().exec_command(cmd, in_data=in_data, sudoable=sudoable)
        # super().exec_command without -i would leave the module's stdin unread.
        super(PodmanConnection, self).exec_command(cmd, in_data=in_data, sudoable=sudoable)
        args = ["exec", "-i"] + (["--user", self.user] if self.user else [])
        return self._podman(args, shlex.split(to_native(cmd, errors="surrogate_or_strict")), in_data)

    def put_file(self, in_path, out_path):
        self._mount_point = self._mounted()
        super().put_file(in_path, out_path)

    def fetch_file(self, in_path, out_path):
        self._mount_point = self._mounted()
        super().fetch_file(in_path, out_path)
