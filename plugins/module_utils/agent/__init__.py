# Copyright: sglang-fleet contributors
# Apache License 2.0 (see LICENSE)
"""Host agent: everything sglang-fleet does on a GPU host, as a package of standard-library modules.

The modules import it on a bare host (``ops.run``); for an instance inside a Proxmox LXC container
the whole package is run there as one payload (``bundle.command_payload``: ``pct exec CTID --
python3 -c PAYLOAD`` with a JSON request on stdin), and the units' start guard imports it from the
one file the server role installs beside it (``bundle.bundle_source``). So every module here must
stay standard-library only, importable on Python 3.9+, import its siblings relatively, and never
import anything from Ansible.

- ``evidence``: ``EvidenceError``, commands (``run_cmd``, in a process group of their own),
  secrets and redaction.
- ``waiting``: the one wait helper every polling loop uses.
- ``procfs``: the process table, cgroups, sockets, telling SGLang processes apart, killing by PID.
- ``systemd``: unit state, systemctl, the journal, unit verification.
- ``nvidia``: nvidia-smi's GPU memory and compute apps.
- ``http_client``: requests to an instance and reading its /server_info.
- ``settings``: the one answer to "does this running instance serve the desired settings, and
  how does it differ?" (also imported by the controller's retune decision).
- ``state``: atomic writes, and the desired-settings and last good settings records.
- ``request``: the request's keys, each required (the agent keeps no fallbacks).
- ``host``: the host interface the operations act through (unit tests fake it).
- ``clients``: the generation clients' control sockets, and which endpoints are this host's.
- ``op_apply``, ``op_inspect``, ``op_stop`` (stop, release), ``op_start`` (start, record),
  ``op_clients`` (clients, drain, resume, client_stop, client_start): the operations; ``ops``:
  the dispatcher and the stdin/stdout entry point.
- ``bundle``: the package as one source, for containers and the start guard.

Each operation takes a request dict and the host, and returns a JSON-serialisable dict. It gathers
or acts on *all* the instances it is given in one run: one module execution per host per phase,
never one round trip per check.

Evidence is never inferred from silence: a command that fails, hangs or prints something we cannot
parse is returned as an ``EvidenceError`` quoting what was run and what came back, and the instance
it concerns is not relaunched.
"""
