"""The agent's apply (what the server role's server_units runs) tested as a builtin module is: the
five runs of the check/diff matrix - check, check with diff, apply, then check and apply again
with nothing to do - with check mode predicting the real run exactly and writing nothing, and the
second apply changing nothing. systemd answers from data; the files are real."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from agent_requests import REQUEST

from ansible_collections.sglang_ops.fleet.plugins.module_utils.agent import ops
from ansible_collections.sglang_ops.fleet.plugins.module_utils.agent.host import Host

UNIT = "sglang-gpu0.service"
# systemctl verbs that change the host (the others only read).
MUTATING = {"daemon-reload", "enable", "start", "reset-failed"}


class SystemdHost(Host):
    """Unit files in ``tmp_path``; systemd's state (enabled, active) kept in memory."""

    def __init__(self, tmp_path: Path):
        super().__init__(
            {
                **REQUEST,
                "secrets_file": str(tmp_path / "secrets.env"),
                "state_dir": str(tmp_path / "state"),
                "desired_dir": str(tmp_path / "desired"),
            }
        )
        self.service.definitions_dir = str(tmp_path / "units")
        self.enabled: set[str] = set()
        self.active: set[str] = set()
        self.calls: list[list[str]] = []

    def units(self, names: list[str]) -> dict[str, dict[str, str]]:
        return {n: {"ActiveState": "active" if n in self.active else "inactive"} for n in names}

    def systemctl(self, args: list[str], timeout: float = 60.0) -> dict[str, Any]:
        self.calls.append(args)
        verb, names = args[0], [a for a in args[1:] if a != "--"]
        stdout = ""
        if verb == "is-enabled":
            stdout = "enabled\n" if names[0] in self.enabled else "disabled\n"
        elif verb == "enable":
            self.enabled.update(names)
        elif verb == "start":
            self.active.update(names)
        return {"cmd": "systemctl " + " ".join(args), "rc": 0, "stdout": stdout, "stderr": ""}

    def mutations(self) -> list[list[str]]:
        return [c for c in self.calls if c[0] in MUTATING]


def request(tmp_path: Path, **more: Any) -> dict[str, Any]:
    units = tmp_path / "units"
    return {
        **REQUEST,
        "op": "apply",
        "directories": [{"path": str(tmp_path / "home"), "mode": "0750"}],
        "files": [
            {"path": str(units / UNIT), "content": "[Service]\nExecStart=/bin/true\n", "verify": False},
            {"path": str(tmp_path / "desired" / "gpu0.json"), "content": '{"name": "gpu0"}\n'},
            {"path": str(tmp_path / "secrets.env"), "content": "SGLANG_API_KEY=k\n", "mode": "0600", "secret": True},
        ],
        "units": [UNIT],
        "enable": True,
        "start": True,
        **more,
    }


def written(tmp_path: Path) -> list[str]:
    return sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))


def test_check_mode_predicts_the_apply_and_a_second_apply_changes_nothing(tmp_path: Path) -> None:
    host = SystemdHost(tmp_path)
    before = written(tmp_path)

    check = ops.run(request(tmp_path, check_mode=True), host)
    check_diff = ops.run(request(tmp_path, check_mode=True, diff=True), host)
    assert written(tmp_path) == before  # check mode writes nothing
    assert host.mutations() == []  # and changes nothing in systemd
    assert check["changed"] is True and check_diff["changed"] is True
    assert [f for f in check["files"] if "diff" in f] == []  # no diff unless asked

    applied = ops.run(request(tmp_path, diff=True), host)
    assert applied["changed"] is True and "failed" not in applied
    # Check mode predicted the real run: the same files changed, the same actions, the same diffs.
    assert check_diff["files"] == applied["files"]
    assert (
        check_diff["actions"]
        == applied["actions"]
        == [
            f"create directory {tmp_path / 'home'}",
            "systemctl daemon-reload",
            f"enable {UNIT}",
            f"start {UNIT}",
        ]
    )
    assert check_diff["started"] == applied["started"] == [UNIT]
    assert [f["path"] for f in applied["files"] if "diff" in f] == [
        str(tmp_path / "units" / UNIT),
        str(tmp_path / "desired" / "gpu0.json"),
    ]  # a secret's content never goes in a diff
    assert host.mutations() == [
        ["daemon-reload"],
        ["enable", "--", UNIT],
        ["reset-failed", "--", UNIT],
        ["start", "--", UNIT],
    ]
    assert (tmp_path / "units" / UNIT).read_text() == "[Service]\nExecStart=/bin/true\n"
    assert oct((tmp_path / "secrets.env").stat().st_mode & 0o777) == "0o600"
    assert oct((tmp_path / "home").stat().st_mode & 0o777) == "0o750"

    host.calls.clear()
    again_check = ops.run(request(tmp_path, check_mode=True, diff=True), host)
    again = ops.run(request(tmp_path, diff=True), host)
    for result in (again_check, again):
        assert result["changed"] is False
        assert result["actions"] == [] and result["started"] == []
        assert all(not f["changed"] and "diff" not in f for f in result["files"])
    assert host.mutations() == []


def test_check_mode_after_a_unit_change_reports_every_unit_as_one_to_start(tmp_path: Path) -> None:
    """A changed unit of a running instance: check mode does not ask systemd for the units' state
    once a unit changed, and reports the start of every unit; the real run reloads and leaves the
    running instance alone (it is never restarted). The one place check mode over-reports."""
    host = SystemdHost(tmp_path)
    ops.run(request(tmp_path), host)
    changed = request(tmp_path)
    changed["files"][0] = dict(changed["files"][0], content="[Service]\nExecStart=/bin/false\n")
    host.calls.clear()
    check = ops.run(dict(changed, check_mode=True, diff=True), host)
    assert check["changed"] is True
    assert check["actions"] == ["systemctl daemon-reload", f"start {UNIT}"]
    (diff,) = [f["diff"] for f in check["files"] if "diff" in f]
    assert (diff["before"], diff["after"]) == ("[Service]\nExecStart=/bin/true\n", "[Service]\nExecStart=/bin/false\n")
    assert host.mutations() == []
    applied = ops.run(changed, host)
    assert applied["actions"] == ["systemctl daemon-reload"]
    assert host.mutations() == [["daemon-reload"]]


def test_an_existing_directory_is_given_its_mode(tmp_path: Path) -> None:
    """As the builtin file module does: a directory that exists with another mode (a pod's umask
    077, a hand-made one) is set to the role's, check mode says so first, and then nothing."""
    host = SystemdHost(tmp_path)
    (tmp_path / "home").mkdir(mode=0o755)
    (tmp_path / "home").chmod(0o755)
    only_dirs = {"files": [], "units": []}
    check = ops.run(request(tmp_path, check_mode=True, **only_dirs), host)
    assert check["actions"] == [f"set directory {tmp_path / 'home'} to mode 0750, owner root"]
    assert oct((tmp_path / "home").stat().st_mode & 0o777) == "0o755"
    applied = ops.run(request(tmp_path, **only_dirs), host)
    assert applied["changed"] is True and applied["actions"] == check["actions"]
    assert oct((tmp_path / "home").stat().st_mode & 0o777) == "0o750"
    again = ops.run(request(tmp_path, **only_dirs), host)
    assert again["changed"] is False and again["actions"] == []
