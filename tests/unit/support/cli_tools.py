"""Where the command-line tools the unit tests run are: beside the test run's interpreter when its
virtualenv installed them (``make venv``), else on PATH (``ansible-test units --venv`` puts
ansible-core's commands there, not in its venv). Imported as ``cli_tools`` (tests/unit/conftest.py
puts this directory on sys.path)."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path


def cli(name: str) -> str:
    """The path of the command ``name`` (ansible-playbook, ansible-galaxy, ...)."""
    beside = Path(sys.executable).with_name(name)
    if beside.exists():
        return str(beside)
    return shutil.which(name) or str(beside)
