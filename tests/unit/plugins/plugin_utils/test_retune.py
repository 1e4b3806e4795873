"""The retune flow on the controller: decisions, waves, fail-closed paths and rollback, with the
host replaced by a scripted phase runner (the real host side is tested by the Molecule
scenarios)."""

from __future__ import annotations

from typing import Any

import pytest

from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._retune import (
    Options,
    Retune,
    decide,
    plan_waves,
)

ARGV_OLD = ["/py", "-m", "sglang.launch_server", "--port", "30000", "--max-mamba-cache-size", "80"]
ARGV_NEW = ["/py", "-m", "sglang.launch_server", "--port", "30000", "--max-mamba-cache-size", "200"]


def instance(name: str, port: int, argv: list[str] = ARGV_NEW) -> dict[str, Any]:
    return {
        "name": name,
        "unit": f"sglang-{name}.service",
        "gpus": [port - 30000],
        "port": port,
        "container": None,
        "argv": argv,
        "env": {"CUDA_VISIBLE_DEVICES": str(port - 30000)},
        "expected_server_info": {"max_mamba_cache_size": 200},
        "fingerprint": f"fp-{name}-new",
    }


def facts(
    name: str, *, running: bool = True, argv: list[str] = ARGV_OLD, mamba: int = 80, **extra: Any
) -> dict[str, Any]:
    base = {
        "name": name,
        "running": running,
        "active_state": "active" if running else "inactive",
        "sub_state": "running" if running else "dead",
        "main_pid": 1000 if running else 0,
        "invocation_id": f"inv-{name}",
        "argv": argv,
        "argv_matches": argv == ARGV_NEW,
        "env_mismatches": {},
        "health_status": 200 if running else None,
        "server_info_status": 200 if running else None,
        "server_info": {"max_mamba_cache_size": mamba},
        "effective_max_running_requests": 16,
        "installed_fingerprint": f"fp-{name}-new",
        "has_last_good": True,
        "gpu_used_mib": {"0": 130000},
        "foreign": [],
    }
    base.update(extra)
    return base


class Host:
    """A scripted host: answers each phase from per-instance behaviour, records the calls."""

    def __init__(self, inspect_facts: dict[str, dict[str, Any]], **behaviour: Any):
        self.inspect = inspect_facts
        self.behaviour = behaviour
        self.calls: list[tuple[str, list[str], dict[str, Any]]] = []

    def __call__(self, op: str, instances: list[dict[str, Any]], options: dict[str, Any]) -> dict[str, Any]:
        names = [i["name"] for i in instances]
        self.calls.append((op, names, {i["name"]: i for i in instances}))
        hook = self.behaviour.get(op)
        if callable(hook):
            out = hook(names, instances, options)
            if out is not None:
                return out
        if op == "inspect":
            return {"instances": {n: self.inspect[n] for n in names}}
        if op == "record":
            return {"instances": {}, "containers": {}}
        if op == "stop":
            return {
                "instances": {n: {"dead": True, "time_to_dead_s": 1.5, "killed": [], "escalated": False} for n in names}
            }
        if op == "release":
            return {"instances": {n: {"released": True, "time_to_release_s": 3.0, "used_mib": {"0": 0}} for n in names}}
        if op == "start":
            return {
                "instances": {
                    n: {
                        "started": True,
                        "healthy": True,
                        "new_main_pid": 2000,
                        "time_to_healthy_s": 9.0,
                        "effective_max_running_requests": 40,
                    }
                    for n in names
                }
            }
        raise AssertionError(op)

    def ops(self) -> list[tuple[str, list[str]]]:
        return [(op, names) for op, names, _ in self.calls]


def run(host: Host, insts: list[dict[str, Any]], check: bool = False, **opts: Any) -> dict[str, Any]:
    return Retune(insts, Options(**opts), host, check_mode=check).run()


# -- decide -----------------------------------------------------------------------------------


def test_unchanged_means_running_healthy_and_reporting_the_desired_settings() -> None:
    inst = instance("gpu0", 30000)
    d = decide(inst, facts("gpu0", argv=ARGV_NEW, mamba=200), check_mode=False)
    assert d.action == "unchanged"
    assert d.reasons == []


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ({"argv": ARGV_OLD, "argv_matches": False}, "--max-mamba-cache-size 80→200"),
        ({"health_status": 503}, "/health answered 503"),
        ({"server_info": {"max_mamba_cache_size": 80}}, "max_mamba_cache_size=80 (desired 200)"),
        ({"server_info_status": 401, "server_info_error": "Unauthorized"}, "/server_info answered 401"),
        (
            {"env_mismatches": {"CUDA_VISIBLE_DEVICES": {"expected": "0", "running": "1"}}},
            "CUDA_VISIBLE_DEVICES='1'→'0'",
        ),
    ],
)
def test_each_difference_is_a_reason_to_relaunch(override: dict[str, Any], needle: str) -> None:
    f = facts("gpu0", argv=ARGV_NEW, mamba=200)
    f.update(override)
    d = decide(instance("gpu0", 30000), f, check_mode=False)
    assert d.action == "relaunch"
    assert needle in " ".join(d.reasons)


def test_an_unchanged_unit_file_is_not_enough() -> None:
    # Same unit file (fingerprint) but the running process serves other settings.
    f = facts("gpu0", argv=ARGV_NEW, mamba=80)
    assert decide(instance("gpu0", 30000), f, check_mode=False).action == "relaunch"


def test_foreign_holder_blocks_before_anything_is_touched() -> None:
    f = facts(
        "gpu0", foreign=[{"pid": 77, "cmdline": "python3 train.py", "reason": "not an SGLang process, holding GPU [0]"}]
    )
    d = decide(instance("gpu0", 30000), f, check_mode=False)
    assert d.action == "blocked"
    assert "PID 77 (python3 train.py)" in d.reasons[0]


def test_desired_state_not_installed_blocks_except_in_check_mode() -> None:
    f = facts("gpu0", installed_fingerprint="fp-old")
    assert decide(instance("gpu0", 30000), f, check_mode=False).action == "blocked"
    assert decide(instance("gpu0", 30000), f, check_mode=True).action == "relaunch"


def test_stopped_instance_is_started() -> None:
    d = decide(instance("gpu0", 30000), facts("gpu0", running=False), check_mode=False)
    assert d.action == "start"


@pytest.mark.parametrize(
    ("names", "canary", "size", "waves"),
    [
        (["a", "b", "c", "d"], True, 0, [["a"], ["b", "c", "d"]]),
        (["a", "b", "c", "d"], True, 2, [["a"], ["b", "c"], ["d"]]),
        (["a", "b", "c", "d"], "c", 1, [["c"], ["a"], ["b"], ["d"]]),
        (["a", "b", "c"], False, 2, [["a", "b"], ["c"]]),
        (["a", "b", "c"], False, 0, [["a", "b", "c"]]),
        (["a"], True, 0, [["a"]]),
        ([], True, 0, []),
    ],
)
def test_plan_waves(names: list[str], canary: Any, size: int, waves: list[list[str]]) -> None:
    assert plan_waves(names, canary, size) == waves


# -- the flow ---------------------------------------------------------------------------------


def test_second_run_with_nothing_to_do_touches_nothing() -> None:
    insts = [instance("gpu0", 30000), instance("gpu1", 30001)]
    host = Host({"gpu0": facts("gpu0", argv=ARGV_NEW, mamba=200), "gpu1": facts("gpu1", argv=ARGV_NEW, mamba=200)})
    out = run(host, insts)
    assert host.ops() == [("inspect", ["gpu0", "gpu1"])]
    assert out["changed"] is False
    assert "failed" not in out
    assert [r["action"] for r in out["instances"]] == ["unchanged", "unchanged"]
    assert out["instances"][0]["effective_max_running_requests_after"] == 16


def test_relaunch_canary_then_wave_with_one_round_trip_per_phase() -> None:
    insts = [instance(f"gpu{i}", 30000 + i) for i in range(4)]
    host = Host({f"gpu{i}": facts(f"gpu{i}") for i in range(4)})
    out = run(host, insts, wave_size=0, canary=True)
    assert host.ops() == [
        ("inspect", ["gpu0", "gpu1", "gpu2", "gpu3"]),
        ("stop", ["gpu0"]),
        ("release", ["gpu0"]),
        ("start", ["gpu0"]),
        ("stop", ["gpu1", "gpu2", "gpu3"]),
        ("release", ["gpu1", "gpu2", "gpu3"]),
        ("start", ["gpu1", "gpu2", "gpu3"]),
    ]
    assert out["changed"] is True
    assert "failed" not in out
    r = out["instances"][0]
    assert r["action"] == "relaunched"
    assert (r["old_main_pid"], r["new_main_pid"]) == (1000, 2000)
    assert (r["time_to_dead_s"], r["time_to_release_s"], r["time_to_healthy_s"]) == (1.5, 3.0, 9.0)
    assert (r["effective_max_running_requests_before"], r["effective_max_running_requests_after"]) == (16, 40)
    assert r["flag_diff"]["changed"] == {"--max-mamba-cache-size": ["80", "200"]}
    assert r["gpu_memory_before_mib"] == {"0": 130000}
    assert out["round_trips"] == {"inspect": 1, "stop": 2, "release": 2, "start": 2}
    # The start phase is told the old identity, so the new one must differ.
    start_payload = host.calls[3][2]["gpu0"]
    assert start_payload["old_main_pid"] == 1000
    assert start_payload["use_last_good"] is False


def test_check_mode_inspects_only_and_shows_the_diff() -> None:
    insts = [instance("gpu0", 30000), instance("gpu1", 30001)]
    host = Host({"gpu0": facts("gpu0"), "gpu1": facts("gpu1", argv=ARGV_NEW, mamba=200)})
    out = run(host, insts, check=True)
    assert host.ops() == [("inspect", ["gpu0", "gpu1"])]
    assert [r["action"] for r in out["instances"]] == ["would_relaunch", "unchanged"]
    assert out["changed"] is True
    assert len(out["diff"]) == 1
    assert "--max-mamba-cache-size\n80" in out["diff"][0]["before"]
    assert "--max-mamba-cache-size\n200" in out["diff"][0]["after"]


def test_blocked_instance_fails_the_host_closed_and_touches_nothing() -> None:
    insts = [instance("gpu0", 30000), instance("gpu1", 30001)]
    host = Host(
        {
            "gpu0": facts("gpu0"),
            "gpu1": facts(
                "gpu1",
                foreign=[
                    {
                        "pid": 9,
                        "cmdline": "python3 -m http.server 30001",
                        "reason": "not an SGLang process, holding port 30001",
                    }
                ],
            ),
        }
    )
    out = run(host, insts)
    assert host.ops() == [("inspect", ["gpu0", "gpu1"])]
    assert out["failed"] is True
    assert "PID 9 (python3 -m http.server 30001)" in out["msg"]
    assert out["changed"] is False
    assert [r["action"] for r in out["instances"]] == ["skipped", "failed"]


def test_unreachable_at_inspect_changes_nothing() -> None:
    host = Host({}, inspect=lambda *a: {"unreachable": True, "msg": "ssh: connect to host x port 22: No route"})
    out = run(host, [instance("gpu0", 30000)])
    assert out["failed"] is True
    assert "No route" in out["msg"]
    assert "nothing was changed" in out["msg"]
    assert host.ops() == [("inspect", ["gpu0"])]


def test_unreachable_mid_way_is_reported_as_unknown_state_and_stops() -> None:
    insts = [instance("gpu0", 30000), instance("gpu1", 30001)]
    host = Host(
        {"gpu0": facts("gpu0"), "gpu1": facts("gpu1")},
        release=lambda *a: {"unreachable": True, "msg": "Connection reset"},
    )
    out = run(host, insts)
    assert out["failed"] is True
    assert [r["action"] for r in out["instances"]] == ["failed", "skipped"]
    assert "not relaunched" in out["instances"][0]["msg"]
    assert out["down"] == ["gpu0"]
    assert ("start", ["gpu0"]) not in host.ops()


def test_not_proven_dead_is_never_relaunched() -> None:
    def stop(names, *_):
        return {
            "instances": {
                n: {
                    "dead": False,
                    "msg": "PID 55 (python3 hold.py) not an SGLang process, holding GPU [0]",
                    "foreign": [{"pid": 55}],
                }
                for n in names
            }
        }

    host = Host({"gpu0": facts("gpu0")}, stop=stop)
    out = run(host, [instance("gpu0", 30000)])
    assert [op for op, _ in host.ops()] == ["inspect", "stop"]
    r = out["instances"][0]
    assert r["action"] == "failed"
    assert r["state"] == "down"
    assert "PID 55" in r["msg"]
    assert out["down"] == ["gpu0"]
    assert "DOWN: gpu0" in out["msg"]


def test_memory_never_released_fails_closed() -> None:
    def release(names, *_):
        return {
            "instances": {
                n: {"released": False, "msg": "GPU memory not released within 5s", "used_mib": {"0": 120000}}
                for n in names
            }
        }

    host = Host({"gpu0": facts("gpu0")}, release=release)
    out = run(host, [instance("gpu0", 30000)])
    assert [op for op, _ in host.ops()] == ["inspect", "stop", "release"]
    assert out["instances"][0]["action"] == "failed"
    assert "not relaunched" in out["instances"][0]["msg"]


def crash_then_ok(names, instances, options):
    out = {}
    for inst in instances:
        if inst["use_last_good"]:
            out[inst["name"]] = {"started": True, "healthy": True, "new_main_pid": 3000, "time_to_healthy_s": 8.0}
        else:
            out[inst["name"]] = {
                "started": True,
                "healthy": False,
                "crashed": True,
                "msg": "crashed while starting",
                "journal": ["OOM"],
            }
    return {"instances": out}


def test_crash_at_start_rolls_back_to_last_good_and_fails_the_task() -> None:
    insts = [instance("gpu0", 30000), instance("gpu1", 30001)]
    host = Host({"gpu0": facts("gpu0"), "gpu1": facts("gpu1")}, start=crash_then_ok)
    out = run(host, insts, canary=True)
    assert host.ops() == [
        ("inspect", ["gpu0", "gpu1"]),
        ("stop", ["gpu0"]),
        ("release", ["gpu0"]),
        ("start", ["gpu0"]),
        ("stop", ["gpu0"]),
        ("release", ["gpu0"]),
        ("start", ["gpu0"]),
    ]
    assert host.calls[-1][2]["gpu0"]["use_last_good"] is True
    r0, r1 = out["instances"]
    assert r0["action"] == "rolled_back"
    assert r0["state"] == "running"
    assert "crashed while starting" in r0["msg"]
    assert r0["relaunch"]["journal"] == ["OOM"]
    assert r1["action"] == "skipped"  # the canary failed: the rest keep running as they were
    assert out["failed"] is True
    assert out["changed"] is True
    assert "down" not in out


def test_no_last_good_means_down_and_said_so() -> None:
    host = Host({"gpu0": facts("gpu0", has_last_good=False)}, start=crash_then_ok)
    out = run(host, [instance("gpu0", 30000)])
    r = out["instances"][0]
    assert r["action"] == "failed"
    assert "no last good settings" in r["msg"]
    assert "instance is DOWN" in r["msg"]
    assert out["down"] == ["gpu0"]


def test_rollback_disabled_settings_mismatch_is_unverified_not_hidden() -> None:
    def mismatch(names, *_):
        return {
            "instances": {
                n: {
                    "started": True,
                    "healthy": False,
                    "new_main_pid": 2000,
                    "msg": "/server_info reports other settings",
                }
                for n in names
            }
        }

    host = Host({"gpu0": facts("gpu0")}, start=mismatch)
    out = run(host, [instance("gpu0", 30000)], rollback=False)
    r = out["instances"][0]
    assert r["action"] == "failed"
    assert r["state"] == "unverified"
    assert "NOT VERIFIED" in r["msg"]
    assert out["unverified"] == ["gpu0"]


def test_unchanged_without_last_good_gets_it_recorded_without_changing() -> None:
    host = Host({"gpu0": facts("gpu0", argv=ARGV_NEW, mamba=200, has_last_good=False)})
    out = run(host, [instance("gpu0", 30000)])
    assert host.ops() == [("inspect", ["gpu0"]), ("record", ["gpu0"])]
    assert out["changed"] is False
    assert out["instances"][0]["recorded_last_good"] is True


def test_force_relaunches_unchanged() -> None:
    host = Host({"gpu0": facts("gpu0", argv=ARGV_NEW, mamba=200)})
    out = run(host, [instance("gpu0", 30000)], force=True)
    assert out["instances"][0]["action"] == "relaunched"
    assert out["instances"][0]["reasons"] == ["forced"]


# -- evidence pre-flight, hanging endpoints, the host lock -----------------------------------

SMI_HANG = {
    "what": "GPU memory",
    "cmd": "nvidia-smi --query-gpu=index,uuid,memory.used,memory.total --format=csv,noheader,nounits",
    "rc": None,
    "msg": "GPU memory: ran 'nvidia-smi --query-gpu=...': timed out, stdout='', stderr=''",
}


def test_broken_evidence_blocks_the_host_before_anything_is_stopped() -> None:
    """nvidia-smi hangs at inspect: no instance of the host is stopped (they keep serving), the
    result is blocked and quotes what was run and what came back."""
    insts = [instance("gpu0", 30000), instance("gpu1", 30001)]
    host = Host(
        {
            "gpu0": facts("gpu0", evidence_errors=[SMI_HANG]),
            "gpu1": facts("gpu1", evidence_errors=[SMI_HANG]),
        }
    )
    out = run(host, insts)
    assert host.ops() == [("inspect", ["gpu0", "gpu1"])]
    assert out["failed"] and "down" not in out
    assert "nothing changed on this host" in out["msg"] and "timed out" in out["msg"]
    for r in out["instances"]:
        assert r["action"] == "failed" and r["state"] == "running"
        assert any("evidence the retune needs is broken" in why for why in r["reasons"])
        assert any("would relaunch" in why for why in r["reasons"])


def test_broken_evidence_leaves_an_unchanged_host_unchanged() -> None:
    inst = instance("gpu0", 30000)
    out = run(Host({"gpu0": facts("gpu0", argv=ARGV_NEW, mamba=200, evidence_errors=[SMI_HANG])}), [inst])
    assert not out.get("failed") and out["instances"][0]["action"] == "unchanged"


def test_a_server_info_that_hangs_blocks_unless_forced() -> None:
    unanswered = ["/server_info did not answer within 30s (it asks every scheduler: one is stuck or gone)"]
    inst = instance("gpu0", 30000)
    stuck = facts("gpu0", server_info_status=None, unanswered=unanswered)
    host = Host({"gpu0": stuck})
    out = run(host, [inst])
    assert host.ops() == [("inspect", ["gpu0"])]
    assert out["failed"] and "/server_info did not answer within 30s" in out["msg"]
    assert "sglang_retune_force" in out["msg"]

    forced = Host({"gpu0": stuck})
    out = run(forced, [inst], force=True)
    assert [op for op, _ in forced.ops()] == ["inspect", "stop", "release", "start"]
    assert out["instances"][0]["action"] == "relaunched"
    assert "/server_info did not answer" in " ".join(out["instances"][0]["reasons"])


def test_force_never_overrides_broken_evidence() -> None:
    inst = instance("gpu0", 30000)
    host = Host({"gpu0": facts("gpu0", argv=ARGV_NEW, mamba=200, evidence_errors=[SMI_HANG])})
    out = run(host, [inst], force=True)
    assert host.ops() == [("inspect", ["gpu0"])]
    assert out["failed"] and out["instances"][0]["state"] == "running"


def test_a_stop_refused_by_the_host_lock_leaves_the_instance_running() -> None:
    def locked(names: list[str], _i: Any, _o: Any) -> dict[str, Any]:
        return {"failed": True, "lock_error": True, "msg": "the host is locked by run abc (user ops on ctl)"}

    host = Host({"gpu0": facts("gpu0")}, stop=locked)
    out = run(host, [instance("gpu0", 30000)])
    r = out["instances"][0]
    assert out["failed"] and "down" not in out
    assert r["state"] == "running" and "not stopped, still running as it was" in r["msg"]
    assert "locked by run abc" in r["msg"]
