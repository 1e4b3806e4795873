"""Orchestration overhead of a retune, against a naive relaunch, measured in the same run.

For one host with 8 instances and for several hosts (simulated GPU hosts: podman containers with
systemd and the SGLang test double), alternately:

- retune: the real retune tasks of retune.yml (role + sglang_ops.fleet.retune), all instances in
  one wave, to new settings;
- naive: write the units, ``systemctl restart`` them all at once, wait for each port.

The overhead of each is its wall time minus the simulator's own delays on the critical path (the
SIGTERM drain poll, the GPU memory release delay, the model load, the warmup and the health
probe). Prints both, their ratio, and the remote round trips per host per phase of the retune.
A benchmark, not a test: it prints figures, it asserts nothing.

    python bench/retune/bench_retune.py [--hosts 1 3] [--rounds 3]

Needs what `make setup` installs (podman, the test-host image, the virtualenv).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # bench/, for the helpers the benchmarks share
from _playbook import playbook  # noqa: E402

GPUS = 8
# The GPU memory release delay is 0 here: with memory still held by the old process, the naive
# restart's new server fails to start (as real SGLang does, "Not enough memory"), and there would
# be no baseline to compare with. The retune's release wait is exercised by the Molecule scenarios.
TIMING = {"startup_s": 5.0, "release_delay_s": 0.0, "drain_poll_s": 1.0, "warmup_poll_s": 1.0, "health_probe_s": 1.0}
# On the critical path of one wave: drain poll, release, load, warmup poll, one health probe.
SIM_RETUNE_S = sum(TIMING.values())
SIM_NAIVE_S = SIM_RETUNE_S - TIMING["release_delay_s"]


def inventory(directory: Path, hosts: int) -> Path:
    names = [f"sglang-bench-{i}" for i in range(hosts)]
    group_vars = {
        "ansible_connection": "containers.podman.podman",
        "ansible_python_interpreter": "/usr/bin/python3",
        "sglang_server_version": "0.5.23",
        "sglang_server_model_path": "tiny",
        "sglang_server_gpu_count": GPUS,
        "sglang_server_stop_timeout": 60,
        "sglang_server_start_timeout": 120,
        "gpu_host_gpusim_config": {
            "sglang_version": "0.5.23",
            "gpus": {"count": GPUS, "name": "NVIDIA B200", "memory_total_mib": 183359},
            "model": {"profile": "tiny"},
            "timing": TIMING,
        },
        "sglang_retune_canary": False,
        "sglang_retune_wave_size": 0,
        "sglang_retune_poll_interval": 0.2,
    }
    data = {"all": {"children": {"sglang_servers": {"hosts": {n: None for n in names}, "vars": group_vars}}}}
    path = directory / "hosts.json"
    path.write_text(json.dumps(data))
    return path


def tuning(directory: Path, mrr: int) -> Path:
    # A fixed memory fraction small enough for two servers on a GPU: the naive restart starts the
    # new server before the old one's memory is released.
    path = directory / f"tuning-{mrr}.json"
    path.write_text(json.dumps({"sglang_server_host_args": {"mem_fraction_static": 0.4, "max_running_requests": mrr}}))
    return path


def bench(hosts: int, rounds: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="sglang-bench-") as tmp:
        d = Path(tmp)
        inv = inventory(d, hosts)
        a, b = tuning(d, 64), tuning(d, 65)
        results = d / "results.json"
        playbook(inv, HERE / "setup.yml", "-e", f"@{a}")
        try:
            retune_walls, naive_walls, trips = [], [], []
            for _ in range(rounds):
                retune_walls.append(playbook(inv, HERE / "retune.yml", "-e", f"@{b}", "-e", f"bench_results={results}"))
                per_host = json.loads(results.read_text())
                actions = {i["action"] for r in per_host.values() for i in r["instances"]}
                if actions != {"relaunched"}:
                    raise SystemExit(f"unexpected retune actions {actions}")
                trips.extend(r["round_trips"] for r in per_host.values())
                naive_walls.append(playbook(inv, HERE / "naive.yml", "-e", f"@{a}"))
        finally:
            playbook(inv, HERE / "teardown.yml")
    retune_wall = statistics.median(retune_walls)
    naive_wall = statistics.median(naive_walls)
    return {
        "hosts": hosts,
        "instances": hosts * GPUS,
        "retune_wall_s": retune_wall,
        "naive_wall_s": naive_wall,
        "retune_overhead_s": retune_wall - SIM_RETUNE_S,
        "naive_overhead_s": naive_wall - SIM_NAIVE_S,
        "round_trips": trips[0] if all(t == trips[0] for t in trips) else trips,
        "rounds": rounds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hosts", type=int, nargs="+", default=[1, 3])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    print(f"simulator delays on the critical path: retune {SIM_RETUNE_S:.1f}s, naive {SIM_NAIVE_S:.1f}s ({TIMING})")
    rows = [bench(h, args.rounds) for h in args.hosts]
    print()
    print(
        f"{'hosts':>5} {'instances':>9} {'retune wall':>11} {'naive wall':>10} "
        f"{'retune overhead':>15} {'naive overhead':>14} {'ratio':>6}  round trips per host per phase"
    )
    for r in rows:
        ratio = r["retune_overhead_s"] / r["naive_overhead_s"] if r["naive_overhead_s"] > 0 else float("nan")
        print(
            f"{r['hosts']:>5} {r['instances']:>9} {r['retune_wall_s']:>10.1f}s {r['naive_wall_s']:>9.1f}s "
            f"{r['retune_overhead_s']:>14.1f}s {r['naive_overhead_s']:>13.1f}s {ratio:>6.2f}  {r['round_trips']}"
        )
    print(
        "\n(median of the rounds; overhead = wall time minus the simulator's delays; the retune also proves each"
        " process dead, its GPU memory free, and the new server's settings and completions, which the naive"
        " restart does not)"
    )


if __name__ == "__main__":
    main()
