"""Newline-delimited JSON over a Unix socket between the main process and its workers."""

from __future__ import annotations

import json
import socket
from typing import Any


class Channel:
    def __init__(self, sock: socket.socket):
        self.sock = sock
        self._buf = b""
        self.closed = False

    @classmethod
    def from_fd(cls, fd: int) -> Channel:
        return cls(socket.socket(fileno=fd))

    def fileno(self) -> int:
        return self.sock.fileno()

    def send(self, msg: dict[str, Any]) -> bool:
        try:
            self.sock.sendall(json.dumps(msg).encode() + b"\n")
            return True
        except OSError:
            return False

    def _pop(self) -> dict[str, Any] | None:
        if b"\n" in self._buf:
            line, self._buf = self._buf.split(b"\n", 1)
            return json.loads(line)
        return None

    def recv(self, timeout: float | None = None) -> dict[str, Any] | None:
        """One message; None on timeout. Sets ``closed`` on EOF."""
        msg = self._pop()
        if msg is not None:
            return msg
        if self.closed:
            return None
        self.sock.settimeout(timeout)
        while True:
            try:
                chunk = self.sock.recv(65536)
            except TimeoutError:
                return None
            except (BlockingIOError, InterruptedError):
                return None
            except OSError:
                self.closed = True
                return None
            if not chunk:
                self.closed = True
                return None
            self._buf += chunk
            msg = self._pop()
            if msg is not None:
                return msg
