"""One version: galaxy.yml's is the changelog's latest release (antsibull-changelog,
changelogs/changelog.yaml) and the controller CLI's package version (ops/setup.py reads galaxy.yml)."""

from __future__ import annotations

import tomllib
from pathlib import Path

import yaml
from ansible.module_utils.compat.version import LooseVersion

REPO = Path(__file__).resolve().parents[2]


def galaxy_version() -> str:
    return str(yaml.safe_load((REPO / "galaxy.yml").read_text(encoding="utf-8"))["version"])


def test_galaxy_version_is_the_latest_release_of_the_changelog() -> None:
    changelog = yaml.safe_load((REPO / "changelogs/changelog.yaml").read_text(encoding="utf-8"))
    releases = sorted(changelog["releases"], key=LooseVersion)
    assert releases[-1] == galaxy_version(), f"galaxy.yml says {galaxy_version()}, the changelog {releases[-1]}"


def test_the_controller_cli_has_the_collection_version() -> None:
    """ops/setup.py gives the package galaxy.yml's version when it is built; the installed CLI says it."""
    from sglang_fleet_ops.collection import own_version  # noqa: PLC0415

    project = tomllib.loads((REPO / "ops/pyproject.toml").read_text(encoding="utf-8"))["project"]
    assert project["dynamic"] == ["version"] and "version" not in project
    assert own_version() == galaxy_version()
