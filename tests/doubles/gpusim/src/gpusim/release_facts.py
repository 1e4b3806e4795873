"""SGLang's facts by release, as vendored in ``facts/<version>.json`` from each release's own
source (``tools/gen_sglang_facts.py``; every fact names its file and line there). The simulator
follows them rather than its own reading: the startup constraints it enforces, the metrics it
exports, the usage gauges' meaning, the start order of the target and draft models.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

from gpusim.versions import Version

FACTS_DIR = Path(__file__).with_name("facts")


def _key(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in text.split("."))


@cache
def _load(name: str) -> dict[str, Any]:
    return json.loads((FACTS_DIR / f"{name}.json").read_text(encoding="utf-8"))


def facts_for(version: Version | str) -> dict[str, Any]:
    """The facts of ``version``, or of the newest vendored release before it."""
    wanted = _key(str(version))
    known = sorted((_key(p.stem), p.stem) for p in FACTS_DIR.glob("*.json"))
    chosen = [name for key, name in known if key <= wanted] or [known[0][1]]
    return _load(chosen[-1])


def _value(args: dict[str, Any], name: str) -> Any:
    value = args.get(name)
    if value is None and name.startswith(("disable_", "enable_")):
        return False
    return value


def refusal(version: Version | str, args: dict[str, Any]) -> dict[str, Any] | None:
    """The first startup constraint of the release that ``args`` (resolved so far) break, as
    vendored: ``error``, ``message``, ``source``; None when none is broken."""
    for constraint in facts_for(version)["constraints"]:
        rule = constraint["rule"]
        when = all(_value(args, k) in v for k, v in rule.get("when", {}).items())
        lifted = any(_value(args, k) in v for k, v in rule.get("unless", {}).items())
        if when and not lifted and not all(_value(args, k) in v for k, v in rule.get("require", {}).items()):
            return constraint
    return None


def draft_before_target_pools(version: Version | str) -> bool:
    return bool(facts_for(version)["scheduler_start"]["draft_before_target_pools"])


def token_usage_pools(version: Version | str) -> list[str]:
    return list(facts_for(version)["token_usage_pools"])


def draft_log_lines(version: Version | str) -> list[str]:
    """The startup lines the draft model's own runner writes too (MTP/EAGLE), as vendored."""
    return sorted(facts_for(version)["draft_log_lines"]["lines"])


def format_has(version: Version | str, line: str, piece: str) -> bool:
    """Whether the release's format string of startup line ``line`` (a ``log_lines`` key) holds
    ``piece``, e.g. ``dtype=`` in ``Load weight end`` (0.5.9 only)."""
    return any(piece in hit["code"] for hit in facts_for(version)["log_lines"][line])
