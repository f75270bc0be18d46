"""A long loop's progress for a person watching: one log line each time another tenth (by default) of the work is
done, with the rate and the time left, so an export of minutes is never silent."""
from __future__ import annotations

import math
import time

from absl import logging


class Progress:
    """`add(n)` after each piece of `total` units; logs '<what>: done/total <unit> (p%), r <unit>/s, ETA s' when the
    done fraction crosses the next multiple of `every`. Counts are shown divided by `scale` (1e6 with unit 'MB' for
    bytes). `clock` is time.monotonic (tests pass their own)."""

    def __init__(self, what: str, total: int, unit: str, every: float = 0.1, scale: float = 1, log=logging.info,
                 clock=time.monotonic):
        self.what, self.total, self.unit, self.every, self.log, self.clock = what, int(total), unit, every, log, clock
        self.scale = scale
        self.done, self.start = 0, clock()
        self.lines = 1  # the next line is due at lines * every * total done (counted: no rounding drifts)

    def add(self, n: int) -> None:
        self.done += int(n)
        if self.total <= 0 or self.done < self._due():
            return
        while self._due() <= self.done:
            self.lines += 1
        seconds = max(self.clock() - self.start, 1e-9)
        rate = self.done / seconds
        left = max(self.total - self.done, 0) / max(rate, 1e-9)
        self.log("%s: %s/%s %s (%.0f%%), %s %s/s, ETA %.0f s", self.what, f"{self.done / self.scale:,.0f}",
                 f"{self.total / self.scale:,.0f}", self.unit, 100 * self.done / self.total,
                 f"{rate / self.scale:,.1f}", self.unit, left)

    def _due(self) -> float:
        fraction = self.lines * self.every
        return math.inf if fraction > 1 + 1e-9 else min(fraction, 1.0) * self.total * (1 - 1e-12)
