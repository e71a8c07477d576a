"""A progress line on stderr for long runs: shown only on a terminal, after about 2 s, unless quiet."""
from __future__ import annotations

import sys
import time
from typing import TextIO

__all__ = ["Progress"]


class Progress:
    """``update(done, total)`` redraws ``label: done/total`` at most five times a second, once
    the run has taken ``after`` seconds; ``close()`` ends the line. Silent when ``quiet`` or
    when ``stream`` is not a terminal (a pipe or a CI log gets the result only)."""

    def __init__(self, label: str, quiet: bool = False, stream: TextIO | None = None, after: float = 2.0) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.label, self.after = label, after
        self.enabled = not quiet and bool(getattr(self.stream, "isatty", lambda: False)())
        self.start = time.monotonic()
        self._last = 0.0
        self.shown = False

    def update(self, done: int, total: int) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if now - self.start < self.after or (now - self._last < 0.2 and done < total):
            return
        self._last = now
        pct = 100 * done // total if total else 100
        self.stream.write(f"\r{self.label}: {done:,}/{total:,} ({pct} %), {now - self.start:.0f} s")
        self.stream.flush()
        self.shown = True

    def close(self) -> None:
        if self.shown:
            self.stream.write("\n")
            self.stream.flush()
            self.shown = False
