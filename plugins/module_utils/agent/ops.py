# Copyright: sglang-fleet contributors
# Apache License 2.0 (see LICENSE)
"""The agent's entry points: ``run`` (one operation on this host, as the modules call it) and
``main`` (the request as JSON on stdin and the result on stdout, as in a container)."""

from __future__ import annotations

import json
import sys
from typing import Any, Callable

from .evidence import EvidenceError
from .host import Host
from .op_apply import op_apply
from .op_clients import op_client_start, op_client_stop, op_clients, op_drain, op_resume
from .op_inspect import op_inspect
from .op_observe import op_observe
from .op_start import op_record, op_start
from .op_stop import op_release, op_stop
from .request import RequestError

AGENT_VERSION = 1

OPS: dict[str, Callable[[dict[str, Any], Host], dict[str, Any]]] = {
    "apply": op_apply,
    "inspect": op_inspect,
    "stop": op_stop,
    "release": op_release,
    "start": op_start,
    "record": op_record,
    "observe": op_observe,
    # The generation clients of the host (on the host itself, never in a container).
    "clients": op_clients,
    "drain": op_drain,
    "resume": op_resume,
    "client_stop": op_client_stop,
    "client_start": op_client_start,
}


def run(req: dict[str, Any], host: Host | None = None) -> dict[str, Any]:
    """One operation; ``host`` replaces the real host (unit tests)."""
    op = req.get("op")
    if op not in OPS:
        return {"failed": True, "msg": f"unknown agent operation {op!r}"}
    try:
        result = OPS[op](req, host or Host(req))
    except EvidenceError as exc:
        return {"failed": True, "msg": exc.describe(), "evidence_error": exc.to_dict()}
    except RequestError as exc:
        return {"failed": True, "msg": str(exc)}
    result.setdefault("agent_version", AGENT_VERSION)
    return result


def main() -> None:
    request = json.loads(sys.stdin.read())
    json.dump(run(request), sys.stdout)
    sys.stdout.write("\n")
