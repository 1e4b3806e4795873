#!/usr/bin/env python3
"""`make demo`'s glue around the advisor (standard library only):

    demo_advice.py extravars PATCH OUT      the advisor's patch as one extra-vars file for retune.yml
    demo_advice.py compare RUNS BEFORE_T [APPLIED]
                                            predicted against measured, per group, side by side

``extravars``: the patch (sglang-fleet-ops advise --out) writes one ``host_vars`` block per host;
the demo's hosts are alike, and the first host's block (the one the trial's canary tried: the
report's first group) is the extra vars that give every host the advisor's change
(``ansible-playbook retune.yml -e @OUT``). Where another host's block differs (its own fit ranked
another candidate first), it says so and applies the first's to all.

``compare``: the advice of the first ``advise`` run made at or after ``BEFORE_T`` (a
``date +%s``) under RUNS (.sglang-fleet-ops/runs) against the newest one: per group of the first,
the predicted throughput factor and the one measured (``sglang:gen_throughput``, the mean over
the group's instances, before and after). With ``APPLIED`` (the extra-vars file ``extravars``
wrote), the prediction is that of the group's candidate (its proposal or an alternative) that
the applied settings carry out: a host whose own fit ranked another candidate first is held to
the prediction for the change it got. Exits 1 when a measured gain is more than 10% off the
prediction, or nothing could be compared.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

TOLERANCE = 0.10


def extravars(patch_path: Path, out: Path) -> int:
    try:
        import yaml  # noqa: PLC0415 - the venv's (ansible-core's dependency)
    except ImportError:
        print("demo_advice: PyYAML is needed (run from the project's .venv)", file=sys.stderr)
        return 2
    patch = yaml.safe_load(patch_path.read_text()) or {}
    by_host = dict(sorted((patch.get("host_vars") or {}).items()))
    if not by_host:
        print(f"demo_advice: {patch_path} proposes no server change: nothing to apply", file=sys.stderr)
        return 1
    first, *others = by_host
    blocks = list(by_host.values())
    for host in others:
        if by_host[host] != by_host[first]:
            print(f"demo_advice: {host}'s block differs from {first}'s; the demo's hosts are alike: {first}'s for all")
    out.write_text(
        "---\n# The advisor's patch ("
        + patch_path.name
        + "), the same for every host.\n"
        + yaml.safe_dump(blocks[0], sort_keys=True)
    )
    print(f"demo_advice: {out}: {first}'s block of {patch_path.name}, for every host")
    return 0


def _advice_runs(runs: Path, since: float) -> list[dict[str, Any]]:
    """The advice reports of the advise runs (advise.json or advice.json) since ``since``, oldest first."""
    found = []
    for directory in sorted(runs.glob("*-advise*")):
        if directory.stat().st_mtime < since:
            continue
        for name in ("advice.json", "advise.json"):
            path = directory / name
            if path.exists():
                found.append(json.loads(path.read_text()))
                break
    return found


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _holds(applied: dict[str, Any], key: str, after: Any) -> bool:
    """Whether the applied settings set ``key`` to ``after`` (absent: SGLang's default, which a
    change to false or to nothing leaves)."""
    return applied.get(key, False if after is False else None) == after


def applied_candidate(group: dict[str, Any], applied: dict[str, Any] | None) -> dict[str, Any] | None:
    """The group's proposal, or (with ``applied``, the settings given to every host) the first
    of its proposal and alternatives whose every change the applied settings hold; None if none."""
    prop = group.get("proposal") or {}
    if applied is None:
        return prop
    for candidate in [prop, *(group.get("alternatives") or [])]:
        changes = candidate.get("changes") or {}
        if changes and all(_holds(applied, key, after) for key, (_, after) in changes.items()):
            return candidate
    return None


def _applied(path: Path | None) -> dict[str, Any] | None:
    if path is None:
        return None
    import yaml  # noqa: PLC0415 - the venv's (ansible-core's dependency)

    block = yaml.safe_load(path.read_text()) or {}
    return dict(block.get("sglang_server_host_args") or {})


def compare(runs: Path, since: float, applied_path: Path | None = None) -> int:
    reports = _advice_runs(runs, since)
    if len(reports) < 2:
        print(f"demo_advice: {len(reports)} advise run(s) under {runs} since the demo began: nothing to compare")
        return 1
    before, after = reports[0], reports[-1]
    by_key = {f"{i['host']}/{i['name']}": i for i in after.get("instances") or []}
    before_by_key = {f"{i['host']}/{i['name']}": i for i in before.get("instances") or []}
    applied = _applied(applied_path)
    worst = 0.0
    compared = 0
    for group in before.get("groups") or []:
        if not (group.get("proposal") or {}).get("changes"):
            continue
        prop = applied_candidate(group, applied)
        if prop is None:
            print(f"{group['label']}: none of its candidates is what was applied: no prediction to compare")
            worst = max(worst, 1.0)
            continue
        predicted = prop.get("throughput_factor_expected")
        if predicted is None:
            continue
        keys = group.get("instances") or []
        t_before = _mean(
            [v for k in keys if (v := (before_by_key.get(k) or {}).get("stats", {}).get("gen_throughput_mean"))]
        )
        t_after = _mean([v for k in keys if (v := (by_key.get(k) or {}).get("stats", {}).get("gen_throughput_mean"))])
        if not t_before or not t_after:
            print(f"{group['label']}: no throughput to compare (before {t_before}, after {t_after})")
            continue
        measured = t_after / t_before
        off = predicted / measured - 1
        worst = max(worst, abs(off))
        compared += 1
        method = (prop.get("throughput_model") or {}).get("method", "exponent")
        if prop is not group.get("proposal"):
            method += ", for the alternative applied"
        print(
            f"{group['label']}: predicted x{predicted:.2f} ({method}), measured x{measured:.2f} "
            f"({t_before:.0f} -> {t_after:.0f} tok/s per instance, sglang:gen_throughput): "
            f"{100 * off:+.1f}% {'within' if abs(off) <= TOLERANCE else 'NOT within'} {TOLERANCE:.0%}"
        )
    if not compared:
        print("demo_advice: no group had a server change with a predicted gain")
        return 1
    return 0 if worst <= TOLERANCE else 1


def main(argv: list[str]) -> int:
    if len(argv) == 3 and argv[0] == "extravars":
        return extravars(Path(argv[1]), Path(argv[2]))
    if len(argv) in (3, 4) and argv[0] == "compare":
        return compare(Path(argv[1]), float(argv[2]), Path(argv[3]) if len(argv) == 4 else None)
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
