"""advise --trial (trial.py) with fake playbook runs: the group and canary chosen, retune.yml's
extra vars (the proposal in the canary's own args, only the canary relaunched), the comparison
against the untouched instances, kept or reverted, and the CLI's JSON and text. With --propose,
in a real fleet repository: a kept trial leaves a branch with the inventory change and
proposal.json; a reverted one writes and commits nothing and says why; a repository that is not
ready refuses before the canary is touched."""

from __future__ import annotations

import io
import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
from sglang_fleet_ops import cli, trial
from sglang_fleet_ops.runner import Run

CHANGES = {"max_mamba_cache_size": [80, 156], "mamba_radix_cache_strategy": ["auto", "no_buffer"]}
GROUP = ["b200-node/gpu0", "b200-node/gpu1", "b200-node/gpu2"]


def item(key: str, rate: float | None) -> dict[str, Any]:
    host, name = key.split("/")
    return {"host": host, "name": name, "stats": {"generation_rate": rate, "gen_throughput_mean": None}}


LAYOUT = [
    {"name": "gpu0", "gpus": [0], "port": 30000},
    {"name": "gpu1", "gpus": [1], "port": 30001, "args": {"max_running_requests": 32}},
    {"name": "gpu2", "gpus": [2], "port": 30002},
]


def args_after(key: str) -> dict[str, Any]:
    """What the advisor's report gives each instance of the group: its own args with the proposal."""
    own = next(e for e in LAYOUT if e["name"] == key.split("/")[1]).get("args") or {}
    return {**own, **{k: v[1] for k, v in CHANGES.items()}}


def report(rates: dict[str, float | None]) -> dict[str, Any]:
    return {
        "groups": [
            {
                "label": "b200-node/gpu3",
                "diagnosis": "client-bound",
                "instances": ["b200-node/gpu3"],
                "proposal": {"changes": {}, "client_changes": {"generation_concurrency": "auto"}},
            },
            {
                "label": "b200-node/gpu0,gpu1,gpu2",
                "diagnosis": "mamba-bound",
                "instances": GROUP,
                "proposal": {
                    "changes": CHANGES,
                    "effective_max_before": 16,
                    "effective_max_after": 52,
                    "throughput_factor": 3.09,
                },
            },
        ],
        "instances": [{**item(k, v), "args_after": args_after(k)} for k, v in rates.items()],
        "layouts": {"b200-node": LAYOUT},
    }


def outcome(action: str, problems: list[str] | None = None, after: int | None = 52) -> dict[str, Any]:
    inst = {
        "name": "gpu0",
        "action": action,
        "effective_max_running_requests_before": 16,
        "effective_max_running_requests_after": after,
    }
    return {"hosts": {"b200-node": {"status": "ok", "instances": [inst]}}, "problems": problems or []}


class Fakes:
    def __init__(self, after_rates: dict[str, float | None], retunes: list[dict[str, Any]]):
        self.reports = [report(dict.fromkeys(GROUP, 1200.0)), report(after_rates)]
        self.retunes = list(retunes)
        self.calls: list[tuple[Any, ...]] = []
        self.slept: list[float] = []

    def advise(self, limit: str | None, window: float | None) -> dict[str, Any]:
        self.calls.append(("advise", limit, window))
        return {"report": self.reports.pop(0), "problems": []}

    def retune(self, limit: str, extravars: dict[str, Any], ident: str) -> dict[str, Any]:
        self.calls.append(("retune", limit, extravars, ident))
        return self.retunes.pop(0)

    def run(self, **kw: Any) -> dict[str, Any]:
        return trial.run_trial(self.advise, self.retune, window=300.0, sleep=self.slept.append, **kw)


def test_a_gain_past_the_threshold_is_kept_and_only_the_canary_is_relaunched() -> None:
    fakes = Fakes(
        {"b200-node/gpu0": 3600.0, "b200-node/gpu1": 1190.0, "b200-node/gpu2": 1210.0}, [outcome("relaunched")]
    )
    out = fakes.run(settle=30.0)
    assert out["decision"] == "kept" and out["problems"] == []
    assert out["canary"] == "b200-node/gpu0" and out["group"]["diagnosis"] == "mamba-bound"
    assert out["after"]["baseline"] == pytest.approx(1200.0) and out["gain"] == pytest.approx(3.0)
    (_, limit, extravars, ident) = fakes.calls[1]
    assert (limit, ident) == ("b200-node", "trial-apply")
    assert extravars["sglang_retune_only"] == ["gpu0"]
    entries = extravars["sglang_server_instances"]
    assert entries[0]["args"] == {"max_mamba_cache_size": 156, "mamba_radix_cache_strategy": "no_buffer"}
    # The untouched instances' entries are the inventory's.
    assert entries[1] == {"name": "gpu1", "gpus": [1], "port": 30001, "args": {"max_running_requests": 32}}
    assert "args" not in entries[2]
    assert fakes.calls[2] == ("advise", "b200-node", 300.0) and fakes.slept == [30.0]
    assert len(fakes.calls) == 3  # no revert
    text = trial.trial_text(out)
    assert "canary b200-node/gpu0" in text and "gain x3.00 >= x1.10" in text and "KEPT" in text
    assert "after: canary 3600 tok/s; the untouched instances' mean 1200 tok/s" in text
    assert trial.trial_exit(out) == 0


def test_a_gain_below_the_threshold_puts_the_canary_back() -> None:
    fakes = Fakes(
        {"b200-node/gpu0": 1250.0, "b200-node/gpu1": 1200.0, "b200-node/gpu2": 1200.0},
        [outcome("relaunched"), outcome("relaunched", after=16)],
    )
    out = fakes.run()
    assert out["decision"] == "reverted" and out["gain"] == pytest.approx(1250 / 1200, abs=1e-4)
    (_, limit, extravars, ident) = fakes.calls[-1]
    assert (limit, extravars, ident) == ("b200-node", {"sglang_retune_only": ["gpu0"]}, "trial-revert")
    assert out["revert"]["effective_max_running_requests_after"] == 16
    assert "REVERTED" in trial.trial_text(out) and "gain x1.04 < x1.10" in trial.trial_text(out)
    assert trial.trial_exit(out) == 0


def test_a_failed_relaunch_is_failed_and_the_host_put_back() -> None:
    fakes = Fakes({}, [outcome("rolled_back", ["b200-node/gpu0: rolled_back: crashed"]), outcome("unchanged")])
    out = fakes.run()
    assert out["decision"] == "failed" and trial.trial_exit(out) == 1
    assert [c[-1] for c in fakes.calls if c[0] == "retune"] == ["trial-apply", "trial-revert"]
    assert any("crashed" in p for p in out["problems"])


def test_a_revert_that_fails_is_an_error() -> None:
    fakes = Fakes(dict.fromkeys(GROUP, 1200.0), [outcome("relaunched"), outcome("failed", ["down"])])
    out = fakes.run()
    assert trial.trial_exit(out) == 1
    assert any("could NOT be put back" in p for p in out["problems"])


def test_group_and_canary_choices() -> None:
    rep = report({})
    with pytest.raises(trial.TrialError, match="no server settings"):
        trial.choose_group(rep, 1)
    assert trial.choose_group(rep)["diagnosis"] == "mamba-bound"
    assert trial.choose_canary(trial.choose_group(rep), "b200-node/gpu2") == "b200-node/gpu2"
    with pytest.raises(trial.TrialError, match="not in the group"):
        trial.choose_canary(trial.choose_group(rep), "b200-node/gpu3")
    # --canary alone: its own group.
    assert trial.choose_group(rep, canary="b200-node/gpu1")["diagnosis"] == "mamba-bound"
    with pytest.raises(trial.TrialError, match=r"the group of b200-node/gpu3 .* has no server settings to try"):
        trial.choose_group(rep, canary="b200-node/gpu3")
    with pytest.raises(trial.TrialError, match="--canary b200-node/gpu9: the report has no such instance"):
        trial.choose_group(rep, canary="b200-node/gpu9")


def test_the_canary_is_relaunched_with_the_args_the_report_gives_it() -> None:
    rep = report(dict.fromkeys(GROUP, 1200.0))
    extravars = trial.trial_extravars(rep, "b200-node/gpu1")
    # gpu1's own max_running_requests stays; the proposal is added (the advisor's args_after).
    assert extravars["sglang_server_instances"][1]["args"] == args_after("b200-node/gpu1")
    assert extravars["sglang_server_instances"][1]["args"]["max_running_requests"] == 32
    del rep["instances"][1]["args_after"]
    with pytest.raises(trial.TrialError, match="no args with the proposal for b200-node/gpu1"):
        trial.trial_extravars(rep, "b200-node/gpu1")


def test_a_group_of_one_is_compared_with_the_canary_before() -> None:
    fakes = Fakes({"b200-node/gpu0": 2400.0}, [outcome("relaunched")])
    for rep in fakes.reports:
        rep["groups"][1]["instances"] = ["b200-node/gpu0"]
    out = fakes.run()
    assert out["after"]["baseline_of"] == "the canary itself before the change"
    assert out["gain"] == pytest.approx(2.0) and out["decision"] == "kept"


def test_the_cli_runs_the_trial_and_prints_json(project: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fakes = Fakes(
        {"b200-node/gpu0": 3600.0, "b200-node/gpu1": 1200.0, "b200-node/gpu2": 1200.0}, [outcome("relaunched")]
    )
    seen: list[tuple[str | None, str, dict[str, Any]]] = []

    def runner(run_dir: Path, proj: Path, inventory: str | None, limit: str | None, request: Any) -> Run:
        seen.append((limit, request.playbook, request.extravars))
        return Run(ident=request.ident, playbook=request.playbook, rc=0, status="successful")

    monkeypatch.setattr(cli.advise_mod, "build_advice", lambda run: fakes.advise(None, None))
    monkeypatch.setattr(cli.apply_mod, "build_outcome", lambda run: fakes.retunes.pop(0))
    out, err = io.StringIO(), io.StringIO()
    argv = [
        "advise",
        "--trial",
        "--json",
        "--settle",
        "0",
        "--window",
        "60",
        "--measure",
        "--project-dir",
        str(project),
    ]
    argv += ["--out", str(project / "advice.yml")]
    code = cli.main(argv, runner=runner, out=out, err=err)
    assert code == 0, err.getvalue()
    printed = json.loads(out.getvalue())
    assert printed["decision"] == "kept" and printed["gain"] == pytest.approx(3.0)
    assert [(s[0], s[1]) for s in seen] == [
        (None, "sglang_ops.fleet.advise"),
        ("b200-node", "sglang_ops.fleet.retune"),
        ("b200-node", "sglang_ops.fleet.advise"),
    ]
    assert seen[1][2]["sglang_retune_only"] == ["gpu0"] and seen[0][2]["sglang_advise_window"] == 60.0
    # The measurement and --out are the advice's; the trial's observation measures the canary as it
    # runs and leaves the advice's patch alone (its own goes to the run dir).
    assert seen[0][2]["sglang_advise_measure"] is True
    assert seen[0][2]["sglang_advise_output"] == str((project / "advice.yml").resolve())
    assert "sglang_advise_measure" not in seen[2][2]
    assert seen[2][2]["sglang_advise_output"].endswith("/trial-observe-advice.yml")


# ------------------------------------------------------------------------------------------
# --propose
HOST_FILE = """---
# b200-node: three B200s, one instance each
sglang_server_instances:
  - name: gpu0
    gpus: [0]
    port: 30000
  # gpu1 serves the long-context jobs
  - name: gpu1
    gpus: [1]
    port: 30001
    args: {max_running_requests: 32}
  - name: gpu2
    gpus: [2]
    port: 30002
"""
KEPT = {"b200-node/gpu0": 3600.0, "b200-node/gpu1": 1200.0, "b200-node/gpu2": 1200.0}
REVERTED = {"b200-node/gpu0": 1210.0, "b200-node/gpu1": 1200.0, "b200-node/gpu2": 1200.0}


def sh(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout


@pytest.fixture
def fleet(tmp_path: Path) -> Path:
    repo = tmp_path / "fleet"
    (repo / "inventory" / "prod" / "host_vars").mkdir(parents=True)
    (repo / "inventory" / "prod" / "host_vars" / "b200-node.yml").write_text(HOST_FILE)
    (repo / "ansible.cfg").write_text("[defaults]\ninventory = inventory/prod\n")
    (repo / ".gitignore").write_text(".sglang-fleet-ops/\n")
    sh(tmp_path, "init", "-q", "-b", "main", str(repo))
    sh(repo, "add", "-A")
    sh(repo, "-c", "user.name=t", "-c", "user.email=t@example.invalid", "commit", "-qm", "the fleet")
    return repo


def trial_cli(
    fleet: Path, monkeypatch: pytest.MonkeyPatch, fakes: Fakes
) -> tuple[int, str, str, list[str], dict[str, Any]]:
    playbooks: list[str] = []

    def runner(run_dir: Path, proj: Path, inventory: str | None, limit: str | None, request: Any) -> Run:
        playbooks.append(request.ident)
        return Run(ident=request.ident, playbook=request.playbook, rc=0, status="successful")

    monkeypatch.setattr(cli.advise_mod, "build_advice", lambda run: fakes.advise(None, None))
    monkeypatch.setattr(cli.apply_mod, "build_outcome", lambda run: fakes.retunes.pop(0))
    out, err = io.StringIO(), io.StringIO()
    argv = ["advise", "--trial", "--propose", "--settle", "0", "--project-dir", str(fleet)]
    code = cli.main(argv, runner=runner, out=out, err=err, check_collection=lambda p: None)
    run_dir = Path(out.getvalue().strip().splitlines()[-1].removeprefix("artifacts: "))
    found = json.loads((run_dir / "proposal.json").read_text()) if (run_dir / "proposal.json").exists() else {}
    return code, out.getvalue(), err.getvalue(), playbooks, found


def branches(repo: Path) -> list[str]:
    return sh(repo, "branch", "--format=%(refname:short)").split()


def test_a_kept_trial_commits_the_inventory_change_on_a_new_branch(
    fleet: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    code, out, err, playbooks, found = trial_cli(fleet, monkeypatch, Fakes(KEPT, [outcome("relaunched")]))
    assert code == 0, err
    assert found["proposed"] is True and found["base"] == "main"
    assert found["files"] == ["inventory/prod/host_vars/b200-node.yml"]
    assert found["branch"].startswith("sglang-fleet/tune-") and found["branch"].endswith(
        "-mamba-bound-b200-node-gpu0-gpu1-gpu2"
    )
    assert branches(fleet) == ["main", found["branch"]]
    assert sh(fleet, "symbolic-ref", "--short", "HEAD").strip() == "main"
    assert (fleet / "inventory/prod/host_vars/b200-node.yml").read_text() == HOST_FILE
    changed = sh(fleet, "show", f"{found['branch']}:inventory/prod/host_vars/b200-node.yml")
    assert "# gpu1 serves the long-context jobs" in changed and "# b200-node: three B200s" in changed
    args = "{max_running_requests: 32, max_mamba_cache_size: 156, mamba_radix_cache_strategy: no_buffer}"
    assert f"  - name: gpu1\n    gpus: [1]\n    port: 30001\n    args: {args}\n" in changed
    assert "| measured gain | x3.00 (kept at x1.10 or more) |" in found["body"]
    assert "| measured gain | x3.00" in sh(fleet, "log", "-1", "--format=%B", found["branch"])
    assert f"PROPOSED: committed {found['commit'][:12]} on the branch {found['branch']}" in out
    assert playbooks == ["advise", "trial-apply", "trial-observe"]


def test_a_reverted_trial_writes_and_commits_nothing_and_says_why(fleet: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fakes = Fakes(REVERTED, [outcome("relaunched"), outcome("relaunched", after=16)])
    code, out, _err, _playbooks, found = trial_cli(fleet, monkeypatch, fakes)
    assert code == 0
    assert found == {
        "format": 1,
        "proposed": False,
        "why": "the trial was reverted: gain x1.01 < x1.10; nothing to propose",
    }
    assert "NOT PROPOSED: the trial was reverted: gain x1.01 < x1.10" in out
    assert branches(fleet) == ["main"] and sh(fleet, "status", "--porcelain") == ""


def test_an_uncommitted_inventory_is_refused_before_the_canary_is_touched(
    fleet: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (fleet / "inventory/prod/host_vars/b200-node.yml").write_text(HOST_FILE + "# an edit\n")
    code, _out, err, playbooks, found = trial_cli(fleet, monkeypatch, Fakes(KEPT, [outcome("relaunched")]))
    assert code == 1
    assert "--propose: the inventory inventory/prod has uncommitted changes" in err and "nothing was touched" in err
    assert playbooks == ["advise"]  # no retune.yml
    assert found["proposed"] is False and found["why"].startswith("the trial failed: --propose: the inventory")
    assert branches(fleet) == ["main"]


def test_propose_without_trial_is_refused_before_anything_runs(fleet: Path) -> None:
    out, err = io.StringIO(), io.StringIO()
    argv = ["advise", "--propose", "--project-dir", str(fleet)]
    code = cli.main(argv, runner=None, out=out, err=err, check_collection=lambda p: None)  # type: ignore[arg-type]
    assert code == 1 and "--propose proposes a kept trial: give --trial too" in err.getvalue()
