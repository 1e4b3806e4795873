"""A kept trial as a proposal: the commit on a new branch of a real git repository (the checkout and
its branch untouched; refusals before anything is touched), and the platforms' API calls against a
local stand-in HTTP server (the payload holds the evidence, the token never in output, HTTP
errors named with the documented exit status)."""

from __future__ import annotations

import datetime as dt
import io
import json
import subprocess
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from sglang_fleet_ops import cli, proposal, proposing
from sglang_fleet_ops.proposal_git import GitError, branch_name, check_ready, commit_on_branch, push_branch
from sglang_fleet_ops.trial import TrialError

TOKEN = "ghs_s3cr3t-t0ken-value"  # noqa: S105 (made up: the tests look for it in every output)
HOST_FILE = "---\n# the big box\nsglang_server_host_args:\n  max_mamba_cache_size: 80  # by hand\n"
VARIABLES = {("host_vars", "b200-node"): {"sglang_server_host_args": {"max_mamba_cache_size": 156}}}
GROUP = {"label": "b200-node/gpu0,gpu1", "diagnosis": "mamba-bound", "instances": ["b200-node/gpu0", "b200-node/gpu1"]}
TRIAL: dict[str, Any] = {
    "decision": "kept",
    "threshold": 1.1,
    "group": GROUP,
    "canary": "b200-node/gpu0",
    "changes": {"max_mamba_cache_size": [80, 156]},
    "before": {"canary": 800.0, "others": {"b200-node/gpu1": 790.0}},
    "after": {
        "canary": 1300.0,
        "others": {"b200-node/gpu1": 800.0},
        "baseline": 800.0,
        "baseline_of": "the untouched instances' mean",
    },
    "gain": 1.625,
    "retune": {"effective_max_running_requests_before": 16, "effective_max_running_requests_after": 52},
    "predicted": {"effective_max_after": 52, "throughput_factor_expected": 1.6},
    "problems": [],
}


def sh(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout


@pytest.fixture
def fleet_repo(tmp_path: Path) -> Path:
    repo = tmp_path / "fleet"
    (repo / "inventory" / "prod" / "host_vars").mkdir(parents=True)
    (repo / "inventory" / "prod" / "hosts.yml").write_text("all:\n  hosts:\n    b200-node: {}\n")
    (repo / "inventory" / "prod" / "host_vars" / "b200-node.yml").write_text(HOST_FILE)
    (repo / "notes.txt").write_text("work in progress\n")
    sh(repo.parent, "init", "-q", "-b", "main", str(repo))
    sh(repo, "add", "-A")
    sh(repo, "-c", "user.name=t", "-c", "user.email=t@example.invalid", "commit", "-qm", "the fleet")
    (repo / "notes.txt").write_text("uncommitted, outside the inventory\n")
    return repo


def test_the_branch_holds_the_inventory_change_and_the_checkout_is_untouched(fleet_repo: Path) -> None:
    branch = branch_name(GROUP, dt.date(2026, 12, 2))
    assert branch == "sglang-fleet/tune-20261202-mamba-bound-b200-node-gpu0-gpu1"
    root, rel = check_ready(fleet_repo, Path("inventory/prod"), branch, VARIABLES)
    head = sh(fleet_repo, "rev-parse", "HEAD")
    done = commit_on_branch(root, rel, branch, VARIABLES, lambda files: proposal.commit_message(TRIAL, files, "d"))
    assert done["base"] == "main" and done["files"] == ["inventory/prod/host_vars/b200-node.yml"]
    # The checkout: same branch, same commit, the uncommitted file as it was, no worktree left.
    assert sh(fleet_repo, "symbolic-ref", "--short", "HEAD").strip() == "main"
    assert sh(fleet_repo, "rev-parse", "HEAD") == head
    assert (fleet_repo / "notes.txt").read_text() == "uncommitted, outside the inventory\n"
    assert (fleet_repo / "inventory/prod/host_vars/b200-node.yml").read_text() == HOST_FILE
    assert len(sh(fleet_repo, "worktree", "list").splitlines()) == 1
    # The branch: one commit on main, the file changed there with its comments, the evidence in the message.
    assert sh(fleet_repo, "rev-parse", f"{branch}~1") == head
    # ruamel.yaml keeps an end-of-line comment at its column.
    changed = HOST_FILE.replace("80  # by hand", "156 # by hand")
    assert sh(fleet_repo, "show", f"{branch}:inventory/prod/host_vars/b200-node.yml") == changed
    message = sh(fleet_repo, "log", "-1", "--format=%B", branch)
    assert message.startswith("sglang-fleet tuning of b200-node/gpu0,gpu1 (mamba-bound): max_mamba_cache_size 156")
    assert "| measured gain | x1.62 (kept at x1.10 or more) |" in message
    assert "| canary after | 1300 tok/s |" in message
    assert "| predicted throughput factor expected | 1.6 |" in message


@pytest.mark.parametrize(
    ("prepare", "said"),
    [
        (lambda r: (r / "inventory/prod/hosts.yml").write_text("all: {}\n"), "uncommitted changes"),
        (lambda r: sh(r, "branch", "sglang-fleet/tune-x"), "exists already"),
        (lambda r: (r / "inventory/prod/host_vars/b200-node.yml").unlink(), "uncommitted changes"),
    ],
)
def test_a_repository_not_ready_is_refused_before_anything(fleet_repo: Path, prepare: Any, said: str) -> None:
    prepare(fleet_repo)
    branches = sh(fleet_repo, "branch", "--list")
    with pytest.raises(GitError, match=said):
        check_ready(fleet_repo, Path("inventory/prod"), "sglang-fleet/tune-x", VARIABLES)
    assert sh(fleet_repo, "branch", "--list") == branches


@pytest.mark.parametrize("changed", ["host_vars/b200-node.yml", "group_vars/all.yml"])
def test_an_inventory_named_by_its_hosts_file_is_checked_whole(fleet_repo: Path, changed: str) -> None:
    # ansible.cfg and -i usually name the hosts file: its host_vars and group_vars are the inventory too.
    (fleet_repo / "inventory/prod" / changed).parent.mkdir(exist_ok=True)
    (fleet_repo / "inventory/prod" / changed).write_text("---\nsglang_server_args: {max_mamba_cache_size: 99}\n")
    with pytest.raises(GitError, match=f"uncommitted changes.*inventory/prod/{changed}"):
        check_ready(fleet_repo, Path("inventory/prod/hosts.yml"), "sglang-fleet/tune-x", VARIABLES)


def test_no_repository_is_refused(tmp_path: Path) -> None:
    (tmp_path / "inv").mkdir()
    with pytest.raises(GitError, match="not in a git repository"):
        check_ready(tmp_path, Path("inv"), "b", VARIABLES)


def test_a_failed_edit_leaves_no_branch(fleet_repo: Path) -> None:
    root, rel = check_ready(fleet_repo, Path("inventory/prod"), "sglang-fleet/tune-y", VARIABLES)
    with pytest.raises(Exception, match="only host_vars and group_vars"):
        commit_on_branch(root, rel, "sglang-fleet/tune-y", {("hosts", "x"): {}}, lambda files: "m")
    assert "tune-y" not in sh(fleet_repo, "branch", "--list")


def test_the_token_pushes_in_a_header_only_and_never_shows(fleet_repo: Path, tmp_path: Path) -> None:
    sh(fleet_repo, "branch", "proposal")
    bare = tmp_path / "origin.git"
    sh(tmp_path, "init", "-q", "--bare", str(bare))
    push_branch(fleet_repo, str(bare), "proposal", TOKEN, "x-access-token")
    assert sh(bare, "rev-parse", "proposal") == sh(fleet_repo, "rev-parse", "proposal")
    with pytest.raises(GitError) as err:
        push_branch(fleet_repo, "http://127.0.0.1:9/fleet.git", "proposal", TOKEN, "x-access-token")
    assert "could not be pushed" in str(err.value) and TOKEN not in str(err.value)


# ------------------------------------------------------------------------------------------
# The platforms, against a local stand-in


class StandIn(BaseHTTPRequestHandler):
    answers: list[tuple[int, dict[str, Any]]] = []
    seen: list[dict[str, Any]] = []

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        self.seen.append(
            {"path": self.path, "headers": dict(self.headers), "json": json.loads(self.rfile.read(length))}
        )
        status, body = self.answers.pop(0)
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def stand_in() -> Iterator[str]:
    StandIn.answers, StandIn.seen = [], []
    server = ThreadingHTTPServer(("127.0.0.1", 0), StandIn)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_github_opens_the_pull_request_with_the_evidence(stand_in: str) -> None:
    StandIn.answers = [(201, {"html_url": "https://github.example/fleet/prod/pull/8"})]
    body = proposal.evidence_markdown(TRIAL, ["inventory/prod/host_vars/b200-node.yml"], "2026-12-02")
    url = proposal.GitHub(stand_in, "fleet/prod", TOKEN).open_proposal("tune-x", "main", proposal.title(TRIAL), body)
    assert url == "https://github.example/fleet/prod/pull/8"
    (seen,) = StandIn.seen
    assert seen["path"] == "/repos/fleet/prod/pulls"
    assert seen["headers"]["Authorization"] == f"Bearer {TOKEN}"
    assert seen["json"]["head"] == "tune-x" and seen["json"]["base"] == "main"
    assert "| measured gain | x1.62 (kept at x1.10 or more) |" in seen["json"]["body"]
    assert "| `max_mamba_cache_size` | `80` -> `156` |" in seen["json"]["body"]


def test_gitlab_opens_the_merge_request_with_a_project_token(stand_in: str) -> None:
    StandIn.answers = [(201, {"web_url": "https://gitlab.example/fleet/prod/-/merge_requests/3"})]
    platform = proposal.GitLab(f"{stand_in}/api/v4", "fleet/prod", TOKEN)
    url = platform.open_proposal("tune-x", "main", "t", "evidence")
    assert url.endswith("/merge_requests/3")
    (seen,) = StandIn.seen
    assert seen["path"] == "/api/v4/projects/fleet%2Fprod/merge_requests"
    assert {k.lower(): v for k, v in seen["headers"].items()}["private-token"] == TOKEN
    assert seen["json"]["source_branch"] == "tune-x" and seen["json"]["description"] == "evidence"


def test_an_http_error_is_named_without_the_token(stand_in: str) -> None:
    StandIn.answers = [(403, {"message": f"Resource not accessible by integration ({TOKEN})"})]
    with pytest.raises(proposal.ProposalError) as err:
        proposal.GitHub(stand_in, "fleet/prod", TOKEN).open_proposal("h", "main", "t", "b")
    assert "HTTP 403" in str(err.value) and "Resource not accessible by integration" in str(err.value)
    assert TOKEN not in str(err.value)


def test_no_answer_within_the_timeout_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(proposal.ProposalError, match="no answer"):
        proposal.GitHub("http://127.0.0.1:9", "fleet/prod", TOKEN, timeout=2).open_proposal("h", "main", "t", "b")


def proposal_file(tmp_path: Path, found: dict[str, Any]) -> Path:
    path = tmp_path / "proposal.json"
    path.write_text(json.dumps({"format": 1, **found}))
    return path


def run_propose(tmp_path: Path, argv: list[str]) -> tuple[int, str, str, dict[str, Any]]:
    out, err = io.StringIO(), io.StringIO()
    code = cli.main(
        ["propose", "--project-dir", str(tmp_path), *argv],
        runner=None,
        out=out,
        err=err,
        check_collection=lambda p: None,
    )  # type: ignore[arg-type]
    run_dir = out.getvalue().strip().splitlines()[-1].removeprefix("artifacts: ")
    return code, out.getvalue(), err.getvalue(), json.loads((Path(run_dir) / "summary.json").read_text())


def test_the_cli_pushes_and_opens(fleet_repo: Path, tmp_path: Path, stand_in: str, monkeypatch: Any) -> None:
    sh(fleet_repo, "branch", "tune-x")
    bare = tmp_path / "origin.git"
    sh(tmp_path, "init", "-q", "--bare", str(bare))
    StandIn.answers = [(201, {"html_url": "https://github.example/pull/8"})]
    monkeypatch.setenv("GITHUB_TOKEN", TOKEN)
    monkeypatch.setenv("GITHUB_REPOSITORY", "fleet/prod")
    monkeypatch.setenv("GITHUB_API_URL", stand_in)
    path = proposal_file(tmp_path, {"proposed": True, "branch": "tune-x", "base": "main", "title": "t", "body": "b"})
    code, out, err, summary = run_propose(
        fleet_repo, ["--proposal", str(path), "--platform", "github", "--remote", str(bare)]
    )
    assert code == proposing.OPENED, err
    assert "opened on GitHub: https://github.example/pull/8 (tune-x -> main)" in out
    assert summary["url"] == "https://github.example/pull/8"
    assert TOKEN not in out + err + json.dumps(summary)


def test_the_cli_names_the_http_status_and_exits_1(
    fleet_repo: Path, tmp_path: Path, stand_in: str, monkeypatch: Any
) -> None:
    sh(fleet_repo, "branch", "tune-x")
    bare = tmp_path / "origin.git"
    sh(tmp_path, "init", "-q", "--bare", str(bare))
    StandIn.answers = [
        (422, {"message": "Validation Failed", "errors": [{"message": "A pull request already exists"}]})
    ]
    monkeypatch.setenv("SGLANG_FLEET_GITLAB_PROPOSE_TOKEN", TOKEN)
    monkeypatch.setenv("CI_API_V4_URL", stand_in)
    monkeypatch.setenv("CI_PROJECT_ID", "7")
    path = proposal_file(tmp_path, {"proposed": True, "branch": "tune-x", "base": "main", "title": "t", "body": "b"})
    code, out, err, summary = run_propose(
        fleet_repo, ["--proposal", str(path), "--platform", "gitlab", "--remote", str(bare)]
    )
    assert code == proposing.FAILED == 1
    assert "HTTP 422" in err and "A pull request already exists" in err
    assert TOKEN not in out + err + json.dumps(summary)


def test_the_cli_without_a_token_touches_nothing(fleet_repo: Path, tmp_path: Path, monkeypatch: Any) -> None:
    monkeypatch.delenv("GITHUB_TOKEN", raising=False)
    path = proposal_file(tmp_path, {"proposed": True, "branch": "tune-x", "base": "main", "title": "t", "body": "b"})
    code, _out, err, _summary = run_propose(fleet_repo, ["--proposal", str(path), "--platform", "github"])
    assert code == 1 and "GITHUB_TOKEN is empty or unset" in err


def test_a_reverted_trial_opens_nothing_and_says_why(tmp_path: Path) -> None:
    why = proposal.not_proposed_why({**TRIAL, "decision": "reverted", "gain": 1.02})
    assert why == "the trial was reverted: gain x1.02 < x1.10; nothing to propose"
    path = proposal_file(tmp_path, {"proposed": False, "why": why})
    code, out, _err, summary = run_propose(tmp_path, ["--proposal", str(path), "--platform", "github"])
    assert code == proposing.NOTHING == 2
    assert "nothing to propose: the trial was reverted: gain x1.02 < x1.10" in out
    assert summary["proposed"] is False


def test_the_trial_proposal_refuses_before_the_canary_is_touched(tmp_path: Path) -> None:
    proposer = proposing.TrialProposal(tmp_path, tmp_path / "inventory")
    with pytest.raises(TrialError, match=r"--propose: .* not in a git repository.*nothing was touched"):
        proposer.before_touch(
            {"patch": {"host_vars": {"b200-node": VARIABLES[("host_vars", "b200-node")]}}}, {"group": GROUP}
        )


def test_the_evidence_names_the_pictures_the_trial_has() -> None:
    rows = dict(proposal.evidence_rows({**TRIAL, "picture": "advice/b200-node.png"}))
    assert rows["picture 1"] == "`advice/b200-node.png`"
    rows = dict(proposal.evidence_rows({**TRIAL, "pictures": {"before": "a.png", "after": "b.png"}}))
    assert rows["picture before"] == "`a.png`" and rows["picture after"] == "`b.png`"


def test_the_platform_needs_its_variables_before_anything_is_pushed() -> None:
    with pytest.raises(proposal.ProposalError, match="CI_API_V4_URL and CI_PROJECT_ID"):
        proposing.platform_from_env("gitlab", None, {"SGLANG_FLEET_GITLAB_PROPOSE_TOKEN": TOKEN})
    with pytest.raises(proposal.ProposalError, match="GITHUB_REPOSITORY"):
        proposing.platform_from_env("github", None, {"GITHUB_TOKEN": TOKEN})
    github = proposing.platform_from_env("github", None, {"GITHUB_TOKEN": TOKEN, "GITHUB_REPOSITORY": "o/r"})
    assert isinstance(github, proposal.GitHub) and github.api_url == "https://api.github.com"
    assert TOKEN not in repr(github)


def test_the_inventory_is_the_one_ansible_cfg_names(tmp_path: Path) -> None:
    assert proposing.inventory_path(tmp_path, "inventory/prod") == tmp_path / "inventory/prod"
    with pytest.raises(TrialError, match="name the inventory with -i"):
        proposing.inventory_path(tmp_path, None)
    (tmp_path / "ansible.cfg").write_text("[defaults]\ninventory = inventory/prod/hosts.yml\n")
    assert proposing.inventory_path(tmp_path, None) == tmp_path / "inventory/prod/hosts.yml"
