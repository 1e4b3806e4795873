"""The distribution builds as a wheel, bundles its data and works from a fresh venv."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from conftest import ROOT

from gpusim.versions import KNOWN_VERSIONS, fmt


def test_wheel_contents_and_console_scripts(tmp_path: Path):
    src = tmp_path / "src-copy"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns("tests", "build", "*.egg-info", "__pycache__"))
    out = tmp_path / "dist"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(src)],
        check=True,
        capture_output=True,
    )
    wheel = next(out.glob("sglang_fleet_gpusim-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    assert len(KNOWN_VERSIONS) == 8
    for flags in map(fmt, KNOWN_VERSIONS):
        assert f"gpusim/flags/{flags}.json" in names
        assert (ROOT / "src/gpusim/flags" / f"{flags}.json").read_bytes() == zipfile.ZipFile(wheel).read(
            f"gpusim/flags/{flags}.json"
        )
    assert "gpusim/flags/order.json" in names and "sglang/launch_server.py" in names
    entry = next(n for n in names if n.endswith("entry_points.txt"))
    text = zipfile.ZipFile(wheel).read(entry).decode()
    assert "nvidia-smi = gpusim.nvsmi:main" in text and "gpusim = gpusim.admin:main" in text

    prefix = tmp_path / "prefix"
    # --ignore-installed: with --prefix alone pip uninstalls the copy already installed in the
    # running environment (the dev virtualenv's editable install) before installing elsewhere.
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--no-deps",
            "--no-index",
            "--ignore-installed",
            "-q",
            "--prefix",
            str(prefix),
            str(wheel),
        ],
        check=True,
        capture_output=True,
    )
    site = next((prefix / "lib").glob("python3*/site-packages"))
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"gpus": {"count": 2}, "devices_dir": str(tmp_path / "dev")}))
    env = {
        "GPUSIM_CONFIG": str(cfg),
        "GPUSIM_STATE_DIR": str(tmp_path / "state"),
        "PATH": f"{prefix / 'bin'}:/usr/bin:/bin",
        "PYTHONPATH": str(site),
    }
    res = subprocess.run(["nvidia-smi", "-L"], env=env, capture_output=True, text=True, check=True)
    assert res.stdout.count("NVIDIA H200") == 2
    res = subprocess.run(["gpusim", "setup"], env=env, capture_output=True, text=True, check=True)
    assert (tmp_path / "state" / "allocations").is_dir() and (tmp_path / "dev" / "nvidia1").exists()
    res = subprocess.run(
        [sys.executable, "-m", "sglang.launch_server", "--model-path", "m", "--bogus"],
        env=env,
        capture_output=True,
        text=True,
    )
    assert res.returncode == 2 and "sglang serve: error: unrecognized arguments: --bogus" in res.stderr
