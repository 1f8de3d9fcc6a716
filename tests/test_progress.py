"""The progress bar `flashgen tune` and `flashgen bench` draw: counts, percentage, elapsed
time and an ETA from the mean time per finished step; redrawn in place on a terminal, one
line per step otherwise."""
from __future__ import annotations

import io

from flashgen.progress import Progress


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


class Tty(io.StringIO):
    def isatty(self):
        return True


def test_eta_is_mean_step_time_times_steps_left():
    clock, out = Clock(), io.StringIO()
    bar = Progress(4, "flashgen bench", stream=out, clock=clock)
    assert bar.eta() is None and "ETA ?" in bar.text()
    clock.t += 30
    bar.advance("case 1")
    clock.t += 10
    bar.advance("case 2")
    lines = out.getvalue().splitlines()
    assert lines[0] == ("flashgen bench [######..................] 1/4  25% elapsed 0:30 "
                        "ETA 1:30 case 1")
    assert lines[1].endswith("2/4  50% elapsed 0:40 ETA 0:40 case 2")
    clock.t += 3600
    bar.advance()
    assert "elapsed 1:00:40 ETA 20:13" in out.getvalue().splitlines()[-1]  # (3640 s / 3) x 1


def test_terminal_redraws_one_line():
    out = Tty()
    bar = Progress(2, "flashgen tune", stream=out, clock=Clock())
    bar.advance("a")
    bar.advance("b")
    bar.close()
    text = out.getvalue()
    assert text.count("\r\033[K") == 2 and text.endswith("ETA 0:00 b\n") and text.count("\n") == 1
