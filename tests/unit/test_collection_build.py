"""`ansible-galaxy collection build` gives the collection alone: no inventories, tests, test
images, virtualenvs or caches, and everything the roles need (the client's source included, from
which the generation role builds its wheel)."""

from __future__ import annotations

import subprocess
import tarfile
from pathlib import Path

from cli_tools import cli as tool
from sglang_fleet_ops import advise, cli

REPO = Path(__file__).resolve().parents[2]


def tarfile_dir(members: dict[str, tarfile.TarInfo], name: str) -> bool:
    return members[name].isdir()


def test_collection_artifact_is_clean(tmp_path: Path) -> None:
    galaxy = tool("ansible-galaxy")
    subprocess.run(
        [str(galaxy), "collection", "build", "--output-path", str(tmp_path), str(REPO)],
        check=True,
        capture_output=True,
        text=True,
    )
    (artifact,) = tmp_path.glob("sglang_ops-fleet-*.tar.gz")
    with tarfile.open(artifact) as tar:
        names = tar.getnames()
        tar_members = {m.name: m for m in tar.getmembers()}
    forbidden = ("inventories", "molecule", ".venv", ".cache", "collections", "bench", "tools", ".git")
    leaked = [n for n in names if n.split("/")[0] in forbidden]
    assert leaked == []
    # Of tests/, only what the tarball's own checks read: ansible-test sanity's ignore file.
    tests = [n for n in names if n.startswith("tests/") and not tarfile_dir(tar_members, n)]
    assert tests and all(n.startswith("tests/sanity/ignore-") for n in tests), tests
    cache_parts = ("__pycache__", ".pytest_cache", ".mypy_cache", ".egg-info")
    caches = [n for n in names if any(part in n for part in cache_parts)]
    assert caches == []
    for needed in (
        "MANIFEST.json",
        "meta/runtime.yml",
        "plugins/action/retune.py",
        "plugins/modules/retune.py",
        "plugins/module_utils/agent/ops.py",
        "plugins/plugin_utils/_flags/sglang_flags.json",
        "roles/server/tasks/main.yml",
        "roles/generation/tasks/main.yml",
        "client/pyproject.toml",
        "playbooks/retune.yml",
        # What the tarball's own checks read: ansible-lint's configuration (the importer runs it),
        # ansible-test sanity's ignore file, the changelog.
        ".ansible-lint",
        "tests/sanity/ignore-2.19.txt",
        "changelogs/changelog.yaml",
        "changelogs/config.yaml",
    ):
        assert needed in names, needed
    assert not any(n.startswith("playbooks/demo") for n in names)
    # Every playbook sglang-fleet-ops runs by FQCN is in the artifact.
    for fqcn in (cli.RETUNE_PLAYBOOK, cli.STATUS_PLAYBOOK, advise.ADVISE_PLAYBOOK):
        namespace, name, playbook = fqcn.split(".")
        assert f"{namespace}.{name}" == "sglang_ops.fleet" and f"playbooks/{playbook}.yml" in names, fqcn
