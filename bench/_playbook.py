"""What the benchmarks share: the repository's paths, and running one of their playbooks against
the simulated fleet (the repository's ansible.cfg, the virtualenv's tools first on PATH).

The benchmarks run as scripts (``python bench/<name>/bench_<name>.py``, see the Makefile's
``bench`` target); each puts this directory on ``sys.path`` to import this module.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BIN = REPO / ".venv" / "bin"


def playbook(inv: Path, book: Path | str, *extra: str) -> float:
    """``ansible-playbook -i inv book *extra`` from the repository root; its wall time in seconds.
    If it fails: the end of its output on stderr, and exit."""
    env = dict(os.environ)
    env["ANSIBLE_CONFIG"] = str(REPO / "ansible.cfg")
    env.setdefault("CONTAINERS_CONF", str(REPO / "tools/testhost/containers.conf"))
    env["PATH"] = f"{BIN}:{env['PATH']}"
    argv = [str(BIN / "ansible-playbook"), "-i", str(inv), str(book), *extra]
    t0 = time.monotonic()
    proc = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, check=False)
    wall = time.monotonic() - t0
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-8000:] + proc.stderr[-3000:])
        raise SystemExit(f"{os.path.relpath(book, REPO)} failed (rc={proc.returncode})")
    return wall
