"""The test hosts' cache of the code modules import from zip archives (tests/testbed/pyc_cache):
a module imported from an archive is compiled once, loaded from the cache after that, and its
code names the archive of the run that imports it."""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path

HOOK = Path(__file__).resolve().parents[2] / "testbed" / "pyc_cache"

RUN = """
import json, sys
sys.path.insert(0, {hook!r})
import sglang_fleet_testbed_pyc as hook
hook.CACHE = {cache!r}
compiled = []
inner = hook._compile_source
hook._compile_source = lambda p, s: compiled.append(p) or inner(p, s)
sys.path.insert(0, {archive!r})
import payload_mod
print(json.dumps({{"value": payload_mod.f(), "file": payload_mod.f.__code__.co_filename, "compiled": compiled}}))
"""


def run(tmp_path: Path, archive: Path) -> dict:
    code = RUN.format(hook=str(HOOK), cache=str(tmp_path / "cache"), archive=str(archive))
    out = subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def archive(tmp_path: Path, name: str, body: str) -> Path:
    path = tmp_path / name
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("payload_mod.py", body)
    return path


def test_an_archive_module_is_compiled_once_and_names_its_own_archive(tmp_path: Path) -> None:
    body = "def f():\n    return 41 + 1\n"
    first = run(tmp_path, archive(tmp_path, "a.zip", body))
    assert first["value"] == 42 and first["compiled"] == [str(tmp_path / "a.zip" / "payload_mod.py")]
    assert len(list((tmp_path / "cache").iterdir())) == 1
    # Another run's archive, the same source: from the cache, under that archive's name.
    second = run(tmp_path, archive(tmp_path, "b.zip", body))
    assert second["value"] == 42 and second["compiled"] == []
    assert second["file"] == str(tmp_path / "b.zip" / "payload_mod.py")
    # Another source: compiled.
    third = run(tmp_path, archive(tmp_path, "c.zip", "def f():\n    return 7\n"))
    assert third["value"] == 7 and len(third["compiled"]) == 1
