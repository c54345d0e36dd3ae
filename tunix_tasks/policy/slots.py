"""`SlotTable`: which KV-cache slot serves which conversation, and what each slot holds.

The sampler's cache has a fixed number of slots. A slot is idle or serves one row; an idle
slot remembers the session (conversation) it last served and the tokens whose keys and
values it holds, so that session's next turn prefills only its new tokens. Idle slots are
handed out least recently used first; taking a slot that held another session drops that
session's cache.

    slot = table.acquire(session)          # None: every slot is busy
    reuse = table.reusable(slot, sequence)  # leading tokens already cached in the slot
    table.hold(slot, sequence[:n])          # after writing them
    table.release(slot, session)            # idle again; remembers the session
    table.invalidate()                      # new weights: nothing cached is valid
"""

from __future__ import annotations

import collections
from collections.abc import Hashable, Sequence

import numpy as np

__all__ = ["SlotTable"]


class SlotTable:
    def __init__(self, slots: int) -> None:
        self.slots = slots
        self._tokens: list[np.ndarray] = [np.zeros(0, np.int32) for _ in range(slots)]
        self._sessions: dict[Hashable, int] = {}
        # Idle slots, least recently used first.
        self._idle: collections.OrderedDict[int, None] = collections.OrderedDict.fromkeys(
            range(slots)
        )

    def acquire(self, session: Hashable | None) -> int | None:
        """The session's own idle slot if it has one, else the least recently used idle
        slot (its cache dropped); None when every slot is busy."""
        own = self._sessions.get(session) if session is not None else None
        if own is not None and own in self._idle:
            del self._idle[own]
            return own
        if not self._idle:
            return None
        slot, _ = self._idle.popitem(last=False)
        for other in [s for s, v in self._sessions.items() if v == slot]:
            del self._sessions[other]
        self._tokens[slot] = np.zeros(0, np.int32)
        return slot

    def release(self, slot: int, session: Hashable | None) -> None:
        if session is not None:
            self._sessions[session] = slot
        else:
            self._tokens[slot] = np.zeros(0, np.int32)
        self._idle[slot] = None  # most recently used

    def hold(self, slot: int, tokens: Sequence[int]) -> None:
        """The slot's cache now holds `tokens` at positions 0..len-1."""
        self._tokens[slot] = np.asarray(tokens, np.int32)

    def reusable(self, slot: int, sequence: Sequence[int]) -> int:
        """How many leading tokens of `sequence` the slot already holds."""
        held = self._tokens[slot]
        n = min(len(held), len(sequence))
        differ = np.flatnonzero(held[:n] != np.asarray(sequence[:n], np.int32))
        return int(differ[0]) if differ.size else n

    def invalidate(self) -> None:
        self._tokens = [np.zeros(0, np.int32) for _ in range(self.slots)]
