"""Exactly-once accounting: every episode handed to the learner is trained or dropped once.

`Accounting` acknowledges episodes to the source (which moves the checkpointed position),
keeps the run's counters (with the stale-drop bias: `drop_bias.py` distributions of the
trained and the stale-dropped episodes), and collects the ledger of episode ids
accounted since the last checkpoint (written just before it, see `checkpoint.py`).

    acct = Accounting(source, counters=meta.get("counters"))
    acct.drop(ep, DropReason.STALE)                    # or, for buffered entries:
    acct.drop_entries(block, entries, DropReason.STALE)
    acct.trained(episodes, real_tokens=batch.real_tokens, longest_bucket=max(buckets))
    ckpt.save(step, state, {..., "counters": acct.counters}, acct.take_ledger())

`read_ledger(store)` reads the ledger back: every checkpoint's entry, in step order.

`RecentIds` is the bounded memory of accounted episode ids with which the source
recognises a replayed episode (a shard copied under a new name); see its docstring.
"""

from __future__ import annotations

import base64
import collections
import hashlib
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
from numpy.typing import ArrayLike

from tunix_tasks.config import MAX_ACTORS
from tunix_tasks.episode import DropReason, Episode
from tunix_tasks.learner import drop_bias
from tunix_tasks.storage.layout import RunLayout
from tunix_tasks.storage.store import ObjectStore, StoreError
from tunix_tasks.untrusted import json_loads

if TYPE_CHECKING:
    from tunix_tasks.learner.blocks import EpisodeBlock

#: Actor incarnations whose consumed episodes the counters keep (the most recently
#: active). Twice the largest fleet: every live actor keeps its count (an evicted one would
#: take every episode it ever committed for unread, and flow control would pause it for
#: good), with room for as many dead incarnations (restarts) before the oldest go.
CONSUMED_KEYS = 2 * MAX_ACTORS


def actor_key(episode: Episode) -> str:
    """The `<actor_id>/<incarnation>` that made an episode (its group id less the group
    number); "" for episodes no actor made (demonstrations)."""
    return group_actor(episode.group_id)


def group_actor(group_id: str) -> str:
    """`actor_key` of an episode of group `group_id`."""
    return group_id.rpartition("/")[0]


class Acknowledger(Protocol):
    def ack(self, episode: Episode) -> None: ...
    def ack_entries(self, block: EpisodeBlock, entries: np.ndarray) -> None: ...


def _empty_ledger() -> dict[str, Any]:
    return {"trained": [], "dropped": {}}


class Accounting:
    def __init__(self, source: Acknowledger, *, counters: dict[str, Any] | None = None) -> None:
        self._source = source
        self.counters: dict[str, Any] = counters or {
            "trained_episodes": 0,
            "trained_tokens": 0,
            "dropped": {},
            "truncated_sequences": 0,
        }
        # Absent in checkpoints written before the bias was kept: from now on.
        self.counters.setdefault("drop_bias", {side: drop_bias.empty() for side in drop_bias.SIDES})
        # Absent before flow control: from now on (flow.py `FlowReport` publishes it).
        self.counters.setdefault("consumed", {})
        self._ledger = _empty_ledger()

    def _consume(self, group_ids: Iterable[str]) -> None:
        """Count episodes consumed (trained or dropped) per actor incarnation, keeping
        the `CONSUMED_KEYS` most recently active (a fleet's restarts do not grow it)."""
        consumed = self.counters["consumed"]
        for group_id in group_ids:
            key = group_actor(group_id)
            if key:
                consumed[key] = consumed.pop(key, 0) + 1  # re-inserted: newest last
        if len(consumed) > CONSUMED_KEYS:
            for old in list(consumed)[: len(consumed) - CONSUMED_KEYS]:
                del consumed[old]

    def _observe(self, side: str, lengths: ArrayLike, turns: ArrayLike, rewards: ArrayLike) -> None:
        bias = self.counters["drop_bias"]
        bias[side] = drop_bias.add(bias[side], lengths, turns, rewards)

    def drop(self, episode: Episode, reason: DropReason) -> None:
        self._source.ack(episode)
        self._dropped(
            reason,
            [episode.episode_id],
            [episode.group_id],
            [episode.length],
            [episode.num_turns],
            [episode.reward],
        )

    def drop_entries(self, block: EpisodeBlock, entries: np.ndarray, reason: DropReason) -> None:
        """`drop` for these entries of a buffered block, column by column."""
        self._source.ack_entries(block, entries)
        self._dropped(
            reason,
            block.episode_id[entries].tolist(),
            block.group_id[entries],
            block.length[entries],
            block.num_turns[entries],
            block.reward[entries],
        )

    def _dropped(
        self,
        reason: DropReason,
        ids: list[str],
        group_ids: Iterable[str],
        lengths: ArrayLike,
        turns: ArrayLike,
        rewards: ArrayLike,
    ) -> None:
        self._consume(group_ids)
        self._ledger["dropped"].setdefault(reason, []).extend(ids)
        dropped = self.counters["dropped"]
        dropped[reason] = dropped.get(reason, 0) + len(ids)
        if reason == DropReason.STALE:
            self._observe("stale", lengths, turns, rewards)

    def trained(
        self, episodes: Sequence[Episode], *, real_tokens: int, longest_bucket: int
    ) -> None:
        for ep in episodes:
            self._source.ack(ep)
        self._ledger["trained"].extend(ep.episode_id for ep in episodes)
        self._consume(ep.group_id for ep in episodes)
        self.counters["trained_episodes"] += len(episodes)
        self._observe(
            "trained",
            [ep.length for ep in episodes],
            [ep.num_turns for ep in episodes],
            [ep.reward for ep in episodes],
        )
        self.counters["trained_tokens"] += int(real_tokens)
        # Counted when trained: a long episode may wait in the buffer over many steps.
        self.counters["truncated_sequences"] += sum(ep.length > longest_bucket for ep in episodes)

    def take_ledger(self) -> dict[str, Any]:
        """The ledger since the last call (for the checkpoint about to be written)."""
        ledger, self._ledger = self._ledger, _empty_ledger()
        return ledger


class RecentIds:
    """The last `capacity` episode ids accounted for (trained or dropped), first in first
    out, to recognise a replay: an episode whose id was accounted before is a duplicate.

    Bounded by design: a checkpoint keeps 64-bit digests of the ids (blake2b; a false
    match needs a 64-bit collision), ~11 bytes an id, so the default window of 65,536 ids
    adds ~0.7 MB to a checkpoint whatever the run's length. In memory the ids this process
    accounted are also kept as they are, so that the source's check of each id it reads
    is a set lookup, not a hash (the digests' cost was a tenth of reading, #29; ~15 MB
    at the default window, ids of ~30 characters); ids restored from a checkpoint are
    known by their digest only, so while the window holds any, a lookup hashes too. A
    replay of episodes accounted longer ago than the window is not recognised here; in
    async mode such old episodes are dropped as stale anyway unless `max_staleness` spans
    the window.
    """

    def __init__(self, capacity: int = 65_536) -> None:
        if capacity < 1:
            raise ValueError(f"RecentIds: capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        # The window, oldest first: each id's digest, and the id (None when restored).
        self._order: collections.deque[tuple[int, str | None]] = collections.deque()
        self._digests: set[int] = set()
        self._ids: set[str] = set()
        self._restored = 0  # entries of the window known by their digest only

    @staticmethod
    def digest(episode_id: str) -> int:
        """The 64-bit digest an id is remembered by in a checkpoint."""
        return int.from_bytes(
            hashlib.blake2b(episode_id.encode(), digest_size=8).digest(), "little"
        )

    def holds_any(self, episode_ids: Iterable[str]) -> bool:
        """Whether any of these ids is in the window (one set operation when no restored
        digest is left in it)."""
        ids = list(episode_ids)
        if not self._ids.isdisjoint(ids):
            return True
        return self._restored > 0 and not self._digests.isdisjoint(map(self.digest, ids))

    def __contains__(self, episode_id: str) -> bool:
        return episode_id in self._ids or (
            self._restored > 0 and self.digest(episode_id) in self._digests
        )

    def __len__(self) -> int:
        return len(self._order)

    def add(self, episode_id: str) -> None:
        digest = self.digest(episode_id)
        if digest in self._digests:
            return
        self._digests.add(digest)
        self._ids.add(episode_id)
        self._order.append((digest, episode_id))
        while len(self._order) > self.capacity:
            old, old_id = self._order.popleft()
            self._digests.discard(old)
            if old_id is None:
                self._restored -= 1
            else:
                self._ids.discard(old_id)

    def get_state(self) -> dict[str, Any]:
        digests = (d for d, _ in self._order)
        packed = np.fromiter(digests, dtype="<u8", count=len(self._order)).tobytes()
        return {"capacity": self.capacity, "digests": base64.b64encode(packed).decode()}

    def set_state(self, state: dict[str, Any]) -> None:
        packed = np.frombuffer(base64.b64decode(state.get("digests", "")), dtype="<u8")
        self._order = collections.deque((int(d), None) for d in packed[-self.capacity :])
        self._digests = {d for d, _ in self._order}
        self._ids = set()
        self._restored = len(self._order)


class LedgerError(StoreError):
    """A ledger file that is not a ledger entry (broken by hand): a `StoreError`, so the
    report and `train`'s end say it in one line."""


def read_ledger(store: ObjectStore) -> list[dict[str, Any]]:
    """All ledger entries (`learner/ledger/<step>.json`, written beside each checkpoint), in
    step order; `LedgerError` naming the file for one that is not a JSON object."""
    entries = []
    for info in store.list(RunLayout.LEDGER):
        try:
            entry = json_loads(store.read_bytes(info.key))
        except ValueError as err:
            raise LedgerError(f"{info.key} is not a ledger entry: {err}") from None
        if not isinstance(entry, dict):
            raise LedgerError(f"{info.key} is not a ledger entry: not a JSON object")
        entries.append(entry)
    return entries
