"""The learner's buffer: blocks from the source -> drop what the flow rejects -> one batch.

    batcher = Batcher(source, flow, accounting, cfg.learner)
    got = batcher.next_batch(version)      # (PackedBatch, its episodes) or None (not ready)
    batcher.put_back(episodes)             # packed but not trained: they stay buffered

The buffer is the source's `EpisodeBlock`s (`blocks.py`), column by column: the flow's
rules run as masks over them, and packing plans over the buffered lengths and copies the
chosen entries' arrays into the batch. Only the episodes of the batch it returns become
`Episode` objects. Buffered episodes are not acknowledged, so a crash re-reads them from
their shards. An episode the source flags as a replay (an id already accounted or in
flight) is dropped as DUPLICATE before any flow rule: it is never trained twice. One in a
group without signal (`learner.filter_zero_variance_groups`) is dropped as ZERO_VARIANCE
unless a flow rule drops it first.

Recentring. The source computes each advantage over the episode's whole group (its shard
with `advantage: batch`) when it reads the shard, before any flow rule; a rule drops
episodes later (STALE: staleness grows while they wait). A group of 8 rewards
(1, 1, 0, 0 | 0, 0, 0, 0) whose last four go stale would train advantages summing to
+2.31: the dropped zeros had lowered the baseline. So when an episode that was in its
group's baseline is dropped, the advantages of its group's buffered members are
recomputed over the members still in the baseline (`shard_advantages`, with the learner's
`advantage` and `normalize_advantage_std`): trained, buffered and not dropped (here
+-1, summing to 0). Members already trained keep theirs, and after a restart the rows
acknowledged before it are not in the recomputed baseline (the source's first one had
them). ENV_ERROR / ENV_TIMEOUT episodes were never in the baseline.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

from tunix_tasks.config import LearnerConfig
from tunix_tasks.episode import DropReason, Episode
from tunix_tasks.learner.accounting import Accounting
from tunix_tasks.learner.advantages import shard_advantages
from tunix_tasks.learner.blocks import EpisodeBlock
from tunix_tasks.learner.flow import FlowPolicy
from tunix_tasks.learner.packing import PackedBatch, assemble, plan
from tunix_tasks.learner.source import PrefetchingSource


class DataTimeout(TimeoutError):
    """No usable data arrived for `learner.data_timeout_s` seconds."""


class _Window:
    """`packing.Sequences` over buffered entries: sequence i is entry `j[i]` of
    `blocks[b[i]]`; the other arguments are those entries' columns."""

    def __init__(
        self,
        blocks: Sequence[EpisodeBlock],
        b: np.ndarray,
        j: np.ndarray,
        *,
        length: np.ndarray,
        advantage: np.ndarray,
        policy_version: np.ndarray,
    ) -> None:
        self.blocks, self.b, self.j = blocks, b, j
        self.lengths, self.advantages, self.policy_versions = length, advantage, policy_version

    def episode_id(self, i: int) -> str:
        return self.blocks[self.b[i]].episode_id[self.j[i]]

    def arrays(self, i: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return self.blocks[self.b[i]].arrays(self.j[i])


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
        self.blocks: list[EpisodeBlock] = []
        self._last_data = time.monotonic()
        # A bounded packing window keeps packing cheap however large the backlog grows.
        self._window = max(4 * cfg.min_episodes_per_step, 8 * cfg.batch_rows, 256)

    @property
    def buffered(self) -> int:
        """Episodes buffered: read, not yet trained, dropped or taken into a batch."""
        return sum(int(np.count_nonzero(b.live)) for b in self.blocks)

    def buffered_versions(self) -> np.ndarray:
        """The buffered episodes' `policy_version`s (what the flow policy asks about)."""
        parts = [b.policy_version[b.live] for b in self.blocks]
        return np.concatenate(parts) if parts else np.zeros(0, np.int64)

    def buffered_episodes(self) -> list[Episode]:
        """The buffered episodes as `Episode`s, block by block (to inspect; not the path
        of training)."""
        return [b.episode(int(j)) for b in self.blocks for j in np.flatnonzero(b.live)]

    def _take(self, timeout_s: float = 0.0) -> None:
        """Drain the source into the buffer; blocks with nothing buffered leave it (their
        trained entries' rewards leave their groups' baselines with them)."""
        self.blocks = [b for b in self.blocks if b.live.any()]
        self.blocks += self._source.drain(timeout_s=timeout_s)

    def next_batch(self, version: int) -> tuple[PackedBatch, list[Episode]] | None:
        self._take()
        self.drop_unusable(version)
        batch = None
        if self._flow.ready(self.buffered_versions(), version):
            batch = self._pack(version)
        if batch is None:
            self._take(timeout_s=0.05)
            if time.monotonic() - self._last_data > self._cfg.data_timeout_s:
                raise DataTimeout(
                    f"no trainable data for {self._cfg.data_timeout_s:.0f}s at version "
                    f"{version} (buffer {self.buffered} episodes); are the actors running?"
                )
            return None
        self._last_data = time.monotonic()
        return batch

    def _pack(self, version: int) -> tuple[PackedBatch, list[Episode]] | None:
        """A batch of the packing window, its entries taken out of the buffer: the one
        with the most episodes the next publish would drop (`flow.due`, packed first),
        then the densest (ties: the oldest data). Density alone would starve the shorter
        episodes whenever more data than a batch is buffered: longer ones keep arriving
        and win every batch until the short ones go stale (docs/scaling.md, "Flow
        control")."""
        live = [np.flatnonzero(b.live) for b in self.blocks]

        def gather(name: str) -> np.ndarray:
            parts = zip(self.blocks, live, strict=True)
            return np.concatenate([getattr(b, name)[js] for b, js in parts])

        # Oldest weights first: they are closest to going stale.
        order = np.argsort(gather("policy_version"), kind="stable")[: self._window]
        b = np.concatenate([np.full(len(js), k) for k, js in enumerate(live)])
        columns = {name: gather(name)[order] for name in ("length", "advantage", "policy_version")}
        window = _Window(self.blocks, b[order], np.concatenate(live)[order], **columns)
        cfg = self._cfg
        due = self._flow.due(window.policy_versions, version)
        planned, _ = plan(
            window.lengths,
            buckets=cfg.buckets,
            batch_rows=cfg.batch_rows,
            flush=self._flow.flush,
            first=due,
        )
        if not planned:
            return None
        scores = [
            (
                sum(int(due[i]) for row in rows for i in row),
                sum(min(int(window.lengths[i]), bucket) for row in rows for i in row) / bucket,
            )
            for bucket, rows in planned
        ]
        bucket, rows = planned[max(range(len(planned)), key=scores.__getitem__)]
        chosen = [i for row in rows for i in row]
        for i in chosen:
            self.blocks[window.b[i]].live[window.j[i]] = False
        episodes = [self.blocks[window.b[i]].episode(int(window.j[i])) for i in chosen]
        return assemble(window, rows, cfg.batch_rows, bucket), episodes

    def drop_unusable(self, version: int) -> None:
        """Drop every buffered episode the source flags or the flow rejects, and recentre
        the advantages of the groups that lost baseline members."""
        for block in self.blocks:
            live = np.flatnonzero(block.live)
            if not live.size:
                continue
            flow = self._flow.drop_masks(block.policy_version[live], block.status[live], version)
            reasons = {
                DropReason.DUPLICATE: block.duplicate[live],
                **flow,
                DropReason.ZERO_VARIANCE: block.zero_variance[live],
            }
            gone = np.zeros(live.size, bool)
            for reason, mask in reasons.items():  # an episode drops for its first reason
                hit = mask & ~gone
                if hit.any():
                    self._acct.drop_entries(block, live[hit], reason)
                    gone |= hit
            if gone.any():
                self._drop_from_baseline(block, live[gone])

    def _drop_from_baseline(self, block: EpisodeBlock, entries: np.ndarray) -> None:
        """Entries leave the buffer and their groups' baselines; the buffered members of
        each group that lost one get advantages over the members still in it."""
        block.live[entries] = False
        shrunk = entries[block.in_baseline[entries]]
        block.in_baseline[entries] = False
        by_group = self._cfg.advantage == "group"
        for group in set(block.group_id[shrunk].tolist()) if by_group else [None]:
            members = block.in_baseline & (block.group_id == group if by_group else True)
            if not (members & block.live).any():
                continue
            adv = shard_advantages(
                block.reward[members],
                [""] * int(members.sum()),  # one group: the baseline
                self._cfg.advantage,
                normalize_std=self._cfg.normalize_advantage_std,
            )
            update = members & block.live
            block.advantage[update] = adv[block.live[members]]

    def usable(self, episodes: Sequence[Episode], version: int) -> bool:
        """Still trainable at `version` (a publish may have moved the version since)?"""
        masks = self._flow.drop_masks(
            [ep.policy_version for ep in episodes], [ep.status for ep in episodes], version
        )
        return not any(m.any() for m in masks.values())

    def put_back(self, episodes: Sequence[Episode]) -> None:
        """Episodes of a batch not trained after all: buffered again, in their blocks."""
        blocks = {b.shard: b for b in self.blocks}
        for ep in episodes:
            assert ep.source is not None
            block = blocks[ep.source.shard]
            block.live[block.entry(ep.source.row)] = True
