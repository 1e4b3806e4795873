"""The advisor's throughput model: an instance's decode step time as a function of its running
requests, fitted to what the instance itself showed, and the gain of a proposal read off that
curve. Pure functions.

A decode step of ``n`` running requests yields ``n x L`` tokens (``L``: the tokens accepted per
request and step, ``sglang:spec_accept_length`` with speculative decoding, else 1) and takes
``step(n)`` seconds, so the instance generates ``n x L / step(n)`` tokens per second. Each sample
of the window (or of the opt-in stepped measurement) that had requests running gives one point
``(n, step = n x L / sglang:gen_throughput)``. The model is the straight line through those
points, ``step(n) = fixed + per_request x n``, fitted by least squares over the levels of ``n``
seen (each level the median of its samples, weighted by how many): the fixed part is what every
step pays whatever the batch (the weights read once per step, the scheduler), the per-request
part grows with the batch (each request's KV cache and state read per step). Nothing in it is a
figure of any GPU or model: both terms are the instance's own.

The terms separate only when ``n`` varied: at least two levels, the highest at least
``fit_min_spread`` times the lowest. A window pinned at the effective max shows one level; then
the stepped measurement (``measure``, opt-in: the agent's own requests at a few concurrencies
for a few seconds each, on every instance of the host at once) gives the levels, fitted to the
pooled samples of the host's alike instances (the same release and settings, only their place -
port, GPU - differs: one curve, several times the samples), and without either the documented exponent
(``Policy.scaling_exponent``) is the fallback. Every prediction says which it used.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._instances.layout import PLACEMENT

WINDOW = "window"
MEASUREMENT = "measurement"
EXPONENT = "exponent"
METHODS = (WINDOW, MEASUREMENT, EXPONENT)

MIN_SAMPLES_PER_LEVEL = 2


@dataclass(frozen=True)
class StepPoint:
    """One sample: ``running`` requests, ``throughput`` tok/s, ``accept`` tokens per request and step."""

    running: float
    throughput: float
    accept: float = 1.0

    @property
    def step_s(self) -> float:
        return self.running * self.accept / self.throughput


@dataclass
class ThroughputModel:
    """The fitted step time (or, ``method`` exponent, the fallback) and the fit's figures."""

    method: str = EXPONENT
    fixed_s: float | None = None  # step time whatever the batch
    per_request_s: float | None = None  # step time added per running request
    accept: float = 1.0  # tokens per request and step (spec_accept_length, else 1)
    levels: list[list[float]] = field(default_factory=list)  # [running, median step s, samples]
    points: int = 0
    r2: float | None = None
    max_error: float | None = None  # the largest relative miss of the line at a level
    exponent: float = 0.7
    instances: int = 1  # the alike instances whose samples the fit pooled
    why: str = ""  # why this method (the fallback's reason, or what the fit saw)

    @property
    def fitted(self) -> bool:
        return self.method != EXPONENT

    def step_s(self, running: float) -> float:
        if self.fixed_s is None or self.per_request_s is None:
            raise ValueError("the exponent's model has no step time")
        return self.fixed_s + self.per_request_s * running

    def throughput(self, running: float) -> float:
        """Tokens per second at ``running`` requests (the fitted model only)."""
        return running * self.accept / self.step_s(running)

    def factor(self, running_after: float, running_before: float) -> float:
        """The throughput of ``running_after`` requests over that of ``running_before``."""
        before = max(running_before, 1e-9)
        if not self.fitted:
            return (running_after / before) ** self.exponent
        return self.throughput(running_after) / self.throughput(before)

    def words(self) -> str:
        """``measured step time 20.1 ms + 1.00 ms x running (window: 4 levels 4-16, 38 samples, r2 1.00)``"""
        if not self.fitted:
            return f"running requests x r give throughput x r^{self.exponent:g} (the documented exponent: {self.why})"
        low, high = self.levels[0][0], self.levels[-1][0]
        return (
            f"step time {1000 * (self.fixed_s or 0):.1f} ms + {1000 * (self.per_request_s or 0):.2f} ms x running "
            f"({self.accept:.2f} tokens per request and step), fitted to the {self.method}'s "
            f"{len(self.levels)} levels {low:g}-{high:g} running"
            + (f" on {self.instances} alike instances" if self.instances > 1 else "")
            + f" ({self.points} samples, r2 {self.r2:.3f}, "
            f"largest miss {100 * (self.max_error or 0):.1f}%)"
        )

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"method": self.method, "why": self.why}
        if self.fitted:
            out.update(
                step_ms_fixed=round(1000 * (self.fixed_s or 0), 3),
                step_ms_per_request=round(1000 * (self.per_request_s or 0), 4),
                accept_length=round(self.accept, 3),
                levels=[[round(level[0], 2), round(1000 * level[1], 3), level[2]] for level in self.levels],
                samples=self.points,
                r2=round(self.r2 or 0.0, 4),
                max_error=round(self.max_error or 0.0, 4),
                instances=self.instances,
            )
        else:
            out["exponent"] = self.exponent
        return out


def _num(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def step_points(samples: Iterable[Mapping[str, Any]], spec: bool) -> list[StepPoint]:
    """One point per sample with requests running and tokens generated (``sglang:gen_throughput``,
    the scheduler's decode throughput over its last logging interval), where the running requests
    were the same at the sample before (the gauge speaks for a batch that held); with speculative
    decoding the sample's ``spec_accept_length``, skipped where it has none."""
    out = []
    previous: float | None = None
    for s in samples:
        running, tput = _num(s.get("num_running_reqs")), _num(s.get("gen_throughput"))
        held = previous is not None and running is not None and abs(running - previous) <= 1
        previous = running
        if not held or not running or running < 1 or not tput or tput <= 0:
            continue
        accept = 1.0
        if spec:
            got = _num(s.get("spec_accept_length"))
            if not got or got < 1:
                continue
            accept = got
        out.append(StepPoint(running, tput, accept))
    return out


def _levels(points: Sequence[StepPoint]) -> list[list[float]]:
    by_level: dict[int, list[float]] = {}
    for p in points:
        by_level.setdefault(round(p.running), []).append(p.step_s)
    return [
        [float(n), statistics.median(steps), float(len(steps))]
        for n, steps in sorted(by_level.items())
        if len(steps) >= MIN_SAMPLES_PER_LEVEL
    ]


def fit_step_time(
    points: Sequence[StepPoint], method: str, min_spread: float = 1.5, exponent: float = 0.7, min_r2: float = 0.9
) -> ThroughputModel:
    """The least-squares line through the levels' median step times; the exponent's model with
    the reason when the points do not separate the terms (or the line is not a step time)."""
    fallback = ThroughputModel(method=EXPONENT, exponent=exponent, points=len(points))
    levels = _levels(points)
    if len(levels) < 2:
        fallback.why = (
            f"the {method} showed {len(levels)} level of running requests with {MIN_SAMPLES_PER_LEVEL}+ samples"
            if levels
            else f"the {method} has no {MIN_SAMPLES_PER_LEVEL} samples in a row at one batch size with "
            "sglang:gen_throughput"
        )
        return fallback
    low, high = levels[0][0], levels[-1][0]
    if high < min_spread * low:
        fallback.why = f"the {method}'s running requests varied only {low:g}-{high:g} (less than x{min_spread:g})"
        return fallback
    ns = [level[0] for level in levels]
    steps = [level[1] for level in levels]
    weights = [level[2] for level in levels]
    total = sum(weights)
    mean_n = sum(w * n for n, w in zip(ns, weights, strict=True)) / total
    mean_s = sum(w * st for st, w in zip(steps, weights, strict=True)) / total
    sxx = sum(w * (n - mean_n) ** 2 for n, w in zip(ns, weights, strict=True))
    sxy = sum(w * (n - mean_n) * (st - mean_s) for n, st, w in zip(ns, steps, weights, strict=True))
    per_request = sxy / sxx
    fixed = mean_s - per_request * mean_n
    if per_request <= 0 or fixed < 0:
        fallback.why = (
            f"the {method}'s step time did not fit a fixed part plus a part per request "
            f"({1000 * fixed:.1f} ms + {1000 * per_request:.3f} ms x running)"
        )
        return fallback
    misses = [st - fixed - per_request * n for n, st in zip(ns, steps, strict=True)]
    syy = sum(w * (st - mean_s) ** 2 for st, w in zip(steps, weights, strict=True))
    residual = sum(w * m**2 for m, w in zip(misses, weights, strict=True))
    accept = statistics.median(p.accept for p in points)
    r2 = 1.0 - residual / syy if syy > 0 else 1.0
    if r2 < min_r2:
        seen = ", ".join(f"{n:g} running {1000 * st:.1f} ms" for n, st in zip(ns, steps, strict=True))
        fallback.why = (
            f"the {method}'s step times are not a straight line in the running requests (r2 {r2:.2f} < "
            f"{min_r2:g}: {seen})"
        )
        return fallback
    return ThroughputModel(
        method=method,
        fixed_s=fixed,
        per_request_s=per_request,
        accept=accept,
        levels=levels,
        points=sum(int(c) for c in weights),
        r2=r2,
        max_error=max(abs(m) / st for m, st in zip(misses, steps, strict=True)),
        exponent=exponent,
        why=f"running requests varied {low:g}-{high:g} over the {method}",
    )


def instance_model(
    observation: Mapping[str, Any], spec: bool, min_spread: float = 1.5, exponent: float = 0.7, min_r2: float = 0.9
) -> ThroughputModel:
    """The model for one instance from observe's result: the window's samples where they separate
    the terms, else the stepped measurement's (``measure_pool``, the measurements of the host's
    alike instances from :func:`pool_measurements`, or its own ``measure_samples``, when the
    operator enabled it), else the exponent, saying why."""
    window = fit_step_time(step_points(observation.get("samples") or [], spec), WINDOW, min_spread, exponent, min_r2)
    if window.fitted:
        return window
    runs = observation.get("measure_pool") or (
        [observation["measure_samples"]] if observation.get("measure_samples") else []
    )
    if runs:
        model = fit_step_time(
            [p for run in runs for p in step_points(run, spec)], MEASUREMENT, min_spread, exponent, min_r2
        )
        if model.fitted:
            model.instances = len(runs)
            return model
        window.why += f"; {model.why}"
    elif observation.get("measure_error"):
        window.why += f"; the measurement: {observation['measure_error']}"
    else:
        window.why += " (sglang_advise_measure / advise --measure measures it)"
    return window


def alike_key(instance: Mapping[str, Any]) -> str:
    """What makes instances alike: the release and every launch setting but their place."""
    args = {k: v for k, v in (instance.get("args") or {}).items() if k not in PLACEMENT}
    return repr(sorted(args.items())) + repr(instance.get("version"))


def pool_measurements(instances: Sequence[Mapping[str, Any]], observations: dict[str, dict[str, Any]]) -> None:
    """Give each measured instance (``measure`` in its observation) the measurements of all the
    alike instances of the host that gave samples (``measure_pool``, its own among them): alike
    instances share one step-time curve, and the pooled samples fit it more surely than any one."""
    sets: dict[str, list[str]] = {}
    for inst in instances:
        sets.setdefault(alike_key(inst), []).append(str(inst["name"]))
    for names in sets.values():
        observed = [observations[n] for n in names if n in observations]
        runs = [
            obs["measure_samples"] for obs in observed if obs.get("measure_samples") and not obs.get("measure_error")
        ]
        if not runs:
            continue
        for obs in observed:
            if "measure" in obs or "measure_error" in obs:
                obs["measure_pool"] = runs
