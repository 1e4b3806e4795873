"""Log formatting shared by all simulated processes.

SGLang uses ``[%(asctime)s{prefix}] %(message)s`` for its own loggers and uvicorn's
``[%(asctime)s] %(levelprefix)s %(message)s`` for the HTTP layer. Every line is flushed
at once because systemd's journal reads the pipe.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import TextIO

_lock = threading.Lock()


def _stamp() -> str:
    now = time.time()
    base = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(now))
    if os.environ.get("SGLANG_LOG_MS", "").lower() in ("1", "true", "yes"):
        base += f".{int((now % 1) * 1000):03d}"
    return base


def _write(stream: TextIO, text: str) -> None:
    with _lock:
        try:
            stream.write(text)
            stream.flush()
        except (BrokenPipeError, ValueError, OSError):
            pass


class Logger:
    """Writes SGLang-style lines; level filtering follows --log-level."""

    LEVELS = {"debug": 10, "info": 20, "warning": 30, "error": 40, "critical": 50}

    def __init__(self, stream_name: str = "stderr", prefix: str = "", level: str = "info"):
        self.stream_name = stream_name
        self.prefix = prefix
        self.level = self.LEVELS.get(str(level).lower(), 20)

    @property
    def stream(self) -> TextIO:
        return sys.stdout if self.stream_name == "stdout" else sys.stderr

    def log(self, level: int, msg: str) -> None:
        if level < self.level:
            return
        _write(self.stream, f"[{_stamp()}{self.prefix}] {msg}\n")

    def debug(self, msg: str) -> None:
        self.log(10, msg)

    def info(self, msg: str) -> None:
        self.log(20, msg)

    def warning(self, msg: str) -> None:
        self.log(30, msg)

    def error(self, msg: str) -> None:
        self.log(40, msg)

    def raw(self, text: str) -> None:
        _write(self.stream, text if text.endswith("\n") else text + "\n")


class UvicornLogger:
    """uvicorn's default (stderr) and access (stdout) loggers without colours (no TTY under systemd)."""

    def __init__(self, level: str = "info", access_stream: str = "stdout", default_stream: str = "stderr"):
        self.level = Logger.LEVELS.get(str(level).lower(), 20)
        self.access_stream_name = access_stream
        self.default_stream_name = default_stream

    def _stream(self, name: str) -> TextIO:
        return sys.stdout if name == "stdout" else sys.stderr

    def _line(self, levelname: str, msg: str) -> str:
        prefix = f"{levelname}:".ljust(10)
        return f"[{_stamp()}] {prefix}{msg}\n"

    def info(self, msg: str) -> None:
        if self.level <= 20:
            _write(self._stream(self.default_stream_name), self._line("INFO", msg))

    def error(self, msg: str) -> None:
        _write(self._stream(self.default_stream_name), self._line("ERROR", msg))

    def access(self, client: str, method: str, target: str, version: str, status: int, phrase: str) -> None:
        if self.level <= 20:
            line = self._line("INFO", f'{client} - "{method} {target} HTTP/{version}" {status} {phrase}')
            _write(self._stream(self.access_stream_name), line)


def bare_stderr(msg: str) -> None:
    """Python's last-resort handler: the bare message, used before logging is configured."""
    _write(sys.stderr, msg + "\n")
