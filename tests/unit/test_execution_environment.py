"""execution-environment.yml is a valid ansible-builder 3 definition: `ansible-builder create`
gives a build context (Containerfile, _build/ with the collection, the Python and the system
requirements) on a copy, without building an image; its pins are the repository's."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
EE = REPO / "execution-environment.yml"


def definition() -> dict[str, Any]:
    data = yaml.safe_load(EE.read_text(encoding="utf-8"))
    assert isinstance(data, dict)
    return data


def constraint(name: str) -> str:
    text = (REPO / "requirements" / "constraints.txt").read_text(encoding="utf-8")
    match = re.search(rf"^{re.escape(name)}==(\S+)$", text, re.MULTILINE | re.IGNORECASE)
    assert match, name
    return match.group(1)


def test_ansible_builder_creates_the_build_context(tmp_path: Path) -> None:
    pytest.importorskip("ansible_builder", reason="ansible-builder is not installed (make setup installs it)")
    shutil.copy(EE, tmp_path / EE.name)
    builder = Path(sys.executable).parent / "ansible-builder"
    done = subprocess.run(
        [str(builder), "create", "-f", EE.name, "-c", "context", "--output-filename", "Containerfile"],
        cwd=tmp_path,
        check=False,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    context = tmp_path / "context"
    containerfile = (context / "Containerfile").read_text(encoding="utf-8")
    base = definition()["images"]["base_image"]["name"]
    assert f'ARG EE_BASE_IMAGE="{base}"' in containerfile
    assert "FROM $EE_BASE_IMAGE AS base" in containerfile
    assert f'ANSIBLE_INSTALL_REFS="ansible-core=={constraint("ansible-core")} ' in containerfile
    galaxy = yaml.safe_load((context / "_build" / "requirements.yml").read_text(encoding="utf-8"))
    (collection,) = galaxy["collections"]
    assert collection["type"] == "git" and collection["name"].endswith("/sglang-fleet.git")
    python = (context / "_build" / "requirements.txt").read_text(encoding="utf-8")
    assert re.search(r"^sglang-fleet-ops @ git\+\S+#subdirectory=ops$", python, re.MULTILINE), python
    bindep = (context / "_build" / "bindep.txt").read_text(encoding="utf-8")
    assert "git [platform:rpm]" in bindep
    assert (context / "_build" / "scripts" / "assemble").is_file()


def test_pins_are_the_repositorys() -> None:
    deps = definition()["dependencies"]
    assert deps["ansible_core"]["package_pip"] == f"ansible-core=={constraint('ansible-core')}"
    assert deps["ansible_runner"]["package_pip"] == f"ansible-runner=={constraint('ansible-runner')}"
    # The collection and sglang-fleet-ops come from the same ref of the same repository.
    (collection,) = deps["galaxy"]["collections"]
    (ops,) = [p for p in deps["python"] if p.startswith("sglang-fleet-ops")]
    assert ops == f"sglang-fleet-ops @ git+{collection['name']}@{collection['version']}#subdirectory=ops"
