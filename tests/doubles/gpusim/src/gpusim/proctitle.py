"""Process titles as the setproctitle C extension sets them, done with ctypes.

setproctitle writes the title over the original argv area and puts a non-NUL byte at the
end of that area; Linux then reports ``/proc/PID/cmdline`` as the title up to its first
NUL. It also sets ``comm`` (15 bytes) with PR_SET_NAME.
"""

from __future__ import annotations

import ctypes
import signal
from pathlib import Path

PR_SET_PDEATHSIG = 1
PR_SET_NAME = 15

_libc: ctypes.CDLL | None = None


def _lib() -> ctypes.CDLL:
    global _libc  # noqa: PLW0603  (one handle per process)
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    return _libc


def set_comm(name: str) -> None:
    buf = ctypes.create_string_buffer(name.encode()[:15])
    _lib().prctl(PR_SET_NAME, buf, 0, 0, 0)


def set_pdeathsig(sig: int = signal.SIGKILL) -> None:
    _lib().prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)


def clear_pdeathsig() -> None:
    _lib().prctl(PR_SET_PDEATHSIG, 0, 0, 0, 0)


def _argv_area() -> tuple[int, int]:
    data = Path("/proc/self/stat").read_text()
    tail = data[data.rindex(")") + 2 :].split()
    return int(tail[45]), int(tail[46])


def set_title(title: str) -> bool:
    """Overwrite the argv area; returns False if the area is too small or unreadable."""
    set_comm(title)
    try:
        start, end = _argv_area()
    except (OSError, IndexError, ValueError):
        return False
    size = end - start
    data = title.encode()
    if size < len(data) + 2 or start == 0:
        return False
    buf = data + b"\0" * (size - len(data) - 1) + b"."
    ctypes.memmove(ctypes.c_void_p(start), buf, size)
    return True
