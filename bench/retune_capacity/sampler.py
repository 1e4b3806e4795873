"""Runs on a benchmark host: samples each local server's running and queued requests (its /metrics
gauges) and its effective max running requests (/server_info), one CSV line per server per sample.

    python3 sampler.py OUT.csv INTERVAL PORT...
"""

import json
import sys
import time
import urllib.request


def get(url: str) -> bytes | None:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:  # noqa: S310 (http://127.0.0.1 only)
            return r.read()
    except Exception:
        return None


def gauge(text: str, name: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return None


def main() -> None:
    out, interval, ports = sys.argv[1], float(sys.argv[2]), [int(p) for p in sys.argv[3:]]
    capacity: dict[int, tuple[float, int | None]] = {}
    with open(out, "a", buffering=1) as f:
        while True:
            t0 = time.time()
            for port in ports:
                base = f"http://127.0.0.1:{port}"
                seen, cap = capacity.get(port, (0.0, None))
                if t0 - seen > 2.0:
                    body = get(base + "/server_info")
                    try:
                        cap = int(json.loads(body)["internal_states"][0]["effective_max_running_requests_per_dp"])
                    except Exception:
                        cap = None
                    capacity[port] = (t0, cap)
                body = get(base + "/metrics")
                text = body.decode() if body else ""
                running = gauge(text, "sglang:num_running_reqs")
                queued = gauge(text, "sglang:num_queue_reqs")
                row = [f"{t0:.3f}", port, running, queued, cap]
                f.write(",".join("" if v is None else str(v) for v in row) + "\n")
            time.sleep(max(0.0, interval - (time.time() - t0)))


if __name__ == "__main__":
    main()
