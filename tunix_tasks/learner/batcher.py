"""The learner's buffer: episodes from the source -> drop what the flow rejects -> one batch.

    batcher = Batcher(source, flow, accounting, cfg.learner)
    got = batcher.next_batch(version)      # (PackedBatch, its episodes) or None (not ready)
    batcher.put_back(episodes)             # packed but not trained: they stay buffered

Buffered episodes are not acknowledged, so a crash re-reads them from their shards. An
episode the source flags as a replay (an id already accounted or in flight) is dropped
as DUPLICATE before any flow rule: it is never trained twice. One in a group without
signal (`learner.filter_zero_variance_groups`) is dropped as ZERO_VARIANCE unless a flow
rule drops it first.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from tunix_tasks.config import LearnerConfig
from tunix_tasks.episode import DropReason, Episode
from tunix_tasks.learner.accounting import Accounting
from tunix_tasks.learner.flow import FlowPolicy
from tunix_tasks.learner.packing import PackedBatch, pack
from tunix_tasks.learner.source import PrefetchingSource


class DataTimeout(TimeoutError):
    """No usable data arrived for `learner.data_timeout_s` seconds."""


class Batcher:
    def __init__(
        self,
        source: PrefetchingSource,
        flow: FlowPolicy,
        accounting: Accounting,
        cfg: LearnerConfig,
    ) -> None:
        self._source = source
        self._flow = flow
        self._acct = accounting
        self._cfg = cfg
        self.buffer: list[Episode] = []
        self._last_data = time.monotonic()
        # A bounded packing window keeps packing cheap however large the backlog grows.
        self._window = max(4 * cfg.min_episodes_per_step, 8 * cfg.batch_rows, 256)

    def next_batch(self, version: int) -> tuple[PackedBatch, list[Episode]] | None:
        self.buffer.extend(self._source.drain())
        self.drop_unusable(version)
        result = None
        if self._flow.ready(self.buffer, version):
            # Oldest weights first: they are closest to going stale.
            self.buffer.sort(key=lambda ep: ep.policy_version)
            window = self.buffer[: self._window]
            result = pack(
                window,
                buckets=self._cfg.buckets,
                batch_rows=self._cfg.batch_rows,
                flush=self._flow.flush,
            )
        if result is None or not result.batches:
            self.buffer.extend(self._source.drain(timeout_s=0.05))
            if time.monotonic() - self._last_data > self._cfg.data_timeout_s:
                raise DataTimeout(
                    f"no trainable data for {self._cfg.data_timeout_s:.0f}s at version "
                    f"{version} (buffer {len(self.buffer)} episodes); are the actors running?"
                )
            return None
        self._last_data = time.monotonic()
        batch = max(result.batches, key=lambda b: b.density)  # ties: the oldest data
        by_id = {ep.episode_id: ep for ep in self.buffer[: self._window]}
        episodes = [by_id[i] for i in batch.episode_ids]
        chosen = set(batch.episode_ids)
        self.buffer = [ep for ep in self.buffer if ep.episode_id not in chosen]
        return batch, episodes

    def drop_unusable(self, version: int) -> None:
        keep = []
        for ep in self.buffer:
            flag = self._source.drop_flag(ep)  # DUPLICATE, ZERO_VARIANCE or None
            reason = flag if flag == DropReason.DUPLICATE else self._flow.drop_reason(ep, version)
            reason = reason or flag
            if reason is None:
                keep.append(ep)
            else:
                self._acct.drop(ep, reason)
        self.buffer = keep

    def usable(self, episodes: Sequence[Episode], version: int) -> bool:
        """Still trainable at `version` (a publish may have moved the version since)?"""
        return all(self._flow.drop_reason(ep, version) is None for ep in episodes)

    def put_back(self, episodes: Sequence[Episode]) -> None:
        self.buffer.extend(episodes)
