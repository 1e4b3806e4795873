"""The collection sglang-fleet-ops drives: its playbooks by FQCN, and the check that it is installed
where ansible looks, at the version this package was built with.

The package's version is the collection's: ``ops/setup.py`` reads it from ``galaxy.yml`` when the
package is built, so one ref of the repository gives both the same version.
"""

from __future__ import annotations

import json
import os
import subprocess
from importlib import metadata
from pathlib import Path

from .runner import ansible_env

COLLECTION = "sglang_ops.fleet"
PACKAGE = "sglang-fleet-ops"
INSTALL_HINT = (
    "install the collection and sglang-fleet-ops from one ref of the sglang-fleet repository: "
    'ansible-galaxy collection build "$src" && ansible-galaxy collection install sglang_ops-fleet-*.tar.gz; '
    'pip install "$src/ops" (examples/ci/ does it so)'
)


def playbook(name: str) -> str:
    """The FQCN of the collection's playbook ``playbooks/<name>.yml``."""
    return f"{COLLECTION}.{name}"


def own_version() -> str:
    """This package's version (the collection's version it was built with)."""
    return metadata.version(PACKAGE)


def installed_version(project: Path) -> tuple[str | None, str]:
    """(version, where) of the collection ansible finds from ``project`` (its ansible.cfg, the
    environment's collections path), from ``ansible-galaxy collection list``; (None, why) when
    it finds none."""
    env = {**os.environ, **ansible_env(project)}
    galaxy = "ansible-galaxy"
    for directory in env.get("PATH", "").split(os.pathsep)[:1]:
        if (Path(directory) / galaxy).is_file():
            galaxy = str(Path(directory) / galaxy)
    try:
        done = subprocess.run(
            [galaxy, "collection", "list", COLLECTION, "--format", "json"],
            check=False,
            cwd=project,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, f"ansible-galaxy could not run: {exc}"
    try:
        found = json.loads(done.stdout or "{}")
    except ValueError:
        found = {}
    # One entry per collections path, in the order ansible searches them: the first one wins.
    for path, collections in found.items() if isinstance(found, dict) else []:
        entry = collections.get(COLLECTION) if isinstance(collections, dict) else None
        if isinstance(entry, dict) and entry.get("version"):
            return str(entry["version"]), str(Path(path) / COLLECTION.replace(".", "/"))
    if done.returncode == 0 and isinstance(found, dict):
        return None, f"ansible-galaxy collection list finds no {COLLECTION}"
    said = " ".join((done.stderr or done.stdout).split())
    return None, f"ansible-galaxy collection list failed: {said or f'exit {done.returncode}'}"


def collection_problem(project: Path) -> str | None:
    """Why the collection cannot be driven from ``project`` (with how to fix it), or None."""
    if "ansible_collections" in project.resolve().parts:
        return (
            f"the project dir {project} is inside an installed collection: run sglang-fleet-ops from the fleet "
            "repository (its working directory or --project-dir), which keeps the runs' artifacts"
        )
    want = own_version()
    have, where = installed_version(project)
    if have is None:
        return f"the collection {COLLECTION} is not installed where ansible looks ({where}); {INSTALL_HINT}"
    if have != want:
        return (
            f"the collection {COLLECTION} at {where} is {have}, but {PACKAGE} is {want} (built with {COLLECTION} "
            f"{want}); {INSTALL_HINT}"
        )
    return None
