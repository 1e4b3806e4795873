"""stdout whose reader may go away (``sglang-fleet-ops plan | head``): what is written after the
reader closed the pipe is dropped, once said on stderr, and the command goes on to its end and
exits with its own status, with no traceback (neither at the write nor when Python flushes
stdout at exit). The same guard as the client's (sglang_fleet.closedpipe): the two packages
are installed apart."""

from __future__ import annotations

import contextlib
import os
from typing import TextIO


class ReaderGoneGuard:
    """A text stream in front of ``stream`` that survives the loss of its reader."""

    def __init__(self, stream: TextIO, err: TextIO, prog: str) -> None:
        self.stream, self.err, self.prog = stream, err, prog
        self.reader_gone = False

    def write(self, text: str) -> int:
        if not self.reader_gone:
            try:
                self.stream.write(text)
            except BrokenPipeError:
                self._gone()
        return len(text)

    def flush(self) -> None:
        if not self.reader_gone:
            try:
                self.stream.flush()
            except BrokenPipeError:
                self._gone()

    def _gone(self) -> None:
        self.reader_gone = True
        # Python flushes stdout again at exit: its descriptor now leads to /dev/null, where the
        # data still buffered goes without an error.
        with contextlib.suppress(OSError, ValueError, AttributeError):
            devnull = os.open(os.devnull, os.O_WRONLY)
            try:
                os.dup2(devnull, self.stream.fileno())
            finally:
                os.close(devnull)
        with contextlib.suppress(OSError):
            print(f"{self.prog}: stdout was closed by its reader; the rest of the output is dropped", file=self.err)

    def __getattr__(self, name: str) -> object:
        return getattr(self.stream, name)
