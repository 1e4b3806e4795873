"""Pictures of the advice and of a trial: per group of instances, a PNG of each instance's
generation throughput (``sglang:gen_throughput``) and running requests
(``sglang:num_running_reqs``) over the window - before, and after a change where there is one.

matplotlib (the Agg backend: no display) is an optional extra, ``sglang-fleet-ops[pictures]``;
without it nothing is drawn and the caller says so.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

MISSING = "no pictures: matplotlib is not installed (pip install 'sglang-fleet-ops[pictures]')"


def _pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend, or None when matplotlib is not installed."""
    try:
        import matplotlib  # noqa: PLC0415 - optional

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
    except ImportError:
        return None
    return plt


def available() -> bool:
    return _pyplot() is not None


def slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", text).strip("-")[:60] or "group"


def _members(report: Mapping[str, Any] | None, keys: Sequence[str]) -> dict[str, Mapping[str, Any]]:
    by_key = {f"{i.get('host')}/{i.get('name')}": i for i in (report or {}).get("instances") or []}
    return {k: by_key[k] for k in keys if k in by_key}


def draw(
    path: Path,
    title: str,
    before: Mapping[str, Mapping[str, Any]],
    after: Mapping[str, Mapping[str, Any]] | None = None,
    note: str = "",
) -> Path:
    """One PNG: throughput (top) and running requests (bottom) per instance over the window,
    ``before`` solid and ``after`` dashed (its time axis follows the before window's)."""
    plt = _pyplot()
    if plt is None:
        raise RuntimeError(MISSING)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    offset = 0.0
    for phase, items, style in (("before", before, "-"), ("after", after or {}, "--")):
        end = offset
        for key, item in items.items():
            series = item.get("series") or {}
            t = [offset + float(x) for x in series.get("t") or []]
            if not t:
                continue
            label = f"{key} {phase}" if after else key
            top.plot(t, series.get("gen_throughput") or [], style, label=label)
            bottom.plot(t, series.get("running") or [], style, label=label)
            end = max(end, t[-1])
        if after and end > offset:
            top.axvline(end, color="grey", linewidth=0.5)
            bottom.axvline(end, color="grey", linewidth=0.5)
        offset = end
    top.set_ylabel("sglang:gen_throughput (tok/s)")
    bottom.set_ylabel("sglang:num_running_reqs")
    bottom.set_xlabel("seconds into the window" + (" (before, then after)" if after else ""))
    top.set_title(title, fontsize=10)
    if note:
        fig.text(0.01, 0.01, note, fontsize=8)
    for axis in (top, bottom):
        axis.grid(True, alpha=0.3)
        axis.set_ylim(bottom=0)
    if top.get_legend_handles_labels()[0]:
        top.legend(fontsize=7, loc="best", ncol=2)
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def advice_pictures(report: Mapping[str, Any], out_dir: Path) -> tuple[list[Path], str | None]:
    """A PNG per group of the advice (the window): the paths, or why none."""
    if not available():
        return [], MISSING
    paths = []
    for index, group in enumerate(report.get("groups") or [], start=1):
        members = _members(report, group.get("instances") or [])
        if not members:
            continue
        prop = group.get("proposal") or {}
        note = ""
        if prop.get("throughput_factor_expected") is not None:
            method = (prop.get("throughput_model") or {}).get("method", "exponent")
            note = f"predicted: throughput x{prop['throughput_factor_expected']:.2f} ({method})"
        title = f"{group.get('label')}: {str(group.get('diagnosis')).upper()}"
        paths.append(draw(out_dir / f"advice-{index}-{slug(str(group.get('label')))}.png", title, members, None, note))
    return paths, None


def trial_picture(
    before: Mapping[str, Any] | None, after: Mapping[str, Any] | None, trial: Mapping[str, Any], out_dir: Path
) -> tuple[Path | None, str | None]:
    """The tried group before (the advice's window) and after (the trial's), one PNG."""
    if not available():
        return None, MISSING
    keys = [str(k) for k in (trial.get("group") or {}).get("instances") or []] or [str(trial.get("canary"))]
    got_before, got_after = _members(before, keys), _members(after, keys)
    if not got_before and not got_after:
        return None, "no pictures: neither window has samples of the group"
    gain, predicted = trial.get("gain"), (trial.get("predicted") or {}).get("throughput_factor_expected")
    note = f"canary {trial.get('canary')}: measured x{gain:.2f}" if isinstance(gain, (int, float)) else ""
    if isinstance(predicted, (int, float)):
        note += f", predicted x{predicted:.2f}"
    title = f"trial of {trial.get('canary')}: {trial.get('decision')}"
    return draw(out_dir / "trial.png", title, got_before, got_after, note), None
