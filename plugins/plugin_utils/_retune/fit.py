# Copyright: sglang-fleet contributors
# Apache License 2.0 (see LICENSE)
"""The fit pre-flight of a retune: before any instance is stopped (or any client drained), each
instance to relaunch is predicted (:mod:`._retune.predict`), and one whose new settings SGLang would
refuse at start (the capacity plan's "would not fit" errors: a certain failure, from the running
instance's own startup lines and SGLang's memory arithmetic) is refused with SGLang's message and
the figures. A prediction missing for lack of evidence never refuses anything: it is reported.

Pure functions over the inspect phase's facts; the flow (:mod:`._retune.flow`) blocks the host.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._retune.decide import Decision
from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._retune.predict import UNFIT, predict_after

IGNORE_FIT_VAR = "sglang_retune_ignore_fit_prediction"

# What the inspect phase is asked to read of the startup journal: in check mode every running
# instance's (the predicted capacity of each), in a real run only those whose settings change (the
# only ones a relaunch could make unfit), so an unchanged host reads no journal.
JOURNAL_ALL = "all"
JOURNAL_CHANGED = "changed"


def journal_request(check_mode: bool) -> str:
    return JOURNAL_ALL if check_mode else JOURNAL_CHANGED


def container_gpus(inspected: Mapping[str, Any], instance: Mapping[str, Any]) -> Mapping[str, Any]:
    """The GPUs (nvidia-smi, by index) where ``instance`` runs: the retune_phase module returns each
    agent's result but its instances under ``containers``, keyed ``host`` or the container's id."""
    key = "host" if instance.get("container") is None else str(instance["container"])
    found = ((inspected.get("containers") or {}).get(key) or {}).get("gpus")
    return found if isinstance(found, Mapping) else {}


def predictions(
    instances: Mapping[str, Mapping[str, Any]],
    inspected: Mapping[str, Any],
    decisions: Mapping[str, Decision],
    check_mode: bool,
) -> dict[str, dict[str, Any]]:
    """The prediction of each instance to relaunch or start, from the inspect phase's result. Outside
    check mode only where the inspect phase read the startup journal (settings that change): a
    relaunch with the running settings (force, a wedged instance) starts as the instance did."""
    facts = inspected.get("instances") or {}
    out = {}
    for name, decision in decisions.items():
        if decision.action not in ("relaunch", "start"):
            continue
        seen = facts.get(name) or {}
        if not check_mode and "journal" not in seen and "journal_error" not in seen:
            continue
        out[name] = predict_after(instances[name], seen, container_gpus(inspected, instances[name]))
    return out


def certain_release(instance: Mapping[str, Any], facts: Mapping[str, Any]) -> bool:
    """The running instance reports the release it is relaunched with (or does not say): its
    startup lines are read with that release's formats and facts."""
    info = facts.get("server_info") if isinstance(facts.get("server_info"), Mapping) else {}
    running = (info or {}).get("version")
    return running is None or str(running) == str(instance.get("version"))


def refusal(prediction: Mapping[str, Any]) -> str | None:
    """SGLang's message and the figures, if the prediction says the settings would not start."""
    if prediction.get("prediction_missing") != UNFIT:
        return None
    detail = prediction.get("prediction") or {}
    errors = [str(e).removeprefix("would not fit: ") for e in detail.get("errors") or []]
    figures = ", ".join(
        f"{k}={detail[k]}" for k in ("mem_fraction_static", "max_mamba_cache_size", "kv_tokens") if k in detail
    )
    return (
        "the new settings would not start, so nothing is stopped: SGLang would refuse them at start ("
        + "; ".join(errors)
        + f") [predicted from its startup journal and SGLang's memory arithmetic: {figures}]; "
        f"to relaunch anyway, set {IGNORE_FIT_VAR}=true"
    )


def refuse_unfit(
    instances: Mapping[str, Mapping[str, Any]],
    facts: Mapping[str, Mapping[str, Any]],
    decisions: dict[str, Decision],
    predicted: Mapping[str, Mapping[str, Any]],
    ignore: bool,
) -> list[str]:
    """Turn each instance whose new settings would not start into a blocked one (its reason says
    why); returns the names. With ``ignore`` (the operator knows better) nothing is refused."""
    refused = []
    for name, prediction in predicted.items():
        why = refusal(prediction)
        if why is None or ignore or not certain_release(instances[name], facts.get(name) or {}):
            continue
        before = decisions[name]
        decisions[name] = Decision(
            name, "blocked", [why, f"(would {before.action}: {'; '.join(before.reasons)})"], before.flag_diff
        )
        refused.append(name)
    return refused
