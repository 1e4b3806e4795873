"""The generation client operations of the agent against a real AF_UNIX control socket (a fake
client serving the protocol in a thread) and a fake host for systemd; and the module's proof of
the host lock lease before any of them acts."""

from __future__ import annotations

import functools
import json
import shutil
import socket
import stat
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from agent_requests import REQUEST, run_op
from ansible.module_utils.testing import patch_module_args

from ansible_collections.sglang_ops.fleet.plugins.module_utils import _host_lock
from ansible_collections.sglang_ops.fleet.plugins.module_utils.agent import client_keys, clients, op_clients
from ansible_collections.sglang_ops.fleet.plugins.module_utils.agent.clients import ClientError
from ansible_collections.sglang_ops.fleet.plugins.module_utils.agent.host import Host
from ansible_collections.sglang_ops.fleet.plugins.modules import retune_phase

GEN = "sglang-fleet-generate.service"
OTHER = "other-client.service"
URL0 = "http://127.0.0.1:30000"
URL1 = "http://localhost:30001"

Handler = Callable[[dict[str, Any]], Any]


class FakeClient:
    """A generation client's control socket: one JSON line in, one JSON line out per connection,
    answered by ``handler`` (its return value; ``HANG`` to never answer, bytes to send as they are)."""

    HANG = object()

    def __init__(self, path: str, handler: Handler):
        self.path = path
        self.handler = handler
        self.requests: list[dict[str, Any]] = []
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        self.server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.server.bind(path)
        self.server.listen(8)
        self.closing = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.closing.is_set():
            try:
                conn, _unused = self.server.accept()
            except OSError:
                return
            threading.Thread(target=self._one, args=(conn,), daemon=True).start()

    def _one(self, conn: socket.socket) -> None:
        with conn:
            data = b""
            while b"\n" not in data:
                chunk = conn.recv(4096)
                if not chunk:
                    return
                data += chunk
            request = json.loads(data.split(b"\n", 1)[0])
            self.requests.append(request)
            answer = self.handler(request)
            if answer is FakeClient.HANG:
                self.closing.wait(30)
                return
            conn.sendall(answer if isinstance(answer, bytes) else json.dumps(answer).encode() + b"\n")

    def close(self) -> None:
        self.closing.set()
        self.server.close()


def hello(endpoints: list[str]) -> Handler:
    def handler(request: dict[str, Any]) -> Any:
        if request["op"] == "hello":
            return {
                "ok": True,
                "v": 1,
                "pid": 4242,
                "unit": GEN,
                "shard": "0/1",
                "state": "running",
                "endpoints": [
                    {"url": u, "state": "up", "in_flight": 3, "capacity": 16, "server_capacity": 16, "drained": False}
                    for u in endpoints
                ],
            }
        if request["op"] == "drain":
            return {"ok": True, "drained": request["endpoints"], "abandoned": 1, "waited_s": 0.25, "unknown": []}
        if request["op"] == "resume":
            return {"ok": True, "resumed": request["endpoints"], "capacity": dict.fromkeys(request["endpoints"], 40)}
        return {"ok": False, "error": f"unknown op {request['op']}"}

    return handler


@pytest.fixture
def sockdir() -> Iterator[str]:
    # AF_UNIX paths are limited to 108 bytes: pytest's tmp_path is too long for them.
    path = tempfile.mkdtemp(prefix="sf-", dir="/tmp")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def serve(sockdir: str) -> Iterator[Callable[[str, Handler], FakeClient]]:
    started: list[FakeClient] = []

    def start(unit: str, handler: Handler) -> FakeClient:
        client = FakeClient(clients.socket_path(unit, sockdir), handler)
        started.append(client)
        return client

    yield start
    for client in started:
        client.close()


class FakeHost(Host):
    """systemd answers from data; the control sockets are real (in ``sockdir``)."""

    def __init__(self, tmp_path: Path, sockdir: str, **request: Any):
        super().__init__(
            {
                **REQUEST,
                "secrets_file": str(tmp_path / "secrets.env"),
                "client_socket_dir": sockdir,
                "poll_interval": 0.01,
                **request,
            }
        )
        self.unit_state: dict[str, dict[str, str]] = {}
        self.systemctl_calls: list[list[str]] = []
        self.on_systemctl: dict[str, Callable[[list[str]], None]] = {}
        self.env_files: dict[str, list[str]] = {}

    def client_env_files(self, unit: str) -> list[str]:
        return list(self.env_files.get(unit, []))

    def units(self, names: list[str]) -> dict[str, dict[str, str]]:
        return {
            n: dict(self.unit_state.get(n, {"LoadState": "loaded", "ActiveState": "inactive", "SubState": "dead"}))
            for n in names
        }

    def systemctl(self, args: list[str], timeout: float = 60.0) -> dict[str, Any]:
        self.systemctl_calls.append(args)
        if args[0] in self.on_systemctl:
            self.on_systemctl[args[0]](args)
        return {"cmd": "systemctl " + " ".join(args), "rc": 0, "stdout": "", "stderr": ""}

    def active(self, *units: str, sub: str = "running") -> None:
        for unit in units:
            self.unit_state[unit] = {"LoadState": "loaded", "ActiveState": "active", "SubState": sub, "MainPID": "77"}


def inst(name: str, port: int) -> dict[str, Any]:
    return {"name": name, "unit": f"sglang-{name}.service", "port": port, "gpus": [port - 30000]}


INSTANCES = [inst("gpu0", 30000), inst("gpu1", 30001), inst("gpu2", 30002)]


# -- the socket talk ------------------------------------------------------------------------


def test_one_request_one_answer_carrying_the_protocol_version(sockdir: str, serve: Any) -> None:
    client = serve(GEN, hello([URL0]))
    answer = clients.call(clients.socket_path(GEN, sockdir), {"op": "hello"}, 5)
    assert answer["ok"] is True and answer["endpoints"][0]["url"] == URL0
    assert client.requests == [{"v": 1, "op": "hello"}]


def test_no_socket_and_a_dead_socket_are_errors(sockdir: str) -> None:
    with pytest.raises(ClientError, match=r"^no such socket$"):
        clients.call(clients.socket_path(GEN, sockdir), {"op": "hello"}, 5)
    # A socket file nobody listens on (the client died without removing it).
    path = clients.socket_path(OTHER, sockdir)
    Path(path).parent.mkdir(parents=True)
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(path)
    dead.close()
    with pytest.raises(ClientError, match=r"^connection refused$"):
        clients.call(path, {"op": "hello"}, 5)


def test_a_client_that_never_answers_is_a_timeout_not_a_hang(sockdir: str, serve: Any) -> None:
    serve(GEN, lambda _r: FakeClient.HANG)
    t0 = time.monotonic()
    with pytest.raises(ClientError, match=r"^no answer within 0.3s$"):
        clients.call(clients.socket_path(GEN, sockdir), {"op": "hello"}, 0.3)
    assert time.monotonic() - t0 < 3


@pytest.mark.parametrize(
    ("answer", "why"),
    [
        ({"ok": False, "error": "unknown endpoint"}, "refused: unknown endpoint"),
        (b"<html>\n", "answered something that is not JSON: b'<html>'"),
        (b"[1]\n", "answered something that is not a JSON object: b'[1]'"),
        (b"", "closed the connection without an answer"),
    ],
)
def test_refusals_and_nonsense_are_errors_quoting_what_came_back(
    sockdir: str, serve: Any, answer: Any, why: str
) -> None:
    serve(GEN, lambda _r: answer)
    with pytest.raises(ClientError) as err:
        clients.call(clients.socket_path(GEN, sockdir), {"op": "hello"}, 5)
    assert str(err.value) == why


# -- which endpoints are this host's --------------------------------------------------------


@pytest.mark.parametrize(
    ("host", "local"),
    [
        ("localhost", True),
        ("LOCALHOST", True),
        ("127.0.0.1", True),
        ("127.0.0.2", True),
        ("::1", True),
        ("[::1]", True),
        ("0.0.0.0", True),
        ("node7", True),  # this host's name
        ("node7.example.org", True),
        ("192.0.2.10", False),  # TEST-NET-1: no interface of this machine has it
        ("node8", False),
        ("example.invalid", False),
        ("", False),
    ],
)
def test_local_hosts(host: str, local: bool) -> None:
    assert clients.is_local_host(host, hostname="node7.example.org") is local


def test_an_address_of_this_machine_is_local_because_it_can_be_bound() -> None:
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect(("192.0.2.1", 9))  # no packet is sent: only picks the outgoing address
        address = probe.getsockname()[0]
    except OSError:
        pytest.skip("no IPv4 route on this machine")
    finally:
        probe.close()
    assert clients.bindable(address)
    assert clients.is_local_host(address, hostname="elsewhere")


def test_an_endpoint_matches_an_instance_by_port_on_a_local_host() -> None:
    endpoints = [
        {"url": URL0},
        {"url": URL1},
        {"url": "http://192.0.2.10:30002"},  # another machine's server on gpu2's port
        {"url": "http://127.0.0.1:31000"},  # a port no instance of the host has
        {"url": "not a url"},
    ]
    assert clients.sends_to(endpoints, INSTANCES, lambda h: clients.is_local_host(h, "node7")) == {
        "gpu0": [URL0],
        "gpu1": [URL1],
    }


# -- the operations -------------------------------------------------------------------------


def test_discovery_reports_state_socket_hello_and_the_instances_each_client_sends_to(
    tmp_path: Path, sockdir: str, serve: Any
) -> None:
    host = FakeHost(tmp_path, sockdir)
    host.active(GEN, OTHER, "finished.service")
    host.unit_state["finished.service"]["SubState"] = "exited"
    serve(GEN, hello([URL0, URL1, "http://192.0.2.10:30002"]))
    units = [GEN, OTHER, "finished.service", "absent.service"]
    out = run_op({"op": "clients", "client_units": units, "instances": INSTANCES}, host)
    gen, other, finished, absent = (out["clients"][u] for u in units)
    assert gen["running"] and gen["answered"] and gen["socket_exists"]
    assert gen["socket"] == f"{sockdir}/{GEN}/control.sock"
    assert (gen["pid"], gen["shard"], gen["state"]) == (4242, "0/1", "running")
    assert [e["url"] for e in gen["endpoints"]] == [URL0, URL1, "http://192.0.2.10:30002"]
    assert gen["sends_to"] == {"gpu0": [URL0], "gpu1": [URL1]}
    # Running, but nothing listens where its socket would be.
    assert other["running"] and not other["answered"] and not other["socket_exists"]
    assert other["error"] == "no such socket" and other["sends_to"] == {}
    # A finished job's client is active (exited): nothing runs, nothing is asked.
    assert not finished["running"] and "error" not in finished
    assert (absent["running"], absent["active_state"]) == (False, "inactive")
    assert out["agent_version"] == 1


def test_discovery_of_a_client_that_hangs_takes_its_timeout_and_says_so(
    tmp_path: Path, sockdir: str, serve: Any
) -> None:
    host = FakeHost(tmp_path, sockdir)
    host.active(GEN)
    serve(GEN, lambda _r: FakeClient.HANG)
    t0 = time.monotonic()
    out = run_op({"op": "clients", "client_units": [GEN], "instances": INSTANCES, "client_hello_timeout": 0.3}, host)
    assert time.monotonic() - t0 < 3
    assert out["clients"][GEN]["answered"] is False
    assert out["clients"][GEN]["error"] == "no answer within 0.3s"


def test_drain_sends_the_wave_endpoints_with_timeout_lease_and_who(tmp_path: Path, sockdir: str, serve: Any) -> None:
    host = FakeHost(tmp_path, sockdir)
    client = serve(GEN, hello([URL0, URL1]))
    out = run_op(
        {
            "op": "drain",
            "clients": {GEN: [URL0], "gone.service": [URL1]},
            "client_drain_timeout": 30,
            "lease": 9340.0,
            "by": "sglang-fleet retune of gpu0",
        },
        host,
    )
    assert client.requests == [
        {
            "v": 1,
            "op": "drain",
            "endpoints": [URL0],
            "timeout": 30.0,
            "lease": 9340.0,
            "by": "sglang-fleet retune of gpu0",
        }
    ]
    assert out["clients"][GEN] == {"ok": True, "drained": [URL0], "abandoned": 1, "waited_s": 0.25, "unknown": []}
    assert out["clients"]["gone.service"]["ok"] is False
    assert out["clients"]["gone.service"]["error"] == "no such socket"


def test_a_drain_that_never_answers_gives_an_error_after_its_timeout_and_margin(
    tmp_path: Path, sockdir: str, serve: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(op_clients, "DRAIN_CALL_MARGIN", 0.2)
    host = FakeHost(tmp_path, sockdir)
    serve(GEN, lambda _r: FakeClient.HANG)
    t0 = time.monotonic()
    out = run_op({"op": "drain", "clients": {GEN: [URL0]}, "client_drain_timeout": 0.2, "lease": 60}, host)
    assert 0.3 < time.monotonic() - t0 < 3
    assert out["clients"][GEN] == {"ok": False, "error": "no answer within 0.4s", "socket": host.client_socket(GEN)}


def test_resume_answers_each_endpoints_capacity(tmp_path: Path, sockdir: str, serve: Any) -> None:
    host = FakeHost(tmp_path, sockdir)
    client = serve(GEN, hello([URL0, URL1]))
    out = run_op({"op": "resume", "clients": {GEN: [URL0, URL1]}, "by": "sglang-fleet retune of gpu0"}, host)
    assert client.requests == [
        {"v": 1, "op": "resume", "endpoints": [URL0, URL1], "by": "sglang-fleet retune of gpu0", "confirm": 0.0}
    ]
    assert out["clients"][GEN]["ok"] is True
    assert out["clients"][GEN]["capacity"] == {URL0: 40, URL1: 40}


def test_a_client_gone_because_its_job_ended_says_so_a_crashed_one_does_not(tmp_path: Path, sockdir: str) -> None:
    host = FakeHost(tmp_path, sockdir)
    done = {"LoadState": "loaded", "Result": "success", "ExecMainStatus": "0"}
    host.unit_state[GEN] = {**done, "ActiveState": "active", "SubState": "exited"}  # systemd, RemainAfterExit
    host.unit_state[OTHER] = {**done, "ActiveState": "inactive", "SubState": "dead"}  # supervisord's EXITED 0
    host.unit_state["crashed.service"] = {
        **done,
        "ActiveState": "activating",
        "SubState": "auto-restart",
        "Result": "exit-code",
        "ExecMainStatus": "1",
    }
    plan = {GEN: [URL0], OTHER: [URL1], "crashed.service": [URL0]}
    out = run_op({"op": "resume", "clients": plan}, host)["clients"]
    assert out[GEN]["ok"] is False and out[GEN]["error"] == "no such socket"
    assert out[GEN]["ended"] == "active (exited), exit status 0"
    assert out[OTHER]["ended"] == "inactive (dead), exit status 0"
    assert "ended" not in out["crashed.service"] and out["crashed.service"]["error"] == "no such socket"


def test_client_stop_and_start_go_through_systemctl_and_say_how_they_ended(tmp_path: Path, sockdir: str) -> None:
    host = FakeHost(tmp_path, sockdir)
    host.active(GEN, OTHER)

    def stop(args: list[str]) -> None:
        host.unit_state[GEN].update(ActiveState="inactive", SubState="dead")  # OTHER ignores SIGTERM

    host.on_systemctl["stop"] = stop
    out = run_op({"op": "client_stop", "client_units": [GEN, OTHER]}, host)
    assert host.systemctl_calls == [["stop", "--", GEN, OTHER]]
    assert out["clients"][GEN]["stopped"] is True and out["clients"][GEN]["unit_state"] == "inactive/dead"
    assert out["clients"][OTHER]["stopped"] is False
    assert out["clients"][OTHER]["msg"] == f"still active/running after systemctl stop -- {GEN} {OTHER} (rc=0)"

    host.on_systemctl["start"] = lambda args: host.active(GEN)
    out = run_op({"op": "client_start", "client_units": [GEN]}, host)
    assert host.systemctl_calls[-1] == ["start", "--", GEN]
    assert out["clients"][GEN] == {
        "started": True,
        "unit_state": "active/running",
        "rc": 0,
        "action": f"systemctl start -- {GEN} (rc=0)",
    }


# -- the API key: the servers' own, handed to the clients that follow it ------------------------

SERVERS_KEY = "sk-servers-new-5150"
GEN_ENV = """# Ansible managed
SGLANG_FLEET_S3_URI="s3://bucket/job"
SGLANG_API_KEY="sk-servers-old-0001"
SGLANG_FLEET_API_KEY_FOLLOWS=servers
AWS_ACCESS_KEY_ID="AKIA-TEST"
"""
OTHER_ENV = 'SGLANG_API_KEY="sk-its-own-7777"\nSGLANG_FLEET_API_KEY_FOLLOWS=own\n'


def keyed_host(tmp_path: Path, sockdir: str) -> FakeHost:
    (tmp_path / "secrets.env").write_text(f'SGLANG_API_KEY="{SERVERS_KEY}"\n')
    (tmp_path / "gen.env").write_text(GEN_ENV)
    (tmp_path / "other.env").write_text(OTHER_ENV)
    (tmp_path / "gen.env").chmod(0o600)
    host = FakeHost(tmp_path, sockdir)
    host.env_files = {GEN: [str(tmp_path / "gen.env")], OTHER: [str(tmp_path / "other.env")]}
    return host


def test_the_generation_role_writes_the_key_and_whether_it_follows_as_the_agent_reads_them() -> None:
    template = (Path(__file__).parents[5] / "roles/generation/templates/generate.env.j2").read_text()
    assert f'\n{client_keys.KEY_VAR}="{{{{ generation_api_key }}}}"\n' in template
    assert f"\n{client_keys.FOLLOWS_VAR}={{{{ '{client_keys.FOLLOWS_SERVERS}' if " in template


def test_with_key_replaces_the_key_line_in_place_or_adds_it() -> None:
    assert client_keys.with_key(GEN_ENV, "k2") == GEN_ENV.replace('"sk-servers-old-0001"', '"k2"')
    assert client_keys.with_key("# none\nA=1\n", "k2") == '# none\nA=1\nSGLANG_API_KEY="k2"\n'
    assert client_keys.with_key('SGLANG_API_KEY="x"\n', "") == 'SGLANG_API_KEY=""\n'


def test_clients_say_whether_each_follows_or_has_the_servers_key_never_the_key(
    tmp_path: Path, sockdir: str, serve: Any
) -> None:
    host = keyed_host(tmp_path, sockdir)
    host.active(GEN, OTHER)
    serve(GEN, hello([URL0]))
    serve(OTHER, hello([URL1]))
    out = run_op({"op": "clients", "instances": INSTANCES, "client_units": [GEN, OTHER], "client_keys": True}, host)
    assert out["servers_key_set"] is True
    assert out["clients"][GEN]["key"] == {"env_file": str(tmp_path / "gen.env"), "follows": True, "matches": False}
    assert out["clients"][OTHER]["key"] == {"env_file": str(tmp_path / "other.env"), "follows": False, "matches": False}
    assert SERVERS_KEY not in json.dumps(out) and "sk-its-own" not in json.dumps(out)
    # The advisor asks without client_keys: no key is looked at.
    plain = run_op({"op": "clients", "instances": INSTANCES, "client_units": [GEN]}, host)
    assert "key" not in plain["clients"][GEN]


def test_a_retunes_resume_hands_the_servers_key_to_a_following_client_alone(
    tmp_path: Path, sockdir: str, serve: Any
) -> None:
    host = keyed_host(tmp_path, sockdir)
    gen = serve(GEN, hello([URL0]))
    other = serve(OTHER, hello([URL1]))
    req = {"op": "resume", "clients": {GEN: [URL0], OTHER: [URL1]}, "client_keys": True, "client_confirm_timeout": 5}
    out = run_op(req, host)
    assert gen.requests[0]["api_key"] == SERVERS_KEY and gen.requests[0]["confirm"] == 5
    assert "api_key" not in other.requests[0]
    # Its environment file holds the servers' key for its next start: that line alone changed,
    # still root-only; the other client's own key is left as it is.
    env = tmp_path / "gen.env"
    assert env.read_text() == GEN_ENV.replace("sk-servers-old-0001", SERVERS_KEY)
    assert stat.S_IMODE(env.stat().st_mode) == 0o600 and env.stat().st_uid == 0
    assert (tmp_path / "other.env").read_text() == OTHER_ENV
    assert SERVERS_KEY not in json.dumps(out)
    # Once it holds the key, the file is not written again.
    inode = env.stat().st_ino
    run_op(req, host)
    assert env.stat().st_ino == inode
    # Without client_keys (the advisor's measurement), no key goes anywhere.
    run_op({"op": "resume", "clients": {GEN: [URL0]}}, host)
    assert "api_key" not in gen.requests[-1]


def test_a_following_client_started_again_has_the_servers_key_first(tmp_path: Path, sockdir: str) -> None:
    host = keyed_host(tmp_path, sockdir)
    seen: list[str] = []
    host.on_systemctl["start"] = lambda _args: seen.append((tmp_path / "gen.env").read_text())
    run_op({"op": "client_start", "client_units": [GEN, OTHER], "client_keys": True}, host)
    assert seen == [GEN_ENV.replace("sk-servers-old-0001", SERVERS_KEY)]
    assert (tmp_path / "other.env").read_text() == OTHER_ENV


# -- the host lock ----------------------------------------------------------------------------


def _module(args: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    with patch_module_args(args), pytest.raises(SystemExit):
        retune_phase.main()
    result: dict[str, Any] = json.loads(capsys.readouterr().out)
    return result


@pytest.fixture
def held_lock(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """The host lock, held by run-a, in a temporary file."""
    path = str(tmp_path / "host.lock")
    monkeypatch.setattr(_host_lock, "guard", functools.partial(_host_lock.guard, path=path))
    _host_lock.acquire(
        {"run_id": "run-a", "controller": "ctl", "user": "ops", "controller_pid": 1, "started_at": "t", "ttl_s": 600},
        path,
    )
    return path


@pytest.mark.parametrize("op", ["drain", "resume", "client_stop", "client_start"])
def test_the_client_operations_that_act_prove_the_lease_first(
    op: str, held_lock: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    ran: list[tuple[dict[str, Any], Any]] = []
    monkeypatch.setattr(retune_phase, "run_agent", lambda req, ct, pct: ran.append((req, ct)) or {"clients": {}})
    args = {"op": op, "instances": [], "options": {"client_units": [GEN], "clients": {GEN: [URL0]}, "lease": 60}}
    refused = _module({**args, "lock_run_id": "run-b"}, capsys)
    assert refused["failed"] is True and refused["lock_error"] is True
    assert f"the {op} phase did nothing" in refused["msg"]
    refused = _module(args, capsys)  # no run id: refused while another run holds the host
    assert refused["failed"] is True and "the host is locked by run run-a" in refused["msg"]
    assert ran == []
    done = _module({**args, "lock_run_id": "run-a"}, capsys)
    assert done["changed"] is True and done["clients"] == {}
    # Once, on the host itself (never in a container), with the operation and its options.
    ((request, container),) = ran
    assert container is None
    assert request["op"] == op and request["client_units"] == [GEN]


def test_discovery_only_reads_and_needs_no_lease(
    held_lock: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(retune_phase, "run_agent", lambda req, ct, pct: {"clients": {GEN: {"running": False}}})
    found = _module({"op": "clients", "instances": [], "options": {"client_units": [GEN]}}, capsys)
    assert found.get("failed") is None and found["changed"] is False
    assert found["clients"] == {GEN: {"running": False}}
