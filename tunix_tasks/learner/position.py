"""`ShardPosition`: which shards and rows the learner has acknowledged, in bounded state.

A per-actor watermark replaces the keys of every fully acknowledged shard below it, so
the checkpointed position does not grow with the run's history (docs/architecture.md,
"Bounded position"); the watermark is also where the source starts listing an actor's
folder, so a listing does not grow with it either.

    pos = ShardPosition(grace_ms=10_000)
    pos.opened(key, num_rows); pos.ack(key, [0, 1]); pos.compact(listed_keys)
    pos.is_done(key); pos.watermark("actor-0003"); state = pos.get_state()
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from tunix_tasks.storage.layout import RunLayout

STATE_VERSION = 2


class ShardPosition:
    """Acknowledged shards and rows.

    A shard is *done* once all its rows are acknowledged (or it was quarantined). Keys are
    `shards/<actor>/<13-digit ms>-<rand>.parquet`, so within one actor they sort by
    creation time, and an actor commits its shards one after another. `compact(listed)`
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
            keys.sort()
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


def _created_ms(key: str) -> int:
    try:
        return int(key.rsplit("/", 1)[-1].split("-", 1)[0])
    except ValueError:
        return 0
