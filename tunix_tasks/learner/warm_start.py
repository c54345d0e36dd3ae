"""Supervised warm start on the run's demonstration shards, before RL.

Maximum likelihood on the policy tokens of the episodes under `demos/` (written by the
actor side, see `tunix_tasks.actor.demonstrations`), with the same packed shapes and step
function as RL. The learner never plays an environment itself.

    nll = warm_start(trainer, cfg, store, vocab_size=tok.vocab_size, metrics=metrics)
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np

from tunix_tasks.config import RunConfig
from tunix_tasks.episode import Episode
from tunix_tasks.learner.packing import pack
from tunix_tasks.learner.train_step import Trainer
from tunix_tasks.storage.layout import RunLayout
from tunix_tasks.storage.metrics import MetricsWriter
from tunix_tasks.storage.shards import table_episodes
from tunix_tasks.storage.store import ObjectStore
from tunix_tasks.storage.validation import read_shard_columns

log = logging.getLogger(__name__)


class MissingDemonstrations(RuntimeError):
    """`warm_start_steps > 0` but the run has no demonstration shards."""


def read_demonstrations(store: ObjectStore, *, vocab_size: int) -> list[Episode]:
    keys = sorted(i.key for i in store.list(RunLayout.DEMOS) if i.key.endswith(".parquet"))
    if not keys:
        raise MissingDemonstrations(
            f"warm start needs demonstrations under {store.uri}/{RunLayout.DEMOS}, and there "
            "are none: prepare the run first (`tunix-tasks prepare`, or the DAG's prepare "
            "task), which writes them"
        )
    episodes = [
        dataclasses.replace(ep, advantage=1.0)
        for key in keys
        for ep in table_episodes(read_shard_columns(store, key, vocab_size=vocab_size))
    ]
    return sorted(episodes, key=lambda ep: ep.episode_id)  # seed order, as they were played


def warm_start(
    trainer: Trainer,
    cfg: RunConfig,
    store: ObjectStore,
    *,
    vocab_size: int,
    metrics: MetricsWriter | None = None,
) -> list[float]:
    """Run `cfg.warm_start_steps` supervised steps; returns the per-step NLL."""
    lc = cfg.learner
    demos = read_demonstrations(store, vocab_size=vocab_size)
    rng = np.random.default_rng(cfg.seed)
    losses: list[float] = []
    if metrics is not None:  # the live display's: the first step compiles (seconds)
        metrics.log(phase="warm start: compiling the supervised step")
    for step in range(cfg.warm_start_steps):
        order = rng.permutation(len(demos))
        result = pack(
            [demos[i] for i in order], buckets=lc.buckets, batch_rows=lc.batch_rows, flush=True
        )
        batch = max(result.batches, key=lambda b: b.density)
        m = trainer.step(batch, supervised=True)
        losses.append(m["nll"])
        if metrics is not None:
            metrics.log(warm_start_step=step + 1, nll=m["nll"], step_s=m["step_s"])
        if step % 20 == 0 or step == cfg.warm_start_steps - 1:
            log.info("warm start %d/%d: nll %.3f", step + 1, cfg.warm_start_steps, m["nll"])
    return losses
