# Copyright: sglang-fleet contributors
# Apache License 2.0 (see LICENSE)
"""Action plugin sglang_ops.fleet.advise: find what limits each instance's throughput and
propose the tuning change, as an inventory patch; nothing is ever applied.

Per host (documentation: plugins/modules/advise.py): runs the observe phase on the host
(``sglang_ops.fleet.advise_observe``, the agent's ``observe``), or reads the metrics from Prometheus
when ``prometheus_url`` is set, then the pure advisor (``plugin_utils/_advisor/diagnose.py``) per
instance. The fleet report from every host's result is sglang_ops.fleet.advise_report's.
"""

from __future__ import annotations

import time
from typing import Any

from ansible.plugins.action import ActionBase
from ansible.utils.display import Display

from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._advisor import diagnose
from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._advisor import prometheus as _prometheus
from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._advisor.evidence import evidence_from_observation
from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._advisor.throughput import pool_measurements
from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._capacity.model_facts import JOURNAL_PATTERN
from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._retune.options import BY_NAME, agent_options

display = Display()

OBSERVE_MODULE = "sglang_ops.fleet.advise_observe"
POLICY_KEYS = frozenset(diagnose.Policy.__dataclass_fields__)
MEASURE_KEYS = frozenset(("levels", "step_s", "interval", "settle", "drain_timeout", "max_new_tokens"))
INVENTORY_VARIABLES = ("sglang_server_args", "sglang_server_host_args", "sglang_server_instances")

# The options it shares with the retune (nvidia_smi, nvidia_smi_timeout, http_timeout, pct) are
# the retune's option table's; every other option the agent reads is sent with the table's default.
ARGUMENT_SPEC: dict[str, dict[str, Any]] = {
    "instances": {"type": "list", "elements": "dict"},
    "window": {"type": "float", "default": 300.0},
    "interval": {"type": "float", "default": 5.0},
    "prometheus_url": {"type": "str"},
    "prometheus_selector": {"type": "str", "default": _prometheus.DEFAULT_SELECTOR},
    "prometheus_timeout": {"type": "float", "default": 30.0},
    "prometheus_ca_path": {"type": "path"},
    "prometheus_validate_certs": {"type": "bool", "default": True},
    "prometheus_username": {"type": "str"},
    "prometheus_password": {"type": "str", "no_log": True},
    "nvidia_smi": BY_NAME["nvidia_smi"].spec(),
    "nvidia_smi_timeout": BY_NAME["nvidia_smi_timeout"].spec(),
    "http_timeout": BY_NAME["http_timeout"].spec(),
    "pct": BY_NAME["pct"].spec(),
    "supervisor": BY_NAME["supervisor"].spec(),
    "supervisor_root": BY_NAME["supervisor_root"].spec(),
    "client_units": {"type": "list", "elements": "str", "default": []},
    "measure": {"type": "bool", "default": False},
    "measure_options": {"type": "dict", "default": {}},
    "policy": {"type": "dict", "default": {}},
}


class ActionModule(ActionBase):
    TRANSFERS_FILES = False
    _VALID_ARGS = frozenset(ARGUMENT_SPEC)
    _requires_connection = True

    def run(self, tmp: str | None = None, task_vars: dict[str, Any] | None = None) -> dict[str, Any]:
        task_vars = task_vars or {}
        result = super().run(tmp, task_vars)
        del tmp
        _validation, args = self.validate_argument_spec(argument_spec=ARGUMENT_SPEC)
        problems = check_args(args)
        if problems:
            result.update(failed=True, changed=False, msg="invalid arguments: " + "; ".join(problems))
            return result
        result.update(self.observe_and_advise(args, task_vars))
        result["changed"] = False
        return result

    def observe_and_advise(self, args: dict[str, Any], task_vars: dict[str, Any]) -> dict[str, Any]:
        hostname = str(task_vars.get("inventory_hostname", "localhost"))
        instances = list(args["instances"])
        prometheus = args.get("prometheus_url")
        window, interval = float(args["window"]), float(args["interval"])
        slim = [{k: i.get(k) for k in ("name", "unit", "gpus", "port", "container", "http_host")} for i in instances]
        observed = self._execute_module(
            module_name=OBSERVE_MODULE,
            module_args={
                "instances": slim,
                "options": {
                    **agent_options(args),
                    "window": window,
                    "interval": interval,
                    "sample_metrics": not prometheus,
                    "journal_pattern": JOURNAL_PATTERN,
                    "client_units": list(args["client_units"]),
                    **(
                        {"measure": {**args["measure_options"], "instances": [str(i["name"]) for i in instances]}}
                        if args["measure"]
                        else {}
                    ),
                },
                "pct": args["pct"],
            },
            task_vars=task_vars,
        )
        layers = self.inventory_layers(task_vars, instances)
        out: dict[str, Any] = {
            "host": hostname,
            "inventory": layers,
            "window_s": window,
            "interval_s": interval,
            "source": "prometheus" if prometheus else "sampled /metrics",
            "instances": [],
        }
        if observed.get("failed") and not observed.get("instances"):
            out["host_problem"] = f"the observe phase failed: {observed.get('msg')}"
            return out
        by_name = observed.get("instances") or {}
        pool_measurements(instances, by_name)
        gpus_by_place = observed.get("containers") or {}
        if prometheus:
            end = time.time()
            start = end - window
            address = str(task_vars.get("ansible_host") or hostname)
            access = _prometheus.Access(
                ca_path=args.get("prometheus_ca_path"),
                validate_certs=args["prometheus_validate_certs"],
                username=args.get("prometheus_username"),
                password=args.get("prometheus_password"),
            )
            for inst in instances:
                facts = by_name.setdefault(inst["name"], {})
                selector = _prometheus.selector_for(
                    args["prometheus_selector"],
                    host=address,
                    inventory_hostname=hostname,
                    port=inst["port"],
                    name=inst["name"],
                )
                samples, problems = _prometheus.read_samples(
                    prometheus, selector, start, end, interval, args["prometheus_timeout"], access=access
                )
                facts["samples"] = samples
                facts["metrics_errors"] = problems[:3]
        policy = diagnose.Policy(**args["policy"])
        for inst in instances:
            place = "host" if inst.get("container") is None else str(inst["container"])
            host_side = gpus_by_place.get(place) or {}
            observation = by_name.get(inst["name"]) or {"server_info_error": "no observation"}
            evidence = evidence_from_observation(
                hostname,
                inst,
                observation,
                host_side.get("gpus") or {},
                float(host_side.get("window_s") or window),
                interval,
                out["source"],
            )
            display.vvv(f"advise: {inst['name']}: {len(observation.get('samples') or [])} samples", host=hostname)
            advice = diagnose.advise_instance(evidence, policy).to_dict()
            # A client that runs but did not say what it sends: the prediction could not count it.
            advice["problems"] += list(host_side.get("clients_problems") or [])
            out["instances"].append(advice)
        return out

    def inventory_layers(
        self, task_vars: dict[str, Any], resolved: list[dict[str, Any]] | None = None
    ) -> dict[str, Any]:
        """The host's settings layers as the inventory writes them (for the patch), and its
        instances as ``sglang_server_instances`` entries, each with its own args (the patch's
        per-instance layer, and ``advise --trial``, which relaunches one of them with the proposal
        as its own args)."""
        templar = self._templar.copy_with_new_env(available_variables=task_vars)
        values = {name: templar.template(task_vars[name]) for name in INVENTORY_VARIABLES if name in task_vars}
        return {
            "sglang_server_args": dict(values.get("sglang_server_args") or {}),
            "sglang_server_host_args": dict(values.get("sglang_server_host_args") or {}),
            "instances": layout_entries(values.get("sglang_server_instances"), resolved or []),
        }


def layout_entries(entries: Any, resolved: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The host's ``sglang_server_instances`` as the inventory writes it, or - for the default
    layout (one instance per GPU) - the same instances written out (name, gpus, port, container)."""
    if isinstance(entries, list) and entries:
        return [dict(e) for e in entries if isinstance(e, dict)]
    out = []
    for inst in resolved:
        entry = {"name": inst.get("name"), "gpus": list(inst.get("gpus") or []), "port": inst.get("port")}
        if inst.get("container") is not None:
            entry["container"] = inst["container"]
        out.append(entry)
    return out


def check_args(args: dict[str, Any]) -> list[str]:
    problems = []
    if args.get("instances") is None:
        problems.append("instances is required: the resolved instances of sglang_ops.fleet.server_validate")
    for key in ("window", "interval", "prometheus_timeout", "nvidia_smi_timeout", "http_timeout"):
        if args[key] <= 0:
            problems.append(f"{key} must be > 0")
    if args["interval"] > args["window"]:
        problems.append("interval must not exceed window")
    unknown_measure = sorted(set(args["measure_options"]) - MEASURE_KEYS)
    if unknown_measure:
        problems.append(f"measure_options: unknown key(s) {unknown_measure}; known: {sorted(MEASURE_KEYS)}")
    unknown = sorted(set(args["policy"]) - POLICY_KEYS)
    if unknown:
        problems.append(f"policy: unknown key(s) {unknown}; known: {sorted(POLICY_KEYS)}")
    url = args.get("prometheus_url")
    if url and not str(url).startswith(("http://", "https://")):
        problems.append(f"prometheus_url {url!r} must start with http:// or https://")
    for i, inst in enumerate(args.get("instances") or []):
        missing = [k for k in ("name", "unit", "gpus", "port", "version", "args") if k not in inst]
        if missing:
            problems.append(
                f"instances[{i}] lacks {missing} (pass the resolved instances of sglang_ops.fleet.server_validate)"
            )
    return problems
