"""The learner's input: shards -> validated `Episode`s with advantages, and their position.

Three pieces, composed like grain's iterators (each `get_state` holds its parent's):

- `ShardPosition` (`position.py`): which shards and rows are acknowledged (trained or
  dropped). Pure state, bounded: a per-actor watermark replaces the keys of every fully
  acknowledged shard below it, so a checkpoint does not grow with the run's history.
- `EpisodeSource`: one round = list each actor's folder from its watermark, decode the
  shards not yet handed out concurrently, validate them `CHECK_EVERY` at a time in one
  vectorised pass (quarantining bad ones), compute each episode's advantage over its
  group (a group is always in one shard) and return one `EpisodeBlock` per shard
  (`blocks.py`): its unacknowledged rows, column by column; replayed episode ids are
  flagged (`block.duplicate`). `ack(episode)` / `ack_entries(block, entries)` mark
  episodes accounted for.
- `PrefetchingSource`: the same interface, with the rounds run by a background thread so
  reading overlaps the train step.

    source = PrefetchingSource(EpisodeSource(store, vocab_size=..., advantage="group"))
    source.set_state(checkpoint["stream"]); source.start()
    for block in source.drain():     # EpisodeBlocks read since the last call
        ...train (source.ack(block.episode(j))) or drop (source.ack_entries(block, js))...
    checkpoint["stream"] = source.get_state(); ...save...; source.committed()

After `set_state`, every unacknowledged row is yielded again: that is what makes the
learner's accounting exactly-once across crashes.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

import numpy as np
import pyarrow as pa

from tunix_tasks.config import LearnerConfig
from tunix_tasks.episode import Episode, ShardRow
from tunix_tasks.learner.accounting import RecentIds
from tunix_tasks.learner.advantages import (
    shard_advantages,
    shard_group_codes,
    zero_variance_mask,
)
from tunix_tasks.learner.blocks import EpisodeBlock
from tunix_tasks.learner.flow import DROPPED_STATUSES
from tunix_tasks.learner.position import STATE_VERSION, ShardPosition
from tunix_tasks.storage.layout import RunLayout
from tunix_tasks.storage.runs import RunReplaced, quarantine, replaced_since
from tunix_tasks.storage.shards import ShardColumns
from tunix_tasks.storage.store import NotFound, ObjectStore, StoreError
from tunix_tasks.storage.uri import join_uri
from tunix_tasks.storage.validation import (
    ShardValidationError,
    read_shard_table,
    validate_tables,
)

log = logging.getLogger(__name__)

#: Shards validated at once (a round's default `max_shards`): the fixed cost of a pass is
#: spread over them, and at most this many decoded shards are held at a time.
CHECK_EVERY = 16

__all__ = [
    "STATE_VERSION",
    "EpisodeSource",
    "PrefetchingSource",
    "ShardPosition",
    "shard_advantages",
]


class _Decoded(NamedTuple):
    """One shard of a round `EpisodeSource._decode` read: its columns, every row's advantage,
    which rows are in a group without signal (`zero_variance_mask`) and which are in their
    group's baseline (not `DROPPED_STATUSES`)."""

    columns: ShardColumns
    advantage: np.ndarray
    zero_variance: np.ndarray
    in_baseline: np.ndarray


class EpisodeSource:
    """Complete shards under `shards/` -> validated `EpisodeBlock`s with advantages.

    Limits: `max_length` (quarantine `too_long`), `run_id` (quarantine `other_run`: an
    actor of the run deleted and created again under its URI wrote it; unless this
    learner's run is the deleted one, when the shard is left for the new run) and
    `newest_version`, which the learner sets to the newest version it has published
    (quarantine `future_version`: no actor can hold weights newer than that). Replays:
    an episode whose id is in flight or was accounted within the last `dedup_window` ids
    is handed out flagged `duplicate`; the
    learner drops it as `duplicate`. Advantages are computed over the episodes the learner
    keeps (not `DROPPED_STATUSES`); with `filter_zero_variance` the kept episodes of a
    group without signal (`advantages.zero_variance_mask`) are flagged
    (`block.zero_variance`) and dropped. Listing: one listing per actor folder, from its
    watermark, so a poll costs the shards not yet done, not the run's history. With
    `delete_consumed`, shards done in a committed checkpoint are deleted (`committed`).
    """

    def __init__(
        self,
        store: ObjectStore,
        *,
        vocab_size: int,
        advantage: str = "group",
        read_threads: int = 4,
        grace_ms: int = 10_000,
        max_length: int | None = None,
        run_id: str = "",
        dedup_window: int = 65_536,
        delete_consumed: bool = False,
        filter_zero_variance: bool = False,
        normalize_std: bool = True,
    ) -> None:
        self._store = store
        self.normalize_std = normalize_std
        self.filter_zero_variance = filter_zero_variance
        self.vocab_size = vocab_size
        self.advantage = advantage
        self.max_length = max_length
        self.run_id = run_id  # the run's (storage.runs.run_id): another's shards, quarantined
        self._replaced = ""  # why this run is gone from its URI, once an other_run shows it
        self.newest_version: int | None = None  # None: no future-version check
        self.delete_consumed = delete_consumed
        self.position = ShardPosition(grace_ms=grace_ms)
        self.seen = RecentIds(dedup_window)  # accounted episode ids (checkpointed)
        self._emitted: set[str] = set()  # shards handed out by this process, not yet done
        self._inflight: set[str] = set()  # ids handed out (not duplicates), not yet acked
        self._duplicates: set[ShardRow] = set()  # rows handed out as duplicates, not acked
        self._consumed: list[str] = []  # shards done since the last get_state ...
        self._uncommitted: list[str] = []  # ... and those in a state not yet committed
        self._pool = ThreadPoolExecutor(max_workers=read_threads, thread_name_prefix="shard-read")
        self._deleter: ThreadPoolExecutor | None = None  # finishes its deletes on close()
        self.quarantined: list[dict[str, str]] = []
        self.backlog_shards = 0
        self.unread_shards: int | None = None  # listed, not yet handed out (None: unlisted)

    @classmethod
    def from_config(
        cls, store: ObjectStore, cfg: LearnerConfig, *, vocab_size: int, **kw: Any
    ) -> EpisodeSource:
        """The source the learner's config asks for (`learner.advantage`,
        `normalize_advantage_std`, `filter_zero_variance_groups`, `dedup_window`,
        `delete_consumed_shards`); `kw`: the other arguments (`max_length`, ...)."""
        return cls(
            store,
            vocab_size=vocab_size,
            advantage=cfg.advantage,
            normalize_std=cfg.normalize_advantage_std,
            dedup_window=cfg.dedup_window,
            delete_consumed=cfg.delete_consumed_shards,
            filter_zero_variance=cfg.filter_zero_variance_groups,
            **kw,
        )

    def get_state(self) -> dict[str, Any]:
        self._uncommitted += self._consumed
        self._consumed = []
        return {**self.position.get_state(), "seen": self.seen.get_state()}

    def set_state(self, state: dict[str, Any]) -> None:
        self.position.set_state(state)
        self.seen.set_state(state.get("seen", {}))  # absent in checkpoints before dedup
        self._emitted, self._inflight, self._duplicates = set(), set(), set()
        self._consumed, self._uncommitted = [], []

    def committed(self) -> None:
        """The state last returned by `get_state` is durable (checkpointed): with
        `delete_consumed`, delete the shards it holds done, in the background."""
        keys, self._uncommitted = self._uncommitted, []
        if self.delete_consumed and keys:
            self._deleter = self._deleter or ThreadPoolExecutor(1, "shard-delete")
            self._deleter.submit(self._delete, keys)

    def _delete(self, keys: list[str]) -> None:
        for key in keys:
            try:
                self._store.delete(key)
            except StoreError as err:  # left in place: it is done, never read again
                log.warning("could not delete consumed shard %s: %s", key, err)

    def ack(self, episode: Episode) -> None:
        """Mark an episode accounted for (trained on, or dropped)."""
        row = episode.source
        assert row is not None, "only episodes read from a shard can be acknowledged"
        self._acked(row.shard, [row.row], [episode.episode_id])

    def ack_entries(self, block: EpisodeBlock, entries: np.ndarray) -> None:
        """Mark these entries of a block accounted for, without building their episodes."""
        self._acked(block.shard, block.rows[entries].tolist(), block.episode_id[entries])

    def _acked(self, shard: str, rows: list[int], ids: Sequence[str]) -> None:
        self.position.ack(shard, rows)
        for row, episode_id in zip(rows, ids, strict=True):
            key = ShardRow(shard, row)
            if key in self._duplicates:
                self._duplicates.discard(key)  # its id belongs to the original
            else:
                self.seen.add(episode_id)
                self._inflight.discard(episode_id)
        if shard in self._emitted and self.position.is_done(shard):
            self._emitted.discard(shard)
            self._consumed.append(shard)

    def _list_shards(self) -> list[str]:
        """Keys above each actor's watermark: one listing per actor folder, from the
        watermark (GCS `start_offset`; locally only the recent time folders are read)."""

        def folder_keys(folder: str) -> list[str]:
            actor = RunLayout.shard_actor(folder)
            mark = self.position.watermark(actor)
            after = RunLayout.shard_list_start(actor, mark) if mark else None
            return [i.key for i in self._store.list(folder, start_after=after)]

        folders = self._store.list_folders(RunLayout.SHARDS)
        listed = [k for keys in self._pool.map(folder_keys, folders) for k in keys]
        return [k for k in listed if k.endswith(".parquet")]

    def pending_shards(self) -> list[str]:
        """Complete shards not yet handed out by this process, oldest first. The store is
        listed again only when the last listing's shards are all handed out: a backlog
        costs no listing requests, and new shards would queue behind it anyway."""
        keys = self.position.pending(self._emitted)
        if keys is None:
            keys = self.position.swept(self._list_shards(), self._emitted)
        self.backlog_shards = len(keys) + len(self._emitted)  # not done: unread + in flight
        self.unread_shards = len(keys)
        return keys

    def poll(self, max_shards: int = 16) -> list[EpisodeBlock]:
        """One round: the unacknowledged rows of up to `max_shards` new shards."""
        keys = self.pending_shards()[:max_shards]
        out: list[EpisodeBlock] = []
        for key, shard in zip(keys, self._decode(keys), strict=True):
            if isinstance(shard, ShardValidationError):
                self._quarantine(key, shard)
                continue
            self._emitted.add(key)
            n = len(shard.columns)
            acked = self.position.acked_rows(key)  # rows done before a restart
            rows = np.setdiff1d(np.arange(n), list(acked)) if acked else np.arange(n)
            self.position.opened(key, n)
            ids = shard.columns.episode_id[rows]
            duplicate = self._replayed(ids)
            self._inflight.update(ids[~duplicate])  # ids are unique within a shard
            self._duplicates.update(ShardRow(key, int(r)) for r in rows[duplicate])
            zero_variance = shard.zero_variance[rows] & self.filter_zero_variance
            block = EpisodeBlock(
                key,
                shard.columns,
                rows,
                shard.advantage[rows],
                duplicate,
                zero_variance,
                shard.in_baseline[rows],
            )
            out.append(block)
        return out

    def _replayed(self, ids: np.ndarray) -> np.ndarray:
        """Which of these ids are in flight or were accounted recently (a replay)."""
        if self._inflight.isdisjoint(ids) and not self.seen.holds_any(ids):
            return np.zeros(len(ids), bool)  # the usual case, without a loop per row
        replayed = (i in self._inflight or i in self.seen for i in ids)
        return np.fromiter(replayed, bool, len(ids))

    def _decode(self, keys: list[str]) -> list[_Decoded | ShardValidationError]:
        """The shards' episodes with their advantages, or why each is refused. Reader
        threads decode the files (Parquet decoding and object-store requests release the
        GIL); the rest is vectorised over `CHECK_EVERY` shards at a time, as per-shard
        Python work would hold the GIL about as long as the decoding takes (#29)."""
        out: list[_Decoded | ShardValidationError] = []
        for start in range(0, len(keys), CHECK_EVERY):
            chunk = keys[start : start + CHECK_EVERY]
            out += self._check(chunk, list(self._pool.map(self._read, chunk)))
        return out

    def _check(
        self, keys: list[str], reads: list[pa.Table | ShardValidationError]
    ) -> list[_Decoded | ShardValidationError]:
        """`_decode`'s validation and advantages of decoded shards."""
        out: list[Any] = list(reads)
        ok = [i for i, r in enumerate(out) if not isinstance(r, ShardValidationError)]
        valid = validate_tables(
            [out[i] for i in ok],
            [join_uri(self._store.uri, keys[i]) for i in ok],
            vocab_size=self.vocab_size,
            max_length=self.max_length,
            max_version=self.newest_version,
        )
        for i, err in zip(ok, valid.errors, strict=True):
            if err is not None:
                out[i] = err
        good = [(i, c) for i, c in zip(ok, valid.columns, strict=True) if c is not None]
        if not good:
            return out
        sizes = [len(c) for _, c in good]
        shard = np.repeat(np.arange(len(good)), sizes)
        reward = np.concatenate([c.reward for _, c in good])
        # Advantages over whole groups, also when part of a group was acknowledged before
        # a restart (`poll` hands out only the unacknowledged rows).
        groups = shard_group_codes(np.concatenate([c.group_id for _, c in good]), shard)
        keep = ~np.isin(np.concatenate([c.status for _, c in good]), DROPPED_STATUSES)
        adv = shard_advantages(
            reward, groups, self.advantage, keep, normalize_std=self.normalize_std, shards=shard
        )
        flat = zero_variance_mask(reward, groups, keep=keep)
        starts = np.cumsum([0, *sizes])
        for (i, cols), a, b in zip(good, starts[:-1], starts[1:], strict=True):
            out[i] = _Decoded(cols, adv[a:b], flat[a:b], keep[a:b])
        return out

    def _read(self, key: str) -> pa.Table | ShardValidationError:
        """A reader thread's part of a round (it touches none of the source's state)."""
        try:
            return read_shard_table(
                self._store, key, max_length=self.max_length, run_id=self.run_id
            )
        except ShardValidationError as err:
            return err
        except NotFound as err:
            # Listed, then deleted (retention, an operator): recorded as a bad shard is,
            # or every later round would retry it.
            where = join_uri(self._store.uri, key)
            return ShardValidationError(where, "not_found", f"listed, then gone: {err}")

    def _quarantine(self, key: str, err: ShardValidationError) -> None:
        if err.reason == "other_run" and (why := replaced_since(self._store, self.run_id)):
            # This learner is the leftover of a deleted run: the shard is the run's now
            # there. Left for that run's learner; this one's lease soon ends it (fenced).
            if not self._replaced:
                log.error("%s: quarantining none of that run's shards", why)
            self._replaced = why
            self.position.mark_done(key)  # this learner's own position: not read again
            return
        log.warning("invalid shard %s: %s", key, err.reason)
        quarantine(self._store, key, reason=err.reason, detail=err.detail)
        self.quarantined.append({"shard": key, "reason": err.reason})
        self.position.mark_done(key)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self._deleter is not None:
            self._deleter.shutdown(wait=True)


class PrefetchingSource:
    """Runs `EpisodeSource` rounds in a background thread; same position, under a lock."""

    def __init__(self, source: EpisodeSource, *, poll_s: float = 0.2, max_queued: int = 20_000):
        self.source = source
        self._poll_s = poll_s
        self._max_queued = max_queued  # episodes read and not yet drained
        self._queued = 0
        self._lock = threading.Lock()
        self._queue: queue.Queue[EpisodeBlock] = queue.Queue()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.errors = 0

    def get_state(self) -> dict[str, Any]:
        with self._lock:
            return {"parent": self.source.get_state()}

    def set_state(self, state: dict[str, Any]) -> None:
        # Checkpoints written before the sources were composed hold the position itself.
        with self._lock:
            self.source.set_state(state.get("parent", state))

    def ack(self, episode: Episode) -> None:
        with self._lock:
            self.source.ack(episode)

    def ack_entries(self, block: EpisodeBlock, entries: np.ndarray) -> None:
        with self._lock:
            self.source.ack_entries(block, entries)

    def committed(self) -> None:
        with self._lock:
            self.source.committed()

    def set_newest_version(self, version: int) -> None:
        self.source.newest_version = version  # one int, read by the next round: no lock

    @property
    def quarantined(self) -> list[dict[str, str]]:
        return self.source.quarantined

    @property
    def backlog_shards(self) -> int:
        return self.source.backlog_shards

    @property
    def caught_up(self) -> bool:
        """Every shard listed so far is read and drained: what more the learner needs
        must still be written."""
        return self.source.unread_shards == 0 and self._queue.empty()  # None: not listed yet

    def poll_once(self) -> int:
        with self._lock:
            blocks = self.source.poll()
        for block in blocks:
            self._queued += len(block)
            self._queue.put(block)
        return sum(map(len, blocks))

    def start(self) -> None:
        def loop() -> None:
            while not self._stop.is_set():
                try:
                    added = self.poll_once()
                except StoreError as err:  # transient storage trouble: retry later
                    self.errors += 1
                    log.warning("shard polling failed: %s", err)
                    added = 0
                except RunReplaced:  # a quarantine move found it: the learner stops
                    return
                if not added or self._queued > self._max_queued:
                    self._stop.wait(self._poll_s)

        self._thread = threading.Thread(target=loop, name="shard-prefetch", daemon=True)
        self._thread.start()

    def drain(self, timeout_s: float = 0.0) -> list[EpisodeBlock]:
        """Blocks read since the last call; waits up to `timeout_s` for the first."""
        out: list[EpisodeBlock] = []
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                wait = max(0.0, deadline - time.monotonic()) if not out else 0
                out.append(self._queue.get(timeout=wait))
                self._queued -= len(out[-1])
            except queue.Empty:
                return out

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        self.source.close()
