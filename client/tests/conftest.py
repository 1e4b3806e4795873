"""Makes the client (src/) and the helpers in support/ importable, and offers fleetkit's fixtures.

This directory itself is kept off sys.path: other test directories import their own ``conftest`` by
name, and must not find this one."""

from __future__ import annotations

import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent
for _p in (_HERE.parent / "src", _HERE / "support"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

from fleetkit import fake, moto, shared_sim, simulator  # noqa: E402, F401  (fixtures)
