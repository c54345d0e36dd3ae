"""The learner's input side: shards -> validated episodes -> advantages -> a buffer.

A background thread follows the `ShardStream` (so reading and validating shards overlaps
the train step), quarantines invalid shards, computes each episode's advantage over its
group (all episodes of a group are in one shard), and hands `BufferedEpisode`s to the
learner. The learner acknowledges an episode only once it is trained or dropped; the
stream's position (under a lock) is what the checkpoint stores.

    inp = LearnerInput(store, cfg, vocab_size=tok.vocab_size)
    inp.set_state(meta["stream"]); inp.start()
    new = inp.drain()                 # BufferedEpisodes read since the last call
    inp.ack(episode)                  # trained or dropped
    meta["stream"] = inp.get_state()
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from tunix_tasks.config import RunConfig
from tunix_tasks.learner.packing import SequenceExample
from tunix_tasks.learner.rl_math import batch_advantages, group_advantages
from tunix_tasks.storage.runs import quarantine
from tunix_tasks.storage.shards import ShardStream, StreamItem
from tunix_tasks.storage.store import ObjectStore, StoreError
from tunix_tasks.storage.validation import ShardValidationError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BufferedEpisode:
    shard: str
    row: int
    episode_id: str
    policy_version: int
    reward: float
    status: str
    example: SequenceExample


def with_advantages(items: list[StreamItem], mode: str) -> list[BufferedEpisode]:
    """Advantages for the episodes of one shard: group-normalised (GRPO) or batch."""
    if not items:
        return []
    rewards = np.asarray([it.episode.reward for it in items], np.float32)
    if mode == "group":
        adv = group_advantages(rewards, [it.episode.group_id for it in items])
    else:
        adv = batch_advantages(rewards)
    out = []
    for it, a in zip(items, np.asarray(adv, np.float32), strict=True):
        e = it.episode
        out.append(
            BufferedEpisode(
                shard=it.shard,
                row=it.row,
                episode_id=e.episode_id,
                policy_version=e.policy_version,
                reward=e.reward,
                status=e.status,
                example=SequenceExample(
                    episode_id=e.episode_id,
                    tokens=e.tokens,
                    loss_mask=e.loss_mask,
                    behavior_logprobs=e.behavior_logprobs,
                    advantage=float(a),
                    policy_version=e.policy_version,
                ),
            )
        )
    return out


class LearnerInput:
    def __init__(
        self, store: ObjectStore, cfg: RunConfig, *, vocab_size: int, poll_s: float = 0.2
    ) -> None:
        self._store = store
        self._advantage = cfg.learner.advantage
        self._poll_s = poll_s
        self._lock = threading.Lock()
        self._queue: queue.Queue[BufferedEpisode] = queue.Queue()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.quarantined: list[dict[str, str]] = []
        self.errors = 0
        self.backlog_shards = 0
        self._stream = ShardStream(store, vocab_size=vocab_size, on_invalid=self._quarantine)

    # -- position -----------------------------------------------------------------
    def get_state(self) -> dict[str, Any]:
        with self._lock:
            return self._stream.get_state()

    def set_state(self, state: dict[str, Any]) -> None:
        with self._lock:
            self._stream.set_state(state)

    def ack(self, ep: BufferedEpisode) -> None:
        with self._lock:
            self._stream.ack(ep.shard, [ep.row])

    # -- reading ------------------------------------------------------------------
    def _quarantine(self, key: str, err: ShardValidationError) -> None:
        quarantine(self._store, key, reason=err.reason, detail=err.detail)
        self.quarantined.append({"shard": key, "reason": err.reason})

    def poll_once(self, max_shards: int = 16) -> int:
        """Read up to `max_shards` new shards into the queue; returns episodes added."""
        with self._lock:
            pending = self._stream.pending_shards()
            self.backlog_shards = len(pending)
            # Acknowledged rows too: a group's advantages are computed over the whole group,
            # also when part of it was trained before a restart.
            items = self._stream.poll(max_shards=max_shards, include_acked=True) if pending else []
        by_shard: dict[str, list[StreamItem]] = {}
        for it in items:
            by_shard.setdefault(it.shard, []).append(it)
        n = 0
        for shard_items in by_shard.values():
            for item, ep in zip(
                shard_items, with_advantages(shard_items, self._advantage), strict=True
            ):
                if not item.acked:
                    self._queue.put(ep)
                    n += 1
        return n

    def start(self) -> None:
        def loop() -> None:
            while not self._stop.is_set():
                try:
                    added = self.poll_once()
                except StoreError as err:  # transient storage trouble: retry later
                    self.errors += 1
                    log.warning("shard polling failed: %s", err)
                    added = 0
                if not added or self._queue.qsize() > 20000:
                    self._stop.wait(self._poll_s)

        self._thread = threading.Thread(target=loop, name="shard-prefetch", daemon=True)
        self._thread.start()

    def drain(self, timeout_s: float = 0.0) -> list[BufferedEpisode]:
        out: list[BufferedEpisode] = []
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                out.append(
                    self._queue.get(timeout=max(0.0, deadline - time.monotonic()) if not out else 0)
                )
            except queue.Empty:
                return out

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
