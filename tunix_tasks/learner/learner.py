"""The learner process: buffer -> staleness filter -> packing -> train -> publish/checkpoint.

One long-lived process per run. It never waits on a particular actor: it trains on
whatever complete shards the store holds, one packed batch (one bucket shape) per step.

    learner = Learner(cfg, store)
    summary = learner.run()      # until max_steps / deadline; then marks the run DONE

Per step:
  1. take new episodes from `LearnerInput` (read + validated in a background thread);
  2. drop what is too stale (`staleness > max_staleness`) or broke (`env_error`), and
     account for it; 3. pack the rest first-fit into the bucket shapes; 4. train on the
  densest full batch; account for its episodes; 5. every `publish_every` steps publish
  weights v+1; every `checkpoint_every` steps write ledger + checkpoint.
Leftover episodes wait in the buffer for the next step (they are not acknowledged, so a
crash re-reads them from their shards).
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
from flax import nnx

from tunix_tasks.config import RunConfig
from tunix_tasks.learner.checkpoint import Checkpointer
from tunix_tasks.learner.packing import PackedBatch, pack
from tunix_tasks.learner.source import BufferedEpisode, LearnerInput
from tunix_tasks.learner.train_step import Trainer
from tunix_tasks.learner.warm_start import warm_start
from tunix_tasks.policy.build import build_policy, model_meta
from tunix_tasks.storage.lease import Lease, LeaseLost
from tunix_tasks.storage.metrics import MetricsWriter
from tunix_tasks.storage.runs import mark_done
from tunix_tasks.storage.store import ObjectStore
from tunix_tasks.storage.weights import WeightsPublisher, read_latest

log = logging.getLogger(__name__)


class DataTimeout(TimeoutError):
    """No usable data arrived for `learner.data_timeout_s` seconds."""


class Learner:
    def __init__(
        self,
        cfg: RunConfig,
        store: ObjectStore,
        *,
        max_steps: int | None = None,
        deadline_s: float | None = None,
        on_publish: Callable[[int, str], None] | None = None,
        progress: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        self.cfg = cfg
        self.store = store
        self.max_steps = max_steps or cfg.learner.max_steps
        self._deadline = time.monotonic() + deadline_s if deadline_s else None
        self._on_publish = on_publish
        self._progress = progress
        self._stop_reason = ""
        self.step = 0
        self.version = 0
        self.counters: dict[str, Any] = {
            "trained_episodes": 0,
            "trained_tokens": 0,
            "dropped": {},
            "truncated_sequences": 0,
        }
        self._ledger: dict[str, Any] = {"trained": [], "dropped": {}}
        self._buffer: list[BufferedEpisode] = []
        self._stop_requested = False
        self._last_checkpoint = -1
        self._published: Future | None = None
        self._publish_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="publish")
        self._sync = cfg.mode == "sync"
        self._sync_trained = 0  # sync mode: episodes of the current version trained so far

    def request_stop(self, reason: str) -> None:
        self._stop_reason = self._stop_reason or reason
        self._stop_requested = True

    # -- setup -----------------------------------------------------------------------
    def _setup(self) -> None:
        cfg = self.cfg
        self.lease = Lease(self.store, ttl_s=cfg.learner.lease_ttl_s)
        self.lease.acquire()  # LeaseHeldError if another learner runs on this run
        self.lease.start_renewing()
        self.tok, model = build_policy(
            cfg.model, seed=cfg.seed, compute_dtype=cfg.learner.compute_dtype
        )
        self.trainer = Trainer(cfg, model)
        self.ckpt = Checkpointer(self.store)
        self.input = LearnerInput(self.store, cfg, vocab_size=self.tok.vocab_size)
        self.metrics = MetricsWriter(self.store, "learner")
        restored = self.ckpt.restore(self.trainer.state())
        latest = read_latest(self.store)
        if restored is not None:
            state, meta = restored
            # trainer.state() is {"model": State, "opt": State}: fill each State in turn.
            target = self.trainer.state()
            for name, part in target.items():
                nnx.replace_by_pure_dict(part, state[name])
            self.trainer.restore_state(target)
            self.step, self.version = int(meta["step"]), int(meta["version"])
            self.counters = meta["counters"]
            self.input.set_state(meta["stream"])
            self._last_checkpoint = self.step
            pruned = self.ckpt.prune_ledger_after(self.step)
            log.info(
                "resumed from checkpoint at step %d (v%d); %d ledger files redone",
                self.step,
                self.version,
                pruned,
            )
        else:
            # No checkpoint committed: ledger files of an earlier attempt that crashed
            # before its first checkpoint describe work that is about to be redone.
            if pruned := self.ckpt.prune_ledger_after(-1):
                log.info("fresh start: removed %d ledger files of a crashed attempt", pruned)
            if cfg.warm_start_steps and latest is None:
                warm_start(self.trainer, cfg, self.tok, metrics=self.metrics)
        self.publisher = WeightsPublisher(self.store)
        # Always publish the weights we resume from, newer than anything out there, so
        # actors drop weights from updates lost in a crash.
        self.version = max(self.version, latest[0] + 1 if latest else 0)
        self._publish()
        self._wait_published()  # actors need the first snapshot before anything else
        self.input.start()

    # -- main loop ---------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        t_start = time.monotonic()
        self._t0 = time.monotonic()
        self._train_s = 0.0
        self._wait_s = 0.0
        try:
            self._setup()
            self._t0 = time.monotonic()
            self._last_data = time.monotonic()
            try:
                self._loop()
            except DataTimeout:
                self._checkpoint()  # nothing is wrong with the state: keep the progress
                raise
            reached = self.step >= self.max_steps
            if reached:
                self._stop_reason = self._stop_reason or "max_steps"
            self._checkpoint()
            if not self._sync and self.step % self.cfg.learner.publish_every:
                self.version += 1
                self._publish()
            self._wait_published()
            if reached or self._stop_reason == "deadline":
                mark_done(self.store, f"learner {self._stop_reason} at step {self.step}")
        finally:
            self._teardown()
        return {
            "steps": self.step,
            "version": self.version,
            "stop_reason": self._stop_reason,
            "trained_episodes": self.counters["trained_episodes"],
            "dropped": self.counters["dropped"],
            "compile_count": self.trainer.compile_count,
            "truncated_sequences": self.counters["truncated_sequences"],
            "quarantined": list(self.input.quarantined),
            "duty_cycle": self._train_s / max(1e-9, time.monotonic() - self._t0),
            "wall_s": time.monotonic() - t_start,
        }

    def _should_stop(self) -> bool:
        if self._deadline is not None and time.monotonic() > self._deadline:
            self.request_stop("deadline")
        if self.lease.lost:
            self.request_stop("lease lost")
        return self._stop_requested

    def _teardown(self) -> None:
        """Stop threads and release the lease, whatever part of `_setup` succeeded."""
        for name, close in (
            ("_publish_pool", "shutdown"),
            ("input", "stop"),
            ("metrics", "close"),
            ("ckpt", "close"),
            ("lease", "release"),
        ):
            obj = getattr(self, name, None)
            if obj is not None:
                try:
                    getattr(obj, close)()
                except Exception as err:  # keep tearing down the rest
                    log.warning("learner teardown: %s.%s failed: %r", name, close, err)

    # -- data --------------------------------------------------------------------------
    def _next_batch(self) -> tuple[PackedBatch | None, list[BufferedEpisode]]:
        t0 = time.monotonic()
        self._buffer.extend(self.input.drain())
        self._drop_unusable()
        lc = self.cfg.learner
        result = None
        if self._ready():
            # Oldest weights first (they are closest to going stale), and a bounded window
            # so packing stays cheap however large the backlog grows.
            self._buffer.sort(key=lambda b: b.policy_version)
            window = self._buffer[: max(4 * lc.min_episodes_per_step, 8 * lc.batch_rows, 256)]
            by_id = {b.episode_id: b for b in window}
            result = pack(
                [b.example for b in window],
                buckets=lc.buckets,
                batch_rows=lc.batch_rows,
                flush=self.cfg.mode == "sync",
            )
        if result is None or not result.batches:
            self._buffer.extend(self.input.drain(timeout_s=0.05))
            waited = time.monotonic() - t0
            self._wait_s += waited
            if time.monotonic() - self._last_data > lc.data_timeout_s:
                raise DataTimeout(
                    f"no trainable data for {lc.data_timeout_s:.0f}s at step {self.step} "
                    f"(buffer {len(self._buffer)} episodes); are the actors running?"
                )
            return None, []
        self._last_data = time.monotonic()
        # Densest batch first; ties: the one holding the oldest data.
        batch = max(result.batches, key=lambda b: b.density)
        chosen = set(batch.episode_ids)
        episodes = [by_id[i] for i in batch.episode_ids]
        self._buffer = [b for b in self._buffer if b.episode_id not in chosen]
        # Count only the trained episodes: `pack` sees the whole buffer every step, so its
        # `stats.truncated` would count a long episode again each step it stays buffered.
        longest = max(lc.buckets)
        self.counters["truncated_sequences"] += sum(ep.example.length > longest for ep in episodes)
        self._wait_s += time.monotonic() - t0
        return batch, episodes

    def _too_stale(self, ep: BufferedEpisode) -> bool:
        return self.version - ep.policy_version > self.cfg.learner.max_staleness

    def _ready(self) -> bool:
        """Enough data to pack a batch? Sync mode waits for the whole version's batch."""
        if not self._sync:
            return len(self._buffer) >= self.cfg.learner.min_episodes_per_step
        fresh = sum(ep.policy_version == self.version for ep in self._buffer)
        return fresh > 0 and fresh + self._sync_trained >= self.cfg.sync_episodes_per_version

    def _publish_due(self) -> bool:
        """Async: every `publish_every` steps. Sync: once all of this version's episodes
        are trained (several steps if they fill several batches), so none goes stale."""
        if not self._sync:
            return self.step % self.cfg.learner.publish_every == 0
        return not any(ep.policy_version == self.version for ep in self._buffer)

    def _drop(self, ep: BufferedEpisode, reason: str) -> None:
        self.input.ack(ep)
        self._ledger["dropped"].setdefault(reason, []).append(ep.episode_id)
        d = self.counters["dropped"]
        d[reason] = d.get(reason, 0) + 1

    def _drop_unusable(self) -> None:
        keep = []
        for ep in self._buffer:
            if self._too_stale(ep):
                self._drop(ep, "stale")
            elif ep.status == "env_error":
                self._drop(ep, "env_error")
            else:
                keep.append(ep)
        self._buffer = keep

    # -- training ----------------------------------------------------------------------
    def _loop(self) -> None:
        """Pipelined: while update N runs on the device, the host drains and packs the
        batch of update N+1; bookkeeping, publishing and checkpoints follow update N."""
        inflight: tuple[Any, PackedBatch, list[BufferedEpisode]] | None = None
        try:
            while self.step < self.max_steps and not self._should_stop():
                batch, episodes = self._next_batch()
                if inflight is not None:
                    self._complete(*inflight)
                    inflight = None
                    if self.step >= self.max_steps or self._should_stop():
                        self._buffer.extend(episodes)  # packed, never trained: not acked
                        break
                if batch is None:
                    continue
                if any(self._too_stale(ep) for ep in episodes):  # a publish just moved us
                    self._buffer.extend(episodes)
                    continue
                inflight = (self.trainer.dispatch(batch), batch, episodes)
        finally:
            if inflight is not None:
                self._complete(*inflight)

    def _complete(self, pending: Any, batch: PackedBatch, episodes: list[BufferedEpisode]) -> None:
        m = self.trainer.collect(pending)
        dt = m["step_s"]
        self._train_s += dt
        self.step += 1
        for ep in episodes:
            self.input.ack(ep)
        self._ledger["trained"].extend(ep.episode_id for ep in episodes)
        self.counters["trained_episodes"] += len(episodes)
        self.counters["trained_tokens"] += int(batch.real_tokens)
        staleness = collections.Counter(self.version - ep.policy_version for ep in episodes)
        wall = time.monotonic() - self._t0
        record = {
            "step": self.step,
            "version": self.version,
            "loss": m["loss"],
            "nll": m["nll"],
            "grad_norm": m["grad_norm"],
            "reward_mean": float(np.mean([ep.reward for ep in episodes])),
            "episodes": len(episodes),
            "real_tokens": int(batch.real_tokens),
            "tokens_per_s": batch.real_tokens / max(dt, 1e-9),
            "bucket": batch.bucket_len,
            "density": float(batch.density),
            "step_s": dt,
            "duty_cycle": self._train_s / max(wall, 1e-9),
            "wait_s_total": self._wait_s,
            "compile_count": self.trainer.compile_count,
            "staleness": {str(k): v for k, v in sorted(staleness.items())},
            "dropped": dict(self.counters["dropped"]),
            "is_weight_mean": m["is_weight_mean"],
            "is_weight_max": m["is_weight_max"],
            "is_clipped_frac": m["is_clipped_frac"],
            "buffer": len(self._buffer),
            "backlog_shards": self.input.backlog_shards,
            "quarantined": len(self.input.quarantined),
        }
        self.metrics.log(**record)
        if self._progress is not None:
            self._progress(record)
        if self._sync:
            self._sync_trained += len(episodes)
        if self._publish_due():
            self.version += 1
            self._sync_trained = 0
            self._publish()
        if self.step % self.cfg.learner.checkpoint_every == 0:
            self._checkpoint()

    def _publish(self) -> None:
        """Snapshot the params now (the next update donates their buffers); serialize,
        checksum and upload them in the background, in order."""
        self.lease.ensure()  # LeaseLost: a learner without the lease never publishes
        self._wait_published()  # keeps versions in order; raises a failed publish here
        flat = self.trainer.flat_params()
        self._published = self._publish_pool.submit(
            self._publish_flat, flat, self.version, self.step
        )

    def _publish_flat(self, flat: dict[str, Any], version: int, step: int) -> None:
        self.publisher.publish(flat, version=version, step=step, model=model_meta(self.cfg.model))
        log.info("published weights v%d at step %d", version, step)
        if self._on_publish is not None:
            try:
                self._on_publish(version, f"{self.store.uri}/weights/v{version:08d}")
            except Exception as err:  # a notification must never kill training
                log.warning("on_publish callback failed: %r", err)

    def _wait_published(self) -> None:
        if self._published is not None:
            done, self._published = self._published, None
            done.result()

    def _checkpoint(self) -> None:
        self._wait_published()
        if self.step == self._last_checkpoint:
            return
        try:
            self.lease.ensure()
        except LeaseLost:
            log.error("lease lost: not checkpointing step %d", self.step)
            raise
        meta = {
            "step": self.step,
            "version": self.version,
            "counters": self.counters,
            "stream": self.input.get_state(),
            "time": time.time(),
        }
        self.ckpt.save(self.step, self.trainer.state(), meta, self._ledger)
        self._ledger = {"trained": [], "dropped": {}}
        self._last_checkpoint = self.step
