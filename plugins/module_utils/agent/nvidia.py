# Copyright: sglang-fleet contributors
# Apache License 2.0 (see LICENSE)
"""nvidia-smi: per-GPU memory and the compute apps, failing closed on anything unusable."""

from __future__ import annotations

from typing import Any

from .evidence import EvidenceError, run_cmd


def parse_csv_rows(text: str, fields: int) -> list[list[str]]:
    rows = []
    for line in text.splitlines():
        if not line.strip():
            continue
        cells = [c.strip() for c in line.split(",")]
        if len(cells) != fields:
            raise ValueError(f"expected {fields} fields, got {len(cells)} in {line!r}")
        rows.append(cells)
    return rows


def query_gpus(nvidia_smi: str, timeout: float) -> dict[int, dict[str, Any]]:
    """Per-GPU memory.used/total. Fails closed: a missing binary, a hang, an error exit, empty
    output or a value that is not a number raise EvidenceError."""
    argv = [nvidia_smi, "--query-gpu=index,uuid,memory.used,memory.total", "--format=csv,noheader,nounits"]
    rc, out, err = run_cmd(argv, timeout=timeout)
    if rc != 0:
        raise EvidenceError("GPU memory", argv, rc, out, err)
    try:
        rows = parse_csv_rows(out, 4)
        if not rows:
            raise ValueError("no GPU rows")
        gpus = {
            int(r[0]): {"index": int(r[0]), "uuid": r[1], "used_mib": int(r[2]), "total_mib": int(r[3])} for r in rows
        }
    except ValueError as exc:
        raise EvidenceError(f"GPU memory (unparsable: {exc})", argv, rc, out, err) from None
    return gpus


def query_compute_apps(nvidia_smi: str, timeout: float, uuid_to_index: dict[str, int]) -> list[dict[str, Any]]:
    argv = [nvidia_smi, "--query-compute-apps=pid,gpu_uuid,used_memory", "--format=csv,noheader,nounits"]
    rc, out, err = run_cmd(argv, timeout=timeout)
    if rc != 0:
        raise EvidenceError("GPU compute processes", argv, rc, out, err)
    apps = []
    try:
        for r in parse_csv_rows(out, 3):
            used = None if r[2].startswith("[") else int(r[2])
            apps.append({"pid": int(r[0]), "gpu": uuid_to_index.get(r[1]), "used_mib": used})
    except ValueError as exc:
        raise EvidenceError(f"GPU compute processes (unparsable: {exc})", argv, rc, out, err) from None
    return apps


def meaningful_app_pids(
    apps: list[dict[str, Any]], table: dict[int, dict[str, Any]]
) -> tuple[dict[int, list[int]], bool]:
    """nvidia-smi shows host-namespace PIDs: inside a container they name nothing, or the wrong
    process. Use them only when every one exists here and holds that GPU's device handle."""
    mapping: dict[int, list[int]] = {}
    for app in apps:
        proc = table.get(app["pid"])
        if proc is None or app["gpu"] is None or app["gpu"] not in proc["gpus"]:
            return {}, False
        mapping.setdefault(app["pid"], []).append(app["gpu"])
    return mapping, True
