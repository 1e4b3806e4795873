"""``advise --trial --propose`` and ``propose``: a kept trial written into the fleet repository's
inventory on a branch of its own (proposal_git.py), described by ``proposal.json``, and the
merge request / pull request opened from it (proposal.py).

``proposal.json`` (in the run dir): ``{"format", "proposed": true, "branch", "base", "commit",
"files", "title", "body"}``, or ``{"format", "proposed": false, "why"}`` when the trial was
reverted or failed (nothing written, nothing committed).
"""

from __future__ import annotations

import configparser
import datetime as dt
import json
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from . import proposal
from .inventory_edit import InventoryEditError, proven_variables
from .proposal_git import GitError, branch_name, check_ready, commit_on_branch, push_branch
from .trial import TrialError

FORMAT = 1
OPENED, FAILED, NOTHING = 0, 1, 2
GITHUB_API = "https://api.github.com"
TOKEN_ENV = {"github": "GITHUB_TOKEN", "gitlab": "SGLANG_FLEET_GITLAB_PROPOSE_TOKEN"}


class TrialProposal:
    """The fleet repository's side of ``advise --trial --propose``: ``before_touch`` (the trial's
    hook, before the canary is touched) checks that the kept patch can be written and committed;
    ``finish`` writes and commits it when the trial was kept."""

    def __init__(self, project: Path, inventory: Path, today: Callable[[], dt.date] = dt.date.today) -> None:
        self.project = project
        self.inventory = inventory
        self.day = today()
        self.ready: tuple[Path, Path, str, dict[tuple[str, str], dict[str, Any]]] | None = None

    def before_touch(self, report: Mapping[str, Any], trial: Mapping[str, Any]) -> None:
        group = trial.get("group") or {}
        branch = branch_name(group, self.day)
        try:
            variables = proven_variables(report, [str(i) for i in group.get("instances") or []])
            root, rel = check_ready(self.project, self.inventory, branch, variables)
        except (GitError, InventoryEditError) as exc:
            raise TrialError(f"--propose: {exc}; nothing was touched") from None
        self.ready = (root, rel, branch, variables)

    def finish(self, trial: Mapping[str, Any]) -> dict[str, Any]:
        """proposal.json's content: the branch committed, or why there is none."""
        if trial.get("decision") != "kept" or self.ready is None:
            return {"format": FORMAT, "proposed": False, "why": proposal.not_proposed_why(trial)}
        root, rel, branch, variables = self.ready
        day = self.day.isoformat()
        try:
            done = commit_on_branch(
                root, rel, branch, variables, lambda files: proposal.commit_message(trial, files, day)
            )
        except (GitError, InventoryEditError) as exc:
            return {"format": FORMAT, "proposed": False, "why": f"the kept patch could not be committed: {exc}"}
        return {
            "format": FORMAT,
            "proposed": True,
            **done,
            "title": proposal.title(trial),
            "body": proposal.evidence_markdown(trial, done["files"], day),
        }


def proposal_text(found: Mapping[str, Any]) -> str:
    if found.get("proposed"):
        return (
            f"  PROPOSED: committed {found.get('commit', '')[:12]} on the branch {found.get('branch')} "
            f"(from {found.get('base')}): {', '.join(found.get('files') or [])}\n"
        )
    return f"  NOT PROPOSED: {found.get('why')}\n"


def platform_from_env(name: str, token_env: str | None, env: Mapping[str, str] = os.environ) -> proposal.Platform:
    """GitHub or GitLab from the job's environment; ProposalError naming what is missing."""
    variable = token_env or TOKEN_ENV[name]
    token = env.get(variable, "")
    if not token:
        raise proposal.ProposalError(f"no token: the environment variable {variable} is empty or unset")
    if name == "github":
        repository = env.get("GITHUB_REPOSITORY", "")
        if not repository:
            raise proposal.ProposalError("GITHUB_REPOSITORY (owner/name) is not set")
        return proposal.GitHub(env.get("GITHUB_API_URL") or GITHUB_API, repository, token)
    api, project = env.get("CI_API_V4_URL", ""), env.get("CI_PROJECT_ID", "")
    if not api or not project:
        raise proposal.ProposalError("CI_API_V4_URL and CI_PROJECT_ID are not both set")
    return proposal.GitLab(api, project, token)


def read_proposal(path: Path) -> dict[str, Any]:
    try:
        found = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise proposal.ProposalError(f"cannot read the proposal {path}: {exc}") from None
    if not isinstance(found, dict) or found.get("format") != FORMAT:
        raise proposal.ProposalError(f"{path} is not a proposal.json of advise --trial --propose")
    return found


def open_proposal(
    found: Mapping[str, Any], platform: proposal.Platform, project: Path, remote: str, base: str | None, token: str
) -> dict[str, Any]:
    """Push the proposal's branch and open its merge request / pull request: ``{"url", ...}``.
    Raises ProposalError or GitError (nothing in them holds the token)."""
    target = base or str(found.get("base") or "")
    if not target:
        raise proposal.ProposalError("no base branch: name it with --base")
    push_branch(project, remote, str(found["branch"]), token, platform.push_user)
    url = platform.open_proposal(str(found["branch"]), target, str(found["title"]), str(found["body"]))
    return {"url": url, "branch": found["branch"], "base": target, "platform": platform.name}


def inventory_path(project: Path, given: str | None) -> Path:
    """The inventory the playbooks run with: -i, else the project's ansible.cfg ``inventory``."""
    if given:
        return Path(given) if Path(given).is_absolute() else project / given
    parser = configparser.ConfigParser(interpolation=None)
    parser.read(project / "ansible.cfg", encoding="utf-8")
    named = parser.get("defaults", "inventory", fallback="").split(",")[0].strip()
    if not named:
        raise TrialError("--propose: name the inventory with -i (the project's ansible.cfg names none)")
    return Path(os.path.expanduser(named)) if Path(os.path.expanduser(named)).is_absolute() else project / named
