"""The retune flow on the controller: decisions, waves, fail-closed paths and rollback, with the
host replaced by a scripted phase runner (the real host side is tested by the Molecule
scenarios)."""

from __future__ import annotations

from typing import Any

import pytest
from simulated_instance import B200, FIRST_TUNING, SIM_B200_SERVER_INFO, simulate

from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._retune.decide import decide
from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._retune.flow import HostLost, Retune, plan_waves
from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._retune.options import Options

ARGV_OLD = ["/py", "-m", "sglang.launch_server", "--port", "30000", "--max-mamba-cache-size", "80"]
ARGV_NEW = ["/py", "-m", "sglang.launch_server", "--port", "30000", "--max-mamba-cache-size", "200"]


def instance(name: str, port: int, argv: tuple[str, ...] = tuple(ARGV_NEW)) -> dict[str, Any]:
    return {
        "name": name,
        "unit": f"sglang-{name}.service",
        "gpus": [port - 30000],
        "port": port,
        "container": None,
        "argv": list(argv),
        "env": {"CUDA_VISIBLE_DEVICES": str(port - 30000)},
        "expected_server_info": {"max_mamba_cache_size": 200},
        "fingerprint": f"fp-{name}-new",
    }


def facts(
    name: str, *, running: bool = True, argv: tuple[str, ...] = tuple(ARGV_OLD), mamba: int = 80, **extra: Any
) -> dict[str, Any]:
    base = {
        "name": name,
        "running": running,
        "active_state": "active" if running else "inactive",
        "sub_state": "running" if running else "dead",
        "main_pid": 1000 if running else 0,
        "invocation_id": f"inv-{name}",
        "argv": list(argv),
        "argv_matches": list(argv) == ARGV_NEW,
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


def taken_back(urls: list[str]) -> dict[str, Any]:
    """A client's answer to a resume, as the agent passes it on: each endpoint back in service."""
    return {
        "ok": True,
        "resumed": urls,
        "capacity": {url: 40 for url in urls},
        "service": {
            url: {
                "in_service": True,
                "state": "up",
                "completed": 2,
                "why": "completed 2 request(s) again",
                "waited_s": 0.3,
            }
            for url in urls
        },
        "unknown": [],
    }


class Host:
    """A scripted host: answers each phase from per-instance behaviour, records the calls."""

    def __init__(
        self,
        inspect_facts: dict[str, dict[str, Any]],
        clients_found: dict[str, dict[str, Any]] | None = None,
        **behaviour: Any,
    ):
        self.inspect = inspect_facts
        self.clients = clients_found or {}  # what the "clients" operation finds, per unit
        self.behaviour = behaviour
        self.calls: list[tuple[str, list[str], dict[str, Any]]] = []
        self.options: list[tuple[str, dict[str, Any]]] = []

    def __call__(self, op: str, instances: list[dict[str, Any]], options: dict[str, Any]) -> dict[str, Any]:
        names = [i["name"] for i in instances]
        self.calls.append((op, names, {i["name"]: i for i in instances}))
        self.options.append((op, options))
        hook = self.behaviour.get(op)
        if callable(hook):
            out = hook(names, instances, options)
            if out is not None:
                return out
        if op == "clients":
            return {"clients": {u: self.clients.get(u, {"unit": u, "running": False}) for u in options["client_units"]}}
        if op == "drain":
            return {
                "clients": {
                    u: {"ok": True, "drained": urls, "abandoned": 0, "waited_s": 0.4, "unknown": []}
                    for u, urls in options["clients"].items()
                }
            }
        if op == "resume":
            return {"clients": {u: taken_back(urls) for u, urls in options["clients"].items()}}
        if op == "client_stop":
            return {"clients": {u: {"stopped": True, "unit_state": "inactive/dead"} for u in options["client_units"]}}
        if op == "client_start":
            return {"clients": {u: {"started": True, "unit_state": "active/running"} for u in options["client_units"]}}
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
            started = {
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
            if options.get("resume_clients"):  # as the agent: the healthy wave handed back at once
                resumed = {u: taken_back(urls) for u, urls in options["resume_clients"].items()}
                started["containers"] = {"host": {"resumed": resumed}}
            return started
        raise AssertionError(op)

    def ops(self) -> list[tuple[str, list[str]]]:
        return [(op, names) for op, names, _unused in self.calls]


def run(host: Host, insts: list[dict[str, Any]], check: bool = False, **opts: Any) -> dict[str, Any]:
    # No generation client unless a test names some (tests of the clients: further below).
    opts.setdefault("client_units", [])
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
    def stop(names, *_unused):
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
    assert [op for op, _unused in host.ops()] == ["inspect", "stop"]
    r = out["instances"][0]
    assert r["action"] == "failed"
    assert r["state"] == "down"
    assert "PID 55" in r["msg"]
    assert out["down"] == ["gpu0"]
    assert "DOWN: gpu0" in out["msg"]


def test_memory_never_released_fails_closed() -> None:
    def release(names, *_unused):
        return {
            "instances": {
                n: {"released": False, "msg": "GPU memory not released within 5s", "used_mib": {"0": 120000}}
                for n in names
            }
        }

    host = Host({"gpu0": facts("gpu0")}, release=release)
    out = run(host, [instance("gpu0", 30000)])
    assert [op for op, _unused in host.ops()] == ["inspect", "stop", "release"]
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
    def mismatch(names, *_unused):
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


WEDGED = ["/server_info did not answer within 30s (it asks every scheduler: one is stuck or gone)"]


def wedged(name: str, **extra: Any) -> dict[str, Any]:
    """A running instance whose scheduler is stopped: /health and /server_info hang; /proc reads."""
    return facts(
        name,
        health_status=None,
        health_error="timed out",
        server_info_status=None,
        server_info_error="timed out",
        server_info=None,
        effective_max_running_requests=None,
        unanswered=["/health did not answer within 30s", *WEDGED],
        **extra,
    )


def test_a_wedged_instance_to_change_is_relaunched_in_its_wave_with_its_siblings() -> None:
    """One scheduler SIGSTOPped: its settings (from /proc) differ, so it is relaunched like its three
    siblings; the host succeeds and the summary names the wedged one and how it was stopped."""
    insts, inspected = four()
    inspected["gpu2"] = wedged("gpu2")

    def stop(names: list[str], _i: Any, _o: Any) -> dict[str, Any]:
        return {
            "instances": {
                n: {"dead": True, "time_to_dead_s": 11.0, "escalated": n == "gpu2", "killed": []} for n in names
            }
        }

    host = Host(inspected, stop=stop)
    out = run(host, insts, wave_size=0)
    assert not out.get("failed"), out["msg"]
    assert [r["action"] for r in out["instances"]] == ["relaunched"] * 4
    assert [op for op, _unused in host.ops()] == ["inspect"] + ["stop", "release", "start"] * 2
    assert "gpu2" in host.ops()[4][1]
    gpu2 = out["instances"][2]
    assert gpu2["reasons"][0].startswith("wedged: /health did not answer within 30s")
    assert "--max-mamba-cache-size 80→200" in " ".join(gpu2["reasons"])
    assert out["wedged"] == [
        "gpu2 was wedged (/health did not answer within 30s; " + WEDGED[0] + "): relaunched, stopped by "
        "SIGTERM, then SIGKILL of its cgroup past the stop deadline"
    ]
    assert out["msg"] == "4 relaunched; " + out["wedged"][0]
    assert [r["wedged"] for r in out["instances"] if r["name"] != "gpu2"] == [[], [], []]
    # The agent stops the wedged one without waiting for a drain; the others get the drain deadline.
    stops = [payload for op, _unused, payload in host.calls if op == "stop"]
    assert {n: p["wedged"] for stop in stops for n, p in stop.items()} == {
        "gpu0": False,
        "gpu1": False,
        "gpu2": True,
        "gpu3": False,
    }


def test_a_wedged_instance_with_the_desired_settings_is_named_and_untouched() -> None:
    """Its settings are already the desired ones: the host fails naming it, nothing is stopped."""
    insts, _unused = four()
    inspected = {f"gpu{i}": facts(f"gpu{i}", argv=ARGV_NEW, mamba=200) for i in range(4)}
    inspected["gpu2"] = wedged("gpu2", argv=ARGV_NEW, argv_matches=True)
    host = Host(inspected)
    out = run(host, insts)
    assert host.ops() == [("inspect", ["gpu0", "gpu1", "gpu2", "gpu3"])]
    assert out["failed"] and not out["changed"] and "down" not in out
    assert out["summary"] == {"unchanged": ["gpu0", "gpu1", "gpu3"], "unhealthy": ["gpu2"]}
    assert out["msg"].startswith("gpu2: wedged: /health did not answer within 30s")
    assert "sglang_retune_relaunch_wedged=true" in out["msg"]
    assert out["instances"][2]["state"] == "running"


def test_a_wedged_instance_with_the_desired_settings_does_not_hold_back_its_siblings() -> None:
    insts, inspected = four()
    inspected["gpu2"] = wedged("gpu2", argv=ARGV_NEW, argv_matches=True)
    host = Host(inspected)
    out = run(host, insts)
    assert out["failed"]
    assert out["summary"] == {"relaunched": ["gpu0", "gpu1", "gpu3"], "unhealthy": ["gpu2"]}
    assert all("gpu2" not in names for op, names in host.ops() if op != "inspect")


@pytest.mark.parametrize("option", ["relaunch_wedged", "force"])
def test_a_wedged_instance_with_the_desired_settings_is_relaunched_when_asked(option: str) -> None:
    inst = instance("gpu0", 30000)
    host = Host({"gpu0": wedged("gpu0", argv=ARGV_NEW, argv_matches=True)})
    out = run(host, [inst], **{option: True})
    assert [op for op, _unused in host.ops()] == ["inspect", "stop", "release", "start"]
    assert not out.get("failed") and out["instances"][0]["action"] == "relaunched"
    assert f"relaunched as asked (sglang_retune_{option})" in " ".join(out["instances"][0]["reasons"])


STALL = (
    "stalled: 0 running and 66 waiting requests and no token processed in 5s "
    "(sglang:realtime_tokens_total stayed at 13993)"
)


def test_a_stalled_instance_to_change_is_relaunched_and_named_stalled() -> None:
    """It answers /health and /server_info but processes nothing (the agent's stall probe): unhealthy
    like a wedged one, relaunched with its siblings without waiting for a drain, named stalled."""
    insts, inspected = four()
    inspected["gpu1"] = facts("gpu1", stalled=STALL)
    host = Host(inspected)
    out = run(host, insts, wave_size=0)
    assert not out.get("failed"), out["msg"]
    assert [r["action"] for r in out["instances"]] == ["relaunched"] * 4
    assert out["instances"][1]["reasons"][0] == STALL
    assert out["wedged"] == [
        "gpu1 was stalled (" + STALL.removeprefix("stalled: ") + "): relaunched, stopped by SIGTERM (systemctl stop)"
    ]
    stops = [payload for op, _unused, payload in host.calls if op == "stop"]
    assert {n: p["wedged"] for stop in stops for n, p in stop.items()}["gpu1"] is True


def test_a_stalled_instance_with_the_desired_settings_is_named_unhealthy_and_untouched() -> None:
    insts, _unused = four()
    inspected = {f"gpu{i}": facts(f"gpu{i}", argv=ARGV_NEW, mamba=200) for i in range(4)}
    inspected["gpu1"] = facts("gpu1", argv=ARGV_NEW, mamba=200, stalled=STALL)
    host = Host(inspected)
    out = run(host, insts)
    assert host.ops() == [("inspect", ["gpu0", "gpu1", "gpu2", "gpu3"])]
    assert out["failed"] and not out["changed"]
    assert out["summary"] == {"unchanged": ["gpu0", "gpu2", "gpu3"], "unhealthy": ["gpu1"]}
    assert out["msg"].startswith("gpu1: " + STALL + ": its command line and environment (/proc) are the desired")
    assert "sglang_retune_relaunch_wedged=true" in out["msg"]
    asked = run(Host(dict(inspected)), insts, relaunch_wedged=True)
    assert asked["summary"] == {"unchanged": ["gpu0", "gpu2", "gpu3"], "relaunched": ["gpu1"]}


def test_a_wedged_instance_on_a_host_with_broken_evidence_blocks_the_host() -> None:
    insts, inspected = four()
    for name in inspected:
        inspected[name]["evidence_errors"] = [SMI_HANG]
    inspected["gpu2"] = wedged("gpu2", evidence_errors=[SMI_HANG])
    host = Host(inspected)
    out = run(host, insts, relaunch_wedged=True)
    assert host.ops() == [("inspect", ["gpu0", "gpu1", "gpu2", "gpu3"])]
    assert out["failed"] and "nothing changed on this host" in out["msg"]
    assert "evidence the retune needs is broken" in out["instances"][2]["reasons"][0]


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


# -- the generation clients: drained per wave, or stopped for the retune ---------------------

GEN = "sglang-fleet-generate.service"
OTHER = "other-client.service"


def sock(unit: str) -> str:
    return f"/run/sglang-fleet/clients/{unit}/control.sock"


def url(port: int) -> str:
    return f"http://127.0.0.1:{port}"


def answering(unit: str, ports: list[int]) -> dict[str, Any]:
    """A running client that answered hello, sending to the instances on these ports."""
    return {
        "unit": unit,
        "running": True,
        "answered": True,
        "socket": sock(unit),
        "endpoints": [{"url": url(p)} for p in ports],
        "sends_to": {f"gpu{p - 30000}": [url(p)] for p in ports},
    }


def silent(unit: str, error: str = "connection refused") -> dict[str, Any]:
    return {"unit": unit, "running": True, "answered": False, "socket": sock(unit), "error": error, "sends_to": {}}


def four() -> tuple[list[dict[str, Any]], dict[str, dict[str, Any]]]:
    return [instance(f"gpu{i}", 30000 + i) for i in range(4)], {f"gpu{i}": facts(f"gpu{i}") for i in range(4)}


def client_ops(host: Host) -> list[tuple[str, Any]]:
    """Each operation in order, with what it was asked about the clients."""
    out: list[tuple[str, Any]] = []
    for (op, names, _unused), (_unused, options) in zip(host.calls, host.options, strict=True):
        if op in ("drain", "resume"):
            out.append((op, options["clients"]))
        elif op in ("clients", "client_stop", "client_start"):
            out.append((op, options["client_units"]))
        else:
            out.append((op, names))
    return out


def test_an_answering_client_is_drained_per_wave_and_never_stopped() -> None:
    insts, found = four()
    host = Host(found, clients_found={GEN: answering(GEN, [30000, 30001, 30002, 30003])})
    out = run(host, insts, client_units=[GEN], canary=True, wave_size=0)
    rest = [url(30001), url(30002), url(30003)]
    assert client_ops(host) == [
        ("inspect", ["gpu0", "gpu1", "gpu2", "gpu3"]),
        ("clients", [GEN]),
        ("drain", {GEN: [url(30000)]}),
        ("stop", ["gpu0"]),
        ("release", ["gpu0"]),
        ("start", ["gpu0"]),
        ("drain", {GEN: rest}),
        ("stop", ["gpu1", "gpu2", "gpu3"]),
        ("release", ["gpu1", "gpu2", "gpu3"]),
        ("start", ["gpu1", "gpu2", "gpu3"]),
    ]
    # Each healthy wave is handed back to the client by the start phase itself, in its round trip.
    starts = [o for op, o in host.options if op == "start"]
    assert [s["resume_clients"] for s in starts] == [{GEN: [url(30000)]}, {GEN: rest}]
    assert all("gpu" in s["by"] for s in starts)
    assert "failed" not in out
    assert out["clients_stopped"] == []
    (client,) = out["clients"]
    assert (client["unit"], client["mode"]) == (GEN, "drained")
    assert "stopped_s" not in client
    assert client["waves"] == [
        {"instances": ["gpu0"], "waited_s": 0.4, "abandoned": 0, "resumed_capacity": {url(30000): 40}, "back_s": 0.3},
        {
            "instances": ["gpu1", "gpu2", "gpu3"],
            "waited_s": 0.4,
            "abandoned": 0,
            "resumed_capacity": {u: 40 for u in rest},
            "back_s": 0.3,
        },
    ]
    assert out["notes"] == [
        f"client {GEN}: drained per wave, never stopped (gpu0: 0.4 s, 0 abandoned, back in service in 0.3 s; "
        "gpu1, gpu2, gpu3: 0.4 s, 0 abandoned, back in service in 0.3 s)"
    ]
    # The client's word is asked for with each hand-back, and the servers' key is handed over.
    assert all(s["client_confirm_timeout"] == 60.0 and s["client_keys"] is True for s in starts)
    # The drain's options: the wave's deadlines as its lease, who asks.
    drain = next(o for op, o in host.options if op == "drain")
    assert drain["client_drain_timeout"] == 120.0
    assert drain["lease"] > 2 * (300 + 300 + 3600)
    assert "gpu0" in drain["by"]


def test_instances_not_retuned_are_never_drained() -> None:
    insts = [instance("gpu0", 30000), instance("gpu1", 30001)]
    host = Host(
        {"gpu0": facts("gpu0"), "gpu1": facts("gpu1", argv=ARGV_NEW, mamba=200)},
        clients_found={GEN: answering(GEN, [30000, 30001]), OTHER: answering(OTHER, [30001])},
    )
    out = run(host, insts, client_units=[GEN, OTHER])
    drains = [o["clients"] for op, o in host.options if op == "drain"]
    assert drains == [{GEN: [url(30000)]}]
    assert [o.get("resume_clients") for op, o in host.options if op == "start"] == [{GEN: [url(30000)]}]
    assert not any(op in ("client_stop", "client_start") for op, _unused in host.ops())
    modes = {c["unit"]: c["mode"] for c in out["clients"]}
    assert modes == {GEN: "drained", OTHER: "not sending here"}
    assert out["clients_stopped"] == []
    assert f"client {OTHER}: sends to none of the instances retuned here ({url(30001)}), left alone" in out["notes"]


def test_a_client_that_does_not_answer_is_stopped_for_the_retune_and_started_again() -> None:
    insts, found = four()
    host = Host(found, clients_found={GEN: silent(GEN)})
    out = run(host, insts, client_units=[GEN])
    ops = [op for op, _unused in host.ops()]
    assert ops == ["inspect", "clients", "client_stop", *(["stop", "release", "start"] * 2), "client_start"]
    assert "drain" not in ops
    assert out["clients_stopped"] == [GEN]
    (client,) = out["clients"]
    assert client["mode"] == "stopped" and client["started_again"] is True
    assert client["stopped_s"] is not None and client["waves"] == []
    (note,) = out["notes"]
    assert note.startswith(f"client {GEN} did not answer on {sock(GEN)} (connection refused): stopped for the retune (")
    assert note.endswith("s), started again")


def test_a_wave_that_fails_still_resumes_and_the_stopped_clients_are_started_again() -> None:
    insts = [instance("gpu0", 30000), instance("gpu1", 30001)]
    host = Host(
        {"gpu0": facts("gpu0"), "gpu1": facts("gpu1")},
        clients_found={GEN: answering(GEN, [30000, 30001]), OTHER: silent(OTHER, "no answer within 10s")},
        start=crash_then_ok,
    )
    out = run(host, insts, client_units=[GEN, OTHER], canary=True)
    assert client_ops(host) == [
        ("inspect", ["gpu0", "gpu1"]),
        ("clients", [GEN, OTHER]),
        ("client_stop", [OTHER]),
        ("drain", {GEN: [url(30000)]}),
        ("stop", ["gpu0"]),
        ("release", ["gpu0"]),
        ("start", ["gpu0"]),
        # The rollback, inside the same drain.
        ("stop", ["gpu0"]),
        ("release", ["gpu0"]),
        ("start", ["gpu0"]),
        ("resume", {GEN: [url(30000)]}),
        ("client_start", [OTHER]),
    ]
    assert out["failed"] is True
    assert [r["action"] for r in out["instances"]] == ["rolled_back", "skipped"]
    assert out["clients_stopped"] == [OTHER]


def test_a_phase_that_raises_still_resumes_and_starts_the_clients_again() -> None:
    def boom(*_unused: Any) -> None:
        raise RuntimeError("the connection plugin blew up")

    insts = [instance("gpu0", 30000)]
    host = Host(
        {"gpu0": facts("gpu0")},
        clients_found={GEN: answering(GEN, [30000]), OTHER: silent(OTHER)},
        release=boom,
    )
    with pytest.raises(RuntimeError):
        run(host, insts, client_units=[GEN, OTHER])
    assert [op for op, _unused in host.ops()][-2:] == ["resume", "client_start"]


def test_a_client_whose_drain_fails_is_stopped_for_the_rest_of_the_retune() -> None:
    def drain(names: list[str], _i: Any, options: dict[str, Any]) -> dict[str, Any] | None:
        if names == ["gpu0"]:
            return None  # the canary's drain works
        return {"clients": {u: {"ok": False, "error": "no answer within 135s"} for u in options["clients"]}}

    insts, found = four()
    host = Host(found, clients_found={GEN: answering(GEN, [30000, 30001, 30002, 30003])}, drain=drain)
    out = run(host, insts, client_units=[GEN], canary=True)
    assert [op for op, _unused in host.ops()] == [
        "inspect",
        "clients",
        "drain",
        "stop",
        "release",
        "start",  # the canary healthy, its endpoint handed back in this round trip
        "drain",
        "client_stop",
        "stop",
        "release",
        "start",
        # Nothing to resume: that client is stopped, and started again at the end.
        "client_start",
    ]
    assert "failed" not in out
    assert [r["action"] for r in out["instances"]] == ["relaunched"] * 4
    (client,) = out["clients"]
    assert client["mode"] == "stopped" and client["started_again"] is True
    assert client["why"] == "drain of gpu1, gpu2, gpu3 failed (no answer within 135s)"
    assert [w["instances"] for w in client["waves"]] == [["gpu0"]]
    assert out["clients_stopped"] == [GEN]
    (note,) = out["notes"]
    assert note.startswith(
        f"client {GEN}: drain of gpu1, gpu2, gpu3 failed (no answer within 135s): stopped for the rest of the retune ("
    )
    assert note.endswith("started again; drained before: gpu0: 0.4 s, 0 abandoned, back in service in 0.3 s")


def test_check_mode_asks_nothing_of_the_clients() -> None:
    insts, found = four()
    host = Host(found, clients_found={GEN: answering(GEN, [30000]), OTHER: silent(OTHER)})
    out = run(host, insts, check=True, client_units=[GEN, OTHER])
    assert host.ops() == [("inspect", ["gpu0", "gpu1", "gpu2", "gpu3"])]
    assert (out["clients"], out["clients_stopped"]) == ([], [])


def test_nothing_to_change_asks_nothing_of_the_clients() -> None:
    host = Host({"gpu0": facts("gpu0", argv=ARGV_NEW, mamba=200)}, clients_found={GEN: answering(GEN, [30000])})
    run(host, [instance("gpu0", 30000)], client_units=[GEN])
    assert host.ops() == [("inspect", ["gpu0"])]


def test_client_drain_false_stops_the_answering_clients_as_before() -> None:
    insts, found = four()
    host = Host(found, clients_found={GEN: answering(GEN, [30000, 30001, 30002, 30003])})
    out = run(host, insts, client_units=[GEN], client_drain=False)
    ops = [op for op, _unused in host.ops()]
    assert ops[:3] == ["inspect", "clients", "client_stop"] and ops[-1] == "client_start"
    assert "drain" not in ops and "resume" not in ops
    assert out["clients"][0]["mode"] == "stopped"
    assert out["clients"][0]["why"] == "sglang_retune_client_drain is false"
    assert out["clients_stopped"] == [GEN]


def test_a_client_that_is_not_running_is_left_alone() -> None:
    host = Host(
        {"gpu0": facts("gpu0")},
        clients_found={GEN: {"unit": GEN, "running": False, "active_state": "active", "sub_state": "exited"}},
    )
    out = run(host, [instance("gpu0", 30000)], client_units=[GEN])
    assert [op for op, _unused in host.ops()] == ["inspect", "clients", "stop", "release", "start"]
    assert out["clients"][0]["mode"] == "not running"
    assert out["notes"] == [f"client {GEN}: not running (unit active/exited), left alone"]


def test_clients_that_cannot_be_found_out_leave_the_host_untouched() -> None:
    host = Host({"gpu0": facts("gpu0")}, clients=lambda *a: {"unreachable": True, "msg": "gone"})
    out = run(host, [instance("gpu0", 30000)], client_units=[GEN])
    assert [op for op, _unused in host.ops()] == ["inspect", "clients"]
    assert out["failed"] is True and out["changed"] is False
    assert "the generation clients could not be found out" in out["msg"] and "nothing was changed" in out["msg"]
    assert out["instances"][0]["action"] == "skipped"


def test_a_client_that_cannot_be_stopped_keeps_its_instances_untouched() -> None:
    def stuck(_n: Any, _i: Any, options: dict[str, Any]) -> dict[str, Any]:
        return {
            "clients": {
                u: {"stopped": False, "msg": "still deactivating/stop-sigterm after systemctl stop (rc=timed out)"}
                for u in options["client_units"]
            }
        }

    host = Host({"gpu0": facts("gpu0")}, clients_found={GEN: silent(GEN)}, client_stop=stuck)
    out = run(host, [instance("gpu0", 30000)], client_units=[GEN])
    # Its instances keep running; the client is started again (the stop may finish later).
    assert [op for op, _unused in host.ops()] == ["inspect", "clients", "client_stop", "client_start"]
    assert out["failed"] is True and "down" not in out
    r = out["instances"][0]
    assert r["action"] == "skipped" and r["state"] == "running"
    assert f"generation client(s) {GEN} may send to it and could not be stopped" in r["msg"]
    assert "could NOT be stopped" in out["notes"][0]


def test_a_failed_resume_fails_the_host_naming_the_endpoint_not_the_instance() -> None:
    def resume(_n: Any, _i: Any, options: dict[str, Any]) -> dict[str, Any]:
        return {"clients": {u: {"ok": False, "error": "no answer within 45s"} for u in options["clients"]}}

    def start(names: list[str], _i: Any, options: dict[str, Any]) -> dict[str, Any]:
        # Healthy, but the client did not answer the start phase's resume either.
        failed = {u: {"ok": False, "error": "no answer within 45s"} for u in options["resume_clients"]}
        return {
            "instances": {n: {"started": True, "healthy": True} for n in names},
            "containers": {"host": {"resumed": failed}},
        }

    host = Host({"gpu0": facts("gpu0")}, clients_found={GEN: answering(GEN, [30000])}, resume=resume, start=start)
    out = run(host, [instance("gpu0", 30000)], client_units=[GEN])
    # What the start phase could not resume, the resume phase tries again; no word from the client
    # is no proof that it has the endpoint back: the host fails, the instance itself is relaunched.
    assert [op for op, _unused in host.ops()][-2:] == ["start", "resume"]
    assert out["instances"][0]["action"] == "relaunched"
    assert out["failed"] is True
    assert f"generation client {GEN} did not take back {url(30000)} (gpu0): resuming it failed" in out["msg"]
    assert out["notes"][1].startswith(f"client {GEN}: resuming it failed (no answer within 45s) for gpu0; its drain")


def test_a_client_whose_job_ended_during_a_wave_is_not_a_lost_endpoint() -> None:
    """The job's last prompts were done while the wave was relaunched: the client exited 0, so its
    socket is gone. Nothing was taken from it: the host does not fail, and the summary says so."""
    ended = {"ok": False, "error": "no such socket", "ended": "inactive (dead), exit status 0"}

    def resume(_n: Any, _i: Any, options: dict[str, Any]) -> dict[str, Any]:
        return {"clients": dict.fromkeys(options["clients"], ended)}

    def start(names: list[str], _i: Any, options: dict[str, Any]) -> dict[str, Any]:
        return {
            "instances": {n: {"started": True, "healthy": True} for n in names},
            "containers": {"host": {"resumed": dict.fromkeys(options["resume_clients"], ended)}},
        }

    host = Host({"gpu0": facts("gpu0")}, clients_found={GEN: answering(GEN, [30000])}, resume=resume, start=start)
    out = run(host, [instance("gpu0", 30000)], client_units=[GEN])
    assert out["instances"][0]["action"] == "relaunched"
    assert not out.get("failed"), out.get("msg")
    assert "it ended by itself during the retune (inactive (dead), exit status 0: its job done)" in out["notes"][0]
    assert out["clients"][0]["ended"] == "inactive (dead), exit status 0" and "lost" not in out["clients"][0]


def test_an_endpoint_the_client_does_not_take_back_fails_the_host_and_holds_the_next_waves() -> None:
    """The canary relaunched and healthy, but its server now refuses the client's API key: the
    client's word names the endpoint and why; the host fails, the other waves are not started."""
    refused = {
        "in_service": False,
        "state": "disabled",
        "completed": 0,
        "why": "taken out of service: HTTP 401 (API key rejected)",
        "waited_s": 0.1,
    }

    def start(names: list[str], _i: Any, options: dict[str, Any]) -> dict[str, Any]:
        resumed = {
            u: {**taken_back(urls), "service": dict.fromkeys(urls, refused)}
            for u, urls in options["resume_clients"].items()
        }
        return {
            "instances": {n: {"started": True, "healthy": True} for n in names},
            "containers": {"host": {"resumed": resumed}},
        }

    insts, found = four()
    host = Host(found, clients_found={GEN: answering(GEN, [30000, 30001, 30002, 30003])}, start=start)
    out = run(host, insts, client_units=[GEN], canary=True, wave_size=0)
    assert [op for op, _unused in host.ops()] == ["inspect", "clients", "drain", "stop", "release", "start"]
    assert out["failed"] is True
    assert out["msg"] == (
        f"retune stopped, as generation client {GEN} did not take back {url(30000)} (gpu0): "
        "taken out of service: HTTP 401 (API key rejected)"
    )
    actions = {r["name"]: r["action"] for r in out["instances"]}
    assert actions == {"gpu0": "relaunched", "gpu1": "skipped", "gpu2": "skipped", "gpu3": "skipped"}
    assert "the generation client did not take back an earlier wave" in out["instances"][1]["msg"]
    (client,) = out["clients"]
    assert client["lost"] == [{"instances": ["gpu0"], "url": url(30000), "why": refused["why"]}]
    assert out["notes"][0] == (
        f"client {GEN}: drained per wave, never stopped, but did NOT take back {url(30000)} (gpu0): "
        "taken out of service: HTTP 401 (API key rejected) (gpu0: 0.4 s, 0 abandoned)"
    )


def test_a_client_that_gives_no_word_on_an_endpoint_has_not_taken_it_back() -> None:
    def resumed_without_word(_n: Any, _i: Any, options: dict[str, Any]) -> dict[str, Any]:
        plain = {
            u: {"ok": True, "resumed": urls, "capacity": {x: 40 for x in urls}}
            for u, urls in options["resume_clients"].items()
        }
        return {"instances": {"gpu0": {"started": True, "healthy": True}}, "containers": {"host": {"resumed": plain}}}

    host = Host({"gpu0": facts("gpu0")}, clients_found={GEN: answering(GEN, [30000])}, start=resumed_without_word)
    out = run(host, [instance("gpu0", 30000)], client_units=[GEN])
    assert out["failed"] is True and "the client gave no word on it" in out["msg"]


@pytest.mark.parametrize(
    ("key", "refused"),
    [
        ({"follows": False, "matches": False, "env_file": "/etc/sglang-fleet/generate.env"}, True),
        ({"follows": True, "matches": False, "env_file": "/etc/sglang-fleet/generate.env"}, False),
        ({"follows": False, "matches": True, "env_file": "/etc/sglang-fleet/generate.env"}, False),
    ],
    ids=["own-key-not-the-servers", "follows-the-servers", "own-key-is-the-servers"],
)
def test_a_client_that_cannot_get_the_servers_key_is_refused_before_any_stop(
    key: dict[str, Any], refused: bool
) -> None:
    def clients(_n: Any, _i: Any, options: dict[str, Any]) -> dict[str, Any]:
        return {"clients": {GEN: {**answering(GEN, [30000, 30001]), "key": key}}, "servers_key_set": True}

    insts = [instance("gpu0", 30000), instance("gpu1", 30001)]
    host = Host({"gpu0": facts("gpu0"), "gpu1": facts("gpu1")}, clients=clients)
    out = run(host, insts, client_units=[GEN])
    ops = [op for op, _unused in host.ops()]
    assert next(o for op, o in host.options if op == "clients")["client_keys"] is True
    if not refused:
        assert "stop" in ops and "failed" not in out
        return
    assert ops == ["inspect", "clients"]
    assert out["failed"] is True
    assert out["msg"].startswith(f"generation client {GEN} cannot get the servers' API key: its key is its own")
    assert out["msg"].endswith("; nothing was changed")
    assert {r["action"] for r in out["instances"]} == {"skipped"}


def test_without_a_key_on_the_servers_a_clients_own_key_is_no_reason_to_refuse() -> None:
    def clients(_n: Any, _i: Any, options: dict[str, Any]) -> dict[str, Any]:
        own = {"follows": False, "matches": False, "env_file": "/etc/g.env"}
        return {"clients": {GEN: {**answering(GEN, [30000]), "key": own}}, "servers_key_set": False}

    host = Host({"gpu0": facts("gpu0")}, clients=clients)
    out = run(host, [instance("gpu0", 30000)], client_units=[GEN])
    assert "failed" not in out and out["instances"][0]["action"] == "relaunched"


def test_a_wave_in_an_lxc_container_is_resumed_from_the_host_not_by_its_start() -> None:
    """The clients' sockets are on the host; a container's start phase runs in the container."""
    host = Host({"gpu0": facts("gpu0")}, clients_found={GEN: answering(GEN, [30000])})
    out = run(host, [{**instance("gpu0", 30000), "container": 101}], client_units=[GEN])
    assert out["instances"][0]["action"] == "relaunched"
    assert "resume_clients" not in next(o for op, o in host.options if op == "start")
    assert [o["clients"] for op, o in host.options if op == "resume"] == [{GEN: [url(30000)]}]


def test_a_client_not_started_again_fails_the_host() -> None:
    def start(_n: Any, _i: Any, options: dict[str, Any]) -> dict[str, Any]:
        return {
            "clients": {
                u: {"started": False, "msg": "failed/exit-code after systemctl start"} for u in options["client_units"]
            }
        }

    host = Host({"gpu0": facts("gpu0")}, clients_found={GEN: silent(GEN)}, client_start=start)
    out = run(host, [instance("gpu0", 30000)], client_units=[GEN])
    assert out["instances"][0]["action"] == "relaunched"
    assert out["failed"] is True
    assert out["msg"] == (
        f"generation client(s) NOT started again after the retune: {GEN} (failed/exit-code after systemctl start)"
    )


# -- a host that stops answering mid-retune: lost, no further call --------------------------


def lost_at(op: str, when: Any = None) -> Any:
    """A phase hook: the host stops answering this call (the action plugin's bound passed), on
    the first call of ``op``, or on the one whose instance names ``when`` gives."""

    def hook(names: list[str], _i: Any, _o: Any) -> None:
        if when is None or names == when:
            raise HostLost(op, deadline_s=41.0, margin_s=30.0, waited_s=71.2)

    return hook


def test_a_host_lost_mid_start_gets_no_further_call_and_says_what_is_known() -> None:
    insts, found = four()
    host = Host(
        found,
        clients_found={GEN: answering(GEN, [30000, 30001, 30002, 30003])},
        start=lost_at("start", ["gpu1", "gpu2", "gpu3"]),
    )
    out = run(host, insts, client_units=[GEN], canary=True)
    # The call that went unanswered is the last: no resume of the drained wave, nothing after.
    assert client_ops(host)[-4:] == [
        ("drain", {GEN: [url(30001), url(30002), url(30003)]}),
        ("stop", ["gpu1", "gpu2", "gpu3"]),
        ("release", ["gpu1", "gpu2", "gpu3"]),
        ("start", ["gpu1", "gpu2", "gpu3"]),
    ]
    r0, *rest = out["instances"]
    assert r0["action"] == "relaunched" and r0["state"] == "running"
    assert r0["host_lost"] == "relaunched and proven healthy before the host was lost"
    for r in rest:
        assert (r["action"], r["state"]) == ("failed", "unknown")
        assert r["msg"] == (
            "relaunch sent, not proven healthy: it may serve the new settings, or be DOWN (the host was lost)"
        )
    assert out["failed"] is True
    assert out["msg"].startswith(
        "HOST LOST: no answer to the start phase of gpu1, gpu2, gpu3 within 71s "
        "(its deadline 41s + sglang_retune_call_margin 30s); no further call was made to the host; "
        "gpu1, gpu2, gpu3: relaunch sent, not proven healthy"
    )
    assert "rerun once the host answers again" in out["msg"]
    assert out["host_lost"] == {
        "phase": "start",
        "instances": ["gpu1", "gpu2", "gpu3"],
        "rollback": False,
        "deadline_s": 41.0,
        "margin_s": 30.0,
        "bound_s": 71.0,
        "waited_s": 71.2,
        "why": None,
    }
    lease = out["notes"][1].split("lapses by itself ")[1]
    assert out["notes"][:2] == [
        out["msg"].split("; gpu1,")[0],
        f"client {GEN}: the drain of {url(30001)}, {url(30002)}, {url(30003)} is not resumed (the host was lost): "
        f"it lapses by itself {lease}",
    ]
    assert float(lease.split("s after")[0]) > 2 * (300 + 300 + 3600)
    assert out["round_trips"]["start"] == 2


def test_a_host_lost_mid_stop_touches_nothing_more_not_even_the_stopped_clients() -> None:
    insts = [instance("gpu0", 30000), instance("gpu1", 30001)]
    host = Host(
        {"gpu0": facts("gpu0"), "gpu1": facts("gpu1", running=False)},
        clients_found={GEN: silent(GEN)},
        stop=lost_at("stop"),
    )
    out = run(host, insts, client_units=[GEN], canary=True)
    assert host.ops()[-1] == ("stop", ["gpu0"])
    assert "client_start" not in [op for op, _unused in host.ops()]
    r0, r1 = out["instances"]
    assert (r0["action"], r0["state"]) == ("failed", "unknown")
    assert r0["msg"].startswith("stop sent, not proven dead: it may still run, or be DOWN")
    assert (r1["action"], r1["state"]) == ("skipped", "stopped")
    assert r1["msg"] == "not touched: the host was lost during the stop phase of gpu0; still stopped"
    assert out["down"] == ["gpu0"]
    assert (
        f"client {GEN}: stopped for the retune, NOT started again (the host was lost): once the host answers, "
        f"systemctl start {GEN} (a rerun leaves a stopped client alone)"
    ) in out["notes"]


def test_a_host_lost_while_a_rollback_starts_says_both() -> None:
    first = {"done": False}

    def start(names: list[str], instances: list[dict[str, Any]], options: dict[str, Any]) -> dict[str, Any] | None:
        if not first["done"]:
            first["done"] = True
            return crash_then_ok(names, instances, options)
        raise HostLost("start", deadline_s=10.0, margin_s=5.0)

    host = Host({"gpu0": facts("gpu0")}, start=start)
    out = run(host, [instance("gpu0", 30000)])
    assert [op for op, _unused in host.ops()] == ["inspect", "stop", "release", "start", "stop", "release", "start"]
    (r,) = out["instances"]
    assert (r["action"], r["state"]) == ("failed", "unknown")
    assert r["msg"] == (
        "new settings failed (crashed while starting); rollback: relaunch of its last good settings sent, "
        "not proven healthy: it may serve them, or be DOWN (the host was lost)"
    )
    assert out["host_lost"]["rollback"] is True


def test_a_host_lost_at_inspect_changes_nothing() -> None:
    host = Host({"gpu0": facts("gpu0")}, inspect=lost_at("inspect"))
    out = run(host, [instance("gpu0", 30000)])
    assert host.ops() == [("inspect", ["gpu0"])]
    assert out["failed"] is True and out["instances"] == []
    assert out["msg"].startswith("HOST LOST: no answer to the inspect phase of gpu0 within 71s")
    assert out["host_lost"]["phase"] == "inspect"


@pytest.mark.parametrize(
    "op", ["clients", "client_stop", "drain", "stop", "release", "start", "resume", "client_start"]
)
def test_no_call_follows_the_one_a_lost_host_did_not_answer(op: str) -> None:
    """Whichever call goes unanswered, it is the last one made: neither the wave's resume nor the
    clients' start (the flow's finally clauses) is tried on a lost host."""
    insts = [instance("gpu0", 30000), instance("gpu1", 30001)]

    def start_fails_to_resume(names: list[str], instances: Any, options: Any) -> dict[str, Any]:
        # A rolled back canary: its endpoints are resumed by the resume phase, not by its start.
        return crash_then_ok(names, instances, options)

    behaviour: dict[str, Any] = {op: lost_at(op)}
    if op == "resume":
        behaviour["start"] = start_fails_to_resume
    host = Host(
        {"gpu0": facts("gpu0"), "gpu1": facts("gpu1")},
        clients_found={GEN: answering(GEN, [30000, 30001]), OTHER: silent(OTHER)},
        **behaviour,
    )
    out = run(host, insts, client_units=[GEN, OTHER], canary=True)
    ops = [o for o, _unused in host.ops()]
    assert ops[-1] == op and ops.count(op) == 1
    assert out["failed"] is True
    assert out["host_lost"]["phase"] == op
    assert f"HOST LOST: no answer to the {op} phase" in out["msg"]
    # Nothing is left said to be proven that was not: an instance is proven, untouched, or failed.
    for r in out["instances"]:
        assert r["action"] in ("relaunched", "rolled_back", "skipped", "failed"), r
        assert r["action"] != "skipped" or r["state"] in ("running", "stopped")


def test_a_host_lost_after_its_waves_names_what_was_proven() -> None:
    insts = [instance("gpu0", 30000)]
    host = Host({"gpu0": facts("gpu0")}, clients_found={GEN: silent(GEN)}, client_start=lost_at("client_start"))
    out = run(host, insts, client_units=[GEN])
    (r,) = out["instances"]
    assert r["action"] == "relaunched"
    assert r["host_lost"] == "relaunched and proven healthy before the host was lost"
    assert f"client {GEN}: stopped for the retune, its start was sent, not confirmed" in " ".join(out["notes"])
    assert out["failed"] is True


# -- the fit pre-flight: settings SGLang would refuse at start are refused before any stop --------

# The demo's case: its tuning with no_buffer, 200 Mamba slots and a ratio of 0.6, on a B200 running
# the first tuning (what the simulator prints and serves for it, tests/unit/plugins/support).
UNFIT_ARGS = {
    **FIRST_TUNING,
    "mamba_radix_cache_strategy": "no_buffer",
    "max_mamba_cache_size": 200,
    "mamba_full_memory_ratio": 0.6,
    "disable_overlap_schedule": True,
}
FIT_ARGS = {**FIRST_TUNING, "max_mamba_cache_size": 120}


def simulated_host(args: dict[str, dict[str, Any]], **more: dict[str, Any]) -> tuple[list[dict[str, Any]], Host]:
    """Instances on 0.5.23 running the first tuning (journal and /server_info as the simulator
    writes them), to be retuned to ``args`` (per name); ``more``: facts to change, per name."""
    journal, info, _plan, _used = simulate(FIRST_TUNING, 0.854)
    insts, seen = [], {}
    for i, (name, new) in enumerate(args.items()):
        insts.append({**instance(name, 30000 + i), "version": "0.5.23", "args": new, "gpus": [0]})
        seen[name] = facts(name, **{"journal": journal, "server_info": info, **more.get(name, {})})
    gpus = {"0": {"total_mib": B200, "used_mib": 158989}}
    # As the retune_phase module returns it: each agent's GPUs under its container's key.
    host = Host(
        seen,
        inspect=lambda names, _i, _o: {
            "instances": {n: seen[n] for n in names},
            "containers": {"host": {"gpus": gpus}},
        },
    )
    return insts, host


def test_settings_sglang_would_refuse_at_start_leave_the_host_untouched() -> None:
    insts, host = simulated_host({"gpu0": UNFIT_ARGS, "gpu1": FIT_ARGS})
    out = run(host, insts, client_units=["sglang-fleet-generate.service"])
    # Nothing but the inspect phase: no client drained or stopped, no instance stopped.
    assert host.ops() == [("inspect", ["gpu0", "gpu1"])]
    assert host.options[0][1]["startup_journal"] == "changed"
    assert out["failed"] is True and out["changed"] is False
    gpu0, gpu1 = out["instances"]
    assert (gpu0["action"], gpu0["state"], gpu0["prediction_missing"]) == ("failed", "running", "unfit")
    assert "Loaded weights leave no GPU memory for the KV cache" in gpu0["reasons"][0]
    assert "above 0.297" in gpu0["reasons"][0] and "max_mamba_cache_size=200" in gpu0["reasons"][0]
    assert "sglang_retune_ignore_fit_prediction=true" in gpu0["reasons"][0]
    assert gpu1["action"] == "skipped" and gpu1["predicted_effective_max_running_requests"] > 0
    assert out["msg"].startswith("failed closed, nothing changed on this host: gpu0: the new settings would not")


def test_check_mode_says_the_same_refusal_as_the_run() -> None:
    insts, host = simulated_host({"gpu0": UNFIT_ARGS})
    out = run(host, insts, check=True)
    assert host.ops() == [("inspect", ["gpu0"])] and host.options[0][1]["startup_journal"] == "all"
    assert out["failed"] is True and out["instances"][0]["action"] == "failed"
    assert "Loaded weights leave no GPU memory" in out["msg"]


def test_ignore_fit_prediction_relaunches_anyway() -> None:
    insts, host = simulated_host({"gpu0": UNFIT_ARGS})
    out = run(host, insts, ignore_fit_prediction=True)
    assert [op for op, _n in host.ops()] == ["inspect", "stop", "release", "start"]
    assert out["instances"][0]["action"] == "relaunched"
    assert out["instances"][0]["prediction_missing"] == "unfit"


@pytest.mark.parametrize(
    ("missing", "word"),
    [
        ({"journal": [], "journal_error": "journalctl: rc=1"}, "journal"),  # no evidence: not a refusal
        ({"server_info": {**SIM_B200_SERVER_INFO, "version": "0.5.14"}}, "unfit"),  # read with another release's facts
    ],
)
def test_an_uncertain_prediction_never_refuses(missing: dict[str, Any], word: str) -> None:
    insts, host = simulated_host({"gpu0": UNFIT_ARGS}, gpu0=missing)
    out = run(host, insts)
    assert [op for op, _n in host.ops()] == ["inspect", "stop", "release", "start"]
    assert out["instances"][0]["action"] == "relaunched"
    assert out["instances"][0]["prediction_missing"] == word


def test_a_forced_relaunch_of_unchanged_settings_reads_and_predicts_nothing() -> None:
    _journal, info, _plan, _used = simulate(FIRST_TUNING, 0.854)
    inst = {**instance("gpu0", 30000), "version": "0.5.23", "args": UNFIT_ARGS}
    seen = facts("gpu0", argv=ARGV_NEW, mamba=200, server_info={**info, "max_mamba_cache_size": 200})
    out = run(Host({"gpu0": seen}), [inst], force=True)
    assert out["instances"][0]["action"] == "relaunched"
    assert "prediction_missing" not in out["instances"][0]
