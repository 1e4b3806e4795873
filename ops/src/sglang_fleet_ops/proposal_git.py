"""A kept trial's patch as a commit on a branch of its own in the fleet repository.

The commit is made in a temporary worktree of the repository (``git worktree add -b``) at the
current commit: the operator's checkout, its current branch and any file in it stay as they were.
Everything that can refuse is checked before the trial touches a canary (``check_ready``): a git
repository holds the inventory, the inventory has no uncommitted change (the trial measured the
committed settings), the branch is new and a valid name, and the patch can be written where it
says (inventory_edit.plan_edits).

The branch is pushed with a token given in the environment of ``git push`` only
(``GIT_CONFIG_*``: an HTTP header), never on a command line, in the remote's URL or in output.
"""

from __future__ import annotations

import base64
import datetime as dt
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from .inventory_edit import InventoryEditError, inventory_dir, plan_edits, write_edits

BRANCH_PREFIX = "sglang-fleet/tune"
GIT_TIMEOUT = 120
# Who commits when git has no identity configured (a CI job's fresh checkout).
FALLBACK_IDENTITY = ("sglang-fleet-ops", "sglang-fleet-ops@localhost")


class GitError(Exception):
    """A git command failed, or the repository is not ready for a proposal (said why)."""


def git(repo: Path, *args: str, stdin: str | None = None, env: Mapping[str, str] | None = None) -> str:
    """``git -C repo args``' stdout; GitError with git's own message when it fails."""
    try:
        done = subprocess.run(
            ["git", "-C", str(repo), *args],
            input=stdin,
            capture_output=True,
            text=True,
            timeout=GIT_TIMEOUT,
            env=dict(env) if env is not None else None,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise GitError(f"git {args[0]}: {exc}") from exc
    if done.returncode != 0:
        said = (done.stderr or done.stdout).strip().splitlines()
        raise GitError(f"git {args[0]}: {'; '.join(said[-3:]) or f'exit {done.returncode}'}")
    return done.stdout


def slug(text: str, limit: int = 48) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")[:limit].strip("-") or "group"


def branch_name(group: Mapping[str, Any], day: dt.date) -> str:
    """``sglang-fleet/tune-YYYYMMDD-<diagnosis>-<group label>``: one proposal per group and day."""
    return f"{BRANCH_PREFIX}-{day:%Y%m%d}-{slug(str(group.get('diagnosis') or ''))}-{slug(str(group.get('label')))}"


def repo_root(path: Path) -> Path:
    try:
        return Path(git(path, "rev-parse", "--show-toplevel").strip()).resolve()
    except GitError as exc:
        raise GitError(f"{path} is not in a git repository: a proposal is a commit of the fleet repository") from exc


def check_ready(
    project: Path, inventory: Path, branch: str, variables: Mapping[tuple[str, str], Mapping[str, Any]]
) -> tuple[Path, Path]:
    """The repository's root and the inventory's path in it, once everything a proposal needs is
    checked (nothing is written); GitError or InventoryEditError says what is not."""
    root = repo_root(project)
    inv = inventory if inventory.is_absolute() else (project / inventory)
    inv = inv.resolve()
    if not inv.is_relative_to(root):
        raise GitError(f"the inventory {inv} is not in the fleet repository {root}")
    rel = inv.relative_to(root)
    git(root, "rev-parse", "--verify", "--quiet", "HEAD^{commit}")
    # The whole inventory directory: an inventory named by its hosts file has its variables beside it.
    dirty = git(root, "status", "--porcelain", "-uall", "--", str(inventory_dir(inv).relative_to(root))).strip()
    if dirty:
        raise GitError(
            f"the inventory {rel} has uncommitted changes (the trial would measure settings no commit holds): "
            + "; ".join(dirty.splitlines()[:5])
        )
    try:
        git(root, "check-ref-format", "--branch", branch)
    except GitError as exc:
        raise GitError(f"{branch!r} is not a valid branch name") from exc
    if git_ok(root, "rev-parse", "--verify", "--quiet", f"refs/heads/{branch}"):
        raise GitError(f"the branch {branch} exists already (this group's proposal of today): delete it first")
    plan_edits(inv, variables)
    return root, rel


def git_ok(repo: Path, *args: str) -> bool:
    try:
        git(repo, *args)
    except GitError:
        return False
    return True


def _identity(root: Path) -> list[str]:
    if os.environ.get("GIT_AUTHOR_EMAIL") or git_ok(root, "config", "user.email"):
        return []
    return ["-c", f"user.name={FALLBACK_IDENTITY[0]}", "-c", f"user.email={FALLBACK_IDENTITY[1]}"]


def commit_on_branch(
    root: Path,
    inventory_rel: Path,
    branch: str,
    variables: Mapping[tuple[str, str], Mapping[str, Any]],
    message: Callable[[list[str]], str],
) -> dict[str, Any]:
    """Write the variables into the inventory files and commit them on the new branch ``branch``
    from the current commit, in a temporary worktree, with ``message(files)`` as the commit message;
    ``{"branch", "base", "commit", "files"}``.
    On any failure the branch is deleted again: nothing is left."""
    base = (
        git(root, "symbolic-ref", "--quiet", "--short", "HEAD").strip()
        if git_ok(root, "symbolic-ref", "--quiet", "HEAD")
        else git(root, "rev-parse", "HEAD").strip()
    )
    scratch = Path(tempfile.mkdtemp(prefix="sglang-fleet-proposal-"))
    tree = scratch / "tree"
    git(root, "worktree", "add", "--quiet", "-b", branch, str(tree), "HEAD")
    try:
        edits = plan_edits(tree / inventory_rel, variables)
        if not edits:
            raise InventoryEditError("the inventory already holds the patch: nothing to commit")
        files = [str(p.relative_to(tree)) for p in write_edits(edits)]
        git(tree, "add", "--", *files)
        git(tree, *_identity(root), "commit", "--quiet", "--no-verify", "-F", "-", stdin=message(files))
        commit = git(tree, "rev-parse", "HEAD").strip()
    except (GitError, InventoryEditError):
        _remove_worktree(root, tree, scratch)
        git_ok(root, "branch", "-D", branch)
        raise
    _remove_worktree(root, tree, scratch)
    return {"branch": branch, "base": base, "commit": commit, "files": files}


def _remove_worktree(root: Path, tree: Path, scratch: Path) -> None:
    git_ok(root, "worktree", "remove", "--force", str(tree))
    shutil.rmtree(scratch, ignore_errors=True)
    git_ok(root, "worktree", "prune")


def push_branch(root: Path, remote: str, branch: str, token: str | None, user: str) -> None:
    """``git push remote branch``; over HTTP(S) with ``token`` as a basic-auth header given in the
    environment only. Errors never hold the token."""
    env = dict(os.environ)
    if token:
        pair = base64.b64encode(f"{user}:{token}".encode()).decode()
        count = int(env.get("GIT_CONFIG_COUNT") or 0)
        env.update(
            {
                "GIT_CONFIG_COUNT": str(count + 1),
                f"GIT_CONFIG_KEY_{count}": "http.extraheader",
                f"GIT_CONFIG_VALUE_{count}": f"AUTHORIZATION: basic {pair}",
                "GIT_TERMINAL_PROMPT": "0",
            }
        )
    try:
        git(root, "push", "--quiet", remote, f"refs/heads/{branch}:refs/heads/{branch}", env=env)
    except GitError as exc:
        text = str(exc)
        if token:
            text = text.replace(token, "***").replace(pair, "***")
        raise GitError(f"the branch {branch} could not be pushed to {remote}: {text}") from None
