"""The learner process: next batch -> dispatch -> acknowledge -> publish/checkpoint when due.

One long-lived process per run. It never waits on a particular actor: it trains on
whatever complete shards the store holds, one packed batch (one bucket shape) per step.
What to train, drop and when to publish is the flow policy's (`flow.py`); the buffer and
packing are the `Batcher`'s; acknowledging is `Accounting`'s.

    summary = Learner(cfg, store).run()   # until max_steps / deadline; then marks DONE

Pipelined: while update N runs on the device, the host drains and packs the batch of
update N+1; bookkeeping, publishing and checkpoints follow update N.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from tunix_tasks.config import RunConfig
from tunix_tasks.episode import Episode
from tunix_tasks.learner.accounting import Accounting
from tunix_tasks.learner.batcher import Batcher, DataTimeout
from tunix_tasks.learner.flow import FlowReport, flow_from_config
from tunix_tasks.learner.packing import PackedBatch
from tunix_tasks.learner.staleness import STALENESS_BUCKETS, staleness, updates_since
from tunix_tasks.learner.startup import start_learner
from tunix_tasks.storage.metrics import Stopwatch
from tunix_tasks.storage.runs import mark_done
from tunix_tasks.storage.store import ObjectStore, StoreError

log = logging.getLogger(__name__)

__all__ = ["DataTimeout", "Learner", "trainer_metrics"]

#: The trainer's metrics in every step record (objective.policy_loss / regularized_loss
#: define them); kl_ref and entropy only when their terms are on.
RECORD_METRICS = (
    *("loss", "pg_loss", "nll", "grad_norm", "step_s", "device_s"),
    *("is_weight_mean", "is_weight_max", "is_clipped_frac", "ratio_mean", "ratio_max"),
    *("approx_kl", "ppo_clip_frac", "kl_ref", "entropy"),
)
_PER_BUCKET = ("tokens", "approx_kl", "max_abs_logprob_diff", "ratio_mean", "is_clipped_frac")
#: Versions whose publish step the learner remembers (and checkpoints), newest first: an
#: older version is far staler than any bound, and goes to the oldest bucket.
_PUBLISHED_KEPT = 1024
WAIT_NOTED_S = 10.0  # a wait for data this long gets a phase record (the live display)


def trainer_metrics(m: dict[str, float]) -> dict[str, float]:
    """A step's trainer metrics for its record: `RECORD_METRICS`, and the mismatch
    metrics of each bucket of learner steps since the behaviour weights that had loss
    tokens (`approx_kl_s0`, ...; `staleness.updates_since`)."""
    out = {k: m[k] for k in RECORD_METRICS if k in m}
    for name, _, _ in STALENESS_BUCKETS:
        if m.get(f"tokens_{name}"):
            out.update({f"{k}_{name}": m[f"{k}_{name}"] for k in _PER_BUCKET})
    return out


class Learner:
    def __init__(
        self,
        cfg: RunConfig,
        store: ObjectStore,
        *,
        max_steps: int | None = None,
        deadline_s: float | None = None,
        run_id: str | None = None,
    ) -> None:
        """`run_id`: the incarnation the process joined (`storage.runs.join_run`); read
        from the run at the start if None."""
        self.cfg = cfg
        self.store = store
        self._joined = run_id
        self.max_steps = max_steps or cfg.learner.max_steps
        self._deadline = time.monotonic() + deadline_s if deadline_s else None
        self.stop_reason = ""
        self.flow = flow_from_config(cfg)
        self.flow_report: FlowReport | None = None  # once started: through the run's fence
        self._needs = 0  # episodes a step still lacks that no shard listed so far holds
        self.watch = Stopwatch()

    def request_stop(self, reason: str) -> None:
        self.stop_reason = self.stop_reason or reason

    def _should_stop(self) -> bool:
        if self._deadline is not None and time.monotonic() > self._deadline:
            self.request_stop("deadline")
        if self.parts.lease.lost:
            self.request_stop("lease lost")
        return bool(self.stop_reason) or self.step >= self.max_steps

    def run(self) -> dict[str, Any]:
        t_start = time.monotonic()
        self.parts = p = start_learner(
            self.cfg,
            self.store,
            self._joined,
            on_replaced=lambda _why: self.request_stop("run replaced"),
        )
        try:
            self.step, self.version, self._last_checkpoint = p.step, p.version, p.last_checkpoint
            self.acct = Accounting(p.source, counters=p.counters)
            # The actors' flow control reads it (actor/admission.py); sync mode waits anyway.
            if self.cfg.actor.flow_control and self.cfg.mode == "async":
                self.flow_report = FlowReport(p.writes, restored=self.acct.counters["consumed"])
            self.batcher = Batcher(p.source, self.flow, self.acct, self.cfg.learner)
            self.watch.reset()
            try:
                self._loop()
            except DataTimeout:
                self._checkpoint(final=True)  # nothing is wrong with the state: keep it
                raise
            reached = self.step >= self.max_steps
            if reached:
                self.request_stop("max_steps")
            self._checkpoint(final=True)
            if self.flow.publish_at_end(self.step):
                self._publish()
            p.publisher.wait()
            if reached or self.stop_reason == "deadline":
                mark_done(p.writes, f"learner {self.stop_reason} at step {self.step}")
        finally:
            p.close()
        return {
            "steps": self.step,
            "version": self.version,
            "stop_reason": self.stop_reason,
            **{k: self.acct.counters[k] for k in ("trained_episodes", "dropped")},
            "truncated_sequences": self.acct.counters["truncated_sequences"],
            "compile_count": p.trainer.compile_count,
            "quarantined": list(p.source.quarantined),
            "duty_cycle": self.watch.share("train"),
            "wall_s": time.monotonic() - t_start,
        }

    def _phase(self, text: str) -> None:
        """A record of what the learner is doing while no step comes (the live display
        shows it until the next step record): text only, so no TensorBoard scalar."""
        self.parts.metrics.log(phase=text)

    def _loop(self) -> None:
        inflight: tuple[Any, PackedBatch, list[Episode]] | None = None
        compiled: set[int] = set()  # buckets whose train step this process compiled
        wait_start: float | None = time.monotonic()
        noted = True  # the first wait's record, just below
        self._phase("waiting for the first shard")
        try:
            while not self._should_stop():
                self._report_flow()
                with self.watch.timed("wait"):
                    got = self.batcher.next_batch(self.version)
                self._needs = self._episodes_needed(got)
                if inflight is not None:
                    done, inflight = inflight, None  # a failed completion is never redone
                    self._complete(*done)
                    if got is not None and self._should_stop():
                        self.batcher.put_back(got[1])  # packed, never trained: not acked
                        break
                if got is None:
                    if wait_start is None:
                        wait_start, noted = time.monotonic(), False
                    if not noted and time.monotonic() - wait_start > WAIT_NOTED_S:
                        self._phase("waiting for data")
                        noted = True
                    continue
                wait_start = None
                if not self.batcher.usable(got[1], self.version):  # a publish just moved us
                    self.batcher.put_back(got[1])
                    continue
                bucket = got[0].bucket_len
                if bucket not in compiled:
                    compiled.add(bucket)
                    buckets = self.cfg.learner.buckets
                    self._phase(
                        f"compiling the train step for bucket {bucket} "
                        f"({len(compiled)} of {len(buckets)})"
                    )
                lag = updates_since(self.step, got[0].policy_versions, self.parts.published_at)
                inflight = (self.parts.trainer.dispatch(got[0], lag=lag), *got)
        finally:
            if inflight is not None:
                self._complete(*inflight)

    def _complete(self, pending: Any, batch: PackedBatch, episodes: list[Episode]) -> None:
        self.parts.publisher.check()  # a background publish failed: stop on it here
        m = self.parts.trainer.collect(pending)
        self.watch.add("train", m["device_s"])  # the device's time, not host packing
        self.step += 1
        self.acct.trained(
            episodes, real_tokens=batch.real_tokens, longest_bucket=max(self.cfg.learner.buckets)
        )
        self.flow.trained(episodes)
        self.parts.metrics.log(**self._record(m, batch, episodes))
        if self.flow.publish_due(self.step, self.batcher.buffered_versions(), self.version):
            self._publish()
        if self.step % self.cfg.learner.checkpoint_every == 0:
            self._checkpoint()

    def _record(
        self, m: dict[str, float], batch: PackedBatch, episodes: Sequence[Episode]
    ) -> dict[str, Any]:
        versions = [ep.policy_version for ep in episodes]
        lags = collections.Counter(staleness(self.version, versions).tolist())
        source = self.parts.source
        bias = self.acct.counters["drop_bias"]  # cumulative, bounded (drop_bias.py)
        return {
            "step": self.step,
            "version": self.version,
            **trainer_metrics(m),
            "reward_mean": float(np.mean([ep.reward for ep in episodes])),
            "episodes": len(episodes),
            "real_tokens": int(batch.real_tokens),
            "tokens_per_s": batch.real_tokens / max(m["step_s"], 1e-9),
            "bucket": batch.bucket_len,
            "density": float(batch.density),
            "duty_cycle": self.watch.share("train"),
            "wait_s_total": self.watch.totals.get("wait", 0.0),
            # The step path's share of publishing: queuing the host copies; the rest is background.
            "publish_copy_s_total": self.watch.totals.get("publish", 0.0),
            "publish_s": self.parts.publisher.last_publish_s,
            "publish_coalesced": self.parts.publisher.coalesced,
            "compile_count": self.parts.trainer.compile_count,
            "staleness": {str(k): v for k, v in sorted(lags.items())},
            "dropped": dict(self.acct.counters["dropped"]),
            "buffer": self.batcher.buffered,
            "backlog_shards": source.backlog_shards,
            "quarantined": len(source.quarantined),
            # 1-2 KB: only once there is a stale drop to compare the trained episodes with.
            **({"drop_bias": bias} if bias["stale"]["n"] else {}),
        }

    def _consumed_total(self) -> int:
        c = self.acct.counters
        return c["trained_episodes"] + sum(c["dropped"].values())

    def _episodes_needed(self, got: Any) -> int:
        """Without a batch, having read every shard listed: the episodes a step still
        lacks, at least 1 (a buffer past `min_episodes_per_step` may not fill a batch's
        rows). The actors' flow control admits while it is > 0, or actors paused on the
        learner's buffer and a learner waiting for more would wait for each other."""
        if got is not None or not self.parts.source.caught_up:
            return 0
        return max(1, self.cfg.learner.min_episodes_per_step - self.batcher.buffered)

    def _report_flow(self) -> None:
        if self.flow_report is None:
            return
        try:  # advisory: an actor without it admits as without flow control
            self.flow_report.maybe_write(
                self.version,
                self.acct.counters["consumed"],
                self._consumed_total(),
                waited_s=self.watch.totals.get("wait", 0.0),
                needs=self._needs,
            )
        except StoreError as err:
            log.warning("flow report not written: %s", err)

    def _look_at_run(self) -> None:
        """`RunReplaced` if the run is another incarnation now; a store that cannot say
        leaves it to the next look (a checkpoint in an outage goes on as before)."""
        try:
            self.parts.writes.check()
        except StoreError as err:
            log.warning("run id not read before a checkpoint: %s", err)

    def _publish(self) -> None:
        self.version += 1
        self.parts.source.set_newest_version(self.version)  # before any actor can have it
        self.flow.published()
        if self.flow_report is not None:
            self.flow_report.published(self.version, self._consumed_total())
        with self.watch.timed("publish"):
            flat = self.parts.trainer.snapshot_params()  # copies queued; the rest is background
            self.parts.publisher.publish(flat, version=self.version, step=self.step)
        published = self.parts.published_at
        published[self.version] = self.step
        for old in sorted(published)[:-_PUBLISHED_KEPT]:
            del published[old]

    def _checkpoint(self, *, final: bool = False) -> None:
        # Every version asked for is out (the newest wins), so `version` below is published.
        self.parts.publisher.wait()
        self.parts.ckpt.wait()  # the save in flight is durable before the next get_state
        # RunReplaced: a learner whose run was deleted (and perhaps created again) never
        # checkpoints, and ends fenced also with no step to save, when a background write
        # (a metrics flush) found it first and only asked it to stop. Looked at after the
        # waits, which can take seconds.
        self._look_at_run()
        if self.step == self._last_checkpoint:
            return
        # LeaseLost: nor does one whose lease is another learner's now, so no later
        # learner resumes from this one's state.
        self.parts.lease.confirm()
        meta = {
            "run_id": self.parts.run_id,  # no learner of another incarnation resumes from it
            "step": self.step,
            "version": self.version,
            "counters": self.acct.counters,
            "stream": self.parts.source.get_state(),
            "published_at": {str(v): s for v, s in self.parts.published_at.items()},
            "time": time.time(),
        }
        state, ledger = self.parts.trainer.state(), self.acct.take_ledger()
        on_durable = self.parts.source.committed  # async save: consumed shards go once durable
        self.parts.ckpt.save(self.step, state, meta, ledger, on_durable=on_durable, wait=final)
        self._last_checkpoint = self.step
