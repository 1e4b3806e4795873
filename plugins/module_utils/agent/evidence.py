# Copyright: sglang-fleet contributors
# Apache License 2.0 (see LICENSE)
"""Evidence and commands: ``EvidenceError``, ``run_cmd`` (each command in a process group of its
own) and the redaction of secrets from everything the agent returns."""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
from collections.abc import Iterable
from typing import Any

REDACTED = "********"
SECRET_FLAGS = ("--api-key", "--admin-api-key")


class EvidenceError(Exception):
    """A command whose output we needed did not give usable evidence."""

    def __init__(self, what: str, argv: list[str], rc: int | None, stdout: str, stderr: str):
        self.what = what
        self.argv = argv
        self.rc = rc
        self.stdout = stdout
        self.stderr = stderr
        super().__init__(self.describe())

    def describe(self) -> str:
        rc = "timed out" if self.rc is None else f"rc={self.rc}"
        return (
            f"{self.what}: ran {shlex.join(self.argv)!r}: {rc}, "
            f"stdout={clip(self.stdout)!r}, stderr={clip(self.stderr)!r}"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "what": self.what,
            "cmd": shlex.join(self.argv),
            "rc": self.rc,
            "stdout": clip(self.stdout),
            "stderr": clip(self.stderr),
            "msg": self.describe(),
        }


def clip(text: str, limit: int = 2000) -> str:
    text = text or ""
    return text if len(text) <= limit else text[:limit] + f"... ({len(text) - limit} more chars)"


# --------------------------------------------------------------------------------------------
# Secrets and redaction
# --------------------------------------------------------------------------------------------


class Redactor:
    """Removes secret values from anything the agent returns (journal lines, command lines,
    /server_info, which echoes api_key in plain text)."""

    def __init__(self, secrets: Iterable[str] = ()):
        self.secrets = sorted({s for s in secrets if s and len(s) >= 4}, key=len, reverse=True)

    def text(self, value: str) -> str:
        for secret in self.secrets:
            value = value.replace(secret, REDACTED)
        return value

    def argv(self, argv: list[str]) -> list[str]:
        out: list[str] = []
        hide_next = False
        for word in argv:
            if hide_next:
                out.append(REDACTED)
                hide_next = False
                continue
            flag, eq, _unused = word.partition("=")
            if flag in SECRET_FLAGS:
                if eq:
                    out.append(flag + "=" + REDACTED)
                else:
                    out.append(word)
                    hide_next = True
                continue
            out.append(self.text(word))
        return out

    def obj(self, value: Any) -> Any:
        if isinstance(value, str):
            return self.text(value)
        if isinstance(value, list):
            return [self.obj(v) for v in value]
        if isinstance(value, dict):
            return {k: (REDACTED if k in ("api_key", "admin_api_key") and v else self.obj(v)) for k, v in value.items()}
        return value


def read_env_file(path: str) -> dict[str, str]:
    """Parse a systemd EnvironmentFile (KEY=VALUE lines, optional quotes)."""
    env: dict[str, str] = {}
    try:
        with open(path, encoding="utf-8") as handle:
            lines = handle.read().splitlines()
    except FileNotFoundError:
        return env
    for raw in lines:
        line = raw.strip()
        if not line or line.startswith(("#", ";")) or "=" not in line:
            continue
        key, _unused, value = line.partition("=")
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        env[key.strip()] = value
    return env


# --------------------------------------------------------------------------------------------
# Commands
# --------------------------------------------------------------------------------------------


def run_cmd(argv: list[str], timeout: float = 30.0, input_text: str | None = None) -> tuple[int | None, str, str]:
    """Run a command; rc None means it timed out, 127 that it was not found.

    The command runs in a process group of its own: on timeout the whole group is SIGKILLed
    and reaped, so a hung wrapper (an ``nvidia-smi`` script, a stuck driver call) leaves no
    children behind, and no grandchild holding our pipes can keep this call waiting."""
    try:
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE if input_text is not None else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
    except FileNotFoundError as exc:
        return 127, "", str(exc)
    try:
        out, err = proc.communicate(input_text, timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_group(proc.pid)
        try:
            # Every holder of the pipes was in the group: EOF comes at once.
            out, err = proc.communicate(timeout=5)
        except subprocess.TimeoutExpired:  # a member that left the group still holds a pipe
            proc.kill()
            out, err = "", ""
            for pipe in (proc.stdout, proc.stderr):
                if pipe is not None:
                    pipe.close()
            proc.wait()
        return None, out or "", err or ""
    return proc.returncode, out, err


def kill_group(pgid: int) -> None:
    """SIGKILL a process group we created (its leader's PID is its id)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def which(cmd: str) -> str | None:
    for directory in os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin").split(os.pathsep):
        candidate = os.path.join(directory, cmd)
        if os.access(candidate, os.X_OK):
            return candidate
    return None
