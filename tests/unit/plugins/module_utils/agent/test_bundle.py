"""The agent package as one payload: run in a container exactly as ``pct exec`` runs it (the system
python3, ``-c PAYLOAD``, the request on stdin, nothing installed), and imported by the start guard
from the one file the server role installs."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from agent_requests import REQUEST

from ansible_collections.sglang_ops.fleet.plugins.module_utils import _pct
from ansible_collections.sglang_ops.fleet.plugins.module_utils.agent import bundle

PACKAGE_DIR = Path(bundle.__file__).parent
# A container's python3: the system one, without this virtualenv or the collection on its path.
SYSTEM_PYTHON = "/usr/bin/python3"
# The longest single argument Linux passes to a command (MAX_ARG_STRLEN).
MAX_ARGUMENT = 128 * 1024


@pytest.fixture(scope="module")
def python3() -> str:
    if not Path(SYSTEM_PYTHON).exists():
        pytest.skip(f"{SYSTEM_PYTHON} is not installed")
    return SYSTEM_PYTHON


def fake_smi(tmp_path: Path) -> str:
    path = tmp_path / "nvidia-smi"
    path.write_text("#!/bin/sh\nprintf '0, GPU-a, 3, 143771\\n'\n")
    path.chmod(0o755)
    return str(path)


def run_payload(python3: str, request: dict, *before: str) -> dict:
    """``python3 -I -c PAYLOAD`` with the request on stdin; ``before`` runs first in the same
    process (to forbid a module)."""
    payload = bundle.command_payload()
    code = "\n".join([*before, payload])
    done = subprocess.run(
        [python3, "-I", "-c", code], input=json.dumps(request), capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_the_payload_runs_an_operation_with_the_system_python(python3: str, tmp_path: Path) -> None:
    request = {
        **REQUEST,
        "op": "release",
        "nvidia_smi": fake_smi(tmp_path),
        "instances": [{"name": "gpu0", "gpus": [0]}],
    }
    out = run_payload(python3, request)
    assert out["instances"]["gpu0"]["released"] is True
    assert out["agent_version"] == 1
    assert run_payload(python3, {"op": "nope"}) == {"failed": True, "msg": "unknown agent operation 'nope'"}


def test_the_payload_is_standard_library_only(python3: str) -> None:
    """Inside containers only the standard library is guaranteed; every module is loaded (the
    dispatcher imports every operation) with Ansible made unimportable."""
    out = run_payload(python3, {"op": "nope"}, "import sys", "sys.modules['ansible'] = None")
    assert out["failed"] is True


def test_the_payload_fits_in_one_command_line_argument() -> None:
    assert len(bundle.command_payload().encode()) < MAX_ARGUMENT


def test_the_bundle_holds_every_module_of_the_package() -> None:
    on_disk = {p.stem: p.read_text(encoding="utf-8") for p in PACKAGE_DIR.glob("*.py") if p.stem != "bundle"}
    assert bundle.package_sources() == on_disk


def test_run_agent_runs_the_payload_through_pct(python3: str, tmp_path: Path) -> None:
    """A stand-in ``pct`` that runs ``exec CTID -- python3 ARGS...`` with the system python3."""
    pct = tmp_path / "pct"
    pct.write_text(f'#!/bin/sh\n[ "$1 $3 $4" = "exec -- python3" ] || exit 99\nshift 4\nexec {python3} "$@"\n')
    pct.chmod(0o755)
    request = {
        **REQUEST,
        "op": "release",
        "nvidia_smi": fake_smi(tmp_path),
        "instances": [{"name": "gpu0", "gpus": [0]}],
    }
    out = _pct.run_agent(request, 101, str(pct), timeout=60)
    assert out["instances"]["gpu0"]["released"] is True
    broken = _pct.run_agent(request, 101, str(tmp_path / "absent-pct"))
    assert broken["failed"] is True and broken["rc"] == 127


def test_the_installed_file_imports_as_the_package(python3: str, tmp_path: Path) -> None:
    """The start guard's view: the file on sys.path, its modules importable by name."""
    (tmp_path / f"{bundle.PACKAGE}.py").write_text(bundle.bundle_source(), encoding="utf-8")
    code = (
        "import sys; sys.dont_write_bytecode = True; sys.path.insert(0, sys.argv[1])\n"
        f"from {bundle.PACKAGE} import ops, procfs\n"
        "print(procfs.is_sglang_process(['sglang::scheduler']), ops.run({'op': 'nope'})['msg'])\n"
    )
    done = subprocess.run([python3, "-I", "-c", code, str(tmp_path)], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split(None, 1) == ["True", "unknown agent operation 'nope'\n"]


def test_a_failure_inside_the_payload_names_the_module(python3: str) -> None:
    """Tracebacks from the bundle name the package module they come from."""
    done = subprocess.run(
        [python3, "-I", "-c", bundle.command_payload()], input="not json", capture_output=True, text=True, check=False
    )
    assert done.returncode == 1
    assert f'File "{bundle.PACKAGE}/ops.py"' in done.stderr
