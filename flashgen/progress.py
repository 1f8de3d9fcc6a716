"""A progress bar with an ETA for long commands (`flashgen tune`, `flashgen bench`).

On a terminal the bar is redrawn in place on stderr; otherwise (a log file, CI) each
update is a line, so a log shows how far a run got and how long it expected to take.
The ETA is the mean time per finished step times the steps left. Nothing here imports
anything beyond the standard library.
"""
from __future__ import annotations

import sys
import time


def _clock(seconds: float) -> str:
    seconds = max(int(round(seconds)), 0)
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


class Progress:
    """`total` steps; call `advance(note)` after each one, `close()` at the end."""

    WIDTH = 24

    def __init__(self, total: int, label: str, stream=None, clock=time.monotonic):
        self.total = max(int(total), 0)
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        self.clock = clock
        self.start = clock()
        self.done = 0
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._drawn = False

    def eta(self) -> float | None:
        """Seconds left, or None before the first step."""
        if self.done == 0:
            return None
        per_step = (self.clock() - self.start) / self.done
        return per_step * max(self.total - self.done, 0)

    def text(self, note: str = "") -> str:
        frac = self.done / self.total if self.total else 1.0
        filled = int(round(frac * self.WIDTH))
        bar = "#" * filled + "." * (self.WIDTH - filled)
        eta = self.eta()
        left = "?" if eta is None else _clock(eta)
        line = (f"{self.label} [{bar}] {self.done}/{self.total} {frac:4.0%} "
                f"elapsed {_clock(self.clock() - self.start)} ETA {left}")
        return f"{line} {note}".rstrip()

    def advance(self, note: str = "", steps: int = 1) -> None:
        self.done = min(self.done + steps, self.total) if self.total else self.done + steps
        self.draw(note)

    def draw(self, note: str = "") -> None:
        text = self.text(note)
        try:
            if self.tty:
                self.stream.write("\r\033[K" + text)
                self._drawn = True
            else:
                self.stream.write(text + "\n")
            self.stream.flush()
        except (OSError, ValueError):  # a closed stream: progress is best effort
            pass

    def close(self) -> None:
        if self.tty and self._drawn:
            try:
                self.stream.write("\n")
                self.stream.flush()
            except (OSError, ValueError):
                pass
            self._drawn = False
