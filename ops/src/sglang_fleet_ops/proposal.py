"""A kept trial as a reviewed change: its evidence as text (the commit message, the merge
request's description) and the platform's API call that opens the merge request / pull request.

The call is behind ``Platform`` (one method, ``open_proposal``), with GitHub's and GitLab's REST
APIs as implementations over urllib: a timeout on every request, and failures raised as
ProposalError naming the HTTP status and the platform's own message - never the token, which is
only ever sent as a request header.

* GitHub: ``POST {GITHUB_API_URL}/repos/{owner}/{repo}/pulls`` with ``Authorization: Bearer``
  (the job's GITHUB_TOKEN with ``pull-requests: write`` and ``contents: write``);
* GitLab: ``POST {CI_API_V4_URL}/projects/{id}/merge_requests`` with ``PRIVATE-TOKEN`` (a project
  access token: CI_JOB_TOKEN cannot create merge requests).
"""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

TIMEOUT = 30.0


class ProposalError(Exception):
    """The merge request / pull request could not be opened (said why; no secret in it)."""


class Platform(Protocol):
    name: str
    # The user name a token pushes a branch with over HTTPS.
    push_user: str

    def open_proposal(self, head: str, base: str, title: str, body: str) -> str:
        """Open the merge request / pull request of branch ``head`` into ``base``; its URL."""
        ...


def _scrub(text: str, secret: str) -> str:
    return text.replace(secret, "***") if secret else text


def post_json(url: str, headers: Mapping[str, str], payload: Mapping[str, Any], secret: str, timeout: float) -> Any:
    """POST ``payload`` as JSON; the decoded answer. ProposalError names the HTTP status and the
    server's message (``message``/``error``), never ``secret``."""
    data = json.dumps(payload).encode()
    if not url.startswith(("https://", "http://")):
        raise ProposalError(f"{url}: not an HTTP(S) URL")
    request = urllib.request.Request(  # noqa: S310 (an HTTP(S) URL, checked above)
        url, data=data, method="POST", headers={"Content-Type": "application/json", **headers}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as answer:  # noqa: S310 (the platform's API URL)
            raw = answer.read()
    except urllib.error.HTTPError as exc:
        raise ProposalError(_scrub(f"POST {url}: HTTP {exc.code} {exc.reason}{_said(exc)}", secret)) from None
    except (urllib.error.URLError, TimeoutError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise ProposalError(_scrub(f"POST {url}: no answer ({reason}; timeout {timeout:g}s)", secret)) from None
    try:
        return json.loads(raw or b"null")
    except ValueError:
        raise ProposalError(f"POST {url}: the answer is not JSON") from None


def _said(exc: urllib.error.HTTPError) -> str:
    try:
        body = json.loads(exc.read() or b"null")
    except (ValueError, OSError):
        return ""
    if isinstance(body, Mapping):
        said = body.get("message") or body.get("error")
        errors = body.get("errors")
        if errors:
            said = f"{said}: {json.dumps(errors)[:300]}"
        return f": {str(said)[:500]}" if said else ""
    return ""


@dataclass
class GitHub:
    api_url: str
    repository: str
    token: str = field(repr=False)
    timeout: float = TIMEOUT
    name: str = "GitHub"
    push_user: str = "x-access-token"

    def open_proposal(self, head: str, base: str, title: str, body: str) -> str:
        url = f"{self.api_url.rstrip('/')}/repos/{self.repository}/pulls"
        headers = {
            "Authorization": f"Bearer {self.token}",
            "Accept": "application/vnd.github+json",
            "X-GitHub-Api-Version": "2022-11-28",
        }
        payload = {"title": title, "head": head, "base": base, "body": body, "maintainer_can_modify": False}
        answer = post_json(url, headers, payload, self.token, self.timeout)
        return str((answer or {}).get("html_url") or (answer or {}).get("url") or "")


@dataclass
class GitLab:
    api_url: str
    project: str
    token: str = field(repr=False)
    timeout: float = TIMEOUT
    name: str = "GitLab"
    # A project access token over HTTPS: any user name, the token as the password.
    push_user: str = "oauth2"

    def open_proposal(self, head: str, base: str, title: str, body: str) -> str:
        project = urllib.parse.quote(self.project, safe="")
        url = f"{self.api_url.rstrip('/')}/projects/{project}/merge_requests"
        payload = {
            "source_branch": head,
            "target_branch": base,
            "title": title,
            "description": body,
            "remove_source_branch": True,
        }
        answer = post_json(url, {"PRIVATE-TOKEN": self.token}, payload, self.token, self.timeout)
        return str((answer or {}).get("web_url") or "")


# --------------------------------------------------------------------------------------------
# The evidence


def _tput(value: Any) -> str:
    return "n/a" if value is None else f"{float(value):.0f} tok/s"


def _value(value: Any) -> str:
    return "unset (SGLang's default)" if value is None else f"`{value}`"


def evidence_rows(trial: Mapping[str, Any]) -> list[tuple[str, str]]:
    """The trial's evidence, one (what, value) row each: the change, the measurements, the
    decision, the prediction (every figure the trial's ``predicted`` holds) and its pictures."""
    rows = [("canary", f"`{trial.get('canary')}`")]
    rows += [(f"`{k}`", f"{_value(v[0])} -> {_value(v[1])}") for k, v in (trial.get("changes") or {}).items()]
    before, after = trial.get("before") or {}, trial.get("after") or {}
    rows.append(("canary before", _tput(before.get("canary"))))
    rows.append(("canary after", _tput(after.get("canary"))))
    for key, value in (after.get("others") or {}).items():
        rows.append((f"untouched `{key}` after", _tput(value)))
    rows.append((f"baseline ({after.get('baseline_of')})", _tput(after.get("baseline"))))
    threshold = float(trial.get("threshold") or 0)
    gain = trial.get("gain")
    rows.append(("measured gain", "n/a" if gain is None else f"x{float(gain):.2f} (kept at x{threshold:.2f} or more)"))
    retune = trial.get("retune") or {}
    before_max = retune.get("effective_max_running_requests_before")
    after_max = retune.get("effective_max_running_requests_after")
    rows.append(("effective max running requests", f"{before_max} -> {after_max}"))
    for key, value in (trial.get("predicted") or {}).items():
        rows.append((f"predicted {key.replace('_', ' ')}", str(value)))
    # Pictures of the trial (a path, a list of paths or paths by name), where it has some.
    pictures = trial.get("pictures") or trial.get("picture") or {}
    if isinstance(pictures, str):
        pictures = [pictures]
    for key, value in pictures.items() if isinstance(pictures, Mapping) else enumerate(pictures, 1):
        rows.append((f"picture {key}", f"`{value}`"))
    return rows


def title(trial: Mapping[str, Any]) -> str:
    group = trial.get("group") or {}
    gain = trial.get("gain")
    words = ", ".join(f"{k} {v[1]}" for k, v in (trial.get("changes") or {}).items())
    return f"sglang-fleet tuning of {group.get('label')} ({group.get('diagnosis')}): {words}" + (
        f", x{float(gain):.2f} measured on {trial.get('canary')}" if gain is not None else ""
    )


def evidence_markdown(trial: Mapping[str, Any], files: list[str], day: str) -> str:
    """The description of the merge request (and the commit message's body)."""
    group = trial.get("group") or {}
    lines = [
        f"`sglang-fleet-ops advise --trial` ({day}) tried the advisor's proposal for {group.get('label')} "
        f"({group.get('diagnosis')}: {', '.join(group.get('instances') or [])}) on one canary and kept it: "
        "this change writes it into the inventory for the whole group.",
        "",
        "| evidence | value |",
        "| --- | --- |",
        *[f"| {what} | {value} |" for what, value in evidence_rows(trial)],
        "",
        "Files: " + ", ".join(f"`{f}`" for f in files),
        "",
        "The canary runs these settings already (an override of the trial); merging applies them to the rest "
        "through the pipeline's plan and apply.",
    ]
    return "\n".join(lines) + "\n"


def commit_message(trial: Mapping[str, Any], files: list[str], day: str) -> str:
    return title(trial) + "\n\n" + evidence_markdown(trial, files, day)


def not_proposed_why(trial: Mapping[str, Any]) -> str:
    """Why a trial opens nothing: its decision and the reason."""
    decision = trial.get("decision")
    threshold = float(trial.get("threshold") or 0)
    if decision == "reverted" and trial.get("gain") is not None:
        return f"the trial was reverted: gain x{float(trial['gain']):.2f} < x{threshold:.2f}; nothing to propose"
    problems = "; ".join(str(p) for p in trial.get("problems") or []) or "no reason given"
    what = "the trial failed" if decision == "failed" else f"the trial was {decision}"
    return f"{what}: {problems}; nothing to propose"
