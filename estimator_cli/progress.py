"""A one-line progress indicator on stderr, only for a terminal (or when asked with ``--progress``)."""

from __future__ import annotations

import itertools
import sys
import time
from typing import TextIO


class Progress:
    def __init__(self, enabled: bool, stream: TextIO | None = None) -> None:
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self._spin = itertools.cycle("|/-\\")
        self._start = time.monotonic()
        self._last = 0.0
        self._width = 0

    def update(self, message: str, force: bool = False) -> None:
        now = time.monotonic()
        if not self.enabled or (not force and now - self._last < 0.2):
            return
        self._last = now
        text = f"\r{next(self._spin)} gpu-estimate {now - self._start:5.1f}s  {message}"
        self.stream.write(text.ljust(self._width))
        self._width = len(text)
        self.stream.flush()

    def done(self) -> None:
        if self.enabled and self._width:
            self.stream.write("\r" + " " * self._width + "\r")
            self.stream.flush()
