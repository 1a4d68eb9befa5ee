"""Elapsed time, steps per second and the time left, for a training loop's log lines.

Plain text rather than a progress bar: the demo's output goes through torchrun and nox, often into a log
file, where a redrawn bar turns into noise; a line per logged step reads the same in both places.
"""

from __future__ import annotations

import time


def clock(seconds: float) -> str:
    """``m:ss``, or ``h:mm:ss`` from an hour; ``?`` before anything is measured."""
    if seconds != seconds or seconds == float("inf"):
        return "?"
    whole = round(seconds)
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


class StepClock:
    """Times the steps of this run, from ``first`` (where a resumed run starts) to ``last`` (where it stops).

    The rate is this run's steps over this run's wall time, evaluations and checkpoints included, so the ETA
    is when the run ends rather than when the training steps alone would.
    """

    def __init__(self, first: int, last: int) -> None:
        self.first, self.last = first, last
        self.started = time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def status(self, done: int) -> str:
        """``elapsed 0:12  2.50 steps/s  ETA 0:40`` after step ``done``."""
        elapsed = self.elapsed()
        rate = (done - self.first) / elapsed if elapsed > 0 else float("nan")
        left = (self.last - done) / rate if rate > 0 else float("nan")
        return f"elapsed {clock(elapsed)}  {rate:.2f} steps/s  ETA {clock(left)}"
