"""Starting and stopping a learner: lease, model, trainer, checkpoint or warm start, source.

    parts = start_learner(cfg, store, joined)   # holds the lease; `parts.version` is published
    try: ...train...
    finally: parts.close()

On a fresh run the learner warm-starts from the run's demonstration shards (if
`warm_start_steps`); on a restart it restores the latest checkpoint, deletes ledger
files of work about to be redone, and always publishes the weights it resumes from as a
new version, newer than anything out there, so actors leave weights from lost updates.
With several processes this is process 0's start: its trainer and checkpointer announce
their collectives to the followers (`multihost.py`), and `close` sends them `STOP`.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jax

from tunix_tasks.config import ConfigError, RunConfig
from tunix_tasks.config.params import flat_fields
from tunix_tasks.learner.checkpoint import Checkpointer
from tunix_tasks.learner.multihost import Channel, LeaderCheckpointer, Op, make_trainer
from tunix_tasks.learner.publishing import SnapshotPublisher
from tunix_tasks.learner.source import EpisodeSource, PrefetchingSource
from tunix_tasks.learner.train_step import Trainer
from tunix_tasks.learner.warm_start import warm_start
from tunix_tasks.policy.build import base_fingerprint, model_meta
from tunix_tasks.storage.layout import RunLayout
from tunix_tasks.storage.lease import Lease
from tunix_tasks.storage.metrics import MetricsWriter
from tunix_tasks.storage.retention import SnapshotRetention
from tunix_tasks.storage.runs import RunFence, run_id
from tunix_tasks.storage.store import ObjectStore
from tunix_tasks.storage.trackers import open_tracker
from tunix_tasks.storage.uri import join_uri

log = logging.getLogger(__name__)

#: How often the learner's metrics and flow report, written on its train loop a second
#: or less apart, look at the run's id before writing (`RunFence`); a metrics chunk is
#: still looked at after each write, and every other write looks before it.
WRITES_LOOK_EVERY_S = 1.0


@dataclass
class LearnerParts:
    channel: Channel | None = None  # to the follower processes (multihost.py), if any
    lease: Lease | None = None
    trainer: Trainer | None = None
    ckpt: Checkpointer | None = None
    source: PrefetchingSource | None = None
    metrics: MetricsWriter | None = None
    publisher: SnapshotPublisher | None = None
    step: int = 0
    version: int = 0
    counters: dict[str, Any] | None = None
    last_checkpoint: int = -1  # step of the checkpoint resumed from
    run_id: str = ""  # this incarnation of the run (storage/runs.py), in every checkpoint
    # What the learner writes besides its lease and checkpoints (metrics, snapshots, the
    # flow report, quarantine moves, DONE) goes through the run's fence.
    writes: RunFence | None = None
    # version -> the step after which it was published (checkpointed): the mismatch
    # metrics' buckets count the steps since an episode's behaviour weights.
    published_at: dict[int, int] = field(default_factory=dict)

    def close(self) -> None:
        """Stop threads and release the lease, whatever part of the start succeeded."""
        if self.channel is not None:  # first: the followers wait for it
            # Called from `finally`: an exception in flight means the leader failed.
            failed = sys.exc_info()[0] is not None
            try:
                self.channel.send(Op.STOP, int(failed))
            except Exception as err:  # a dead peer: the coordination service ends us
                log.warning("learner teardown: could not stop the followers: %r", err)
        # A replaced run's lease is abandoned as the fence finds it (`_start`): its
        # `release` is then a no-op.
        for name, close in (
            ("publisher", "close"),
            ("source", "stop"),
            ("metrics", "close"),
            ("ckpt", "close"),
            ("lease", "release"),
        ):
            obj = getattr(self, name)
            if obj is not None:
                try:
                    getattr(obj, close)()
                except Exception as err:  # keep tearing down the rest
                    log.warning("learner teardown: %s.%s failed: %r", name, close, err)


def start_learner(
    cfg: RunConfig,
    store: ObjectStore,
    joined: str | None = None,
    on_replaced: Callable[[str], None] = lambda _why: None,
) -> LearnerParts:
    """The learner's parts, started. `joined`: the `run_id` its process joined (read here
    if None); its writes stop with `RunReplaced` once the run at the URI is another
    incarnation, and `on_replaced(why)` is called once."""
    parts = LearnerParts()
    try:
        _start(parts, cfg, store, joined, on_replaced)
    except BaseException:
        parts.close()
        raise
    return parts


def _check_incarnation(meta: dict[str, Any], run: str, where: str) -> None:
    """A checkpoint another incarnation of the run wrote (a deleted run's learner whose
    save was in flight as the run was created again) is never resumed from: a clear
    error naming it. Checkpoints from before run ids, or of a run without one, name none."""
    written = meta.get("run_id") or ""
    if written and run and written != run:
        raise ConfigError(
            f"checkpoint step {meta.get('step')} under {where} was written by run_id "
            f"{str(written)[:40]!r}, not this run's ({run}): a learner of the run deleted "
            "there saved it late; delete that step's folder and start again"
        )


def _start(
    p: LearnerParts,
    cfg: RunConfig,
    store: ObjectStore,
    joined: str | None,
    on_replaced: Callable[[str], None],
) -> None:
    for warning in cfg.warnings:
        log.warning("config: %s", warning)
    p.run_id = run_id(store) if joined is None else joined
    # The lease fences a running learner only at its renewals (every ttl/3): between them
    # a learner whose run was deleted and created again would log, publish and
    # quarantine into the other run. The fence stops it at its first such write. The
    # lease (compare-and-swap on its own generation) and orbax's checkpoints keep the
    # plain store; `Learner._checkpoint` checks the fence before each save.

    def replaced(why: str) -> None:
        # No renewal or release writes to the lease at that path again: it would only
        # fail there (another run's generation) after the fence has said why.
        if p.lease is not None:
            p.lease.abandon()
        on_replaced(why)

    writes = p.writes = RunFence(
        store,
        p.run_id,
        on_replaced=replaced,
        fresh_s=WRITES_LOOK_EVERY_S,
        fresh_for=(RunLayout.METRICS, RunLayout.FLOW),
    )
    p.lease = Lease(store, ttl_s=cfg.learner.lease_ttl_s)
    p.lease.acquire()  # LeaseHeldError if another learner runs on this run
    p.lease.start_renewing()
    # Several processes: this one leads, announcing every collective to the others.
    channel = Channel() if jax.process_count() > 1 else None
    p.trainer = make_trainer(cfg, channel)
    model = p.trainer.model
    p.ckpt = Checkpointer(store) if channel is None else LeaderCheckpointer(store, channel)
    p.channel = channel  # only now are the followers waiting for announcements (STOP)
    p.source = PrefetchingSource(
        EpisodeSource.from_config(
            writes,
            cfg.learner,
            vocab_size=model.vocab_size,
            max_length=cfg.actor.max_episode_tokens,  # <= model.max_seq_len (validated)
            run_id=p.run_id,
        )
    )
    tracker = None
    if cfg.tracker is not None:  # the user's own experiment tracker (storage/trackers.py)
        params = dict(flat_fields(json.loads(cfg.to_json())))
        try:
            tracker = open_tracker(
                cfg.tracker, run_name=cfg.run_name, run_uri=store.uri, params=params
            )
        except Exception as err:  # a view of the metrics: training goes on without it
            log.warning("tracker %s not opened, metrics not sent to it: %r", cfg.tracker, err)
    p.metrics = MetricsWriter(writes, "learner", tracker=tracker)
    # Reads weights/LATEST. One that is missing or not a valid pointer (a poisoned
    # `{"version": "../../etc"}`) does not stop the start: the publisher then counts from
    # the newest snapshot folder under weights/, and its first publish CASes over it.
    retention = SnapshotRetention(
        writes, keep_last=cfg.learner.keep_snapshots, keep_every=cfg.learner.keep_every
    )
    adapter_base = None
    if model.lora is not None:
        uri = cfg.model.checkpoint or f"preset {cfg.model.preset}, seed {cfg.seed}"
        adapter_base = {"fingerprint": base_fingerprint(cfg.model, cfg.seed), "uri": uri}
    p.publisher = SnapshotPublisher(
        writes,
        p.lease,
        model=model_meta(cfg.model, model),
        retention=retention,
        adapter_base=adapter_base,
        full_every=cfg.learner.full_snapshot_every,
    )
    published = p.publisher.latest_version  # -1: no weights out there
    restored = p.ckpt.restore(p.trainer.checkpoint_template())
    if restored is not None:
        state, meta = restored
        _check_incarnation(meta, p.run_id, join_uri(store.uri, RunLayout.CHECKPOINTS))
        p.trainer.load_state(state)
        p.step, p.version, p.counters = int(meta["step"]), int(meta["version"]), meta["counters"]
        p.source.set_state(meta["stream"])
        p.published_at = {int(v): int(s) for v, s in meta.get("published_at", {}).items()}
        p.last_checkpoint = p.step
        pruned = p.ckpt.prune_ledger_after(p.step)
        log.info("resumed at step %d (v%d); %d ledger files redone", p.step, p.version, pruned)
    else:
        # No checkpoint committed: ledger files of an earlier attempt that crashed before
        # its first checkpoint describe work that is about to be redone.
        if pruned := p.ckpt.prune_ledger_after(-1):
            log.info("fresh start: removed %d ledger files of a crashed attempt", pruned)
        # No checkpoint: all training so far is lost, so the warm start is redone too
        # (also when an attempt that crashed before its first checkpoint published).
        if cfg.warm_start_steps:
            warm_start(p.trainer, cfg, store, vocab_size=model.vocab_size, metrics=p.metrics)
        p.trainer.freeze_reference()  # RL starts here (a restart restores the reference)
    p.version = max(p.version, published + 1)
    p.publisher.publish(p.trainer.snapshot_params(), version=p.version, step=p.step)
    p.publisher.wait()  # actors need the first snapshot before anything else
    p.published_at[p.version] = p.step
    p.source.set_newest_version(p.version)  # newer policy_versions are quarantined
    p.source.start()
