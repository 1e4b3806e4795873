#!/usr/bin/env python3
"""A stand-in for a code platform's API (test bed only; Python standard library).

It answers ``POST`` requests as GitHub answers ``POST /repos/{owner}/{repo}/pulls`` (201 with an
``html_url``) and GitLab ``POST /projects/{id}/merge_requests`` (201 with a ``web_url``), and
records each request as one JSON line in ``--record``: its path, its JSON body and, for the
headers that carry a token (Authorization, PRIVATE-TOKEN), the SHA-256 of their value only, so
that the record itself never holds a token. The line is written before the answer is sent: when
the client has its answer, the record holds its request.

It listens on 127.0.0.1, on a free port it writes to ``--port-file`` once it listens (the caller
waits for that file), and exits after ``--requests`` POSTs or at ``--deadline`` seconds, so that
nothing is left running. The Molecule scenario ``advisor`` starts it as an async task for
``sglang-fleet-ops propose``:

    platform_standin.py --record posts.jsonl --port-file port --requests 1 --deadline 120
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

TOKEN_HEADERS = ("authorization", "private-token")


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--record", type=Path, required=True, help="where each request is appended (JSON lines)")
    p.add_argument("--port-file", type=Path, required=True, help="written with the port once listening")
    p.add_argument("--requests", type=int, default=1, help="exit after this many POSTs")
    p.add_argument("--deadline", type=float, default=120.0, help="exit after this many seconds in any case")
    return p.parse_args(argv)


def recorded(path: str, headers: dict[str, str], raw: bytes) -> dict[str, Any]:
    """One request as recorded: token-carrying headers as the SHA-256 of their value."""
    try:
        body: Any = json.loads(raw or b"null")
    except ValueError:
        body = {"not_json": raw.decode(errors="replace")}
    lowered = {k.lower(): v for k, v in headers.items()}
    return {
        "path": path,
        "json": body,
        "token_sha256": {h: hashlib.sha256(lowered[h].encode()).hexdigest() for h in TOKEN_HEADERS if h in lowered},
        "content_type": lowered.get("content-type"),
    }


def main(argv: list[str]) -> int:
    args = parse(argv)
    done = threading.Event()
    count = {"posts": 0}

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            entry = recorded(self.path, dict(self.headers), self.rfile.read(length))
            with args.record.open("a", encoding="utf-8") as out:
                out.write(json.dumps(entry) + "\n")
            number = count["posts"] = count["posts"] + 1
            url = f"http://127.0.0.1:{self.server.server_address[1]}{self.path.rstrip('/')}/{number}"
            data = json.dumps({"number": number, "html_url": url, "web_url": url}).encode()
            self.send_response(201)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
            self.wfile.flush()
            if number >= args.requests:
                done.set()

        def log_message(self, *_args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    tmp = args.port_file.with_name(args.port_file.name + ".tmp")
    tmp.write_text(f"{server.server_address[1]}\n", encoding="utf-8")
    tmp.replace(args.port_file)
    finished = done.wait(args.deadline)
    server.shutdown()
    server.server_close()
    if not finished:
        said = f"platform stand-in: {count['posts']} of {args.requests} POSTs within {args.deadline:g}s"
        print(said, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
