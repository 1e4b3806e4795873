"""The control socket: a local Unix socket through which a retune (root, on the same host) drains the
endpoints of the servers it is about to relaunch and resumes them afterwards, while the client goes
on sending to every other endpoint.

Protocol version 1: one request per connection, one JSON object on one line each way, then the
client closes. Every request carries ``"v": 1``; anything else is answered ``{"ok": false, "error"}``.

- ``{"v":1,"op":"hello"}``: the pid, the systemd unit (from ``/proc/self/cgroup``, else null), the
  host shard, the run state and each endpoint (url, state, in_flight, capacity, server_capacity,
  drained, and whether its concurrency follows the server's capacity - ``follows_server``, auto
  concurrency - with the ``factor`` it is multiplied by; the tuning advisor predicts from them what
  the client sends after a relaunch).
- ``{"v":1,"op":"drain","endpoints":[url...],"timeout":s,"lease":s,"by":who}``: nothing new is sent
  to those endpoints from now on; the answer comes once none of their requests is in flight, or at
  ``timeout``, when the requests still open are abandoned (cancelled, their prompts requeued for the
  other endpoints). The drain lapses by itself ``lease`` seconds after the request unless a resume
  or another drain of the endpoint comes first.
- ``{"v":1,"op":"resume","endpoints":[url...],"api_key":key,"confirm":s}``: lifts the drain; each
  endpoint's ``/health`` and ``/server_info`` are read again (for at most ``RESUME_TIMEOUT_S``; an
  endpoint that does not answer goes down and is probed as usual; one whose server refuses the API
  key is taken out of service) before the answer, which gives the concurrency limit in force
  (``capacity``) and, per endpoint, whether it is back in service (``service``). ``api_key``
  (optional; "" for none) is the key to send to those endpoints from now on: a retune that relaunched
  their servers with another key hands it over here (it is never logged nor answered back).
  ``confirm`` (optional, seconds, default 0) waits up to that long for each endpoint to complete a
  request again: ``service[url]`` says ``in_service`` true once one completed, or at the bound when it
  is usable and none of its requests failed since (slow generations, or nothing left to send), and
  false with the client's own reason (``why``) when it was taken out of service, is down or stalled,
  or only failed since the resume.

The socket is made with mode 0600 (in a directory made 0750 if missing) and removed at exit. A socket
file nobody listens on (a killed client's) is replaced; one another process listens on is an error.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import socket
import stat
import time
from pathlib import Path
from typing import Any

from sglang_fleet.config import ConfigError, GenerateConfig, normalise_endpoint
from sglang_fleet.control import RunControl
from sglang_fleet.dispatch import Dispatcher
from sglang_fleet.endpoints import RESUME_TIMEOUT_S, Endpoint

log = logging.getLogger(__name__)

PROTOCOL_VERSION = 1
_MAX_REQUEST_BYTES = 1 << 16
_READ_TIMEOUT_S = 10.0
_CONFIRM_POLL_S = 0.1
# How long a closing socket lets the requests being answered finish (a resume's word: a few polls).
_CLOSE_GRACE_S = 1.0
# Run states in which the client sends nothing more (RunControl.state).
_ENDING = ("finishing", "draining", "stopped", "done")
_SUN_PATH_MAX = 107  # sockaddr_un.sun_path less its terminating NUL (Linux)


def service_verdict(
    ep: Endpoint, completed: int, failed: int, control: RunControl, at_bound: bool
) -> dict[str, Any] | None:
    """Is ``ep`` back in service since its resume (when it had ``completed`` completions and
    ``failed`` failed attempts)? None: not decided yet (before the bound)."""
    done = ep.completed - completed
    errors = sum(ep.errors.values()) - failed
    word = {"state": ep.state, "completed": done, "failed": errors, "in_flight": ep.in_flight}
    if ep.state == "disabled":
        return {**word, "in_service": False, "why": f"taken out of service: {ep.disabled_reason}"}
    if control.fatal is not None:
        # The run ends on an error (every prompt failing in a row, no endpoint left): whatever this
        # endpoint did, the client does not go on.
        return {**word, "in_service": False, "why": f"the client stops: {control.fatal}"}
    if done > 0 and ep.usable:
        return {**word, "in_service": True, "why": f"completed {done} request(s) again"}
    if control.state in _ENDING or control.stop.is_set():
        # It sends nothing more anywhere (finished, or asked to stop): only a failure here counts.
        if errors and not done:
            return {
                **word,
                "in_service": False,
                "why": f"{errors} request(s) failed since, none completed: {ep.last_error}",
            }
        return {**word, "in_service": ep.usable or ep.drained, "why": f"the client is stopping ({control.state})"}
    if not at_bound:
        return None
    if not ep.usable:
        return {**word, "in_service": False, "why": f"{ep.state}: {ep.state_reason or 'no reason given'}"}
    if errors:
        return {
            **word,
            "in_service": False,
            "why": f"{errors} request(s) failed since, none completed: {ep.last_error}",
        }
    return {**word, "in_service": True, "why": f"up, {ep.in_flight} request(s) in flight, none failed"}


class ControlSocketError(Exception):
    """The socket cannot be made: its path is in use by another process, or is not a socket."""


class _BadRequest(Exception):
    pass


def unit_name(cgroup_file: str = "/proc/self/cgroup") -> str | None:
    """The systemd service this process runs in: the last element of its cgroup path that ends in
    ``.service`` (cgroup v2's ``0::`` line first), or None outside a service."""
    try:
        lines = Path(cgroup_file).read_text().splitlines()
    except OSError:
        return None
    lines.sort(key=lambda line: not line.startswith("0::"))
    for line in lines:
        for part in reversed(line.split(":", 2)[-1].split("/")):
            if part.endswith(".service"):
                return part
    return None


def _check_free(path: Path) -> None:
    """Return if ``path`` is absent or a socket nobody listens on (a stale one, replaced later)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise ControlSocketError(f"control socket {path}: something else is there (not a socket); not replacing it")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(2.0)
    try:
        probe.connect(str(path))
    except (ConnectionRefusedError, FileNotFoundError):
        return  # stale: left by a client that was killed
    except OSError as e:
        raise ControlSocketError(f"control socket {path}: cannot tell whether it is in use ({e})") from None
    finally:
        probe.close()
    raise ControlSocketError(
        f"control socket {path}: another process is listening on it (another client configured with the "
        "same control_socket?); give each client its own"
    )


def bind_socket(path: Path) -> socket.socket:
    """A listening-ready Unix socket at ``path``, mode 0600. It is bound under a temporary name,
    chmodded, then renamed over ``path``, so it is never reachable with looser permissions and a
    stale socket is replaced in one step."""
    parent = path.parent
    if not parent.is_dir():
        parent.mkdir(mode=0o750, parents=True, exist_ok=True)
        os.chmod(parent, 0o750)  # noqa: S103  (owner and group only; mkdir's mode is masked by the umask)
    _check_free(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        tmp = parent / f".sgf-{os.getpid()}.sock"
        if len(os.fsencode(tmp)) <= _SUN_PATH_MAX:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)  # a temporary name a killed process with our pid left
            sock.bind(str(tmp))
            try:
                os.chmod(tmp, 0o600)
                os.rename(tmp, path)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
        else:  # no room for a temporary name: bind in place under a tight umask
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            old = os.umask(0o177)
            try:
                sock.bind(str(path))
            finally:
                os.umask(old)
    except OSError as e:
        sock.close()
        raise ControlSocketError(f"control socket {path}: {e.strerror or e}") from None
    except BaseException:
        sock.close()
        raise
    return sock


def _error(message: str) -> dict[str, Any]:
    return {"ok": False, "error": message}


def _number(req: dict[str, Any], key: str, *, positive: bool) -> float:
    v = req.get(key)
    if not isinstance(v, int | float) or isinstance(v, bool) or not math.isfinite(v) or v < 0 or (positive and v == 0):
        raise _BadRequest(f"{key} must be a {'positive' if positive else 'non-negative'} number of seconds, got {v!r}")
    return float(v)


def _urls(req: dict[str, Any]) -> list[str]:
    urls = req.get("endpoints")
    if not isinstance(urls, list) or not all(isinstance(u, str) for u in urls):
        raise _BadRequest("endpoints must be a list of URLs")
    return urls


def _api_key(req: dict[str, Any]) -> str | None:
    key = req.get("api_key")
    if key is not None and (not isinstance(key, str) or any(c in key for c in "\r\n")):
        raise _BadRequest("api_key must be a string of one line")
    return key


def _by(req: dict[str, Any]) -> str:
    by = req.get("by", "")
    if not isinstance(by, str):
        raise _BadRequest("by must be a string")
    return by or "an unnamed peer"


class ControlServer:
    def __init__(
        self,
        path: Path,
        *,
        cfg: GenerateConfig,
        endpoints: list[Endpoint],
        dispatcher: Dispatcher,
        control: RunControl,
        resume_timeout: float = RESUME_TIMEOUT_S,
    ) -> None:
        self.path = path
        self.cfg = cfg
        self.endpoints = endpoints
        self.dispatcher = dispatcher
        self.control = control
        self.resume_timeout = resume_timeout
        self.unit = unit_name()
        self._server: asyncio.AbstractServer | None = None
        self._ident: tuple[int, int] | None = None
        self._handlers: set[asyncio.Task[Any]] = set()

    async def start(self) -> None:
        sock = bind_socket(self.path)
        st = os.stat(self.path)
        self._ident = (st.st_dev, st.st_ino)
        self._server = await asyncio.start_unix_server(self._handle, sock=sock, limit=_MAX_REQUEST_BYTES)
        log.info("control socket %s (protocol v%d)", self.path, PROTOCOL_VERSION)

    async def close(self) -> None:
        """Stop answering, end the requests being answered, and remove the socket (if still ours).
        A request being answered is given a moment first: a resume's word on its endpoints sees the
        run end and answers why, rather than leaving its asker with no answer."""
        if self._server is None:
            return
        self._server.close()
        if self._handlers:
            await asyncio.wait(list(self._handlers), timeout=_CLOSE_GRACE_S)
        for t in list(self._handlers):
            t.cancel()
        await asyncio.gather(*self._handlers, return_exceptions=True)
        self._server = None
        with contextlib.suppress(OSError):
            st = os.stat(self.path)
            if (st.st_dev, st.st_ino) == self._ident:
                os.unlink(self.path)

    # ------------------------------------------------------------------ one connection
    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._handlers.add(task)
        try:
            try:
                async with asyncio.timeout(_READ_TIMEOUT_S):
                    line = await reader.readline()
            except TimeoutError:
                reply = _error(f"no request line within {_READ_TIMEOUT_S:g}s")
            except ValueError:
                reply = _error(f"request longer than {_MAX_REQUEST_BYTES} bytes")
            else:
                if not line.strip():
                    return  # connected and said nothing (another client checking whether this one lives)
                reply = await self.answer(line)
            writer.write(json.dumps(reply, separators=(",", ":")).encode() + b"\n")
            await writer.drain()
        except (ConnectionError, OSError):
            pass  # the peer went away; a drain it asked for stands (its lease bounds it)
        finally:
            writer.close()
            if task is not None:
                self._handlers.discard(task)

    async def answer(self, line: bytes) -> dict[str, Any]:
        try:
            req = json.loads(line)
        except ValueError:
            return _error("not valid JSON")
        if not isinstance(req, dict):
            return _error("a request is one JSON object")
        v = req.get("v")
        if not isinstance(v, int) or isinstance(v, bool) or v != PROTOCOL_VERSION:
            return _error(f"unsupported protocol version {v!r}: this client speaks v {PROTOCOL_VERSION}")
        op = req.get("op")
        ops = {"hello": self._hello, "drain": self._drain, "resume": self._resume}
        handler = ops.get(op) if isinstance(op, str) else None
        if handler is None:
            return _error(f"unknown op {op!r}: one of {', '.join(ops)}")
        try:
            return await handler(req)
        except _BadRequest as e:
            return _error(str(e))

    # ------------------------------------------------------------------ the operations
    def _resolve(self, urls: list[str]) -> tuple[list[Endpoint], list[str]]:
        by_url = {ep.url: ep for ep in self.endpoints}
        found: list[Endpoint] = []
        unknown: list[str] = []
        for u in urls:
            try:
                ep = by_url.get(normalise_endpoint(u))
            except ConfigError:
                ep = None
            if ep is None:
                unknown.append(u)
            elif ep not in found:
                found.append(ep)
        return found, unknown

    async def _hello(self, req: dict[str, Any]) -> dict[str, Any]:
        return {
            "ok": True,
            "v": PROTOCOL_VERSION,
            "pid": os.getpid(),
            "unit": self.unit,
            "shard": str(self.cfg.shard),
            "state": self.control.state,
            "endpoints": [
                {
                    "url": ep.url,
                    "state": ep.state,
                    "in_flight": ep.in_flight,
                    "capacity": ep.limiter.limit,
                    "server_capacity": ep.server_capacity,
                    "drained": ep.drained,
                    "follows_server": ep.follows_server,
                    "factor": ep.factor,
                }
                for ep in self.endpoints
            ],
        }

    async def _drain(self, req: dict[str, Any]) -> dict[str, Any]:
        urls = _urls(req)
        timeout = _number(req, "timeout", positive=False)
        lease = _number(req, "lease", positive=True)
        if lease <= timeout:
            raise _BadRequest(f"lease ({lease:g}s) must be longer than timeout ({timeout:g}s)")
        by = _by(req)
        eps, unknown = self._resolve(urls)
        t0 = time.monotonic()
        for ep in eps:
            ep.drain(lease, by)
        names = " ".join(ep.url for ep in eps) or "no endpoint"
        in_flight = sum(ep.in_flight for ep in eps)
        log.info(
            "drain of %s asked by %s: waiting up to %gs for %d request(s) in flight; lease %gs",
            names,
            by,
            timeout,
            in_flight,
            lease,
        )
        if unknown:
            log.warning("drain asked by %s names endpoints this client does not have: %s", by, " ".join(unknown))
        abandoned = await self.dispatcher.wait_drained(eps, timeout)
        waited = time.monotonic() - t0
        log.info(
            "drained %s for %s in %.1fs%s",
            names,
            by,
            waited,
            f"; {abandoned} request(s) abandoned and requeued for the other endpoints" if abandoned else "",
        )
        return {
            "ok": True,
            "drained": [ep.url for ep in eps],
            "abandoned": abandoned,
            "waited_s": round(waited, 3),
            "unknown": unknown,
        }

    async def _resume(self, req: dict[str, Any]) -> dict[str, Any]:
        urls = _urls(req)
        by = _by(req)
        api_key = _api_key(req)
        confirm = _number(req, "confirm", positive=False) if "confirm" in req else 0.0
        eps, unknown = self._resolve(urls)
        names = " ".join(ep.url for ep in eps) or "no endpoint"
        log.info(
            "resume of %s asked by %s: reading their /server_info%s",
            names,
            by,
            "" if api_key is None else " with the API key handed over",
        )
        if unknown:
            log.warning("resume asked by %s names endpoints this client does not have: %s", by, " ".join(unknown))
        since = {ep: (ep.completed, sum(ep.errors.values())) for ep in eps}
        t0 = time.monotonic()
        limits = await asyncio.gather(*(ep.resume(self.resume_timeout, api_key) for ep in eps))
        capacity = {ep.url: limit for ep, limit in zip(eps, limits, strict=True)}
        log.info(
            "resumed %s for %s: %s",
            names,
            by,
            ", ".join(f"{u} {'concurrency ' + str(c) if c is not None else 'not ready'}" for u, c in capacity.items())
            or "nothing",
        )
        service = await self._confirm(since, t0, confirm)
        lost = [f"{url} ({v['why']})" for url, v in service.items() if not v["in_service"]]
        if lost:
            log.warning("after the resume asked by %s, NOT back in service: %s", by, "; ".join(lost))
        return {
            "ok": True,
            "resumed": [ep.url for ep in eps],
            "capacity": capacity,
            "service": service,
            "unknown": unknown,
        }

    async def _confirm(
        self, since: dict[Endpoint, tuple[int, int]], t0: float, confirm: float
    ) -> dict[str, dict[str, Any]]:
        """Each resumed endpoint's word, waiting up to ``confirm`` seconds for it (see the module's
        docstring): it completed a request again, or, at the bound, it is usable and nothing it was
        sent since failed; else why not."""
        deadline = time.monotonic() + confirm
        verdicts: dict[Endpoint, dict[str, Any]] = {}
        while True:
            at_bound = time.monotonic() >= deadline
            for ep, (completed, failed) in since.items():
                if ep not in verdicts:
                    verdict = service_verdict(ep, completed, failed, self.control, at_bound)
                    if verdict is not None:
                        verdicts[ep] = {**verdict, "waited_s": round(time.monotonic() - t0, 3)}
            if len(verdicts) == len(since):
                return {ep.url: verdicts[ep] for ep in since}
            await asyncio.sleep(min(_CONFIRM_POLL_S, max(0.0, deadline - time.monotonic())))
