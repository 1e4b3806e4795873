"""Running a playbook of the collection (by FQCN) with ansible-runner's Python API, in a private
data dir of the project (the fleet repository: its working directory, its ansible.cfg if any).

Every command gets its own run dir, ``<project>/.sglang-fleet-ops/runs/<UTC time>-<command>/``,
which is the runner's private data dir: the runner keeps its artifacts (job events, stdout,
status, rc, the command line) under ``artifacts/<ident>/`` there, and the command writes its
summary beside them. Results are read from the job events, never from the text output.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

RUNS_DIR = Path(".sglang-fleet-ops") / "runs"
# Environment variables whose values the run's recorded command keeps (set here or by the runner).
KEPT_ENV = frozenset(
    {
        "ANSIBLE_CONFIG",
        "ANSIBLE_NOCOLOR",
        "ANSIBLE_STDOUT_CALLBACK",
        "ANSIBLE_CALLBACK_PLUGINS",
        "ANSIBLE_INVENTORY_ANY_UNPARSED_IS_FAILED",
    }
)
# The lines ansible-playbook prints for an error that ends it (2.19: "[ERROR]: ...", before: "ERROR! ...").
ERROR_PREFIXES = ("[ERROR]:", "ERROR!")


@dataclass
class Run:
    """One playbook run: what was asked and what the runner recorded."""

    ident: str
    playbook: str
    rc: int
    status: str
    events: list[dict[str, Any]] = field(default_factory=list)
    artifact_dir: Path | None = None

    def reached_a_task(self) -> bool:
        """Whether any task gave a result (ansible-playbook got past parsing and the inventory)."""
        return any(str(e.get("event", "")).startswith("runner_on_") for e in self.events)

    def error_lines(self) -> list[str]:
        """ansible-playbook's own error lines, from the run's output (events, else the stdout file)."""
        text = "\n".join(str(e.get("stdout") or "") for e in self.events)
        if not text.strip() and self.artifact_dir is not None:
            try:
                text = (self.artifact_dir / "stdout").read_text(encoding="utf-8", errors="replace")
            except OSError:
                text = ""
        return [line.strip() for line in text.splitlines() if line.strip().startswith(ERROR_PREFIXES)]


@dataclass(frozen=True)
class Request:
    """One playbook run to make."""

    playbook: str  # a playbook of the collection by FQCN (sglang_ops.fleet.retune), or a path in the project
    ident: str
    check: bool = False
    extravars: dict[str, Any] = field(default_factory=dict)
    # Print progress on stderr while it runs (an apply takes hours): hosts done of the total, and
    # each failure as it comes. A host is done when its result of ``done_action`` arrives.
    progress: bool = False
    done_action: str | None = None


# How the commands run a playbook: (run dir, project dir, inventory, limit, request) -> Run.
# Tests pass recorded events through a stand-in.
Runner = Callable[[Path, Path, str | None, str | None, Request], Run]


def new_run_dir(project: Path, command: str) -> Path:
    """A fresh run dir for ``command`` (a second one within the same microsecond gets a suffix)."""
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime()) + f"{time.time() % 1:.6f}"[1:] + "Z"
    base = project / RUNS_DIR
    base.mkdir(parents=True, exist_ok=True)
    for n in range(100):
        path = base / (f"{stamp}-{command}" + (f"-{n}" if n else ""))
        try:
            path.mkdir()
        except FileExistsError:
            continue
        return path
    raise RuntimeError(f"cannot make a run dir under {base}")


def ansible_env(project: Path) -> dict[str, str]:
    """The environment ansible-* commands get, besides the caller's."""
    # An inventory that does not parse is an error, not a warning and a run on no host.
    envvars: dict[str, str] = {"ANSIBLE_NOCOLOR": "1", "ANSIBLE_INVENTORY_ANY_UNPARSED_IS_FAILED": "1"}
    config = project / "ansible.cfg"
    if config.is_file():
        # The project's ansible.cfg: it may name the collections path and the default inventory.
        envvars["ANSIBLE_CONFIG"] = str(config)
    # The ansible-* of the environment this command runs in first, activated or not.
    bindir = Path(sys.executable).parent
    if (bindir / "ansible-playbook").is_file():
        envvars["PATH"] = os.pathsep.join([str(bindir), os.environ.get("PATH", os.defpath)])
    return envvars


def run_playbook(run_dir: Path, project: Path, inventory: str | None, limit: str | None, request: Request) -> Run:
    """Run ``request.playbook`` through ``ansible_runner.run``, in ``project``."""
    import ansible_runner  # noqa: PLC0415 (slow import, only when a playbook runs)

    envvars = ansible_env(project)
    kwargs: dict[str, Any] = {
        "private_data_dir": str(run_dir),
        "project_dir": str(project),
        "playbook": request.playbook,
        "ident": request.ident,
        "envvars": envvars,
        "quiet": True,
        "rotate_artifacts": 0,
    }
    if inventory:
        kwargs["inventory"] = str(Path(inventory).resolve()) if Path(inventory).exists() else inventory
    if limit:
        kwargs["limit"] = limit
    if request.extravars:
        # Never a secret here: the runner keeps the command line (with these) in the artifacts.
        kwargs["extravars"] = dict(request.extravars)
    if request.check:
        kwargs["cmdline"] = "--check --diff"
    if request.progress:
        kwargs["event_handler"] = Progress(request.done_action)
    # The runner writes a run's command-line options and extra vars into env/ of the private data
    # dir and reads them back on the next run there: the check of `apply --plan` must not make
    # the apply that follows it a check too.
    for written in ("cmdline", "extravars"):
        (run_dir / "env" / written).unlink(missing_ok=True)
    result = ansible_runner.run(**kwargs)
    artifact_dir = Path(result.config.artifact_dir)
    scrub_command_env(artifact_dir / "command")
    return Run(
        ident=request.ident,
        playbook=request.playbook,
        rc=int(result.rc if result.rc is not None else -1),
        status=str(result.status),
        events=list(result.events),
        artifact_dir=artifact_dir,
    )


def scrub_command_env(path: Path) -> None:
    """The runner records the whole environment of ansible-playbook beside its command line;
    the caller's environment may hold credentials. Keep the names, drop the values (but of the
    variables this module set, which hold no secret)."""
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return
    env = record.get("env")
    if isinstance(env, dict):
        record["env"] = {k: (v if k in KEPT_ENV else "(not recorded)") for k, v in env.items()}
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(record), encoding="utf-8")
        tmp.replace(path)


class Progress:
    """Progress on stderr: each failure or unreachable host as it comes, and ``host done (k/n)``
    when a host's result of ``done_action`` arrives or it is unreachable (n: the hosts seen so far; the playbooks
    validate every host first, so n is the run's hosts by the time any is done). Without a
    ``done_action``, one line per task result. Every event is kept (True)."""

    def __init__(self, done_action: str | None = None) -> None:
        self.done_action = done_action
        self.hosts: set[str] = set()
        self.done: set[str] = set()

    def __call__(self, event: dict[str, Any]) -> bool:
        word = PROGRESS_EVENTS.get(str(event.get("event")))
        data = event.get("event_data") or {}
        if not word:
            return True
        host = str(data.get("host"))
        self.hosts.add(host)
        ignored = " (ignored)" if data.get("ignore_errors") and word != "ok" else ""
        action = str(data.get("resolved_action") or data.get("task_action") or "")
        if self.done_action is None:
            print(f"[{host}] {word}{ignored}: {data.get('task')}", file=sys.stderr, flush=True)
        elif word != "ok" and not ignored:
            print(f"[{host}] {word}: {data.get('task')}", file=sys.stderr, flush=True)
        finished = action == self.done_action or (word == "UNREACHABLE" and not ignored)
        if self.done_action is not None and finished and host not in self.done:
            self.done.add(host)
            print(f"[{host}] done ({len(self.done)}/{len(self.hosts)} hosts)", file=sys.stderr, flush=True)
        return True


PROGRESS_EVENTS = {
    "runner_on_ok": "ok",
    "runner_on_failed": "FAILED",
    "runner_on_unreachable": "UNREACHABLE",
}
