"""`ShardPosition`: which shards and rows the learner has acknowledged, in bounded state.

A per-actor watermark replaces the keys of every fully acknowledged shard below it, so
the checkpointed position does not grow with the run's history (docs/architecture.md,
"Bounded position"); the watermark is also where the source starts listing an actor's
folder, so a listing does not grow with it either. The last listing is handed out oldest
first and the store is listed again only once it runs dry (`ShardSweep`), so a backlog
costs no listing requests (docs/scaling.md).

    pos = ShardPosition(grace_ms=10_000)
    keys = pos.pending(handed_out) or pos.swept(listed_keys, handed_out)
    pos.opened(key, num_rows); pos.ack(key, [0, 1]); pos.compact(listed_keys)
    pos.is_done(key); pos.watermark("actor-0003"); state = pos.get_state()
"""

from __future__ import annotations

from collections.abc import Callable, Container, Iterable
from typing import Any

from tunix_tasks.storage.layout import RunLayout

STATE_VERSION = 2


class ShardPosition:
    """Acknowledged shards and rows.

    A shard is *done* once all its rows are acknowledged (or it was quarantined). A key's
    file name is `<13-digit ms>-<rand>.parquet` (under a time folder since #16, directly
    in `shards/<actor>/` before), so within one actor the names sort by creation time,
    and an actor commits its shards one after another. `compact(listed)`
    advances each actor's watermark over the done shards at the front of its listing;
    a key at or below the watermark is done. A shard is passed over only when it was
    created at least `grace_ms` before the actor's newest listed shard, which covers a
    clock step or a restarted actor's last upload still landing.
    """

    def __init__(self, *, grace_ms: int = 10_000) -> None:
        self.grace_ms = grace_ms
        self._watermarks: dict[str, str] = {}  # actor -> last key name known done
        self._done: set[str] = set()  # done keys above their actor's watermark
        self._acked: dict[str, set[int]] = {}  # shard -> acknowledged rows (in progress)
        self._rows: dict[str, int] = {}  # shard -> row count (in progress)
        self._sweep: ShardSweep | None = None  # the last listing, being handed out

    # -- queries -----------------------------------------------------------------
    def is_done(self, key: str) -> bool:
        if key in self._done:
            return True
        mark = self._watermarks.get(RunLayout.shard_actor(key))
        return mark is not None and key.rsplit("/", 1)[-1] <= mark

    def watermark(self, actor: str) -> str | None:
        """The last key name of `actor` known done (all its keys up to it are done)."""
        return self._watermarks.get(actor)

    def acked_rows(self, key: str) -> set[int]:
        return self._acked.get(key, set())

    # -- updates -----------------------------------------------------------------
    def opened(self, key: str, num_rows: int) -> None:
        self._rows[key] = num_rows
        self._acked.setdefault(key, set())
        self._maybe_done(key)

    def ack(self, key: str, rows: Iterable[int]) -> None:
        if self.is_done(key):
            return
        self._acked.setdefault(key, set()).update(rows)
        self._maybe_done(key)

    def mark_done(self, key: str) -> None:
        self._done.add(key)
        self._acked.pop(key, None)
        self._rows.pop(key, None)

    def _maybe_done(self, key: str) -> None:
        total = self._rows.get(key)
        if total is not None and len(self._acked.get(key, ())) >= total:
            self.mark_done(key)

    def compact(self, listed: Iterable[str]) -> None:
        """Fold done shards into watermarks, given the shard keys currently listed."""
        by_actor: dict[str, list[str]] = {}
        for key in listed:
            by_actor.setdefault(RunLayout.shard_actor(key), []).append(key)
        for actor, keys in by_actor.items():
            keys.sort(key=_name)  # by name: time folders or not, names order the shards
            newest_ms = _created_ms(keys[-1])
            mark = self._watermarks.get(actor)
            for key in keys:
                name = key.rsplit("/", 1)[-1]
                if mark is not None and name <= mark:
                    continue
                if key not in self._done or _created_ms(key) > newest_ms - self.grace_ms:
                    break
                mark = name
            if mark is not None:
                self._watermarks[actor] = mark
        # Done keys below a watermark, or no longer listed (quarantined: moved away),
        # need no entry of their own.
        listed_now = {k for keys in by_actor.values() for k in keys}
        self._done = {
            k
            for k in self._done
            if k in listed_now
            and k.rsplit("/", 1)[-1] > self._watermarks.get(RunLayout.shard_actor(k), "")
        }

    # -- listings --------------------------------------------------------------------
    def swept(self, listed: list[str], handed_out: Container[str]) -> list[str]:
        """Start handing out a fresh listing of the shard folders: compact over it, and
        return its shards neither done nor `handed_out`, oldest first (by file name, so
        the shards of all actors interleave fairly)."""
        self.compact(listed)
        keys = [k for k in listed if not self.is_done(k) and k not in handed_out]
        keys.sort(key=lambda k: (_name(k), k))
        self._sweep = ShardSweep(listed, keys)
        return keys

    def pending(self, handed_out: Container[str]) -> list[str] | None:
        """The last listing's shards not yet done nor `handed_out`, oldest first; None when
        it has none left (or there is none): then list the store again (`swept`)."""
        sweep = self._sweep
        if sweep is None or not sweep.advance(lambda k: k in handed_out or self.is_done(k)):
            return None
        if sweep.compaction_due():
            self.compact(sweep.listed)
        return [k for k in sweep.rest() if k not in handed_out] or None

    # -- state ---------------------------------------------------------------------
    def get_state(self) -> dict[str, Any]:
        return {
            "version": STATE_VERSION,
            "watermarks": dict(sorted(self._watermarks.items())),
            "done": sorted(self._done),
            "partial": {k: sorted(v) for k, v in sorted(self._acked.items())},
            "rows": dict(sorted(self._rows.items())),
        }

    def set_state(self, state: dict[str, Any]) -> None:
        # Version 1 (before watermarks) is the same without "watermarks".
        if state.get("version") not in (1, STATE_VERSION):
            raise ValueError(f"unsupported shard position version {state.get('version')!r}")
        self._watermarks = dict(state.get("watermarks", {}))
        self._done = set(state["done"])
        self._acked = {k: set(v) for k, v in state["partial"].items()}
        self._rows = dict(state.get("rows", {}))
        self._sweep = None  # listed under another position


class ShardSweep:
    """One listing of every actor folder, handed out oldest first until it runs dry.

    The source lists the store again only when a sweep has no shard left to hand out (or
    the position was restored): a learner behind its actors reads its backlog without
    listing requests, and shards written meanwhile would queue behind it anyway.
    `pending` is consumed from the front (the source reads the first shards it gets), so
    skipping the handed-out ones costs what was read, not the backlog.
    """

    # A reused sweep is compacted at every poll while it is small, else once per 256
    # shards handed out: folding acknowledged shards into watermarks keeps a checkpoint
    # small, and costs O(listed), which must not be paid at every poll of a long backlog.
    SMALL = 1024
    COMPACT_EVERY = 256

    def __init__(self, listed: list[str], pending: list[str]) -> None:
        self.listed = listed  # every key listed (ShardPosition.compact needs them all)
        self.pending = pending  # not done and not handed out when listed, oldest first
        self.cursor = 0  # pending[:cursor] are handed out or done
        self._compacted_at = 0

    def advance(self, handled: Callable[[str], bool]) -> bool:
        """Skip the shards at the front that are `handled`; False if none is left."""
        while self.cursor < len(self.pending) and handled(self.pending[self.cursor]):
            self.cursor += 1
        return self.cursor < len(self.pending)

    def compaction_due(self) -> bool:
        moved = self.cursor - self._compacted_at
        if not moved or (moved < self.COMPACT_EVERY and len(self.listed) > self.SMALL):
            return False
        self._compacted_at = self.cursor
        return True

    def rest(self) -> list[str]:
        return self.pending[self.cursor :]


def _name(key: str) -> str:
    return key.rsplit("/", 1)[-1]


def _created_ms(key: str) -> int:
    try:
        return int(key.rsplit("/", 1)[-1].split("-", 1)[0])
    except ValueError:
        return 0
