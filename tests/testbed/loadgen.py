#!/usr/bin/env python3
"""A steady load for one SGLang instance (test bed only; Python standard library).

``--concurrency`` threads each keep one ``POST /generate`` open at all times: when a request
ends, the thread sends the next one at once, so the server sees exactly that many requests,
running or queued. A failed request (the server restarting) is retried after ``--retry`` seconds.
Every prompt differs (a counter), so the simulator gives each its own completion length.
Runs until stopped; the Molecule scenario ``advisor`` starts it as a transient unit:

    systemd-run --unit=load-gpu0 --collect python3 loadgen.py --port 30000 --concurrency 40
"""

from __future__ import annotations

import argparse
import itertools
import json
import signal
import sys
import threading
import time
import urllib.error
import urllib.request


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--concurrency", type=int, required=True, help="requests kept open at all times")
    p.add_argument("--prompt-tokens", type=int, default=200, help="prompt length (the simulator: 4 bytes a token)")
    p.add_argument("--max-new-tokens", type=int, default=4096, help="completion length limit")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds one request may take")
    p.add_argument("--retry", type=float, default=0.5, help="seconds before a failed request is sent again")
    return p.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse(argv)
    url = f"http://{args.host}:{args.port}/generate"
    counter = itertools.count()
    lock = threading.Lock()
    stop = threading.Event()
    done = {"ok": 0, "failed": 0}

    def body() -> bytes:
        with lock:
            n = next(counter)
        head = f"Request {n}: write about the weather. "
        text = (head * (4 * args.prompt_tokens // len(head) + 1))[: 4 * args.prompt_tokens]
        return json.dumps({"text": text, "sampling_params": {"max_new_tokens": args.max_new_tokens}}).encode()

    def worker() -> None:
        while not stop.is_set():
            req = urllib.request.Request(url, data=body(), headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=args.timeout) as resp:  # noqa: S310 - http:// built here
                    resp.read()
                key = "ok"
            except (OSError, urllib.error.URLError):
                key = "failed"
                stop.wait(args.retry)
            with lock:
                done[key] += 1

    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    threads = [threading.Thread(target=worker, daemon=True) for _ in range(args.concurrency)]
    for t in threads:
        t.start()
    print(f"loadgen: {args.concurrency} requests kept open to {url}", flush=True)
    while not stop.wait(10.0):
        with lock:
            print(f"loadgen: {done['ok']} done, {done['failed']} failed", flush=True)
    time.sleep(0.1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
