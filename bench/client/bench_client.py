"""Benchmark of the generation client (prints figures; not a test).

1. Throughput and CPU cost against a zero-latency OpenAI-compatible endpoint on loopback:
   ``sglang-fleet generate`` with durability on (every record written before it counts, fsync every
   second; and once with fsync after every record), against two loops with no persistence at the
   same concurrency: a bare asyncio HTTP/1.1 loop (the floor) and a plain aiohttp loop (one
   ``ClientSession``, a ``TCPConnector`` limited to the concurrency, N workers POSTing the same body
   and reading the JSON; what a client written the usual way costs). Each runs as its own process;
   CPU is that process's user+system time from wait4(). Exits 1 if the client's requests/s are below
   ``MIN_RATIO_VS_AIOHTTP`` times the aiohttp loop's (a regression guard). aiohttp is a dependency of
   this benchmark only (requirements/dev.txt), never of the client.
2. Resume with 1,000,000 done ids: start-up time (until the done set is built) and peak RSS of a
   cold start (prompts file not yet scanned) and of a warm restart.

    python bench/client/bench_client.py [--requests 20000] [--concurrency 64] [--done 1000000]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CLIENT_SRC = ROOT / "client" / "src"
FAKE = ROOT / "client" / "tests" / "support" / "fake_openai.py"

# The client must stay at least this much faster than the plain aiohttp loop (steady phase).
MIN_RATIO_VS_AIOHTTP = 1.5

BODY = json.dumps({"model": "default", "messages": [{"role": "user", "content": "hello"}], "stream": False}).encode()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def spawn_wait4(argv: list[str], env: dict[str, str] | None = None) -> tuple[float, float, float, str]:
    """(wall s, CPU s, peak RSS MiB, combined output), CPU and RSS of that child alone."""
    with tempfile.TemporaryFile() as log:
        t0 = time.perf_counter()
        proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
        _, status, ru = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - t0
        proc.returncode = os.waitstatus_to_exitcode(status)
        log.seek(0)
        text = log.read().decode(errors="replace")
    if proc.returncode != 0:
        raise SystemExit(f"{argv[:4]} exited {proc.returncode}:\n{text[-2000:]}")
    return wall, ru.ru_utime + ru.ru_stime, ru.ru_maxrss / 1024, text


# ---------------------------------------------------------------------- the floor: bare asyncio loop
async def _floor(port: int, n: int, concurrency: int) -> None:
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(BODY)}\r\n\r\n"
    ).encode() + BODY
    left = n

    async def worker() -> None:
        nonlocal left
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        while left > 0:
            left -= 1
            writer.write(head)
            hdr = await reader.readuntil(b"\r\n\r\n")
            length = int(re.search(rb"(?i)content-length: *(\d+)", hdr).group(1))  # type: ignore[union-attr]
            await reader.readexactly(length)
        writer.close()

    await asyncio.gather(*(worker() for _ in range(concurrency)))


def floor_main(port: int, n: int, concurrency: int) -> None:
    t0 = time.perf_counter()
    asyncio.run(_floor(port, n, concurrency))
    print(f"floor-loop {time.perf_counter() - t0:.4f}")


# ---------------------------------------------------------------------- the usual way: plain aiohttp
async def _aiohttp_loop(port: int, n: int, concurrency: int) -> None:
    import aiohttp  # noqa: PLC0415  (a bench dependency, imported in this child process only)

    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    headers = {"Content-Type": "application/json"}
    left = n

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as session:

        async def worker() -> None:
            nonlocal left
            while left > 0:
                left -= 1
                async with session.post(url, data=BODY, headers=headers) as resp:
                    resp.raise_for_status()
                    await resp.json()

        await asyncio.gather(*(worker() for _ in range(concurrency)))


def aiohttp_main(port: int, n: int, concurrency: int) -> None:
    try:
        import aiohttp  # noqa: F401, PLC0415
    except ImportError:
        raise SystemExit("the aiohttp baseline needs aiohttp: pip install -r requirements/dev.txt") from None
    t0 = time.perf_counter()
    asyncio.run(_aiohttp_loop(port, n, concurrency))
    print(f"aiohttp-loop {time.perf_counter() - t0:.4f}")


# ---------------------------------------------------------------------- helpers
def env_for_client() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(CLIENT_SRC) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def write_prompts(path: Path, n: int) -> None:
    with open(path, "w") as f:
        for i in range(n):
            f.write(f'{{"id":"p{i:08d}","messages":[{{"role":"user","content":"hello {i}"}}]}}\n')


def loop_seconds(text: str) -> float:
    """The client's own measure of its generation phase (from first request to last record)."""
    m = re.search(r"this run: \d+ completed, \d+ failed in ([\d.]+)s", text)
    return float(m.group(1)) if m else float("nan")


def start_server(port: int) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(
        [sys.executable, str(FAKE), "--port", str(port), "--zero", "--capacity", "64"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return proc
        except OSError:
            time.sleep(0.05)
    raise SystemExit("zero-latency endpoint did not start")


def generate_argv(prompts: Path, out: Path, port: int, concurrency: int, fsync: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "sglang_fleet",
        "generate",
        "--prompts",
        str(prompts),
        "--output",
        str(out),
        "--endpoint",
        f"http://127.0.0.1:{port}",
        "--concurrency",
        str(concurrency),
        "--fsync",
        fsync,
        "--progress",
        "off",
        "--shard-records",
        "10000",
    ]


# ---------------------------------------------------------------------- part 1
def bench_throughput(work: Path, n: int, concurrency: int, repeat: int) -> float:
    """Prints the table; returns the client's requests/s over the aiohttp loop's (steady phase)."""
    port = free_port()
    server = start_server(port)
    try:
        prompts = work / "prompts.jsonl"
        write_prompts(prompts, n)
        small = max(1000, n // 10)
        prompts_small = work / f"prompts-{small}.jsonl"
        write_prompts(prompts_small, small)
        kinds = [
            ("bare asyncio loop, no persistence (floor)", n, "floor"),
            ("plain aiohttp loop, no persistence", n, "aiohttp"),
            ("sglang-fleet generate, fsync=interval", n, "interval"),
            ("sglang-fleet generate, fsync=always", small, "always"),
        ]
        samples: dict[str, list[tuple[float, float, float, float]]] = {k[0]: [] for k in kinds}
        # Interleaved repeats, median reported: the machine's other load moves single runs around.
        for r in range(repeat):
            for name, count, fsync in kinds:
                if fsync in ("floor", "aiohttp"):
                    wall, cpu, rss, text = spawn_wait4(
                        [sys.executable, __file__, f"--{fsync}", str(port), str(count), str(concurrency)]
                    )
                    loop_s = float(text.split(f"{fsync}-loop")[1].split()[0])
                else:
                    out = work / f"out-{fsync}-{r}"
                    p = prompts if count == n else prompts_small
                    wall, cpu, rss, text = spawn_wait4(
                        generate_argv(p, out, port, concurrency, fsync), env_for_client()
                    )
                    loop_s = loop_seconds(text)
                    check = subprocess.run(
                        [sys.executable, "-m", "sglang_fleet", "verify", "--prompts", str(p), "--output", str(out)],
                        env=env_for_client(),
                        capture_output=True,
                        text=True,
                        check=False,
                    )
                    assert check.returncode == 0, check.stdout
                samples[name].append((loop_s, wall, cpu, rss))
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(10)

    def med(name: str, i: int) -> float:
        return float(statistics.median(s[i] for s in samples[name]))

    print(
        f"\n## Throughput against a zero-latency endpoint on loopback (concurrency {concurrency}, "
        f"{os.cpu_count()} CPUs, median of {repeat}; the endpoint is one Python process)\n"
    )
    print(f"{'':48s} {'requests':>9s} {'req/s':>9s} {'req/s e2e':>10s} {'CPU s/1k':>9s} {'peak RSS':>9s}")
    for name, count, _ in kinds:
        print(
            f"{name:48s} {count:9d} {count / med(name, 0):9.0f} {count / med(name, 1):10.0f} "
            f"{1000 * med(name, 2) / count:9.3f} {med(name, 3):8.0f}M"
        )
    floor, plain, client = kinds[0][0], kinds[1][0], kinds[2][0]
    vs_aiohttp = med(plain, 0) / med(client, 0)
    print(f"\nratio client/floor, requests/s (steady phase):   {med(floor, 0) / med(client, 0):.2f}")
    print(f"ratio client/floor, CPU per request:            {med(client, 2) / med(floor, 2):.2f}")
    print(f"ratio client/aiohttp, requests/s (steady phase): {vs_aiohttp:.2f}")
    print(f"ratio client/aiohttp, CPU per request:          {med(client, 2) / med(plain, 2):.2f}")
    print(
        "req/s = the steady generation phase (client: from its own log; loops: the loop alone); "
        "req/s e2e = whole process, start-up included; CPU = user+system of that process alone."
    )
    return vs_aiohttp


# ---------------------------------------------------------------------- part 2
def build_done_dir(out: Path, prompts: Path, done: int, extra: int) -> None:
    sys.path.insert(0, str(CLIENT_SRC))
    from sglang_fleet.ids import ShardSpec  # noqa: PLC0415  (after the path insert)
    from sglang_fleet.store import OutputStore  # noqa: PLC0415

    write_prompts(prompts, done + extra)
    store = OutputStore(out, ShardSpec(0, 1), shard_records=10_000, fsync="never")
    store.open(prompts=prompts)
    for i in range(done):
        pid = f"p{i:08d}"
        store.append_record(pid, f'{{"id":"{pid}","output":"x","finish_reason":"stop"}}\n'.encode())
        if store.rotation_due():
            shard = store.detach_open_shard()
            assert shard is not None
            store.finalize(shard)
    store.close()


def bench_resume(work: Path, done: int) -> None:
    extra = 1000
    out = work / "resume-out"
    prompts = work / "resume-prompts.jsonl"
    t0 = time.perf_counter()
    build_done_dir(out, prompts, done, extra)
    print(
        f"\n## Resume with {done:,} done ids ({done // 10_000} closed shards; prompts file of {done + extra:,} "
        f"lines; built in {time.perf_counter() - t0:.0f}s)\n"
    )
    port = free_port()
    server = start_server(port)
    try:
        rows = []
        for label in ("cold start (prompts file scanned)", "warm restart (scan cached), nothing left to do"):
            wall, cpu, rss, text = spawn_wait4(generate_argv(prompts, out, port, 64, "interval"), env_for_client())
            m = re.search(r"done set built in ([\d.]+)s", text)
            stamps = re.findall(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)", text, re.M)
            rows.append((label, float(m.group(1)) if m else float("nan"), wall, cpu, rss, len(stamps)))
            assert (
                f"{done} of {done + extra} prompts already done" in text
                or f"{done + extra} of {done + extra} prompts already done" in text
            ), text[-1500:]
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(10)
    print(f"{'':48s} {'done set':>9s} {'process':>9s} {'CPU':>8s} {'peak RSS':>9s}")
    for label, ds, wall, cpu, rss, _ in rows:
        print(f"{label:48s} {ds:8.2f}s {wall:8.2f}s {cpu:7.2f}s {rss:8.0f}M")
    print(
        "done set = building the set of done ids from the shard indexes; process = the whole run (scan, "
        "done set, streaming the prompts file past the done ids, the remaining requests, exit)."
    )


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] in ("--floor", "--aiohttp"):
        child = floor_main if sys.argv[1] == "--floor" else aiohttp_main
        child(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=20_000)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--done", type=int, default=1_000_000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--skip-resume", action="store_true")
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="sgf-bench-"))
    try:
        vs_aiohttp = bench_throughput(work, a.requests, a.concurrency, a.repeat)
        if not a.skip_resume:
            bench_resume(work, a.done)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if vs_aiohttp < MIN_RATIO_VS_AIOHTTP:
        raise SystemExit(
            f"REGRESSION: the client made {vs_aiohttp:.2f}x the requests/s of the plain aiohttp loop; "
            f"it must make at least {MIN_RATIO_VS_AIOHTTP}x"
        )
    print(f"\nOK: the client makes {vs_aiohttp:.2f}x the requests/s of the aiohttp loop (>= {MIN_RATIO_VS_AIOHTTP}x)")


if __name__ == "__main__":
    main()
