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

from tunix_tasks.episode import DropReason, Episode
from tunix_tasks.learner import drop_bias

if TYPE_CHECKING:
    from tunix_tasks.learner.blocks import EpisodeBlock

#: Actor incarnations whose consumed episodes the counters keep (the most recent).
CONSUMED_KEYS = 256


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
        for old in list(consumed)[: max(0, len(consumed) - CONSUMED_KEYS)]:
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

    Bounded by design: it keeps 64-bit digests of the ids (blake2b; a false match needs
    a 64-bit collision), 8 bytes an id in memory and ~11 in a checkpoint, so the default
    window of 65,536 ids adds ~0.7 MB to a checkpoint whatever the run's length. A replay
    of episodes accounted longer ago than the window is not recognised here; in async mode
    such old episodes are dropped as stale anyway unless `max_staleness` spans the window.
    """

    def __init__(self, capacity: int = 65_536) -> None:
        if capacity < 1:
            raise ValueError(f"RecentIds: capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._order: collections.deque[int] = collections.deque()
        self._set: set[int] = set()

    @staticmethod
    def digest(episode_id: str) -> int:
        """The 64-bit digest an id is remembered by (a pure function: the source computes
        a round's ahead of `holds`, with `digests`)."""
        return RecentIds.digests([episode_id])[0]

    @staticmethod
    def digests(episode_ids: Iterable[str]) -> list[int]:
        """`digest` of each id (names bound once: this runs for every episode read)."""
        blake2b, from_bytes = hashlib.blake2b, int.from_bytes
        return [
            from_bytes(blake2b(i.encode(), digest_size=8).digest(), "little") for i in episode_ids
        ]

    def holds(self, digest: int) -> bool:
        return digest in self._set

    def holds_any(self, digests: Iterable[int]) -> bool:
        return not self._set.isdisjoint(digests)

    def __contains__(self, episode_id: str) -> bool:
        return self.digest(episode_id) in self._set

    def __len__(self) -> int:
        return len(self._order)

    def add(self, episode_id: str) -> None:
        digest = self.digest(episode_id)
        if digest in self._set:
            return
        self._set.add(digest)
        self._order.append(digest)
        while len(self._order) > self.capacity:
            self._set.discard(self._order.popleft())

    def get_state(self) -> dict[str, Any]:
        packed = np.fromiter(self._order, dtype="<u8", count=len(self._order)).tobytes()
        return {"capacity": self.capacity, "digests": base64.b64encode(packed).decode()}

    def set_state(self, state: dict[str, Any]) -> None:
        packed = np.frombuffer(base64.b64decode(state.get("digests", "")), dtype="<u8")
        self._order = collections.deque(int(d) for d in packed[-self.capacity :])
        self._set = set(self._order)
