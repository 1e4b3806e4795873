# Copyright: sglang-fleet contributors
# Apache License 2.0 (see LICENSE)
"""The one answer to "is this running instance serving its desired settings, and how does it
differ?", used by the controller's retune decision (before anything is touched) and by the host's
proof after a start.

The desired instance carries ``argv``, ``env``, ``user`` and ``expected_server_info``. The running
evidence comes in two steps, because a process's command line and environment may hold secrets
and never leave the host: on the host :func:`process_evidence` reduces them to what may (the
command line with secrets masked, whether the unmasked one matches, which desired variables differ);
:func:`differences` then compares that evidence, with the process's user and its own /server_info
where they were read, against the desired instance and returns the differences as data.

Standard library only: the controller imports this module on its own.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any, Callable


def process_evidence(
    desired: Mapping[str, Any],
    argv: list[str],
    environ: Mapping[str, str] | None,
    redact: Callable[[list[str]], list[str]],
) -> dict[str, Any]:
    """What a running process shows of its settings, in the form that may leave the host."""
    return {
        "argv": redact(argv),
        "argv_matches": argv_matches(list(desired.get("argv") or []), argv),
        "env_mismatches": env_mismatches(dict(desired.get("env") or {}), dict(environ or {})),
    }


def differences(desired: Mapping[str, Any], running: Mapping[str, Any]) -> dict[str, Any]:
    """How a running instance differs from the desired one.

    ``running`` holds :func:`process_evidence`'s keys, and ``user`` (the main process's user) and
    ``server_info`` (its /server_info) when they were read: one absent or None is not compared.
    Returns ``flag_diff`` (:func:`argv_diff` from the running command line to the desired one;
    None when they match), ``env`` (the desired variables it does not have as desired), ``user``
    (``{"expected", "running"}`` or None) and ``server_info`` (:func:`compare_server_info`)."""
    found: dict[str, Any] = {
        "flag_diff": None,
        "env": dict(running.get("env_mismatches") or {}),
        "user": None,
        "server_info": [],
    }
    if not running.get("argv_matches"):
        found["flag_diff"] = argv_diff(list(running.get("argv") or []), list(desired.get("argv") or []))
    want_user, user = desired.get("user"), running.get("user")
    if want_user and user and user != want_user:
        found["user"] = {"expected": want_user, "running": user}
    if running.get("server_info") is not None:
        found["server_info"] = compare_server_info(desired.get("expected_server_info") or {}, running["server_info"])
    return found


def describe_server_info(mismatches: list[dict[str, Any]], wanted: str) -> str:
    """The reason given for /server_info mismatches; ``wanted`` names the desired value
    ("desired" before a retune, "expected" in the proof after a start)."""
    return "/server_info reports other settings: " + ", ".join(
        f"{m['arg']}={m['reported']!r} ({wanted} {m['expected']!r})" for m in mismatches
    )


def compare_server_info(expected: Mapping[str, Any], reported: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Keys of ``expected`` whose value the running server reports differently. Numbers compare
    by value with a tolerance (64 == 64.0, 0.93 == 0.9300000001), booleans only equal booleans,
    lists and mappings compare element by element."""
    mismatches = []
    for key, want in sorted(expected.items()):
        if key not in reported:
            mismatches.append({"arg": key, "expected": want, "reported": "(not reported)"})
            continue
        got = reported[key]
        if not reports_as_expected(want, got):
            mismatches.append({"arg": key, "expected": want, "reported": got})
    return mismatches


def reports_as_expected(want: Any, got: Any) -> bool:
    """A value /server_info reports equals the expected one (see :func:`compare_server_info`)."""
    if isinstance(want, bool) or isinstance(got, bool):
        return isinstance(want, bool) and isinstance(got, bool) and want == got
    if isinstance(want, (int, float)) and isinstance(got, (int, float)):
        return math.isclose(want, got, rel_tol=1e-6, abs_tol=1e-9)
    if isinstance(want, (list, tuple)) and isinstance(got, (list, tuple)):
        return len(want) == len(got) and all(reports_as_expected(a, b) for a, b in zip(want, got))
    if isinstance(want, dict) and isinstance(got, dict):
        return set(want) == set(got) and all(reports_as_expected(want[k], got[k]) for k in want)
    return bool(want == got)


def argv_matches(expected: list[str], running: list[str]) -> bool:
    """The running command line equals the desired one. ``${VAR}`` words in the desired argv are
    systemd environment substitutions (secrets): any single word matches them."""
    if len(expected) != len(running):
        return False
    for want, got in zip(expected, running):
        if re.fullmatch(r"\$\{[A-Za-z_][A-Za-z0-9_]*\}", want):
            continue
        if want != got:
            return False
    return True


def env_mismatches(expected: dict[str, str], environ: dict[str, str]) -> dict[str, dict[str, Any]]:
    """The desired environment variables a running process does not have as desired."""
    return {k: {"expected": v, "running": environ.get(k)} for k, v in sorted(expected.items()) if environ.get(k) != v}


def argv_flags(argv: list[str]) -> tuple[list[str], dict[str, Any]]:
    """Split an SGLang command line into its command words (interpreter, ``-m module``) and a
    {flag: value} map: a bare switch is True, one value a string, several (nargs) a list."""
    first = next((i for i, w in enumerate(argv) if w.startswith("--")), len(argv))
    flags: dict[str, Any] = {}
    key: str | None = None
    for word in argv[first:]:
        if word.startswith("--"):
            key, eq, value = word.partition("=")
            flags[key] = [value] if eq else []
            if eq:
                key = None
        elif key is not None:
            flags[key].append(word)
    simple = {k: (True if not v else v[0] if len(v) == 1 else v) for k, v in flags.items()}
    return argv[:first], simple


def argv_diff(before: list[str], after: list[str]) -> dict[str, Any]:
    """Flag-level difference of two SGLang command lines."""
    cmd_a, a = argv_flags(before)
    cmd_b, b = argv_flags(after)
    changed = {k: [a[k], b[k]] for k in sorted(a.keys() & b.keys()) if a[k] != b[k]}
    if cmd_a != cmd_b:
        changed["(command)"] = [" ".join(cmd_a), " ".join(cmd_b)]
    return {
        "changed": changed,
        "added": {k: b[k] for k in sorted(b.keys() - a.keys())},
        "removed": {k: a[k] for k in sorted(a.keys() - b.keys())},
    }
