"""A one-line terminal progress bar (no dependencies); silent when the stream is not a TTY."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class ProgressBar:
    """`[#####.....]  45/137 req  err 0  12.3s` redrawn in place at most every `interval_s`."""

    def __init__(
        self,
        total: int,
        label: str = "",
        *,
        stream: TextIO | None = None,
        enabled: bool | None = None,
        interval_s: float = 0.2,
        width: int = 30,
    ) -> None:
        self.total = max(total, 0)
        self.label = label
        self.stream = stream or sys.stderr
        self.enabled = self.stream.isatty() if enabled is None else enabled
        self.interval_s = interval_s
        self.width = width
        self.done = 0
        self.errors = 0
        self._t0 = time.monotonic()
        self._last = 0.0

    def line(self) -> str:
        frac = self.done / self.total if self.total else 1.0
        filled = round(self.width * min(frac, 1.0))
        bar = "#" * filled + "." * (self.width - filled)
        elapsed = time.monotonic() - self._t0
        head = f"{self.label} " if self.label else ""
        return f"{head}[{bar}] {self.done}/{self.total} req  err {self.errors}  {elapsed:.1f}s"

    def update(self, done: int = 1, errors: int = 0) -> None:
        self.done += done
        self.errors += errors
        now = time.monotonic()
        if self.enabled and (now - self._last >= self.interval_s or self.done >= self.total):
            self._last = now
            self.stream.write("\r" + self.line())
            self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self.stream.write("\r" + self.line() + "\n")
            self.stream.flush()
