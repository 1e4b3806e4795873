"""execution-environment.yml is a valid ansible-builder 3 definition: `ansible-builder create`
gives a build context (Containerfile, _build/ with the collection, the Python and the system
requirements) on a copy, without building an image; its pins are the repository's, and the
context holds what the example pipelines install (the same packages from the same ref, under the
same constraints)."""

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


def build_context(tmp_path: Path) -> Path:
    """``ansible-builder create`` on a copy of the definition and the files it names."""
    pytest.importorskip("ansible_builder", reason="ansible-builder is not installed (make setup installs it)")
    shutil.copy(EE, tmp_path / EE.name)
    (tmp_path / "requirements").mkdir()
    shutil.copy(REPO / "requirements" / "constraints.txt", tmp_path / "requirements" / "constraints.txt")
    builder = Path(sys.executable).parent / "ansible-builder"
    done = subprocess.run(
        [str(builder), "create", "-f", EE.name, "-c", "context", "--output-filename", "Containerfile"],
        cwd=tmp_path,
        check=False,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return tmp_path / "context"


def pipeline_installs() -> dict[str, tuple[str, str, tuple[str, ...]]]:
    """Per pipeline: (repository, ref, what its pip install names after the constraints)."""
    found = {}
    for name, path, env_key in (
        ("github", REPO / "examples/ci/github/sglang-fleet.yml", "env"),
        ("gitlab", REPO / "examples/ci/gitlab/.gitlab-ci.yml", "variables"),
    ):
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
        text = path.read_text(encoding="utf-8")
        if name == "github":
            text = (REPO / "examples/ci/github/actions/sglang-fleet-setup/action.yml").read_text(encoding="utf-8")
        joined = text.replace("\\\n", " ")
        (line,) = [ln for ln in joined.splitlines() if 'pip" install' in ln]
        words = line.split('constraints.txt"', 1)[1].split()
        packages = ["sglang-fleet-ops" if w.endswith('/ops"') else w for w in words if not w.startswith(('"${', "-"))]
        assert "collection build" in joined and "collection install" in joined, name
        found[name] = (data[env_key]["SGLANG_FLEET_REPO"], data[env_key]["SGLANG_FLEET_REF"], tuple(packages))
    return found


def test_the_build_context_holds_what_the_pipelines_install(tmp_path: Path) -> None:
    context = build_context(tmp_path)
    installs = pipeline_installs()
    assert len(set(installs.values())) == 1, installs
    repo, ref, packages = installs["github"]
    assert packages == ("sglang-fleet-ops", "ansible-core", "ansible-runner")
    # The collection and sglang-fleet-ops from the pipelines' repository and ref.
    galaxy = yaml.safe_load((context / "_build" / "requirements.yml").read_text(encoding="utf-8"))
    assert galaxy["collections"] == [{"name": repo, "type": "git", "version": ref}]
    python = (context / "_build" / "requirements.txt").read_text(encoding="utf-8").splitlines()
    assert f"sglang-fleet-ops @ git+{repo}@{ref}#subdirectory=ops" in python
    # ansible-core and ansible-runner at the constraints' pins, and the constraints themselves
    # where the builder stage resolves the Python dependencies.
    containerfile = (context / "Containerfile").read_text(encoding="utf-8")
    pins = " ".join(f"{p}=={constraint(p)}" for p in packages[1:])
    assert f'ARG ANSIBLE_INSTALL_REFS="{pins}"' in containerfile
    kept = context / "_build" / "configs" / "constraints.txt"
    assert kept.read_text() == (REPO / "requirements" / "constraints.txt").read_text()
    builder = containerfile.split("AS builder", 1)[1].split("AS final", 1)[0]
    assert "COPY _build/configs/constraints.txt /tmp/sglang-fleet-constraints.txt" in builder
    assert builder.index("ENV PIP_CONSTRAINT=/tmp/sglang-fleet-constraints.txt") < builder.index(
        "/output/scripts/assemble"
    )


def test_ansible_builder_creates_the_build_context(tmp_path: Path) -> None:
    context = build_context(tmp_path)
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
