"""The ``nvidia-smi`` console script, reading the simulated GPUs and the allocation registry.

Only what fleet tooling and SGLang call is implemented: ``--query-gpu``,
``--query-compute-apps``, ``--format``, ``-i``, ``-L`` and the default table.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Mapping
from typing import Any

from gpusim import procutil, registry
from gpusim.config import GPU, Config, ConfigError

DRIVER_MISSING = (
    "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. "
    "Make sure that the latest NVIDIA driver is installed and running.\n"
)

# field -> (header name, unit or None, numeric)
GPU_FIELDS: dict[str, tuple[str, str | None, bool]] = {
    "timestamp": ("timestamp", None, False),
    "driver_version": ("driver_version", None, False),
    "count": ("count", None, False),
    "name": ("name", None, False),
    "gpu_name": ("name", None, False),
    "serial": ("serial", None, False),
    "gpu_serial": ("serial", None, False),
    "uuid": ("uuid", None, False),
    "gpu_uuid": ("uuid", None, False),
    "pci.bus_id": ("pci.bus_id", None, False),
    "gpu_bus_id": ("pci.bus_id", None, False),
    "index": ("index", None, False),
    "memory.total": ("memory.total", "MiB", True),
    "memory.reserved": ("memory.reserved", "MiB", True),
    "memory.used": ("memory.used", "MiB", True),
    "memory.free": ("memory.free", "MiB", True),
    "utilization.gpu": ("utilization.gpu", "%", True),
    "utilization.memory": ("utilization.memory", "%", True),
    "temperature.gpu": ("temperature.gpu", None, True),
    "power.draw": ("power.draw", "W", True),
    "power.limit": ("power.limit", "W", True),
    "pstate": ("pstate", None, False),
    "compute_cap": ("compute_cap", None, False),
    "persistence_mode": ("persistence_mode", None, False),
    "mig.mode.current": ("mig.mode.current", None, False),
    "display_mode": ("display_mode", None, False),
}

APP_FIELDS: dict[str, tuple[str, str | None]] = {
    "timestamp": ("timestamp", None),
    "gpu_name": ("gpu_name", None),
    "gpu_bus_id": ("gpu_bus_id", None),
    "gpu_serial": ("gpu_serial", None),
    "gpu_uuid": ("gpu_uuid", None),
    "pid": ("pid", None),
    "process_name": ("process_name", None),
    "name": ("process_name", None),
    "used_memory": ("used_gpu_memory", "MiB"),
    "used_gpu_memory": ("used_gpu_memory", "MiB"),
}


class _Out:
    def __init__(self) -> None:
        self.out: list[str] = []
        self.err: list[str] = []


def _gpu_state(cfg: Config) -> tuple[list[registry.Holder], dict[int, int]]:
    holders = registry.scan(cfg.state_dir(), float(cfg.timing["release_delay_s"]))
    return holders, registry.used_by_gpu(holders)


def _select(cfg: Config, ids: str | None) -> list[GPU] | None:
    if not ids:
        return list(cfg.gpus)
    chosen = []
    for raw in ids.split(","):
        item = raw.strip()
        match = None
        for g in cfg.gpus:
            by_index = item.isdigit() and int(item) == g.index
            by_name = bool(item) and item.lower() in (g.uuid.lower(), g.pci_bus_id.lower())
            if by_index or by_name:
                match = g
        if match is None:
            return None
        chosen.append(match)
    return chosen


def _gpu_value(field: str, g: GPU, used: int, cfg: Config, garbled: bool) -> Any:
    total = g.memory_total_mib
    reserved = 0
    if field in ("memory.total", "memory.used", "memory.free", "memory.reserved") and garbled:
        return "[N/A]"
    if field in ("utilization.gpu", "utilization.memory", "temperature.gpu", "power.draw") and garbled:
        return "ERR!"
    return {
        "timestamp": time.strftime("%Y/%m/%d %H:%M:%S.000"),
        "driver_version": cfg.driver_version,
        "count": len(cfg.gpus),
        "name": g.name,
        "gpu_name": g.name,
        "serial": f"165{g.index:010d}",
        "gpu_serial": f"165{g.index:010d}",
        "uuid": g.uuid,
        "gpu_uuid": g.uuid,
        "pci.bus_id": g.pci_bus_id,
        "gpu_bus_id": g.pci_bus_id,
        "index": g.index,
        "memory.total": total,
        "memory.reserved": reserved,
        "memory.used": min(used, total),
        "memory.free": max(total - reserved - used, 0),
        "utilization.gpu": 0,
        "utilization.memory": 0,
        "temperature.gpu": 30 + g.index % 5,
        "power.draw": "75.00",
        "power.limit": "700.00",
        "pstate": "P0",
        "compute_cap": g.compute_cap,
        "persistence_mode": "Enabled",
        "mig.mode.current": "Disabled",
        "display_mode": "Disabled",
    }[field]


def _fmt(value: Any, unit: str | None, nounits: bool) -> str:
    text = str(value)
    if unit and not nounits and text not in ("[N/A]", "ERR!"):
        return f"{text} {unit}"
    return text


def _header(name: str, unit: str | None) -> str:
    return f"{name} [{unit}]" if unit else name


def _parse_format(fmt: str | None) -> tuple[bool, bool] | None:
    if fmt is None:
        return None
    parts = [p.strip() for p in fmt.split(",") if p.strip()]
    if "csv" not in parts:
        return None
    return "noheader" in parts, "nounits" in parts


def _query_args(
    cfg: Config, fields_arg: str, known: Mapping[str, Any], fmt: str | None, ids: str | None, o: _Out
) -> tuple[list[str], bool, bool, list[GPU]] | int:
    """Fields, noheader, nounits and the selected GPUs of a --query-* call, or the exit code
    after writing nvidia-smi's error for a bad field, format or id."""
    fields = [f.strip() for f in fields_arg.split(",") if f.strip()]
    for f in fields:
        if f not in known:
            o.out.append(f'Field "{f}" is not a valid field to query.\n\n')
            return 2
    parsed = _parse_format(fmt)
    if parsed is None:
        o.out.append('"--format" must be specified as "csv" with optional "noheader" and "nounits".\n')
        return 2
    gpus = _select(cfg, ids)
    if gpus is None:
        o.out.append("No devices were found\n")
        return 6
    return fields, parsed[0], parsed[1], gpus


def query_gpu(cfg: Config, fields_arg: str, fmt: str | None, ids: str | None, o: _Out) -> int:
    query = _query_args(cfg, fields_arg, GPU_FIELDS, fmt, ids, o)
    if isinstance(query, int):
        return query
    fields, noheader, nounits, gpus = query
    _, used = _gpu_state(cfg)
    garbled = cfg.nvsmi["mode"] == "garbled"
    if not noheader:
        o.out.append(", ".join(_header(*GPU_FIELDS[f][:2]) for f in fields) + "\n")
    for g in gpus:
        row = []
        for f in fields:
            val = _gpu_value(f, g, used.get(g.index, 0) + g.idle_used_mib, cfg, garbled)
            row.append(_fmt(val, GPU_FIELDS[f][1], nounits))
        o.out.append(", ".join(row) + "\n")
    return 0


def _process_name(h: registry.Holder) -> str:
    args = procutil.cmdline(h.alloc.pid)
    return args[0] if args else h.alloc.title


def query_apps(cfg: Config, fields_arg: str, fmt: str | None, ids: str | None, o: _Out) -> int:
    query = _query_args(cfg, fields_arg, APP_FIELDS, fmt, ids, o)
    if isinstance(query, int):
        return query
    fields, noheader, nounits, gpus = query
    holders, _ = _gpu_state(cfg)
    wanted = {g.index for g in gpus}
    by_index = {g.index: g for g in cfg.gpus}
    garbled = cfg.nvsmi["mode"] == "garbled"
    if not noheader:
        o.out.append(", ".join(_header(*APP_FIELDS[f]) for f in fields) + "\n")
    for h in sorted(holders, key=lambda x: (x.alloc.gpu, x.alloc.pid)):
        if not h.alive or h.alloc.gpu not in wanted or h.alloc.gpu not in by_index:
            continue
        g = by_index[h.alloc.gpu]
        values = {
            "timestamp": time.strftime("%Y/%m/%d %H:%M:%S.000"),
            "gpu_name": g.name,
            "gpu_bus_id": g.pci_bus_id,
            "gpu_serial": f"165{g.index:010d}",
            "gpu_uuid": g.uuid,
            "pid": h.alloc.pid + cfg.pid_offset,
            "process_name": _process_name(h),
            "name": _process_name(h),
            "used_memory": "[N/A]" if garbled else h.alloc.mib,
            "used_gpu_memory": "[N/A]" if garbled else h.alloc.mib,
        }
        o.out.append(", ".join(_fmt(values[f], APP_FIELDS[f][1], nounits) for f in fields) + "\n")
    return 0


def list_gpus(cfg: Config, ids: str | None, o: _Out) -> int:
    gpus = _select(cfg, ids)
    if gpus is None:
        o.out.append("No devices were found\n")
        return 6
    for g in gpus:
        o.out.append(f"GPU {g.index}: {g.name} (UUID: {g.uuid})\n")
    return 0


def _short_name(name: str, width: int = 27) -> str:
    return name if len(name) <= width else name[: width - 3] + "..."


def table(cfg: Config, ids: str | None, o: _Out) -> int:
    gpus = _select(cfg, ids)
    if gpus is None:
        o.out.append("No devices were found\n")
        return 6
    holders, used = _gpu_state(cfg)
    garbled = cfg.nvsmi["mode"] == "garbled"
    sep = "+-----------------------------------------+------------------------+----------------------+"
    wide = "+" + "-" * 89 + "+"
    lines = [time.strftime("%a %b %e %H:%M:%S %Y") + "       ", wide]
    lines.append(
        f"| NVIDIA-SMI {cfg.driver_version:<23}Driver Version: {cfg.driver_version:<15}"
        f"CUDA Version: {cfg.cuda_version:<9}|"
    )
    lines += [
        sep,
        "| GPU  Name                 Persistence-M | Bus-Id          Disp.A | Volatile Uncorr. ECC |",
        "| Fan  Temp   Perf          Pwr:Usage/Cap |           Memory-Usage | GPU-Util  Compute M. |",
        "|                                         |                        |               MIG M. |",
        "|=========================================+========================+======================|",
    ]
    for g in gpus:
        mem_used = used.get(g.index, 0) + g.idle_used_mib
        name = _short_name(g.name)
        lines.append(f"|{g.index:>4}  {name:<29}{'On':>4}  |   {g.pci_bus_id} Off |{'0':>21} |")
        if garbled:
            mem = f"{'ERR!':>11} / {'ERR!':>9} "
            left = f" N/A  ERR!    P0{'ERR!':>16} / ERR! "
            util = "ERR!"
        else:
            mem = f"{str(mem_used) + 'MiB':>11} / {str(g.memory_total_mib) + 'MiB':>9} "
            left = f" N/A  {30 + g.index % 5:>3}C    P0{75:>15}W /  700W "
            util = "0%"
        lines.append(f"|{left:<41}|{mem:>24}|{util:>8}      Default |")
        lines.append("|                                         |                        |             Disabled |")
        lines.append(sep)
    lines.append(" " * 91)
    lines += [
        wide,
        "| Processes:" + " " * 78 + "|",
        "|  GPU   GI   CI              PID   Type   Process name                        GPU Memory |",
        "|        ID   ID                                                               Usage      |",
        "|" + "=" * 89 + "|",
    ]
    wanted = {g.index for g in gpus}
    rows = [h for h in holders if h.alive and h.alloc.gpu in wanted]
    if not rows:
        lines.append("|  No running processes found" + " " * 61 + "|")
    for h in sorted(rows, key=lambda x: (x.alloc.gpu, x.alloc.pid)):
        left = f"  {h.alloc.gpu:>3}   N/A  N/A  {h.alloc.pid + cfg.pid_offset:>11}      C   "
        right = f"{h.alloc.mib}MiB "
        width = 89 - len(left) - len(right)
        pname = _process_name(h)
        if len(pname) > width:
            pname = "..." + pname[-(width - 3) :]
        lines.append("|" + left + f"{pname:<{width}}" + right + "|")
    lines.append(wide)
    o.out.append("\n".join(lines) + "\n")
    return 0


def _argparser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="nvidia-smi", add_help=True)
    p.add_argument("--query-gpu", dest="query_gpu")
    p.add_argument("--query-compute-apps", dest="query_apps")
    p.add_argument("--format", dest="format")
    p.add_argument("-i", "--id", dest="ids")
    p.add_argument("-L", "--list-gpus", dest="list", action="store_true")
    p.add_argument("-q", "--query", dest="query", action="store_true")
    return p


def run_capture(argv: list[str], cfg: Config | None = None) -> tuple[int, str, str]:
    """Run nvidia-smi in-process; returns (exit status, stdout, stderr)."""
    o = _Out()
    try:
        cfg = cfg or Config.load()
    except ConfigError as exc:
        return 1, "", f"gpusim: {exc}\n"
    hang = float(cfg.nvsmi.get("hang_s") or 0)
    if hang > 0:
        time.sleep(hang)
    mode = cfg.nvsmi["mode"]
    if mode == "driver_not_loaded":
        return 9, DRIVER_MISSING, ""
    if mode == "library_mismatch":
        return (
            18,
            (
                "Failed to initialize NVML: Driver/library version mismatch\n"
                f"NVML library version: {cfg.nvsmi.get('nvml_library_version')}\n"
            ),
            "",
        )
    try:
        ns = _argparser().parse_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0), "", "Invalid combination of input arguments. Please run 'nvidia-smi -h' for help.\n"
    if ns.query_gpu:
        rc = query_gpu(cfg, ns.query_gpu, ns.format, ns.ids, o)
    elif ns.query_apps:
        rc = query_apps(cfg, ns.query_apps, ns.format, ns.ids, o)
    elif ns.list:
        rc = list_gpus(cfg, ns.ids, o)
    else:
        rc = table(cfg, ns.ids, o)
    return rc, "".join(o.out), "".join(o.err)


def main(argv: list[str] | None = None) -> int:
    rc, out, err = run_capture(list(sys.argv[1:] if argv is None else argv))
    if out:
        sys.stdout.write(out)
        sys.stdout.flush()
    if err:
        sys.stderr.write(err)
        sys.stderr.flush()
    return rc


if __name__ == "__main__":
    sys.exit(main())
