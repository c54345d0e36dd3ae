"""`ActorRuntime`: what every actor kind shares, around the engine that makes episodes.

An actor process waits for the first weights, then serves (the kind's own loop) until the
run's DONE marker, its deadline or a signal, and always flushes its last shard and
metrics, unless its run was deleted or created again (`storage.runs.RunFence`: then it
writes nothing more and raises `RunReplaced`). This class owns that lifecycle, the weights reload, the shard writer, the
metrics and the `EpisodeBuilder` that stamps every episode (`self.episodes`);
`asynchronous.actor.Actor` (asyncio environments, the batched sampler) and
`vectorized.actor.VectorizedActor` (JAX environments and the policy on the device) own
how episodes are made:

    class MyActor(ActorRuntime):
        def _build_engine(self) -> RolloutEngine:   # once, at the end of __init__
            return ...                              # engine.py: update_params, compile_count
        def _serve(self):                           # until self._should_stop()
            ... self._maybe_reload() ... self._commit(group_of_episodes) ... self._watch_once()

Store outages: the actor keeps its episodes buffered and retries with backoff (a
blocked commit also stops it from producing more) for up to an hour, then exits with
`StoreUnavailable`; polls of weights, DONE and metrics just try again later (outage.py).

Flow control (`actor.flow_control`, `admission.py`): with the weights the runtime polls
the learner's `learner/flow.json`; a kind's loop asks `_admit(in_flight)` before starting
new episodes and waits (polling) while it says no.

Weights: the runtime polls `weights/LATEST` (at most every `weight_poll_s`, one thread at
a time) and swaps in a new snapshot once its checksum, tensor names, shapes and dtypes
check out (a bad snapshot or pointer is refused once; the actor keeps its weights). An
episode's `policy_version` is the OLDEST version that produced any of its tokens, so
staleness is never underestimated.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import signal
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from flax import nnx

from tunix_tasks.actor.admission import CONFIRM_S, LEARNER_WAITING, LEFT_PARKED, AdmissionGate
from tunix_tasks.actor.engine import RolloutEngine
from tunix_tasks.actor.episodes import EpisodeBuilder
from tunix_tasks.config import RunConfig
from tunix_tasks.episode import Episode
from tunix_tasks.policy.build import base_fingerprint
from tunix_tasks.seeds import HELD_OUT_SEED_BASE  # the seed ranges: tunix_tasks/seeds.py
from tunix_tasks.storage.layout import RunLayout
from tunix_tasks.storage.metrics import MetricsWriter
from tunix_tasks.storage.outage import StoreOutage
from tunix_tasks.storage.runs import RunFence, RunReplaced, is_done
from tunix_tasks.storage.runs import run_id as read_run_id
from tunix_tasks.storage.shards import RUN_ID_KEY, ShardWriter
from tunix_tasks.storage.store import ObjectStore, StoreError
from tunix_tasks.storage.weights import Manifest, WeightsClient

__all__ = [
    "FINAL_FLUSH_S",
    "HELD_OUT_SEED_BASE",
    "ActorRuntime",
    "ActorStats",
    "episode_seed",
]

log = logging.getLogger(__name__)

FINAL_FLUSH_S = 30.0  # how long the last shard is retried in an outage when stopping


def episode_seed(run_seed: int, actor_id: str, group: int) -> int:
    """Deterministic, distinct env seeds per (run, actor, group); < HELD_OUT_SEED_BASE.
    The actor passes `<actor_id>/<incarnation>` as `actor_id`, so a restarted actor (same
    id, new incarnation) never replays the seeds of its previous life."""
    h = hashlib.blake2b(f"{run_seed}/{actor_id}/{group}".encode(), digest_size=8).digest()
    # The remainder of a 64-bit hash: uniform to within 2**-33 over the training range.
    return int.from_bytes(h, "little") % HELD_OUT_SEED_BASE


@dataclass
class ActorStats:
    episodes: int = 0
    tokens: int = 0
    policy_tokens: int = 0
    env_steps: int = 0  # turns of the committed episodes: one env step each
    reward_sum: float = 0.0
    status: dict[str, int] = field(default_factory=dict)
    env_step_s: list[float] = field(default_factory=list)
    reloads: int = 0
    reload_bytes: int = 0  # read from the store for the last version loaded
    publish_to_reload_s: float = 0.0  # from the learner's publish to this actor sampling it


class ActorRuntime:
    """The lifecycle, weights, shards and metrics of an actor (module docstring)."""

    def __init__(
        self,
        cfg: RunConfig,
        store: ObjectStore,
        *,
        actor_id: str,
        deadline_s: float | None = None,
        weights_timeout_s: float = 900.0,
        incarnation: str | None = None,
        store_outage_s: float | None = None,
        leave_when_parked: bool = False,
        run_id: str | None = None,
    ) -> None:
        self.cfg = cfg
        # Exit once parked with nothing in flight (stop_reason LEFT_PARKED), for a
        # launcher that frees the actor's resources and starts it again when unparked.
        self._leave_when_parked = leave_when_parked
        # This incarnation of the run (storage/runs.py; `join_run` reads it before the
        # config), named in every shard. Every write checks it first: a deleted run's
        # leftover actor stops at its next write, and writes nothing into the run created
        # again there (whose learner would quarantine it, `other_run`, anyway).
        self.run_id = read_run_id(store) if run_id is None else run_id
        self.fence = RunFence(store, self.run_id, on_replaced=self.request_stop)
        self._outage = StoreOutage(should_stop=self._should_stop, limit_s=store_outage_s)
        # Every store call that works ends an outage: a write with its fence's check as
        # one call (the check's read working says nothing of the write).
        store = self._outage.observe(self.fence)
        self.store = store
        self.actor_id = actor_id
        # A fresh random incarnation per process start: env seeds, group ids and the
        # sampling seed never repeat across restarts. Pass one for reproducible seeds.
        self.incarnation = incarnation if incarnation is not None else uuid.uuid4().hex[:12]
        self._seed_key = f"{actor_id}/{self.incarnation}"
        self._deadline = time.monotonic() + deadline_s if deadline_s else None
        self._weights_timeout_s = weights_timeout_s
        self._stop = threading.Event()
        self._stop_reason = ""
        self.weights = WeightsClient(store)
        self.version = -1
        self._last_poll = 0.0
        self._behind_poll_at = float("-inf")  # when a paused actor behind last polled at once
        self._reloading = threading.Lock()  # one weights poll at a time (`_maybe_reload`)
        self.writer = ShardWriter(
            store,
            actor_id=actor_id,
            max_episodes=cfg.actor.episodes_per_shard,
            max_interval_s=cfg.actor.shard_interval_s,
            metadata={RUN_ID_KEY: self.run_id} if self.run_id else None,
        )
        # Commits and the time-based flush may run on different threads: serialise them
        # so no episode is lost or duplicated.
        self._writer_lock = threading.Lock()
        self.metrics = MetricsWriter(store, f"actor/{actor_id}")
        self.stats = ActorStats()
        self._last_metrics = 0.0
        self._last_counts = (0, 0, 0, 0.0)
        self.episodes = EpisodeBuilder(
            actor_id=actor_id, env=cfg.env.name, group_key=self._seed_key
        )
        # Flow control (actor/admission.py); sync mode already waits for each version.
        lc = cfg.learner
        self.gate = (
            AdmissionGate(
                store,
                actor_key=self._seed_key,
                max_staleness=lc.max_staleness,
                fallback_episodes_per_version=lc.min_episodes_per_step * lc.publish_every,
                fleet=cfg.actor.num_actors,
                park_index=RunLayout.actor_index(actor_id) if cfg.autopilot_on else None,
                default_active=cfg.first_active_actors,
            )
            if cfg.actor.flow_control and cfg.mode == "async"
            else None
        )
        self.engine: RolloutEngine = self._build_engine()

    @functools.cached_property
    def base_fingerprint(self) -> str:
        """The base this actor's adapters apply to; read (checkpoint headers) only when an
        adapter snapshot first arrives, not at every actor's start."""
        return base_fingerprint(self.cfg.model, self.cfg.seed)

    def _build_engine(self) -> RolloutEngine:
        """The kind's engine, built once the runtime's fields (seeds, ids) are set."""
        raise NotImplementedError

    # -- lifecycle -----------------------------------------------------------------
    def request_stop(self, reason: str) -> None:
        if not self._stop.is_set():
            self._stop_reason = reason
            log.info("actor %s stopping: %s", self.actor_id, reason)
            self._stop.set()

    def install_signal_handlers(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, lambda s, _f: self.request_stop(signal.Signals(s).name))

    def _should_stop(self) -> bool:
        if self._stop.is_set():
            return True
        if self._deadline is not None and time.monotonic() > self._deadline:
            self.request_stop("deadline")
            return True
        return False

    def run(self) -> dict[str, Any]:
        """Run until stopped; flushes the last shard and metrics (none once its run is
        deleted or created again: `RunReplaced` then). Returns a summary."""
        t0 = time.monotonic()
        self._outage.tolerate("metrics", self._log_metrics, None)  # phase: waiting for weights
        got = self._wait_for_weights()
        try:
            if got is not None:  # already loaded by `_load`
                if self.gate is not None:  # the first decision on the position and fleet file
                    self._outage.tolerate("flow poll", self.gate.poll)
                self._outage.tolerate("metrics", self._log_metrics, None)  # phase: compiling
                self._serve()
        finally:  # the last shard, even in an outage (bounded: the launcher's grace is 60 s)
            if not self.fence.replaced:  # else nothing more is written there (RunFence)
                until = time.monotonic() + FINAL_FLUSH_S
                self._outage.call("final shard", self._locked, self.writer.close, deadline=until)
                self._outage.tolerate("metrics", self._log_metrics, time.monotonic() - t0)
                self._outage.tolerate("metrics", self.metrics.close)
        if self.fence.replaced:  # a background write (a watch task's flush) found it
            raise RunReplaced(self.fence.replaced)
        return {
            "actor_id": self.actor_id,
            "episodes": self.stats.episodes,
            "shards": len(self.writer.shards_written),
            "reward_mean": self.stats.reward_sum / max(1, self.stats.episodes),
            "last_version": self.version,
            "stop_reason": self._stop_reason,
            "compile_count": self.engine.compile_count,
            "wall_s": time.monotonic() - t0,
        }

    def _serve(self) -> None:
        """Make and commit episodes until `_should_stop()` (the actor kind's loop)."""
        raise NotImplementedError

    def _watch_once(self) -> bool:
        """Housekeeping between batches: True once the run's DONE marker is there (and the
        actor is stopping); else commits a partial shard on time and logs metrics."""
        done = self._outage.tolerate("DONE check", is_done, self.store)
        if done:
            self.request_stop(f"run done: {done.get('reason', '')}")
            return True
        tolerate = self._outage.tolerate  # a store outage: try again next round
        tolerate("shard commit", self._locked, self.writer.maybe_flush)
        tolerate("metrics", self._log_metrics_periodic)
        return False

    # -- weights -------------------------------------------------------------------
    def _wait_for_weights(self):
        """First snapshot, or None when stopped (SIGTERM, DONE, deadline) before it came."""
        deadline = time.monotonic() + self._weights_timeout_s
        while not self._should_stop():
            got = self._outage.tolerate("weights poll", self.weights.poll, self._load)
            if got is not None:
                return got
            if self._outage.tolerate("DONE check", is_done, self.store):
                self.request_stop("run done before weights were published")
                return None
            if time.monotonic() > deadline:
                refused = self.weights.refusals()
                raise TimeoutError(
                    f"no weights published under {self.store.uri}/{RunLayout.LATEST} within "
                    f"{self._weights_timeout_s:.0f}s; is the learner running?"
                    + (f" (refused: {refused})" if refused else "")
                )
            time.sleep(0.25)
        return None

    def _load(self, flat: dict[str, np.ndarray], manifest: Manifest) -> None:
        """`WeightsClient.poll`'s apply: swap in a checksum-verified snapshot. The engine
        checks names, shapes and dtypes before swapping; its ValueError makes the client
        refuse (and remember) the version while the actor keeps its current weights."""
        only: type[nnx.Variable] = nnx.Param
        if manifest.kind == "adapter":
            # Adapters only mean something on the base they were trained on.
            base = (manifest.base or {}).get("fingerprint")
            if base != self.base_fingerprint:
                raise ValueError(
                    f"v{manifest.version} holds adapters for base {str(base)[:12]}... "
                    f"({(manifest.base or {}).get('uri', '?')}), this actor runs base "
                    f"{self.base_fingerprint[:12]}... ({self.cfg.model.checkpoint or 'preset'})"
                )
            only = nnx.LoRAParam
        self.engine.update_params(
            flat,
            version=manifest.version,
            only=only,
            digest=manifest.sha256,
            created_at=manifest.created_at,
        )
        self.stats.reload_bytes = self.weights.last_reload_bytes
        self.stats.publish_to_reload_s = max(0.0, time.time() - manifest.created_at)
        self.version = manifest.version
        self.stats.reloads += 1
        log.info("actor %s loaded weights v%d", self.actor_id, manifest.version)

    def _maybe_reload(self) -> None:
        # The async kinds call this from the engine thread (between batches) and from the
        # event loop (group and sync loops): one polls, the other skips. Without the lock
        # both saw each new version and loaded it twice (SmolLM2: 514 MB each time).
        if not self._reloading.acquire(blocking=False):
            return
        try:
            now = time.monotonic()
            if now - self._last_poll < self.cfg.actor.weight_poll_s:
                return
            self._last_poll = now
            if self.gate is not None:  # first: the poll that unparks loads weights below
                self._outage.tolerate("flow poll", self.gate.poll)
            # Loads, or refuses (or the store fails) and keeps the current weights. A
            # parked actor loads none (a snapshot can be 500 MB): it catches up unparked.
            if self.gate is None or not self.gate.parked or self.version < 0:
                # `reload_every_versions` holds old weights only while flow control
                # admits: paused, only newer weights make room (else a learner waiting
                # for data and actors waiting for room would wait for each other).
                paused = self.gate is not None and not self.gate.last.admit
                ahead = 1 if paused else self.cfg.actor.reload_every_versions
                poll = functools.partial(self.weights.poll, self._load, ahead=ahead)
                self._outage.tolerate("weights poll", poll)
        finally:
            self._reloading.release()

    def _admit(self, in_flight: int) -> bool:
        """May the actor start new episodes now (flow control; always without it)?
        `in_flight`: episodes started and not committed, with those it would start."""
        return self._room(in_flight) > 0

    def _room(self, in_flight: int) -> float:
        """How many new episodes the actor may start now: 0 while flow control pauses
        it, `inf` without flow control. `in_flight`: episodes started, not committed."""
        if self.gate is None:
            return float("inf")
        got = self.gate.decide(
            version=self.version, committed=self.stats.episodes, in_flight=in_flight
        )
        flow = self.gate.flow
        # Paused with older weights than the learner says it published (at most every
        # CONFIRM_S: one it refuses or is still uploading is not polled every 50 ms).
        now = time.monotonic()
        newer = (
            not self.gate.parked
            and flow is not None
            and self.version < flow.version
            and now - self._behind_poll_at >= CONFIRM_S
        )
        if not got.admit and (self.gate.confirm or newer):
            # About to resume, or behind: poll the position and the weights now, not a
            # weight_poll_s later (a fast learner moves versions in between).
            self._last_poll = 0.0
            if newer:
                self._behind_poll_at = now
        # Admitted with less room than one episode: one still starts, or nothing would
        # ever be read that could make room (flow control never deadlocks).
        return max(got.room, 1.0) if got.admit else 0.0

    def _leave_if_parked(self, in_flight: int) -> None:
        """With `leave_when_parked`, stop once the autopilot parks this actor and its last
        episodes are in (`in_flight` 0); the final shard is flushed as at any stop."""
        parked = self.gate is not None and self.gate.parked
        if self._leave_when_parked and parked and in_flight == 0:
            self.request_stop(LEFT_PARKED)

    def _flush_early(self) -> None:
        """Paused by flow control, or admitted only because the learner waits for data,
        commit a partial shard now, not `shard_interval_s` later: paused, nothing more is
        coming for a while and the learner must read these episodes before they go stale;
        waited on, the learner needs them now."""
        gate = self.gate
        waited_on = gate is not None and (
            not gate.last.admit or gate.last.reason == LEARNER_WAITING
        )
        if waited_on and self.writer.pending:
            self._outage.tolerate("shard commit", self._locked, self.writer.flush)

    # -- records -------------------------------------------------------------------
    def _commit(self, episodes: list[Episode]) -> None:
        """One group's episodes into the shard writer (a group never spans shards)."""
        for ep in episodes:
            s = self.stats
            s.episodes += 1
            s.tokens += ep.length
            s.policy_tokens += int(ep.loss_mask.sum())
            s.env_steps += ep.num_turns
            s.reward_sum += ep.reward
            s.status[ep.status] = s.status.get(ep.status, 0) + 1
        try:
            self._locked(self.writer.add_group, episodes)
        except StoreError as err:  # still buffered: committed with the next flush that works
            self._outage.call("shard commit", self._locked, self.writer.flush, failed=err)
        self._flush_early()

    def _locked(self, fn, *args):
        with self._writer_lock:
            return fn(*args)

    def _log_metrics_periodic(self) -> None:
        # Also at once after the first episodes (the last record counted none): the audit's
        # supply rate runs from the first record that counts some, which a short run may
        # not log before its final one.
        first = self._last_counts[0] == 0 and self.stats.episodes > 0
        if first or time.monotonic() - self._last_metrics >= 5.0:
            self._log_metrics(None)

    def _phase(self, final: bool) -> str:
        """What the actor is doing, in each metrics record (the live display shows it
        while it is not simply sampling). The sampler compiles its programs as new
        shapes come, so their number is counted, not known ahead."""
        if final:
            return "stopped"
        if self.version < 0:
            return "waiting for the first weights"
        if self.gate is not None and self.gate.parked:
            return self.gate.last.reason  # a parked actor has compiled nothing yet
        if self.stats.episodes == 0:
            n = self.engine.compile_count
            return "compiling the sampler" + (f" ({n} programs so far)" if n else "")
        if not self.writer.shards_written:
            return "sampling, first shard not written yet"
        if self.gate is not None and not self.gate.last.admit:
            return f"paused by flow control: {self.gate.last.reason}"
        return "sampling"

    def _engine_metrics(self) -> dict[str, Any]:
        """The actor kind's own figures for each metrics record."""
        return {}

    def _log_metrics(self, wall: float | None) -> None:
        now = time.monotonic()
        eps0, tok0, steps0, t0 = self._last_counts
        dt = max(1e-6, now - t0) if t0 else None
        s = self.stats
        env = np.asarray(s.env_step_s[-2000:] or [0.0])
        self.metrics.log(
            actor_id=self.actor_id,
            actor_kind=self.cfg.actor.kind,
            episodes=s.episodes,
            episodes_per_s=(s.episodes - eps0) / dt if dt else None,
            tokens_per_s=(s.tokens - tok0) / dt if dt else None,
            env_steps_per_s=(s.env_steps - steps0) / dt if dt else None,
            policy_tokens=s.policy_tokens,
            reward_mean=s.reward_sum / max(1, s.episodes),
            status=dict(s.status),
            env_step_p50_s=float(np.percentile(env, 50)),
            env_step_p99_s=float(np.percentile(env, 99)),
            weights_version=self.version,
            reload_s=self.weights.last_reload_s,
            reload_bytes=s.reload_bytes,
            publish_to_reload_s=s.publish_to_reload_s,
            reloads=s.reloads,
            compile_count=self.engine.compile_count,
            shards=len(self.writer.shards_written),
            final=wall is not None,
            phase=self._phase(wall is not None),
            **(self.gate.metrics() if self.gate is not None else {}),
            **self._engine_metrics(),
        )
        self._last_metrics = now
        self._last_counts = (s.episodes, s.tokens, s.env_steps, now)
