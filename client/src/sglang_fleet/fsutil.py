"""Small filesystem primitives that the crash-consistency design is built on."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def fsync_dir(path: Path) -> None:
    """Make a rename or a new directory entry in ``path`` survive a power loss."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: Path, data: bytes, *, durable: bool = True, mode: int = 0o644) -> None:
    """Replace ``path`` with ``data`` so that readers (and a restart after a kill) see either the old
    file or the new one, never a mix. ``durable`` adds the fsyncs needed to survive a power loss too."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        write_all(fd, data)
        if durable:
            os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    if durable:
        fsync_dir(path.parent)


def atomic_write_json(path: Path, obj: Any, *, durable: bool = True, mode: int = 0o644) -> None:
    data = json.dumps(obj, indent=1, sort_keys=True, ensure_ascii=False).encode() + b"\n"
    atomic_write_bytes(path, data, durable=durable, mode=mode)


def write_all(fd: int, data: bytes) -> None:
    """One record is handed to the kernel in as few write calls as it takes (normally one), so that a
    kill of this process never leaves a record half in the page cache and half in a user buffer."""
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]
