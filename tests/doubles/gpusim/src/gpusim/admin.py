"""``gpusim`` admin command: setup, status, reset."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time

from gpusim import driver, registry
from gpusim.config import Config, ConfigError


def setup(cfg: Config, driver_mode: str = "auto") -> dict:
    state = cfg.state_dir()
    registry.ensure_state_dir(state)
    # World-writable and sticky: an unprivileged server registers, only owners delete.
    os.chmod(state, 0o1777)  # noqa: S103
    os.chmod(registry.alloc_dir(state), 0o1777)  # noqa: S103
    devdir = cfg.devices_dir
    devdir.mkdir(parents=True, exist_ok=True)
    made = []
    for name in [f"nvidia{g.index}" for g in cfg.gpus] + ["nvidiactl", "nvidia-uvm"]:
        path = devdir / name
        if not path.exists():
            path.touch()
            made.append(str(path))
        with contextlib.suppress(PermissionError):
            os.chmod(path, 0o666)  # noqa: S103  (the real /dev/nvidia* nodes are 0666)
    # The teardown tracer must live outside every server's cgroup (a systemd stop SIGKILLs the
    # whole cgroup), so it runs as its own transient unit where systemd is PID 1.
    drv = driver.start(state, driver_mode)
    return {"state_dir": str(state), "devices_dir": str(devdir), "created": made, "driver": drv}


def status(cfg: Config) -> dict:
    holders = registry.scan(cfg.state_dir(), float(cfg.timing["release_delay_s"]), prune=False)
    used = registry.used_by_gpu(holders)
    now = time.time()
    return {
        "sglang_version": str(cfg.version),
        "state_dir": str(cfg.state_dir()),
        "gpus": [
            {
                "index": g.index,
                "uuid": g.uuid,
                "name": g.name,
                "memory_total_mib": g.memory_total_mib,
                "memory_used_mib": used.get(g.index, 0) + g.idle_used_mib,
            }
            for g in cfg.gpus
        ],
        "driver": driver.status(cfg.state_dir()),
        "allocations": [
            {**h.to_dict(), "releases_in_s": None if h.releases_at is None else round(max(0.0, h.releases_at - now), 3)}
            for h in holders
        ],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="gpusim", description="Administer the simulated GPU host.")
    sub = p.add_subparsers(dest="cmd", required=True)
    sp = sub.add_parser("setup", help="create the state directory and the fake device files, start the driver")
    sp.add_argument(
        "--driver",
        choices=("auto", "systemd", "fork", "none"),
        default="auto",
        help="how to run the teardown tracer: a transient systemd unit, a detached daemon, or not at all",
    )
    sub.add_parser("status", help="print GPUs and live allocations as JSON")
    sub.add_parser("reset", help="drop every allocation, including never-released ones")
    sub.add_parser("driver", help="run the teardown tracer in the foreground (what setup starts)")
    ns = p.parse_args(argv)
    try:
        cfg = Config.load()
    except ConfigError as exc:
        print(f"gpusim: configuration error: {exc}", file=sys.stderr)
        return 1
    if ns.cmd == "driver":
        return driver.serve(cfg.state_dir())
    if ns.cmd == "setup":
        out = setup(cfg, ns.driver)
    elif ns.cmd == "status":
        out = status(cfg)
    else:
        out = {"removed": registry.reset(cfg.state_dir())}
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
