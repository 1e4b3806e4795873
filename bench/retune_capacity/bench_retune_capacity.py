"""What a retune costs in generation, with the client stopped (the old way) and with per-wave drain.

A simulated fleet of the demo's shape (2 hosts x 4 B200s, one server per GPU, the hybrid
Qwen3.6-27B profile with MTP, a startup of several seconds) generates continuously: on each host the
generation client runs as a service, one shard of one job, sending to its host's four servers. The
fleet is retuned twice with waves of one instance, in the same run:

- drain: ``sglang_retune_client_drain=true``: each wave's endpoints are drained in the client, the
  wave relaunched, the endpoints handed back (the first tuning's 80 Mamba slots -> 200: capacity
  16 -> 40 running requests per server);
- stop: ``sglang_retune_client_drain=false``: the client of each host is stopped for its host's
  retune and started after it (back to the first tuning).

Printed, for each run:

- capacity lost: instance-seconds not serving, from the client's own record (its endpoint log:
  drained, down, and the client not running), against the sum over waves of (instances in the wave
  x their relaunch time: the drain's wait, then the retune's wall time from the stop to proven
  health, ``relaunch_s``); goal <= 1.1x;
- per wave, the completions of the untouched instances (in service, not relaunched yet) against
  their rate before the retune; goal >= 95%;
- completions lost or duplicated (``sglang-fleet verify --in-progress`` of both shards, and the
  client's own count against the records): must be 0;
- saturation: of the samples of each server's gauges (running and queued requests, /metrics)
  against its effective max running requests (/server_info), before and after the drain run's
  capacity change, the share at the max by the advisor's rule (``window_stats``'s
  ``pinned_fraction``: running at the max, or just below it with running + queued at least the max,
  every slot a finished request frees having a request waiting), and of all samples the share just
  below it with the queue refilling (``refill_fraction``); goal >= 98% at the max.

Writes ``timeline.csv`` (completions per second over time, both runs aligned on their start) and
``timeline.png`` (both runs) to ``--out``. A benchmark: it prints figures; it exits non-zero only
when completions were lost or duplicated or a run did not complete.

    python bench/retune_capacity/bench_retune_capacity.py [--out bench-out/retune_capacity]

Needs what `make setup` installs (podman, the test-host image, the virtualenv with matplotlib).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import csv
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import matplotlib
import matplotlib.pyplot as plt

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # bench/, for the helpers the benchmarks share
from _playbook import BIN, REPO, playbook  # noqa: E402

# The collection (collections/ansible_collections/sglang_ops/fleet links to the repository root, as
# for the unit tests), for the advisor's rule of a server at its effective max.
sys.path.insert(0, str(REPO / "collections"))
from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._advisor.window import window_stats  # noqa: E402

HOSTS = ["sglang-cap-0", "sglang-cap-1"]
GPUS = 4
PORTS = [30000 + i for i in range(GPUS)]
OUTPUT_DIR = "/var/lib/sglang-fleet/generate"
ENDPOINT_LOG = "/var/lib/sglang-fleet/generate/endpoints.jsonl"
TIMING = {"startup_s": 6.0, "release_delay_s": 2.0, "drain_poll_s": 1.0, "warmup_poll_s": 0.5, "health_probe_s": 0.5}
FIRST = {"max_mamba_cache_size": 80, "mamba_full_memory_ratio": 0.4}
SECOND = {"max_mamba_cache_size": 200, "mamba_full_memory_ratio": 0.6, "mem_fraction_static": 0.93}
COMMON_ARGS = {
    "speculative_algorithm": "EAGLE",
    "speculative_num_steps": 3,
    "speculative_eagle_topk": 1,
    "speculative_num_draft_tokens": 4,
    "reasoning_parser": "qwen3",
    "enable_metrics": True,
}


# --------------------------------------------------------------------------------- the fleet
def write_inventory(d: Path, prompts: Path) -> Path:
    group_vars = {
        "ansible_connection": "containers.podman.podman",
        "ansible_python_interpreter": "/usr/bin/python3",
        "sglang_server_version": "0.5.23",
        "sglang_server_model_path": "Qwen/Qwen3.6-27B",
        "sglang_server_served_model_name": "qwen3.6-27b",
        "sglang_server_gpu_count": GPUS,
        "sglang_server_host_args": {**COMMON_ARGS, **FIRST},
        "sglang_server_stop_timeout": 60,
        "sglang_server_start_timeout": 300,
        "gpu_host_gpusim_config": {
            "sglang_version": "0.5.23",
            "gpus": {"count": GPUS, "name": "NVIDIA B200", "memory_total_mib": 183359},
            "timing": TIMING,
        },
        "generation_prompts_src": str(prompts),
        "generation_prompts_file": "/var/lib/sglang-fleet/prompts.jsonl",
        "generation_endpoint_count": GPUS,
        "generation_model": "qwen3.6-27b",
        "generation_sampling": {"max_tokens": 64, "temperature": 0},
        "generation_shard_seconds": 30,
        "generation_endpoint_log": ENDPOINT_LOG,
        "sglang_retune_canary": False,
        "sglang_retune_wave_size": 1,
        "sglang_retune_poll_interval": 0.25,
    }
    hosts = {h: {"generation_shard": f"{i}/{len(HOSTS)}"} for i, h in enumerate(HOSTS)}
    data = {"all": {"children": {"sglang_servers": {"hosts": hosts, "vars": group_vars}}}}
    path = d / "hosts.json"
    path.write_text(json.dumps(data))
    return path


def write_prompts(d: Path, n: int) -> Path:
    path = d / "prompts.jsonl"
    with path.open("w") as f:
        for i in range(n):
            f.write(json.dumps({"id": f"p{i}", "messages": [{"role": "user", "content": f"Question {i}"}]}) + "\n")
    return path


def podman(*args: str, check: bool = True) -> str:
    proc = subprocess.run(["podman", *args], capture_output=True, text=True, check=False)
    if check and proc.returncode != 0:
        raise SystemExit(f"podman {' '.join(args[:3])} failed: {proc.stderr[-2000:]}")
    return proc.stdout


def retune(inv: Path, d: Path, label: str, args: dict[str, Any], drain: bool) -> dict[str, Any]:
    results = d / f"results-{label}.json"
    tuning = d / f"tuning-{label}.json"
    tuning.write_text(json.dumps({"sglang_server_host_args": {**COMMON_ARGS, **args}}))
    t0 = time.time()
    wall = playbook(
        inv,
        str(HERE / "retune.yml"),
        "-e",
        f"@{tuning}",
        "-e",
        json.dumps({"sglang_retune_client_drain": drain, "bench_results": str(results)}),
    )
    per_host = json.loads(results.read_text())
    actions = {i["action"] for r in per_host.values() for i in r.get("instances", [])}
    if actions != {"relaunched"}:
        raise SystemExit(f"{label}: unexpected retune actions {actions}")
    return {"label": label, "start": t0, "end": t0 + wall, "wall_s": wall, "hosts": per_host}


# --------------------------------------------------------------------------------- the record
def fetch(d: Path) -> dict[str, Path]:
    out = {}
    for h in HOSTS:
        target = d / "fetched" / h
        target.mkdir(parents=True, exist_ok=True)
        podman("cp", f"{h}:{OUTPUT_DIR}", str(target / "output"))
        podman("cp", f"{h}:/root/samples.csv", str(target / "samples.csv"))
        out[h] = target
    return out


def read_records(dirs: dict[str, Path]) -> list[dict[str, Any]]:
    records = []
    for target in dirs.values():
        for shard in sorted((target / "output" / "shards").glob("part-*.jsonl*")):
            for line in shard.read_text().splitlines():
                # A line still being written when the shard was copied is skipped.
                with contextlib.suppress(ValueError):
                    records.append(json.loads(line))
    return records


def endpoint_events(dirs: dict[str, Path]) -> dict[str, list[dict[str, Any]]]:
    """host -> the client's endpoint log (state changes, client starts and stops), in time order."""
    out = {}
    for h, target in dirs.items():
        path = target / "output" / Path(ENDPOINT_LOG).name
        lines = path.read_text().splitlines() if path.exists() else []
        out[h] = sorted((json.loads(x) for x in lines if x.strip()), key=lambda e: e["t"])
    return out


def not_serving(events: list[dict[str, Any]], start: float, end: float) -> dict[str, float]:
    """Seconds each endpoint of one client did not serve within [start, end]: drained or down (per
    the client's endpoint log), or the client itself not running."""
    lost: dict[str, float] = collections.defaultdict(float)
    since: dict[str, float] = {}
    client_down_since: float | None = None
    urls = {e["url"] for e in events if e.get("url")}

    def clip(a: float, b: float) -> float:
        return max(0.0, min(b, end) - max(a, start))

    for e in events:
        t, url, ev = e["t"], e.get("url"), e["event"]
        if ev == "client_stop":
            client_down_since = t
            for u in list(since):
                lost[u] += clip(since.pop(u), t)
        elif ev == "client_start":
            if client_down_since is not None:
                for u in urls:
                    lost[u] += clip(client_down_since, t)
                client_down_since = None
        elif ev in ("drained", "down") and url and url not in since:
            since[url] = t
        elif ev in ("up", "resumed") and url in since:
            lost[url] += clip(since.pop(url), t)
    for u, t in since.items():
        lost[u] += clip(t, end)
    if client_down_since is not None:
        for u in urls:
            lost[u] += clip(client_down_since, end)
    return dict(lost)


def relaunch_times(run: dict[str, Any]) -> list[float]:
    """Per relaunched instance, from the retune's result: its wall time from the stop to proven
    health (round trips included), and its drain in the client before that, if any."""
    out = []
    for r in run["hosts"].values():
        drained = {}
        for client in r.get("clients", []):
            for wave in client.get("waves", []):
                for name in wave.get("instances", []):
                    drained[name] = max(drained.get(name, 0.0), wave.get("waited_s") or 0.0)
        for inst in r.get("instances", []):
            out.append(drained.get(inst["name"], 0.0) + (inst.get("relaunch_s") or 0.0))
    return out


def rate(records: list[dict[str, Any]], urls: set[str], a: float, b: float) -> float:
    n = sum(1 for r in records if r["endpoint"] in urls and a <= r["timings"]["finished"] < b)
    return n / max(b - a, 1e-9) / max(len(urls), 1)


def out_of_service(events: dict[str, list[dict[str, Any]]], a: float, b: float) -> list[tuple[str, str, float, float]]:
    """(host, url, from, to) of every drained interval of the client's record that starts in [a, b]."""
    out = []
    for h, evs in events.items():
        since: dict[str, float] = {}
        for e in evs:
            if e["event"] == "drained" and a <= e["t"] <= b:
                since[e["url"]] = e["t"]
            elif e["event"] == "resumed" and e.get("url") in since:
                out.append((h, e["url"], since.pop(e["url"]), e["t"]))
    return out


def untouched_ratios(
    run: dict[str, Any], events: dict[str, list[dict[str, Any]]], records: list[dict[str, Any]], baseline
) -> list[float]:
    """For each wave of the run (an endpoint out of the client's rotation), the completions of the
    fleet's untouched endpoints during it (in service throughout, and not relaunched yet, so still
    at their settings of before) against their rates before the retune: one ratio per wave."""
    waves = out_of_service(events, run["start"], run["end"])
    by_endpoint: dict[tuple[str, str], list[float]] = collections.defaultdict(list)
    for r in records:
        by_endpoint[(r["_host"], r["endpoint"])].append(r["timings"]["finished"])
    ratios = []
    for _h, _u, a, b in waves:
        touched = {(h2, u2) for h2, u2, a2, _b2 in waves if a2 < b}  # out now, or relaunched before
        done = expected = 0.0
        for host, urls in baseline.items():
            for url, before in urls.items():
                if (host, url) in touched or before <= 0:
                    continue
                done += sum(1 for t in by_endpoint[(host, url)] if a <= t < b)
                expected += before * (b - a)
        if expected:
            ratios.append(done / expected)
    return ratios


def saturation(samples: dict[str, Path], a: float, b: float) -> tuple[float, float, int]:
    """Of the samples of the servers' gauges in [a, b], by the advisor's rule (window_stats, over the
    samples of each server at each effective max it reported): the share at the effective max
    (pinned_fraction: running at the max, or below it with running + queued at least the max), the
    share below it with the queue refilling (refill_fraction), and the number of samples."""
    series: dict[tuple[str, str, int], list[dict[str, float]]] = collections.defaultdict(list)
    for host, path in samples.items():
        with path.open() as f:
            for row in csv.reader(f):
                t, port, running, queued, cap = row
                if not (a <= float(t) < b) or not running or not cap or not queued:
                    continue
                sample = {"t": float(t), "num_running_reqs": float(running), "num_queue_reqs": float(queued)}
                series[host, port, int(float(cap))].append(sample)
    pinned = refilling = total = 0
    for (_host, _port, cap), rows in series.items():
        stats = window_stats(rows, cap, None)
        total += len(rows)
        pinned += round((stats.pinned_fraction or 0.0) * len(rows))
        refilling += round((stats.refill_fraction or 0.0) * len(rows))
    if not total:
        return float("nan"), float("nan"), 0
    return pinned / total, refilling / total, total


# --------------------------------------------------------------------------------- main
def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=REPO / "bench-out" / "retune_capacity")
    parser.add_argument("--prompts", type=int, default=200000)
    parser.add_argument("--steady", type=float, default=30.0, help="seconds of steady generation around each run")
    parser.add_argument("--keep", action="store_true", help="leave the benchmark hosts running")
    a = parser.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="sglang-cap-") as tmp:
        d = Path(tmp)
        prompts = write_prompts(d, a.prompts)
        inv = write_inventory(d, prompts)
        print(f"setting up {len(HOSTS)} hosts x {GPUS} simulated B200s, the client on each ...", flush=True)
        playbook(inv, str(HERE / "setup.yml"))
        try:
            for h in HOSTS:
                podman("cp", str(HERE / "sampler.py"), f"{h}:/root/sampler.py")
                podman("exec", "-d", h, "python3", "/root/sampler.py", "/root/samples.csv", "0.5", *map(str, PORTS))
            time.sleep(a.steady)
            t_before = time.time() - a.steady + 5
            print("run 1: retune with per-wave drain (80 -> 200 Mamba slots) ...", flush=True)
            drain = retune(inv, d, "drain", SECOND, drain=True)
            time.sleep(a.steady)
            print("run 2: retune with the client stopped (back to 80 slots) ...", flush=True)
            stop = retune(inv, d, "stop", FIRST, drain=False)
            time.sleep(a.steady)
            for h in HOSTS:
                podman("exec", h, "systemctl", "stop", "sglang-fleet-generate.service")
                podman("exec", h, "pkill", "-f", "/root/sampler.py", check=False)
            dirs = fetch(d)
            verify = subprocess.run(
                [str(BIN / "sglang-fleet"), "verify", "--prompts", str(prompts), "--in-progress", "--json"]
                + [x for t in dirs.values() for x in ("--output", str(t / "output"))],
                capture_output=True,
                text=True,
                check=False,
            )
            statuses = {h: json.loads((t / "output" / "status.json").read_text()) for h, t in dirs.items()}
        finally:
            if not a.keep:
                playbook(inv, str(REPO / "bench" / "retune" / "teardown.yml"))
        return report(a.out, dirs, drain, stop, t_before, verify, statuses)


def report(out: Path, dirs, drain, stop, t_before, verify, statuses) -> int:
    records = []
    for h, target in dirs.items():
        for r in read_records({h: target}):
            r["_host"] = h
            records.append(r)
    events = endpoint_events(dirs)
    urls = {h: sorted({e["url"] for e in evs if e.get("url")}) for h, evs in events.items()}
    baseline = {
        h: {u: rate([r for r in records if r["_host"] == h], {u}, t_before, drain["start"]) for u in us}
        for h, us in urls.items()
    }
    ids = collections.Counter(r["id"] for r in records)
    doubled = sum(1 for c in ids.values() if c > 1)
    done = sum(int(s.get("done", 0)) for s in statuses.values())
    lost = done - len(ids)
    try:
        vr = json.loads(verify.stdout)
    except ValueError:
        vr = {"raw": verify.stdout[-2000:] + verify.stderr[-2000:]}

    print()
    print(
        f"{'run':<6} {'wall':>7} {'lost capacity':>14} {'sum of relaunches':>18} {'ratio':>6}"
        "  untouched rate during waves"
    )
    rows = {}
    for run in (drain, stop):
        window_end = run["end"] + 15
        lost_s = sum(sum(not_serving(evs, run["start"], window_end).values()) for evs in events.values())
        relaunch = sum(relaunch_times(run))
        ratios = untouched_ratios(run, events, records, baseline) if run is drain else []
        rows[run["label"]] = (lost_s, relaunch, ratios)
        unt = f"min {min(ratios):.2f}, mean {sum(ratios) / len(ratios):.2f} ({len(ratios)} waves)" if ratios else "-"
        ratio = lost_s / relaunch if relaunch else float("nan")
        print(f"{run['label']:<6} {run['wall_s']:>6.1f}s {lost_s:>13.1f}s {relaunch:>17.1f}s {ratio:>6.2f}  {unt}")
    print(f"\nstop run / drain run, capacity lost: {rows['stop'][0] / max(rows['drain'][0], 1e-9):.2f}x")
    waves = out_of_service(events, drain["start"], drain["end"])
    if waves:
        out_s = [b - a for _h, _u, a, b in waves]
        relaunch_s = [i.get("relaunch_s") or 0.0 for r in drain["hosts"].values() for i in r.get("instances", [])]
        waited = [
            w.get("waited_s") or 0.0
            for r in drain["hosts"].values()
            for c in r.get("clients", [])
            for w in c.get("waves", [])
        ]
        m_out, m_wait, m_relaunch = (
            statistics.mean(out_s),
            statistics.mean(waited or [0.0]),
            statistics.mean(relaunch_s),
        )
        print(
            f"drain run, per relaunched instance (mean): out of the client's rotation {m_out:.1f} s"
            f" = drain wait {m_wait:.1f} s + stop to proven health {m_relaunch:.1f} s"
            f" + the rest {m_out - m_wait - m_relaunch:.1f} s (the drain's round trip, the client's resume)"
        )
    print(
        f"completions: {len(ids)} distinct ids in the shards, {doubled} doubled, client's count {done} "
        f"(lost: {lost}); verify --in-progress rc={verify.returncode}: "
        + json.dumps({k: vr.get(k) for k in ("exact", "records", "missing_count", "doubled_count", "damaged")})
    )
    samples = {h: t / "samples.csv" for h, t in dirs.items()}
    sat_before = saturation(samples, t_before, drain["start"])
    sat_after = saturation(samples, drain["end"] + 5, stop["start"])
    for label, sat in (("before the retune", sat_before), ("after the drain run's capacity change", sat_after)):
        print(
            f"saturation {label}, by the advisor's rule (window_stats): at the effective max in {sat[0]:.3f}"
            f" of {sat[2]} samples ({sat[1]:.3f} of the {sat[2]} just below it, the queue refilling)"
        )
    timeline(out, records, drain, stop)
    print(f"\nwrote {out / 'timeline.csv'} and {out / 'timeline.png'}")
    return 1 if (doubled or lost or verify.returncode not in (0,)) else 0


def timeline(out: Path, records, drain, stop) -> None:
    span = int(max(drain["wall_s"], stop["wall_s"]) + 40)
    series = {}
    for run in (drain, stop):
        counts = collections.Counter(int(r["timings"]["finished"] - run["start"] + 20) for r in records)
        series[run["label"]] = [counts.get(i, 0) for i in range(span)]
    with (out / "timeline.csv").open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["t_s", "drain_completions_per_s", "stop_completions_per_s"])
        for i in range(span):
            w.writerow([i - 20, series["drain"][i], series["stop"][i]])
    matplotlib.use("Agg")
    fig, ax = plt.subplots(figsize=(10, 4.5))
    xs = [i - 20 for i in range(span)]
    ax.plot(xs, series["drain"], label=f"per-wave drain (retune {drain['wall_s']:.0f} s)")
    ax.plot(xs, series["stop"], label=f"client stopped (retune {stop['wall_s']:.0f} s)")
    ax.axvline(0, color="grey", linestyle=":")
    ax.set_xlabel("seconds from the start of the retune")
    ax.set_ylabel("completions per second (fleet)")
    ax.set_title("Generation through a retune: 2 hosts x 4 simulated B200s, waves of 1")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "timeline.png", dpi=110)


if __name__ == "__main__":
    shutil.which("podman") or sys.exit("podman not found: run make setup")
    sys.exit(main())
