# The test bed's podman connection: containers.podman's own (1.18.0, which tools/setup installs),
# with pipelining, as the collection's later releases have it. A module then costs one
# `podman exec -i` with the module on its stdin, instead of mkdir, copy, chmod, exec and rm
# (about 0.3 s each on the 2-core test machines), and the container's filesystem is mounted only
# for a task that copies a file. Molecule's inventory names the connection `podman`; this plugin
# directory comes first on the test bed's connection plugin path (.config/molecule/config.yml,
# ansible.cfg), so that name resolves here.
from __future__ import annotations

import shlex

from ansible.module_utils.common.text.converters import to_native
from ansible.plugins.connection import ensure_connect

from ansible_collections.containers.podman.plugins.connection.podman import (
    Connection as PodmanConnection,
)

DOCUMENTATION = """
name: podman
short_description: Run tasks in a podman container, with pipelining (test bed)
description:
  - containers.podman.podman with pipelining (C(podman exec -i)) and a lazy mount.
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

    @ensure_connect
    def exec_command(self, cmd, in_data=None, sudoable=False):
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
