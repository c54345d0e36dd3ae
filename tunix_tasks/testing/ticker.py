"""`Ticker`: a thread that sleeps 1 ms at a time and records the gaps between its wake-ups,
to see how long other threads keep a Python thread from running (holding the GIL, or a
core): a test that a background encode leaves the GIL free, the publishing benchmark's
longest stall.

    with Ticker() as ticker:
        work()
    ticker.longest, sum(g for g in ticker.gaps if g < 0.05)
"""

from __future__ import annotations

import threading
import time


class Ticker:
    """Records `gaps` (s) between wake-ups while entered; `longest` is the largest."""

    def __init__(self) -> None:
        self.gaps: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._tick, daemon=True)

    @property
    def longest(self) -> float:
        return max(self.gaps, default=0.0)

    def _tick(self) -> None:
        last = time.perf_counter()
        while not self._stop.is_set():
            time.sleep(0.001)
            now = time.perf_counter()
            self.gaps.append(now - last)
            last = now

    def __enter__(self) -> Ticker:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
