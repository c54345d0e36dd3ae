"""The learner's buffer: episodes from the source -> drop what the flow rejects -> one batch.

    batcher = Batcher(source, flow, accounting, cfg.learner)
    got = batcher.next_batch(version)      # (PackedBatch, its episodes) or None (not ready)
    batcher.put_back(episodes)             # packed but not trained: they stay buffered

Buffered episodes are not acknowledged, so a crash re-reads them from their shards. An
episode the source flags as a replay (an id already accounted or in flight) is dropped
as DUPLICATE before any flow rule: it is never trained twice. One in a group without
signal (`learner.filter_zero_variance_groups`) is dropped as ZERO_VARIANCE unless a flow
rule drops it first.

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

import dataclasses
import time
from collections.abc import Sequence

from tunix_tasks.config import LearnerConfig
from tunix_tasks.episode import DropReason, Episode
from tunix_tasks.learner.accounting import Accounting
from tunix_tasks.learner.advantages import shard_advantages
from tunix_tasks.learner.flow import DROPPED_STATUSES, FlowPolicy
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
        # Baseline key -> {episode id: reward} of the episodes its advantages are over:
        # seen, not dropped (trained ones included). Kept while a member is buffered.
        self._baselines: dict[tuple[str, str], dict[str, float]] = {}

    def _baseline_key(self, episode: Episode) -> tuple[str, str]:
        """What an episode's advantage is relative to: its group in its shard (a group is
        always in one shard), or its whole shard with `advantage: batch`."""
        shard = episode.source.shard if episode.source is not None else ""
        return shard, episode.group_id if self._cfg.advantage == "group" else ""

    def _take(self, timeout_s: float = 0.0) -> None:
        """Drain the source into the buffer, recording each group's baseline members."""
        episodes = self._source.drain(timeout_s=timeout_s)
        for ep in episodes:
            if ep.status not in DROPPED_STATUSES:  # never in the source's baseline
                self._baselines.setdefault(self._baseline_key(ep), {})[ep.episode_id] = ep.reward
        self.buffer.extend(episodes)

    def next_batch(self, version: int) -> tuple[PackedBatch, list[Episode]] | None:
        self._take()
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
            self._take(timeout_s=0.05)
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
        shrunk: set[tuple[str, str]] = set()  # baselines that lost a member
        for ep in self.buffer:
            flag = self._source.drop_flag(ep)  # DUPLICATE, ZERO_VARIANCE or None
            reason = flag if flag == DropReason.DUPLICATE else self._flow.drop_reason(ep, version)
            reason = reason or flag
            if reason is None:
                keep.append(ep)
                continue
            self._acct.drop(ep, reason)
            key = self._baseline_key(ep)
            if self._baselines.get(key, {}).pop(ep.episode_id, None) is not None:
                shrunk.add(key)
        advantages = {i: a for key in shrunk for i, a in self._recentre(key).items()}
        self.buffer = [
            dataclasses.replace(ep, advantage=advantages[ep.episode_id])
            if ep.episode_id in advantages
            else ep
            for ep in keep
        ]
        live = {self._baseline_key(ep) for ep in self.buffer}
        self._baselines = {k: v for k, v in self._baselines.items() if k in live}

    def _recentre(self, key: tuple[str, str]) -> dict[str, float]:
        """Episode id -> advantage over the baseline `key`'s remaining members."""
        members = self._baselines[key]
        adv = shard_advantages(
            list(members.values()),
            [""] * len(members),  # one group: the baseline
            self._cfg.advantage,
            normalize_std=self._cfg.normalize_advantage_std,
        )
        return dict(zip(members, adv.tolist(), strict=True))

    def usable(self, episodes: Sequence[Episode], version: int) -> bool:
        """Still trainable at `version` (a publish may have moved the version since)?"""
        return all(self._flow.drop_reason(ep, version) is None for ep in episodes)

    def put_back(self, episodes: Sequence[Episode]) -> None:
        self.buffer.extend(episodes)
