"""`DecodeLanes`: the decode working set, and which lane of it serves which request.

A decode segment runs on `work`: the active rows' KV-cache windows, one lane per row
([batch, n_kv_heads, window, head_dim] per layer; policy/decoding.py). The working set
stays on the device between segments, and a request keeps its lane while it decodes, so
a segment copies in only the lanes whose row is new (admitted, or moved by a change of
shape) instead of every row's window. The slot cache stays the truth: each segment writes
the positions it computed back to it, so dropping the working set loses nothing.

    plan = lanes.plan(rows, batch, window, scratch)  # plan.rows: lane -> request or None
    work = lanes.work or new_buffer(batch, window)  # None after a change of shape
    ... decode_segment(cache, work, *plan.arrays, ...) copies in the stale lanes, runs, and
        returns the new working set ...
    lanes.keep(work)   # every occupied lane now holds its row's window
    lanes.clear()      # new weights (every slot recomputed), or nothing left to decode

Memory: the working set holds up to `batch x window` positions per layer on top of the
slot cache (at most as much again, when every slot decodes at the longest window).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from tunix_tasks.policy.requests import Request

__all__ = ["DecodeLanes", "LanePlan"]


class LanePlan(NamedTuple):
    """One segment's lanes: the requests by lane (None: padding) and the decode program's
    per-lane inputs, [batch] each: slot, stale lanes (the first n_stale entries), the last
    drawn token, the position it sits at, tokens generated so far, and done (padding)."""

    rows: list[Request | None]
    slots: np.ndarray
    stale: np.ndarray
    n_stale: int
    last_tok: np.ndarray
    pos: np.ndarray
    n_gen: np.ndarray
    done: np.ndarray

    @property
    def arrays(self) -> tuple:
        """`decode_segment`'s arguments after `work`, in its order."""
        return self[1:]


class DecodeLanes:
    def __init__(self) -> None:
        self.work: Any = None  # the working set (a KVCache), None until a segment keeps one
        self._shape: tuple[int, int] | None = None
        # Per lane: (request, its slot) and whether the working set holds its window.
        self._lanes: list[tuple[Request, int] | None] = []
        self._fresh: list[bool] = []

    def plan(self, rows: Sequence[Request], batch: int, window: int, *, scratch: int) -> LanePlan:
        """Lay `rows` (each with a slot and at least one generated token) onto `batch`
        lanes for a segment over `window`; padding lanes use the `scratch` slot.

        A row already in a lane keeps it; new rows take free lanes. A new shape starts an
        empty working set."""
        if len(rows) > batch:
            raise ValueError(f"{len(rows)} rows do not fit {batch} lanes")
        if self._shape != (batch, window):
            self.clear()
            self._shape = (batch, window)
            self._lanes, self._fresh = [None] * batch, [False] * batch
        wanted = {id(r): r for r in rows}
        for i, entry in enumerate(self._lanes):
            if entry is not None and (
                wanted.get(id(entry[0])) is not entry[0] or entry[0].slot != entry[1]
            ):
                self._lanes[i], self._fresh[i] = None, False
        placed = {id(e[0]) for e in self._lanes if e is not None}
        free = iter([i for i, e in enumerate(self._lanes) if e is None])
        for r in rows:
            if id(r) not in placed:
                lane = next(free)
                self._lanes[lane], self._fresh[lane] = (r, r.slot), False
        order = [e[0] if e is not None else None for e in self._lanes]
        stale = [i for i, e in enumerate(self._lanes) if e is not None and not self._fresh[i]]
        slots = np.full(batch, scratch, np.int32)
        arrays = np.zeros((4, batch), np.int32)  # stale lanes, last token, position, n_gen
        arrays[0, : len(stale)] = stale
        for i, r in enumerate(order):
            if r is not None:  # the last drawn token is fed next, at the position it sits
                slots[i] = r.slot
                arrays[1:, i] = r.generated[-1], len(r.sequence) - 1, len(r.generated)
        done = np.asarray([r is None for r in order])
        return LanePlan(order, slots, arrays[0], len(stale), *arrays[1:], done)

    def keep(self, work: Any) -> None:
        """The segment ran: `work` holds every occupied lane's window."""
        self.work = work
        self._fresh = [e is not None for e in self._lanes]

    def clear(self) -> None:
        """Forget the working set (its memory is freed once the device drops it)."""
        self.work, self._shape = None, None
        self._lanes, self._fresh = [], []
