# Copyright: sglang-fleet contributors
# Apache License 2.0 (see LICENSE)
"""The options of a retune, each defined once: name, type, default, description, the inventory
variable that sets it and the server-role variable it follows, if any.

Everything else is derived from or checked against this table: the action plugin's argument spec
(``ARGUMENT_SPEC``), ``Options``, and, by unit tests, the documentation of the action
(``plugins/modules/retune.py``, literal YAML for ansible-doc) and the ``retune`` role's
``defaults/main.yml`` and ``meta/argument_specs.yml``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ansible_collections.sglang_ops.fleet.plugins.module_utils.agent.clients import (
    DRAIN_CALL_MARGIN,
    HELLO_TIMEOUT,
)
from ansible_collections.sglang_ops.fleet.plugins.module_utils.agent.op_clients import (
    CLIENT_START_TIMEOUT,
    CLIENT_STOP_TIMEOUT,
    resume_call_timeout,
)
from ansible_collections.sglang_ops.fleet.plugins.module_utils.agent.stall import REPORT_DUE_S as STALL_REPORT_DUE_S
from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._instances.role_defaults import ROLE_DEFAULTS, ROLE_VARS

# Where an option goes:
ACTION = "action"  # read by the action plugin itself (which instances, how to reach the host)
RETUNE = "retune"  # a field of Options, read by the controller-side flow (_retune.Retune)
AGENT = "agent"  # passed with every phase to the host agent (Options.agent)
ROLE = "role"  # used by the retune role's own tasks, not an argument of the action


@dataclass(frozen=True)
class Option:
    name: str
    type: str
    description: str
    scope: str
    default: Any = None
    elements: str | None = None
    required: bool = False
    # The inventory variable that sets it through the retune role (sglang_retune_<name>); None for
    # an argument that only a direct use of the action sets.
    var: str | None = None
    # The server role's variable it follows through the role (unless its own variable is set): the
    # retune must wait as long as the unit itself does, judge GPU memory as the start guard does,
    # and reach the containers as the server role does.
    server_var: str | None = None

    def spec(self) -> dict[str, Any]:
        """The option in the form of an Ansible argument spec."""
        out: dict[str, Any] = {"type": self.type}
        if self.elements:
            out["elements"] = self.elements
        if self.required:
            out["required"] = True
        if self.default is not None:
            out["default"] = self.default
        return out


CASTS = {"int": int, "float": float}


def _opt(name: str, type_: str, scope: str, description: str, **kw: Any) -> Option:
    var = None if kw.pop("no_var", False) else f"sglang_retune_{name}"
    if kw.get("server_var"):
        # The server role's default, read from the role (the unit and the start guard use it).
        kw["default"] = CASTS.get(type_, str)(ROLE_DEFAULTS[kw["server_var"]])
    if kw.get("server_path"):
        # A path the server role writes on the host (its vars/main.yml).
        kw["default"] = ROLE_VARS[kw.pop("server_path")]
    return Option(name=name, type=type_, scope=scope, description=description, var=var, **kw)


OPTIONS: tuple[Option, ...] = (
    _opt(
        "instances",
        "list",
        ACTION,
        "The host's resolved instances, as sglang_ops.fleet.server_validate returns them.",
        elements="dict",
        required=True,
        no_var=True,
    ),
    _opt("only", "list", ACTION, "Limit the retune to these instance names (null - all).", elements="str"),
    _opt(
        "wave_size",
        "int",
        RETUNE,
        "Instances relaunched in parallel per wave after the canary; 0 - all the rest at once.",
        default=0,
    ),
    _opt(
        "canary",
        "raw",
        RETUNE,
        "Relaunch one instance alone first - true the first to change, or an instance name; false for none.",
        default=True,
    ),
    _opt(
        # SGLang drains in-flight requests on SIGTERM; long generations take minutes. Shorter than
        # the unit's TimeoutStopSec, the retune would SIGKILL a drain systemd still allows.
        "stop_timeout",
        "float",
        RETUNE,
        "Seconds for the unit to stop (SGLang drains in-flight requests) before its cgroup is "
        "SIGKILLed. Defaults to the server role's sglang_server_stop_timeout (the unit's TimeoutStopSec).",
        server_var="sglang_server_stop_timeout",
    ),
    _opt("kill_timeout", "float", RETUNE, "Seconds to wait after each signal of an escalation.", default=10.0),
    _opt(
        # A dead SGLang process's GPU context can take over 30 s to be torn down on large GPUs.
        "release_timeout",
        "float",
        RETUNE,
        "Seconds for the GPU memory to fall to the release threshold after the processes are gone.",
        default=300.0,
    ),
    _opt(
        # An idle GPU shows a few hundred MiB used (driver, context of nvidia-smi itself); a loaded
        # SGLang instance holds tens of GiB. The start guard must agree, or it would hold back a
        # start the retune judged safe.
        "release_threshold_mib",
        "int",
        RETUNE,
        "memory.used (MiB) at or below which a GPU counts as released. Defaults to the server "
        "role's sglang_server_release_threshold_mib (the start guard's threshold).",
        server_var="sglang_server_release_threshold_mib",
    ),
    _opt(
        # Loading a large model (weights from network storage, CUDA graph capture, kernel JIT on a
        # first start) can take well over half an hour. The start guard passes at once in a retune
        # (GPUs and port proven free first), so the model load gets the same budget as in the unit.
        "start_timeout",
        "float",
        RETUNE,
        "Seconds from the start until /health answers 200 (model load). Defaults to the server "
        "role's sglang_server_start_timeout: the unit's TimeoutStartSec less the start guard's "
        "deadline, since a retune starts an instance only once its GPUs and port are proven free "
        "and the guard passes at once.",
        server_var="sglang_server_start_timeout",
    ),
    _opt(
        "health_timeout",
        "float",
        RETUNE,
        "Timeout (seconds) of each verification request (smoke completions included) once the instance is up.",
        default=120.0,
    ),
    _opt(
        "min_max_running_requests",
        "int",
        RETUNE,
        "Fail (and roll back) if the effective max running requests per DP rank is below this (null - no check).",
    ),
    _opt("smoke_requests", "int", RETUNE, "Real completions each relaunched instance must answer.", default=2),
    _opt("rollback", "bool", RETUNE, "Relaunch the last good settings when the new ones fail.", default=True),
    _opt(
        "force",
        "bool",
        RETUNE,
        "Relaunch instances even when unchanged (a wedged one included).",
        default=False,
    ),
    _opt(
        "relaunch_wedged",
        "bool",
        RETUNE,
        "Relaunch a wedged instance (its /health or /server_info does not answer within http_timeout) or a "
        "stalled one (it holds requests and produces nothing, see stall_probe_s) whose "
        "command line and environment are already the desired ones; without it such an instance is named "
        "unhealthy, left as it is, and the host fails. A wedged instance whose settings differ is relaunched "
        "in its wave either way.",
        default=False,
    ),
    _opt(
        # The prediction is SGLang's own arithmetic over the instance's own startup lines; an
        # operator who knows better (a GPU shared differently after the relaunch) may still ask.
        "ignore_fit_prediction",
        "bool",
        RETUNE,
        "Relaunch an instance even when the fit pre-flight predicts that SGLang would refuse its new settings at "
        "start (from its startup journal and SGLang's memory arithmetic); without it such an instance fails before "
        "anything is stopped and nothing on its host is touched. A prediction missing for lack of evidence never "
        "refuses.",
        default=False,
    ),
    _opt(
        # A frozen host (kernel hang, network partition) cannot keep its own deadlines: the
        # controller keeps them, with room for what no option bounds (see call_deadline).
        "call_margin",
        "float",
        RETUNE,
        "Seconds the controller waits for the host's answer to a call of the retune beyond the deadline of "
        "what the call asked for (its stop, release, start, drain... deadlines, see the operator guide). A host "
        "that has not answered by then counts as lost - its retune fails naming the phase and what is known of "
        "each instance, no further call is made to it, and the other hosts finish. Covers the connection, "
        "the module's start and the commands no option bounds (systemctl, journalctl).",
        default=120.0,
    ),
    _opt(
        "nvidia_smi",
        "str",
        AGENT,
        "The nvidia-smi command on the host (or inside the container).",
        default="nvidia-smi",
    ),
    _opt(
        "nvidia_smi_timeout",
        "float",
        AGENT,
        "Seconds each nvidia-smi call may take; one that hangs past it is killed with its process "
        "group and counts as broken evidence.",
        default=20.0,
    ),
    _opt("devices_dir", "path", AGENT, "Where the nvidiaN device nodes are.", default="/dev", no_var=True),
    _opt(
        # Chosen per host in the inventory, for the server role, the retune and the clients alike.
        "supervisor",
        "str",
        AGENT,
        "What supervises the instances and clients on the host: C(systemd), or C(supervisord) on a pod. Set by "
        "the server role's sglang_server_supervisor.",
        default="systemd",
        no_var=True,
        server_var="sglang_server_supervisor",
    ),
    _opt(
        "supervisor_root",
        "path",
        AGENT,
        "On a pod, where supervisord's files live (see the server role). Set by the server role's "
        "sglang_server_supervisor_root.",
        default="/workspace/sglang-fleet",
        no_var=True,
        server_var="sglang_server_supervisor_root",
    ),
    _opt(
        "secrets_file",
        "path",
        AGENT,
        "Root-only environment file holding SGLANG_API_KEY (read on the host, never sent back).",
        server_path="_sglang_server_secrets_file",
        no_var=True,
    ),
    _opt(
        "state_dir",
        "path",
        AGENT,
        "Where the last good settings are kept on the host.",
        server_path="_sglang_server_state_dir",
        no_var=True,
    ),
    _opt(
        "desired_dir",
        "path",
        AGENT,
        "Where the server role records each instance's desired settings on the host.",
        server_path="_sglang_server_desired_dir",
        no_var=True,
    ),
    _opt(
        # Each poll of GPU memory runs nvidia-smi (a fraction of a second on a host of 8 GPUs);
        # half a second resolves deadlines of seconds to minutes without loading the host.
        "poll_interval",
        "float",
        AGENT,
        "Seconds between polls (unit state, GPU memory, health).",
        default=0.5,
    ),
    _opt(
        "http_timeout",
        "float",
        AGENT,
        "Timeout (seconds) of each /health and /server_info request; a running instance whose "
        "endpoint does not answer within it is wedged, relaunched when its settings differ, else named "
        "unhealthy (see relaunch_wedged). Its siblings are retuned as usual.",
        default=30.0,
    ),
    _opt(
        # SGLang's per-step token counter moves at every decode step (milliseconds): seconds tell a
        # server that stopped producing from one that is slow.
        "stall_probe_s",
        "float",
        AGENT,
        "Seconds between the two reads of /metrics that tell whether a running instance that answers /health and "
        "/server_info still produces: one that holds requests and processes no token between them "
        "(sglang:realtime_tokens_total flat) is stalled, relaunched when its settings differ, else named unhealthy "
        f"(see relaunch_wedged), once a third read, {STALL_REPORT_DUE_S:g} s after the first (when an idle "
        "scheduler has reported its requests again), finds the same. The second read is made only when the first "
        "finds requests; an "
        "instance without /metrics (no enable_metrics) is not checked. 0 - no check.",
        default=5.0,
    ),
    _opt(
        "pct",
        "str",
        ACTION,
        "The pct command on a Proxmox node. Set by the server role's sglang_server_pct (one command per node).",
        no_var=True,
        server_var="sglang_server_pct",
    ),
    _opt(
        "lock_ttl",
        "int",
        ROLE,
        "Seconds after which the host lock of a run that stopped renewing it may be taken over.",
        default=1800,
    ),
    _opt(
        "lock_wait",
        "int",
        ROLE,
        "Seconds the fleet lock (sglang_retune_fleet_lock) waits for a host lock held by another run before "
        "the run fails naming the holder; 0 - fail at once.",
        default=0,
    ),
    _opt(
        "fleet_lock",
        "bool",
        ROLE,
        "Take the host lock of every host of the run before any host is touched (one apply at a time for the "
        "fleet); the last play gives back every lease of the run.",
        default=False,
    ),
    _opt(
        "client_units",
        "list",
        RETUNE,
        "systemd units of the generation clients on the host (was sglang_retune_pause_units). A running client "
        "that answers on its control socket (/run/sglang-fleet/clients/UNIT/control.sock) is drained per wave, "
        "only on the endpoints of the instances relaunched, and keeps generating on the others; one that does not "
        "answer is stopped for the host's retune and started again after it.",
        elements="str",
        default=["sglang-fleet-generate.service"],
    ),
    _opt(
        "client_drain",
        "bool",
        RETUNE,
        "Drain the answering generation clients per wave (true); false - stop every running client for the "
        "host's retune and start it again after, as before 0.2.0.",
        default=True,
    ),
    _opt(
        # A long generation takes minutes; what is not done by then is requeued on other endpoints.
        "client_drain_timeout",
        "float",
        RETUNE,
        "Seconds a drained generation client waits for its requests in flight on a wave's endpoints before it "
        "requeues the rest on its other endpoints.",
        default=120.0,
    ),
    _opt(
        # A generation takes seconds to minutes; a refused key or path fails at once. Most waves
        # are confirmed by a completion within a second or two; the bound is paid only by an
        # endpoint whose requests are slow (and then it is counted in service if none failed).
        "client_confirm_timeout",
        "float",
        RETUNE,
        "Seconds a drained generation client is given, after a wave's endpoints are handed back to it, to say that "
        "each is back in service - it completed a request there, or, at the bound, it sends there and nothing failed. "
        "An endpoint it took out of service (an API key or path refused), that is down, or whose requests only failed "
        "fails the host with the client's own reason, and the next wave does not start.",
        default=60.0,
    ),
)

BY_NAME: dict[str, Option] = {o.name: o for o in OPTIONS}

# The arguments of the action sglang_ops.fleet.retune.
ARGUMENT_SPEC: dict[str, dict[str, Any]] = {o.name: o.spec() for o in OPTIONS if o.scope != ROLE}


def default(name: str) -> Any:
    return BY_NAME[name].default


def agent_options(args: dict[str, Any]) -> dict[str, Any]:
    """What every request to the host agent carries (tool paths, timeouts, state directories,
    poll interval): the table's defaults, overridden by the caller's arguments of the same name."""
    return {o.name: args.get(o.name, o.default) for o in OPTIONS if o.scope == AGENT}


@dataclass
class Options:
    """What the controller-side flow of a retune reads; agent options go to the host as they are."""

    wave_size: int = default("wave_size")
    canary: bool | str = default("canary")
    stop_timeout: float = default("stop_timeout")
    kill_timeout: float = default("kill_timeout")
    release_timeout: float = default("release_timeout")
    release_threshold_mib: int = default("release_threshold_mib")
    start_timeout: float = default("start_timeout")
    health_timeout: float = default("health_timeout")
    min_max_running_requests: int | None = default("min_max_running_requests")
    smoke_requests: int = default("smoke_requests")
    rollback: bool = default("rollback")
    force: bool = default("force")
    relaunch_wedged: bool = default("relaunch_wedged")
    ignore_fit_prediction: bool = default("ignore_fit_prediction")
    call_margin: float = default("call_margin")
    client_units: list[str] = field(default_factory=lambda: list(default("client_units")))
    client_drain: bool = default("client_drain")
    client_drain_timeout: float = default("client_drain_timeout")
    client_confirm_timeout: float = default("client_confirm_timeout")
    agent: dict[str, Any] = field(default_factory=dict)  # tool paths, state dirs, poll interval

    @classmethod
    def from_args(cls, args: dict[str, Any]) -> Options:
        """From the action's validated arguments."""
        return cls(
            **{o.name: args[o.name] for o in OPTIONS if o.scope == RETUNE},
            agent={o.name: args[o.name] for o in OPTIONS if o.scope == AGENT},
        )


def call_deadline(op: str, options: Mapping[str, Any]) -> float:
    """The deadline of one call of the retune to the host, derived from what the call carries
    (``options``: the agent options and the phase's own, as sent): the seconds the host may take
    by the waits it is asked for, each at its deadline, and by the nvidia-smi calls, HTTP requests
    and control-socket calls it makes outside them, each at its timeout (the instances of a phase
    are worked on at once). The controller waits this plus ``call_margin`` for the answer, which
    covers what no option bounds: the connection, the module's start, systemctl and journalctl,
    the last sample of a poll. A host that has not answered by then is lost (_retune.flow)."""
    smi = float(options["nvidia_smi_timeout"])
    http = float(options["http_timeout"])
    # Who holds the GPUs (op_inspect.collect_holders): GPU memory, then the compute apps.
    holders = 2 * smi
    if op == "inspect":
        # GPU memory and the holders; per instance /health, /server_info and the stall probe's
        # reads of /metrics: two stall_probe_s apart, a third once the idle report is due.
        probe_s = float(options["stall_probe_s"])
        return smi + holders + 5 * http + (max(probe_s, STALL_REPORT_DUE_S) if probe_s > 0 else 0.0)
    if op == "record":
        return 0.0  # files only
    if op == "stop":
        # The drained stop; SIGKILL of the cgroup, then its wait; the survivors' SIGTERM and SIGKILL
        # waits; the teardown within the release deadline; the last wait for the units. The
        # holders are looked at before and after the survivors are killed.
        kill = float(options["kill_timeout"])
        return float(options["stop_timeout"]) + 4 * kill + float(options["release_timeout"]) + 2 * holders
    if op == "release":
        return float(options["release_timeout"]) + smi
    if op == "start":
        # The model load until /health answers, /health and /server_info again, the smoke
        # completions one after another, and the clients' resume of the wave once it is healthy.
        resume = resume_call_timeout(options) if options.get("resume_clients") else 0.0
        smoke = int(options["smoke_requests"]) * float(options["health_timeout"])
        return float(options["start_timeout"]) + 2 * http + smoke + resume
    if op == "clients":
        return len(options.get("client_units") or []) * float(options.get("client_hello_timeout", HELLO_TIMEOUT))
    if op == "drain":
        return float(options["client_drain_timeout"]) + DRAIN_CALL_MARGIN
    if op == "resume":
        return resume_call_timeout(options)
    if op == "client_stop":
        return float(options.get("client_stop_timeout", CLIENT_STOP_TIMEOUT))
    if op == "client_start":
        return float(options.get("client_start_timeout", CLIENT_START_TIMEOUT))
    raise ValueError(f"no deadline known for the retune's call {op!r}")
