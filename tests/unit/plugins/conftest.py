"""Makes the plugin tests' helpers in support/ importable (as client/tests/conftest.py does for
the client's): ``simulated_instance``, the simulated SGLang instance (tests/doubles/gpusim) that the
advisor, capacity, model-facts, retune-prediction and advise-action tests share.

This directory itself is kept off sys.path: other test directories import their own ``conftest`` by
name, and must not find this one."""

from __future__ import annotations

import sys
from pathlib import Path

_SUPPORT = Path(__file__).resolve().parent / "support"
if str(_SUPPORT) not in sys.path:
    sys.path.insert(0, str(_SUPPORT))
