"""GPU memory allocations shared by all simulated processes through the state directory.

Each scheduler owns one JSON file per GPU it holds. The file's mtime is its heartbeat.
A holder that is gone (or a zombie) keeps counting towards ``memory.used`` until its
last heartbeat plus the configured release delay, the way a real driver frees a dead
context's memory seconds after the process exits. A process the driver held in teardown
gets its heartbeat refreshed when it is let go, so the delay runs from its end.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from gpusim import procutil

ALLOC_SUBDIR = "allocations"


@dataclass
class Allocation:
    pid: int
    start_time: int
    gpu: int
    mib: int
    title: str
    role: str = "scheduler"
    port: int | None = None
    never_release: bool = False
    created: float = field(default_factory=time.time)

    @property
    def key(self) -> str:
        return f"gpu{self.gpu}-{self.pid}-{self.start_time}"


@dataclass
class Holder:
    alloc: Allocation
    alive: bool
    heartbeat: float
    releases_at: float | None
    path: Path

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self.alloc)
        d.update(
            alive=self.alive,
            heartbeat=round(self.heartbeat, 3),
            releases_at=None if self.releases_at is None else round(self.releases_at, 3),
            state="alive" if self.alive else ("held" if self.releases_at is None else "releasing"),
        )
        return d


def alloc_dir(state_dir: Path) -> Path:
    return state_dir / ALLOC_SUBDIR


def ensure_state_dir(state_dir: Path) -> Path:
    """Create the state tree world-writable and sticky so an unprivileged server can register."""
    d = alloc_dir(state_dir)
    for p in (state_dir, d):
        if not p.exists():
            with contextlib.suppress(FileExistsError):
                p.mkdir(parents=True)
            with contextlib.suppress(PermissionError):
                os.chmod(p, 0o1777)  # noqa: S103
    return d


class AllocationHandle:
    """The owning side: a scheduler updates its size and heartbeats until it dies."""

    def __init__(self, state_dir: Path, alloc: Allocation):
        self.dir = ensure_state_dir(state_dir)
        self.alloc = alloc
        self.path = self.dir / f"{alloc.key}.json"
        self._write()

    def _write(self) -> None:
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(asdict(self.alloc)))
        with contextlib.suppress(PermissionError):
            os.chmod(tmp, 0o644)
        os.replace(tmp, self.path)

    def set_mib(self, mib: int) -> None:
        self.alloc.mib = int(mib)
        self._write()

    def heartbeat(self) -> None:
        try:
            os.utime(self.path)
        except FileNotFoundError:
            # `gpusim reset` removed it; the process still holds the memory, so re-register.
            self._write()

    def release(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()


def scan(state_dir: Path, release_delay: float, now: float | None = None, prune: bool = True) -> list[Holder]:
    """All allocations that still count, alive or not yet released."""
    now = time.time() if now is None else now
    d = alloc_dir(state_dir)
    if not d.is_dir():
        return []
    out: list[Holder] = []
    for path in sorted(d.glob("*.json")):
        try:
            data = json.loads(path.read_text())
            mtime = path.stat().st_mtime
        except (OSError, ValueError):
            continue
        try:
            alloc = Allocation(**data)
        except TypeError:
            continue
        alive = procutil.is_alive(alloc.pid, alloc.start_time)
        releases_at = None
        if not alive:
            if alloc.never_release:
                releases_at = None
            else:
                releases_at = mtime + release_delay
                if now >= releases_at:
                    if prune:
                        with contextlib.suppress(OSError):
                            path.unlink()
                    continue
        out.append(Holder(alloc, alive, mtime, releases_at, path))
    return out


def used_by_gpu(holders: list[Holder]) -> dict[int, int]:
    used: dict[int, int] = {}
    for h in holders:
        used[h.alloc.gpu] = used.get(h.alloc.gpu, 0) + int(h.alloc.mib)
    return used


def reset(state_dir: Path) -> int:
    d = alloc_dir(state_dir)
    n = 0
    if d.is_dir():
        for path in d.glob("*.json"):
            with contextlib.suppress(OSError):
                path.unlink()
                n += 1
    return n
