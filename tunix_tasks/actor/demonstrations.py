"""Demonstration shards: expert episodes for the learner's supervised warm start.

Agentic RL starts from a pretrained model; the tiny presets start from random weights,
so a run with `warm_start_steps > 0` first imitates each environment's
`demonstration(seed)`. The environments play them here, on the actor side of the run
(its `prepare` step), through the same rollout as the actors; the learner only reads
the shards (`demos/*.parquet`, format v1, metadata `tunix.kind=demonstration`) and never
imports an environment. Seeds come from a range actors never use (>= 2**31).

    keys = write_demonstrations(cfg, store)      # idempotent: no-op if demos/ is filled
"""

from __future__ import annotations

import asyncio
import logging

from tunix_tasks.actor.asynchronous.rollout import EpisodeLimits, ScriptedPolicy, play_episode
from tunix_tasks.config import RunConfig
from tunix_tasks.envs import make_env
from tunix_tasks.episode import Episode
from tunix_tasks.policy.preflight import build_chat
from tunix_tasks.seeds import DEMO_SEED_BASE
from tunix_tasks.storage.layout import RunLayout
from tunix_tasks.storage.shards import episodes_to_table, table_to_parquet_bytes
from tunix_tasks.storage.store import ObjectStore

log = logging.getLogger(__name__)

DEMO_METADATA = {"tunix.kind": "demonstration", "tunix.actor_id": "demonstrations"}
EPISODES_PER_SHARD = 256


def demonstration_count(cfg: RunConfig) -> int:
    """Enough demonstrations to fill each warm-start batch without repeating too much."""
    lc = cfg.learner
    return max(64, 4 * lc.batch_rows * (lc.buckets[0] // 32))


async def _play(cfg: RunConfig, n: int) -> list[Episode]:
    chat = build_chat(cfg.model)
    limits = EpisodeLimits.from_config(cfg)
    out = []
    for i in range(n):
        seed = DEMO_SEED_BASE + cfg.seed * 100_003 + i
        env = make_env(cfg.env.name, **cfg.env.kwargs)
        policy = ScriptedPolicy(env.demonstration(seed), chat)
        out.append(
            await play_episode(
                env, policy, seed=seed, limits=limits, chat=chat, episode_id=f"demo-{i:06d}"
            )
        )
    return out


def write_demonstrations(cfg: RunConfig, store: ObjectStore) -> list[str]:
    """Play and store the run's demonstrations unless `demos/` already holds them."""
    existing = [i.key for i in store.list(RunLayout.DEMOS) if i.key.endswith(".parquet")]
    if existing:
        return existing
    episodes = asyncio.run(_play(cfg, demonstration_count(cfg)))
    keys = []
    for start in range(0, len(episodes), EPISODES_PER_SHARD):
        chunk = episodes[start : start + EPISODES_PER_SHARD]
        key = RunLayout.demo_key(len(keys))
        table = episodes_to_table(chunk)
        store.write_bytes(key, table_to_parquet_bytes(table, extra_metadata=DEMO_METADATA))
        keys.append(key)
    log.info("wrote %d demonstrations in %d shards", len(episodes), len(keys))
    return keys
