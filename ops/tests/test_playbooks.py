"""The names the CLI reads results by are the playbooks' own."""

from __future__ import annotations

from pathlib import Path

import yaml
from sglang_fleet_ops import events, status

REPO = Path(__file__).resolve().parents[2]


def plays(path: str) -> list[dict[str, object]]:
    loaded: list[dict[str, object]] = yaml.safe_load((REPO / path).read_text())
    return loaded


def test_the_retune_plays_the_cli_tells_apart_exist() -> None:
    names = [p["name"] for p in plays("playbooks/retune.yml")]
    assert events.FLEET_LOCK_PLAY in names and events.SUMMARY_PLAY in names
    # The fleet lock is taken after the validation and before any host is touched.
    assert names.index(events.FLEET_LOCK_PLAY) == 1 and names[2] == "Retune the canary hosts"
    assert names[-2] == "Give back the fleet lock - every lease of this run" and names[-1] == events.SUMMARY_PLAY


def test_the_fleet_lock_takes_every_host_and_waits() -> None:
    (play,) = [p for p in plays("playbooks/retune.yml") if p["name"] == events.FLEET_LOCK_PLAY]
    tasks = play["tasks"]
    assert isinstance(tasks, list)
    (take,) = [t for t in tasks if t.get("sglang_ops.fleet.host_lock", {}).get("wait")]
    assert take["sglang_ops.fleet.host_lock"] == {
        "ttl": "{{ sglang_retune_lock_ttl }}",
        "wait": "{{ sglang_retune_lock_wait }}",
    }
    assert take["when"] == "sglang_retune_fleet_lock | bool" and take["ignore_errors"] and take["ignore_unreachable"]
    assert all("always" in t["tags"] for t in tasks)


def test_the_status_tasks_the_cli_reads_exist() -> None:
    (play,) = plays("playbooks/status.yml")
    tasks = play["tasks"]
    assert isinstance(tasks, list)
    names = {t["name"] for t in tasks}
    for name in (status.UPTIME_TASK, status.METRICS_TASK, status.CLIENTS_TASK, status.CLIENT_FILES_TASK):
        assert name in names, name
    actions = {next(k for k in t if k.startswith(("sglang_ops.", "ansible."))) for t in tasks}
    assert {events.VALIDATE, events.PHASE, events.RETUNE} <= actions
    (check,) = [t for t in tasks if events.RETUNE in t]
    assert check["check_mode"] is True
