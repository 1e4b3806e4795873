# Copyright: sglang-fleet contributors
# Apache License 2.0 (see LICENSE)
"""The effective max running requests an instance would get after a retune, predicted (in check
mode, and by the fit pre-flight of a real run, :mod:`._retune.fit`) from the running instance's
memory facts (its startup journal lines and ``/server_info``, read by the inspect phase the way the
advisor's observe phase reads them) and SGLang's memory math (:mod:`._capacity`). Pure functions,
no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._capacity.inputs import Settings, release_tuple
from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._capacity.model_facts import derive_model_facts
from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._capacity.plan import (
    predict_effective_max_running_requests,
)

# Why there is no prediction, in one word (the summary table shows it after "-").
DOWN = "down"  # not running: no facts of a current run
JOURNAL = "journal"  # the startup journal could not be read and /server_info does not give the facts
FACTS = "facts"  # the evidence does not give the model's memory facts
GPU = "gpu"  # the GPU's memory.total is unknown (nvidia-smi)
RELEASE = "release"  # a release the memory math does not know
UNFIT = "unfit"  # the new settings would not start (SGLang's "would not fit" message in ``errors``)


def gpu_total_mib(instance: Mapping[str, Any], gpus: Mapping[str, Mapping[str, Any]] | None) -> float | None:
    """The smallest memory.total of the instance's GPUs (nvidia-smi), None if unknown."""
    totals = [
        float(g["total_mib"])
        for g in ((gpus or {}).get(str(i)) for i in instance.get("gpus") or [])
        if isinstance(g, Mapping) and isinstance(g.get("total_mib"), (int, float))
    ]
    return min(totals) if totals else None


def predict_after(
    instance: Mapping[str, Any], facts: Mapping[str, Any], gpus: Mapping[str, Mapping[str, Any]] | None
) -> dict[str, Any]:
    """``{"predicted_effective_max_running_requests": N or None, "prediction_missing": word or
    None, "prediction": {...}}`` for an instance that would be relaunched with ``instance``'s
    settings (a resolved instance of server_validate: version, args, env, gpus)."""
    out: dict[str, Any] = {"predicted_effective_max_running_requests": None, "prediction_missing": None}
    detail: dict[str, Any] = {}
    out["prediction"] = detail
    release = str(instance.get("version") or "")
    try:
        release_tuple(release)
    except ValueError as exc:
        detail["why"] = str(exc)
        out["prediction_missing"] = RELEASE
        return out
    if not facts.get("running"):
        detail["why"] = "not running: no startup facts of a current run"
        out["prediction_missing"] = DOWN
        return out
    total = gpu_total_mib(instance, gpus)
    info = facts.get("server_info") if isinstance(facts.get("server_info"), Mapping) else None
    derived = derive_model_facts(release, facts.get("journal") or [], info, total)
    if derived.facts is None:
        detail["why"] = "; ".join(derived.problems) or "no model facts"
        if facts.get("journal_error"):
            detail["journal_error"] = str(facts["journal_error"])
        if total is None:
            out["prediction_missing"] = GPU
        elif facts.get("journal_error") or not facts.get("journal"):
            out["prediction_missing"] = JOURNAL
        else:
            out["prediction_missing"] = FACTS
        return out
    if total is None:  # derive_model_facts needs it for the facts
        raise AssertionError("the total GPU memory is known here")
    settings = Settings.from_args(dict(instance.get("args") or {}), dict(instance.get("env") or {}))
    plan = predict_effective_max_running_requests(release, derived.facts, total, settings)
    detail.update(
        binding=plan.binding,
        kv_tokens=plan.kv_tokens,
        max_mamba_cache_size=plan.mamba_k,
        mem_fraction_static=round(plan.mem_fraction_static, 4),
        errors=list(plan.errors),
        facts_from=dict(derived.sources),
    )
    if plan.errors:
        detail["why"] = plan.errors[0]
        out["prediction_missing"] = UNFIT
        return out
    out["predicted_effective_max_running_requests"] = plan.effective_max_running_requests
    return out
