"""docs/operator-guide.md cannot drift from the code: every failure message it explains still
occurs in the code that gives it, it names every option of the retune role (and no option that
does not exist), and the files it points to exist."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
GUIDE = REPO / "docs" / "operator-guide.md"
# Where the messages of a retune come from: the controller side, the host agent, the lock, the
# modules and actions, the start guard (and a pod's start command), the server role's pre-flight,
# and retune.yml itself.
SOURCES = [
    REPO / "plugins" / "plugin_utils" / "_retune" / "flow.py",
    REPO / "plugins" / "plugin_utils" / "_retune" / "decide.py",
    REPO / "plugins" / "plugin_utils" / "_retune" / "record.py",
    REPO / "plugins" / "plugin_utils" / "_retune" / "clients.py",
    REPO / "plugins" / "plugin_utils" / "_retune" / "fit.py",
    REPO / "roles" / "retune" / "tasks" / "validate.yml",
    REPO / "plugins" / "module_utils" / "_host_lock.py",
    REPO / "roles" / "server" / "files" / "sglang-fleet-start-guard",
    REPO / "roles" / "server" / "files" / "sglang-fleet-supervised-start",
    REPO / "roles" / "server" / "tasks" / "main.yml",
    REPO / "playbooks" / "retune.yml",
    *sorted((REPO / "plugins" / "module_utils" / "agent").glob("*.py")),
    *sorted((REPO / "plugins" / "action").glob("*.py")),
    *sorted((REPO / "plugins" / "modules").glob("*.py")),
]


def guide() -> str:
    return GUIDE.read_text(encoding="utf-8")


def failure_messages() -> list[str]:
    section = guide().split("## Failure messages", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    return [re.match(r"^\| `([^`]+)` \|", row).group(1) for row in rows]  # type: ignore[union-attr]


def test_every_failure_message_still_occurs_in_the_code() -> None:
    code = "\n".join(path.read_text(encoding="utf-8") for path in SOURCES)
    messages = failure_messages()
    assert len(messages) >= 50
    assert len(set(messages)) == len(messages)
    assert [m for m in messages if m not in code] == []


def retune_options() -> set[str]:
    specs = yaml.safe_load((REPO / "roles" / "retune" / "meta" / "argument_specs.yml").read_text(encoding="utf-8"))
    return set(specs["argument_specs"]["main"]["options"])


def test_every_retune_option_is_named_and_none_other() -> None:
    options = retune_options()
    assert options
    named = set(re.findall(r"\bsglang_retune_\w+", guide()))
    assert sorted(options - named) == []
    assert sorted(named - options) == []


def test_the_files_it_points_to_exist() -> None:
    paths = set(re.findall(r"`((?:examples|inventories|roles|playbooks|docs)/[\w./-]*\w)`", guide()))
    paths |= set(re.findall(r"\]\(((?:\.\./)?[\w./-]+)\)", guide()))
    assert "examples/ci/gitlab/.gitlab-ci.yml" in paths
    missing = [p for p in paths if not (REPO / p).exists() and not (GUIDE.parent / p).exists()]
    assert missing == []
