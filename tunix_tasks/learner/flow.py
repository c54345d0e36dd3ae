"""Flow policies: when the learner trains, which episodes it drops, when it publishes;
and `FlowReport`, the consumption position it publishes for the actors' flow control.

A flow policy is the learner's only rule about data and versions (in the spirit of
Reverb's rate limiters: a named object with exact semantics, validated on construction).
The learner's loop asks it, per step:

    flow = flow_from_config(cfg)
    masks = flow.drop_masks(versions, statuses, version)  # over the buffered episodes'
    # columns: {DropReason: bool mask}, first reason first (STALE, ENV_ERROR, ENV_TIMEOUT)
    (the batcher drops what the source flags as a replay as DUPLICATE before asking, and
    groups without signal as ZERO_VARIANCE after, with learner.filter_zero_variance_groups)
    if flow.ready(versions, version): ...pack (flush=flow.flush; flow.due(...) first), train...
    flow.trained(episodes)
    if flow.publish_due(step, versions, version): ...publish version + 1...; flow.published()
    ...at the end: if flow.publish_at_end(step): publish

Staleness is `learner_version - policy_version` (`staleness.py`), measured when an
episode is about to be packed, so time spent in the buffer counts (docs/architecture.md,
"Staleness").
"""

from __future__ import annotations

import collections
import json
import time
from collections.abc import Mapping, Sequence
from typing import Protocol

import numpy as np
from numpy.typing import ArrayLike

from tunix_tasks.config import RunConfig
from tunix_tasks.episode import DropReason, Episode, EpisodeStatus
from tunix_tasks.learner.staleness import staleness
from tunix_tasks.storage.layout import RunLayout
from tunix_tasks.storage.store import ObjectStore
from tunix_tasks.storage.uri import scheme_of


def stale_mask(
    learner_version: ArrayLike, policy_versions: ArrayLike, max_staleness: int
) -> np.ndarray:
    """True where an episode is too stale to train on (`staleness > max_staleness`).

    Negative staleness is not stale. It cannot reach the flow: a restarted learner
    publishes a version newer than any snapshot out there, and the source quarantines
    shards whose `policy_version` is newer than what the learner published
    (`future_version`).
    """
    return staleness(learner_version, policy_versions) > max_staleness


class FlowPolicy(Protocol):
    """The questions the learner's loop asks; see the module docstring for the loop.
    Episodes come as columns: `versions` their `policy_version`s, `statuses` their
    `status` values (arrays, one entry per buffered episode)."""

    flush: bool  # pack partial batches too (sync: a version's last episodes must train)

    def drop_masks(
        self, versions: ArrayLike, statuses: ArrayLike, version: int
    ) -> dict[DropReason, np.ndarray]: ...
    def ready(self, versions: ArrayLike, version: int) -> bool: ...
    def due(self, versions: ArrayLike, version: int) -> np.ndarray:
        """Episodes the next publish would drop: packed before the others."""
        ...

    def trained(self, episodes: Sequence[Episode]) -> None: ...
    def publish_due(self, step: int, versions: ArrayLike, version: int) -> bool: ...
    def published(self) -> None: ...
    def publish_at_end(self, step: int) -> bool: ...


#: Episode statuses the learner never trains on; each is its own drop reason.
DROPPED_STATUSES = (EpisodeStatus.ENV_ERROR, EpisodeStatus.ENV_TIMEOUT)


def _env_failures(statuses: ArrayLike) -> dict[DropReason, np.ndarray]:
    # An environment that broke or was too slow says nothing about the policy: never
    # train on it (and the source keeps it out of its group's baseline).
    values = np.asarray(statuses, dtype=object)
    return {DropReason(s): values == s.value for s in DROPPED_STATUSES}


def _fresh(versions: ArrayLike, version: int) -> np.ndarray:
    """Played with the learner's current version (staleness 0; its weights may have moved since)?"""
    return np.asarray(staleness(version, versions)) == 0


class AsyncFlow:
    """Asynchronous: train whenever at least `min_episodes` usable episodes are buffered;
    drop an episode whose staleness exceeds `max_staleness` versions; publish version
    v + 1 after every `publish_every` steps, and once more at the end if steps ran since
    the last publish. Actors never wait for the learner, nor the learner for one actor.
    """

    flush = False

    def __init__(self, *, min_episodes: int, max_staleness: int, publish_every: int) -> None:
        if min_episodes < 1:
            raise ValueError(f"AsyncFlow: min_episodes must be >= 1, got {min_episodes}")
        if max_staleness < 0:
            raise ValueError(f"AsyncFlow: max_staleness must be >= 0, got {max_staleness}")
        if publish_every < 1:
            raise ValueError(f"AsyncFlow: publish_every must be >= 1, got {publish_every}")
        self.min_episodes = min_episodes
        self.max_staleness = max_staleness
        self.publish_every = publish_every

    def drop_masks(
        self, versions: ArrayLike, statuses: ArrayLike, version: int
    ) -> dict[DropReason, np.ndarray]:
        stale = np.asarray(stale_mask(version, versions, self.max_staleness)).reshape(-1)
        return {DropReason.STALE: stale, **_env_failures(statuses)}

    def ready(self, versions: ArrayLike, version: int) -> bool:
        return np.size(versions) >= self.min_episodes

    def due(self, versions: ArrayLike, version: int) -> np.ndarray:
        # at the bound now: stale once version + 1 is out (within publish_every steps)
        return np.asarray(stale_mask(version + 1, versions, self.max_staleness)).reshape(-1)

    def trained(self, episodes: Sequence[Episode]) -> None:
        pass

    def publish_due(self, step: int, versions: ArrayLike, version: int) -> bool:
        return step % self.publish_every == 0

    def published(self) -> None:
        pass

    def publish_at_end(self, step: int) -> bool:
        return step % self.publish_every != 0


class SyncFlow:
    """Synchronous lockstep, the classic baseline: the actors play `episodes_per_version`
    episodes with version v and wait; the learner trains on exactly those (in as many
    steps as their batches need, partial batches included) and publishes v + 1 once none
    of them is left. Every trained episode has staleness 0; an episode of any other
    version is dropped as stale.
    """

    flush = True

    def __init__(self, *, episodes_per_version: int) -> None:
        if episodes_per_version < 1:
            raise ValueError(
                f"SyncFlow: episodes_per_version must be >= 1, got {episodes_per_version}"
            )
        self.episodes_per_version = episodes_per_version
        self._trained = 0  # episodes of the current version trained so far

    def drop_masks(
        self, versions: ArrayLike, statuses: ArrayLike, version: int
    ) -> dict[DropReason, np.ndarray]:
        return {DropReason.STALE: ~_fresh(versions, version), **_env_failures(statuses)}

    def ready(self, versions: ArrayLike, version: int) -> bool:
        fresh = int(np.count_nonzero(_fresh(versions, version)))
        return fresh > 0 and fresh + self._trained >= self.episodes_per_version

    def due(self, versions: ArrayLike, version: int) -> np.ndarray:
        return np.zeros(np.shape(versions), bool)  # every version is trained in full

    def trained(self, episodes: Sequence[Episode]) -> None:
        self._trained += len(episodes)

    def publish_due(self, step: int, versions: ArrayLike, version: int) -> bool:
        return not _fresh(versions, version).any()

    def published(self) -> None:
        self._trained = 0

    def publish_at_end(self, step: int) -> bool:
        return False  # every version's update was published when its batch finished


def flow_from_config(cfg: RunConfig) -> FlowPolicy:
    lc = cfg.learner
    if cfg.mode == "sync":
        return SyncFlow(episodes_per_version=cfg.sync_episodes_per_version)
    return AsyncFlow(
        min_episodes=lc.min_episodes_per_step,
        max_staleness=lc.max_staleness,
        publish_every=lc.publish_every,
    )


class FlowReport:
    """The learner's consumption position for the actors' flow control (`learner/flow.json`,
    read by `actor/admission.py`): its version, the episodes consumed per actor
    incarnation (`Accounting`'s checkpointed counter), the episodes it consumes per
    published version over the last `window` publishes and per second of having data over
    the last `rate_s` (a paused actor extrapolates it to guess when to read again), how
    many actors (ids: an actor's incarnations count once) it consumed from in the last
    `active_s`, and the episodes it `needs`
    (waiting for data with every listed shard read). Written at most every `every_s`.

    `restored`: the per-incarnation counts a resumed learner's checkpoint holds. They are
    not consumption now: counted as moving at the first write, the dead incarnations of
    every earlier launch would pass for active actors for `active_s`, multiply each
    actor's estimate of the backlog ahead of it and pause the fleet while the learner
    waits for data (seen: a 50 s stall after a resume).

        report = FlowReport(store, restored=counters["consumed"])
        report.published(version, consumed_total)         # at each publish
        report.maybe_write(version, consumed, consumed_total, waited_s, needs)   # every round
    """

    def __init__(
        self,
        store: ObjectStore,
        *,
        every_s: float | None = None,
        window: int = 4,
        active_s: float = 60.0,
        restored: Mapping[str, int] | None = None,
    ) -> None:
        self.store = store
        # A fresher position lets paused actors resume sooner (docs/scaling.md): every
        # 0.1 s on a local folder (about a step of the demo's learner: 0.5 s cost it 0.17
        # of its duty cycle, #29), every second on an object store (GCS sustains about
        # one write a second to one object name).
        local = scheme_of(store.uri) == "file"
        self.every_s = every_s if every_s is not None else 0.1 if local else 1.0
        self.active_s = active_s
        self._publishes: collections.deque[tuple[int, int]] = collections.deque(maxlen=window + 1)
        # actor key -> (count, when it moved); a restored count has not moved since
        self._seen = {k: (n, float("-inf")) for k, n in (restored or {}).items()}
        self._written = 0.0
        # (when, consumed_total, waited_s) over about the last `rate_s`: the drain rate
        self._samples: collections.deque[tuple[float, int, float]] = collections.deque()
        self.rate_s = 5.0

    def published(self, version: int, consumed_total: int) -> None:
        self._publishes.append((version, consumed_total))

    def episodes_per_version(self) -> float | None:
        if len(self._publishes) < 2:
            return None
        (v0, c0), (v1, c1) = self._publishes[0], self._publishes[-1]
        return (c1 - c0) / (v1 - v0) if c1 > c0 and v1 > v0 else None

    def episodes_per_s(self) -> float:
        """Episodes consumed per second the learner had data (its time waiting for data
        excluded): how fast it drains a backlog, which is what an actor extrapolates.
        Over wall time, a learner the actors starve would look as slow as its supply, and
        paused actors would resume late."""
        if len(self._samples) < 2:
            return 0.0
        (t0, c0, w0), (t1, c1, w1) = self._samples[0], self._samples[-1]
        busy = (t1 - t0) - (w1 - w0)
        return (c1 - c0) / busy if busy > 0 else 0.0

    def maybe_write(
        self,
        version: int,
        consumed: dict[str, int],
        consumed_total: int,
        waited_s: float,
        needs: int = 0,
    ) -> None:
        """`waited_s`: the learner's total time waiting for data so far; `needs`: the
        episodes its next step lacks with every listed shard read (0: none, or not
        waiting), which the actors admit regardless of the backlog they estimate."""
        now = time.monotonic()
        if now - self._written < self.every_s:
            return
        self._written = now
        self._samples.append((now, consumed_total, waited_s))
        while len(self._samples) > 2 and now - self._samples[1][0] >= self.rate_s:
            self._samples.popleft()
        for key, n in consumed.items():
            if self._seen.get(key, (None, 0.0))[0] != n:
                self._seen[key] = (n, now)
        self._seen = {k: v for k, v in self._seen.items() if k in consumed}
        # Actor ids, not incarnations: a restarted actor's previous life moved recently too
        # (its last shards), and counted twice it inflated every actor's backlog estimate.
        active = len(
            {k.rpartition("/")[0] for k, (_, t) in self._seen.items() if now - t <= self.active_s}
        )
        body = {
            "version": version,
            "consumed": consumed,
            "consumed_total": consumed_total,
            "episodes_per_version": self.episodes_per_version(),
            "episodes_per_s": self.episodes_per_s(),
            "actors": active,  # 0 before any: the actors assume their configured fleet
            "needs": needs,
            "time": time.time(),
        }
        self.store.write_bytes(RunLayout.FLOW, json.dumps(body).encode())
