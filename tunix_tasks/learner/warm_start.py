"""Supervised warm start on generated demonstrations, before RL.

Agentic RL starts from a pretrained model; our tiny policies start from random weights,
so the learner can first imitate each environment's `demonstration(seed)` for a few
steps (maximum likelihood on the policy tokens, same packed shapes and step function).
Demonstration seeds come from a range the actors never use (>= 2**31).

    warm_start(trainer, cfg, tok, metrics=metrics)
"""

from __future__ import annotations

import asyncio
import logging

import numpy as np

from tunix_tasks.actor.rollout import EpisodeLimits, ScriptedPolicy, play_episode
from tunix_tasks.config import RunConfig
from tunix_tasks.envs import make_env
from tunix_tasks.learner.packing import SequenceExample, pack
from tunix_tasks.learner.train_step import Trainer
from tunix_tasks.policy.tokenizer import Tokenizer
from tunix_tasks.storage.metrics import MetricsWriter

log = logging.getLogger(__name__)

DEMO_SEED_BASE = 1 << 31


async def _demos(cfg: RunConfig, tok: Tokenizer, n: int) -> list[SequenceExample]:
    limits = EpisodeLimits.from_config(cfg)
    out = []
    for i in range(n):
        seed = DEMO_SEED_BASE + cfg.seed * 100_003 + i
        env = make_env(cfg.env.name, **cfg.env.kwargs)
        policy = ScriptedPolicy(env.demonstration(seed), tok)
        rec = await play_episode(env, policy, seed=seed, limits=limits, tok=tok)
        tokens, mask, _ = rec.arrays()
        out.append(
            SequenceExample(
                episode_id=f"demo-{i}",
                tokens=tokens,
                loss_mask=mask,
                behavior_logprobs=np.zeros(len(tokens), np.float32),
                advantage=1.0,
            )
        )
    return out


def demonstrations(cfg: RunConfig, tok: Tokenizer, n: int) -> list[SequenceExample]:
    return asyncio.run(_demos(cfg, tok, n))


def warm_start(
    trainer: Trainer, cfg: RunConfig, tok: Tokenizer, *, metrics: MetricsWriter | None = None
) -> list[float]:
    """Run `cfg.warm_start_steps` supervised steps; returns the per-step NLL."""
    lc = cfg.learner
    # Enough demonstrations to fill each step's batch without repeating too much.
    demos = demonstrations(cfg, tok, n=max(64, 4 * lc.batch_rows * (lc.buckets[0] // 32)))
    rng = np.random.default_rng(cfg.seed)
    losses: list[float] = []
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
