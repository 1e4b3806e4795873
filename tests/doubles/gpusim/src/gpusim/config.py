"""Simulator configuration: one YAML or JSON file, read fresh by every process start.

Tests change faults between steps by rewriting the file, so nothing here is cached
across calls.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import os
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpusim import profiles
from gpusim.versions import Version

DEFAULT_CONFIG_PATH = "/etc/gpusim/config.yaml"
DEFAULT_STATE_DIR = "/run/gpusim"

FAULT_KINDS = (
    "ignore_sigterm",
    "detach_scheduler",
    "never_release",
    "startup_crash",
    "generation_hang",
    "port_taken",
    "settings_mismatch",
    "server_info_hang",
)

NVSMI_MODES = ("ok", "driver_not_loaded", "library_mismatch", "garbled")

# The timing presets. "test" (the default) is DEFAULTS["timing"]: a server starts in seconds and
# frees its memory a few seconds after death, so the Molecule scenarios run fast; "reference" takes
# the real servers' order of magnitude from the reference, for the demo and the benches: weights,
# pools and CUDA graphs load for minutes (§2.1 step 4), a killed process stays in GPU teardown for
# more than 30 s (GB300, §8), and its memory is released seconds after (§8). Keys given under
# `timing` win over the preset's.
TIMING_PRESETS: dict[str, dict[str, float]] = {
    "test": {},
    "reference": {"startup_s": 120.0, "release_delay_s": 10.0, "teardown_s": 30.0},
}

DEFAULTS: dict[str, Any] = {
    "sglang_version": "0.5.23",
    "timing_preset": "test",
    "uuid_seed": None,
    "devices_dir": "/dev",
    "pid_namespace_offset": 0,
    "gpus": {
        "count": 8,
        "name": "NVIDIA H200",
        "memory_total_mib": 143771,
        "idle_used_mib": 0,
        "compute_cap": None,
        "driver_version": "580.105.08",
        "cuda_version": "13.0",
        "pci_bus_ids": None,
        "devices": [],
    },
    "model": {
        "profile": None,
        "by_path": {},
        "overrides": {},
        "profiles": {},
    },
    "timing": {
        "startup_s": 3.0,
        "release_delay_s": 3.0,
        "teardown_s": 2.0,
        "heartbeat_s": 0.2,
        "drain_poll_s": 5.0,
        "warmup_poll_s": 1.0,
        "warmup_timeout_s": 120.0,
        "health_probe_s": 1.0,
        "health_timeout_s": 20.0,
        "subprocess_watchdog_s": 1.0,
        "scheduler_exit_timeout_s": 15.0,
        "scheduler_shutdown_s": 0.2,
        "step_base_s": 0.02,
        "step_per_req_s": 0.001,
        "prefill_tokens_per_s": 50000.0,
        "idle_metrics_s": 30.0,
    },
    "generation": {
        "output_tokens_min": 8,
        "output_tokens_max": 128,
        "spec_accept_length": 2.4,
    },
    "nvidia_smi": {
        "mode": "ok",
        "hang_s": 0.0,
        "nvml_library_version": "580.95.05",
    },
    "logging": {
        "stream": "stderr",
    },
    "faults": [],
}

_GPU_CAPS = (
    ("B200", "10.0"),
    ("B300", "10.3"),
    ("GB200", "10.0"),
    ("RTX PRO 6000", "12.0"),
    ("H200", "9.0"),
    ("H100", "9.0"),
    ("H20", "9.0"),
    ("A100", "8.0"),
    ("L40S", "8.9"),
    ("4090", "8.9"),
    ("T4", "7.5"),
)

_DEFAULT_BUS = ("18", "2A", "3A", "5D", "9A", "AB", "BA", "DB")


class ConfigError(Exception):
    pass


@dataclass
class GPU:
    index: int
    name: str
    memory_total_mib: int
    idle_used_mib: int
    uuid: str
    pci_bus_id: str
    compute_cap: str


@dataclass
class Fault:
    kind: str
    match: dict[str, Any] = field(default_factory=dict)
    params: dict[str, Any] = field(default_factory=dict)

    def applies(self, port: int | None, args: dict[str, Any] | None) -> bool:
        want_port = self.match.get("port")
        if want_port is not None:
            ports = want_port if isinstance(want_port, list) else [want_port]
            if port is None or int(port) not in [int(p) for p in ports]:
                return False
        want_args = self.match.get("args") or {}
        for key, value in want_args.items():
            if args is None or key.replace("-", "_").lstrip("_") not in args:
                return False
            if not _loose_equal(args[key.replace("-", "_").lstrip("_")], value):
                return False
        return True


def _loose_equal(actual: Any, wanted: Any) -> bool:
    if actual == wanted:
        return True
    try:
        return math.isclose(float(actual), float(wanted))
    except (TypeError, ValueError):
        return str(actual) == str(wanted)


def _merge(base: dict[str, Any], over: dict[str, Any], path: str = "") -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in over.items():
        where = f"{path}{key}"
        if key not in base:
            raise ConfigError(f"unknown config key: {where}")
        if isinstance(base[key], dict) and key not in ("by_path", "overrides", "profiles"):
            if not isinstance(value, dict):
                raise ConfigError(f"config key {where} must be a mapping")
            out[key] = _merge(base[key], value, where + ".")
        else:
            out[key] = value
    return out


def _load_text(path: Path) -> dict[str, Any]:
    text = path.read_text(encoding="utf-8")
    if not text.strip():
        return {}
    data: Any
    try:
        import yaml  # noqa: PLC0415  (optional dependency)
    except ImportError:
        yaml = None
    if yaml is not None:
        data = yaml.safe_load(text)
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path}: PyYAML is not installed and the file is not JSON ({exc})") from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping")
    return data


class Config:
    """Resolved configuration plus derived values (GPU list, faults)."""

    def __init__(self, raw: dict[str, Any], source: str | None = None):
        self.source = source
        preset = raw.get("timing_preset", DEFAULTS["timing_preset"])
        if preset not in TIMING_PRESETS:
            raise ConfigError(f"timing_preset must be one of {', '.join(TIMING_PRESETS)}")
        base = _merge(DEFAULTS, {"timing": TIMING_PRESETS[preset]})
        self.data = _merge(base, raw)
        self.version = Version.of(str(self.data["sglang_version"]))
        if self.version.v < (0, 5, 9):
            raise ConfigError(f"sglang_version {self.version} is older than 0.5.9")
        mode = self.data["nvidia_smi"]["mode"]
        if mode not in NVSMI_MODES:
            raise ConfigError(f"nvidia_smi.mode must be one of {', '.join(NVSMI_MODES)}")
        if self.data["logging"]["stream"] not in ("stderr", "stdout"):
            raise ConfigError("logging.stream must be stderr or stdout")
        self.faults = self._parse_faults(self.data["faults"] or [])
        self.gpus = self._build_gpus()

    # --- loading ------------------------------------------------------------
    @classmethod
    def load(cls, path: str | None = None) -> Config:
        explicit = path or os.environ.get("GPUSIM_CONFIG")
        target = Path(explicit or DEFAULT_CONFIG_PATH)
        if not target.exists():
            if explicit:
                raise ConfigError(f"GPUSIM_CONFIG file not found: {target}")
            return cls({}, None)
        return cls(_load_text(target), str(target))

    @staticmethod
    def state_dir() -> Path:
        return Path(os.environ.get("GPUSIM_STATE_DIR") or DEFAULT_STATE_DIR)

    # --- sections -----------------------------------------------------------
    @property
    def timing(self) -> dict[str, float]:
        return self.data["timing"]

    @property
    def generation(self) -> dict[str, Any]:
        return self.data["generation"]

    @property
    def nvsmi(self) -> dict[str, Any]:
        return self.data["nvidia_smi"]

    @property
    def devices_dir(self) -> Path:
        return Path(self.data["devices_dir"])

    @property
    def pid_offset(self) -> int:
        return int(self.data["pid_namespace_offset"] or 0)

    @property
    def log_stream(self) -> str:
        return self.data["logging"]["stream"]

    @property
    def driver_version(self) -> str:
        return str(self.data["gpus"]["driver_version"])

    @property
    def cuda_version(self) -> str:
        return str(self.data["gpus"]["cuda_version"])

    def _parse_faults(self, items: list[Any]) -> list[Fault]:
        out = []
        for entry in items:
            item = {"kind": entry} if isinstance(entry, str) else entry
            if not isinstance(item, dict) or "kind" not in item:
                raise ConfigError(f"fault entries need a 'kind': {item!r}")
            kind = item["kind"]
            if kind not in FAULT_KINDS:
                raise ConfigError(f"unknown fault kind {kind!r}; known: {', '.join(FAULT_KINDS)}")
            params = {k: v for k, v in item.items() if k not in ("kind", "match")}
            out.append(Fault(kind=kind, match=dict(item.get("match") or {}), params=params))
        return out

    def faults_for(self, kind: str, port: int | None, args: dict[str, Any] | None) -> list[Fault]:
        return [f for f in self.faults if f.kind == kind and f.applies(port, args)]

    def fault(self, kind: str, port: int | None, args: dict[str, Any] | None) -> Fault | None:
        found = self.faults_for(kind, port, args)
        return found[0] if found else None

    def _build_gpus(self) -> list[GPU]:
        g = self.data["gpus"]
        count = int(g["count"])
        seed = self.data["uuid_seed"] or socket.gethostname()
        per_index: dict[int, dict[str, Any]] = {}
        for entry in g.get("devices") or []:
            if "index" not in entry:
                raise ConfigError("gpus.devices entries need an 'index'")
            per_index[int(entry["index"])] = entry
        bus_ids = g.get("pci_bus_ids")
        gpus = []
        for i in range(count):
            over = per_index.get(i, {})
            name = str(over.get("name", g["name"]))
            total = int(over.get("memory_total_mib", g["memory_total_mib"]))
            idle = int(over.get("idle_used_mib", g["idle_used_mib"]))
            if "uuid" in over:
                uuid = str(over["uuid"])
            else:
                digest = hashlib.sha256(f"{seed}:{i}".encode()).hexdigest()
                uuid = f"GPU-{digest[0:8]}-{digest[8:12]}-{digest[12:16]}-{digest[16:20]}-{digest[20:32]}"
            if "pci_bus_id" in over:
                bus = str(over["pci_bus_id"])
            elif bus_ids and i < len(bus_ids):
                bus = str(bus_ids[i])
            else:
                part = _DEFAULT_BUS[i] if i < len(_DEFAULT_BUS) else f"{(0x10 + 8 * i) % 256:02X}"
                bus = f"00000000:{part}:00.0"
            cap = over.get("compute_cap") or g.get("compute_cap") or _cap_for(name)
            gpus.append(GPU(i, name, total, idle, uuid, bus, str(cap)))
        return gpus

    # --- model profile --------------------------------------------------------
    def profile_for(self, model_path: str) -> profiles.ModelProfile:
        m = self.data["model"]
        custom: dict[str, Any] = m.get("profiles") or {}
        chosen: str | None = None
        by_path: dict[str, str] = m.get("by_path") or {}
        base = model_path.rstrip("/").rsplit("/", 1)[-1]
        for key, name in by_path.items():
            if key in (model_path, base) or key.lower() in (model_path.lower(), base.lower()):
                chosen = name
                break
        if chosen is None and m.get("profile"):
            chosen = str(m["profile"])
        prof: profiles.ModelProfile | None
        if chosen is not None:
            prof = self._named_profile(chosen, custom)
        else:
            prof = profiles.match_by_model_path(model_path)
            if prof is None:
                for name in custom:
                    if name.lower() == base.lower():
                        prof = self._named_profile(name, custom)
                        break
            if prof is None:
                prof = profiles.get_builtin("qwen3-8b")
        assert prof is not None
        return profiles.apply_overrides(prof, m.get("overrides") or {})

    def _named_profile(self, name: str, custom: dict[str, Any]) -> profiles.ModelProfile:
        if name in custom:
            spec = dict(custom[name])
            base_name = spec.pop("base", "qwen3-8b")
            base = profiles.get_builtin(base_name)
            if base is None:
                raise ConfigError(f"model.profiles.{name}.base: unknown profile {base_name!r}")
            spec.setdefault("name", name)
            return profiles.apply_overrides(base, spec)
        prof = profiles.get_builtin(name)
        if prof is None:
            known = ", ".join(profiles.builtin_names() + sorted(custom))
            raise ConfigError(f"unknown model profile {name!r}; known: {known}")
        return prof


def _cap_for(name: str) -> str:
    upper = name.upper()
    for needle, cap in _GPU_CAPS:
        if needle.upper() in upper:
            return cap
    return "9.0"
