"""Recorded runner events (fixtures/*.json, shaped like ansible-runner's job events with the
result shapes of server_validate, server_units in check mode with diff, retune, host_lock and
the status playbook's tasks) and a stand-in for the runner that replays them."""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from sglang_fleet_ops.runner import Request, Run

FIXTURES = Path(__file__).parent / "fixtures"


def events(name: str) -> list[dict[str, Any]]:
    loaded: list[dict[str, Any]] = json.loads((FIXTURES / f"{name}.json").read_text())
    return copy.deepcopy(loaded)


def run_of(evts: list[dict[str, Any]], rc: int | None = None, ident: str = "plan") -> Run:
    failed = any(
        e["event"] in ("runner_on_failed", "runner_on_unreachable") and not e["event_data"].get("ignore_errors")
        for e in evts
    )
    code = (2 if failed else 0) if rc is None else rc
    return Run(ident=ident, playbook="retune.yml", rc=code, status="failed" if code else "successful", events=evts)


def find(evts: list[dict[str, Any]], host: str, task: str) -> dict[str, Any]:
    (found,) = [e for e in evts if e["event_data"]["host"] == host and e["event_data"]["task"] == task]
    return found


def retune_instance(evts: list[dict[str, Any]], host: str, name: str) -> dict[str, Any]:
    res = find(evts, host, "Relaunch the instances whose running settings differ")["event_data"]["res"]
    (inst,) = [i for i in res["instances"] if i["name"] == name]
    return inst


@dataclass
class FakeRunner:
    """Replays one recorded run per call, recording what was asked."""

    runs: list[Run]
    requests: list[Request] = field(default_factory=list)
    calls: list[dict[str, Any]] = field(default_factory=list)

    def __call__(self, run_dir: Path, project: Path, inventory: str | None, limit: str | None, request: Request) -> Run:
        self.requests.append(request)
        self.calls.append({"run_dir": run_dir, "project": project, "inventory": inventory, "limit": limit})
        run = self.runs.pop(0)
        artifacts = run_dir / "artifacts" / request.ident
        artifacts.mkdir(parents=True)
        run.ident, run.artifact_dir = request.ident, artifacts
        return run


@pytest.fixture(autouse=True)
def collection_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    """cli.main checks the installed collection first (tests/test_collection.py tests the check);
    the tests that replay recorded runs stand for a fleet repository where it is installed."""
    from sglang_fleet_ops import cli  # noqa: PLC0415

    defaults = cli.main.__defaults__
    assert defaults is not None
    monkeypatch.setattr(cli.main, "__defaults__", (*defaults[:-1], lambda project: None))


@pytest.fixture
def project(tmp_path: Path) -> Path:
    path = tmp_path / "project"
    path.mkdir()
    return path


class Recorded:
    """The helpers above, for the tests (a fixture: test modules do not import conftest)."""

    events = staticmethod(events)
    run_of = staticmethod(run_of)
    find = staticmethod(find)
    retune_instance = staticmethod(retune_instance)
    FakeRunner = FakeRunner


@pytest.fixture
def rec() -> type[Recorded]:
    return Recorded
