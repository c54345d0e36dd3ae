"""Evaluation of a weight snapshot on held-out environment seeds.

Seeds come from a range neither actors nor warm start use (`actor.runtime.HELD_OUT_SEED_BASE`
and up, below the demonstrations' 2**31), so the figure measures generalisation over
tasks, not memorisation. Decoding is greedy (top_k=1) by default.
The result is written to `eval/v<version>.json` beside the run and returned.

What plays each seed (`harness`): `env`, the run's environment in-process (the async
actor's rollout); `program`, the run's agent program unchanged against a private endpoint
(`actor/endpoint/evaluation.py`), so an `actor.kind: agent` run is scored as it trains,
with whatever the program does with the task. The default follows `actor.kind`.

    result = evaluate_snapshot("file:///tmp/runs/demo", version=None, seeds=None)
    result["reward_mean"], result["success_rate"], result["solved_rate"]   # > 0, >= 1
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import numpy as np
from flax import nnx

from tunix_tasks.actor.asynchronous.batching import BatchingPolicy
from tunix_tasks.actor.asynchronous.rollout import EpisodeLimits, play_episode
from tunix_tasks.actor.endpoint.evaluation import play_program
from tunix_tasks.actor.runtime import HELD_OUT_SEED_BASE
from tunix_tasks.config import RunConfig
from tunix_tasks.envs import make_env
from tunix_tasks.envs.base import Environment
from tunix_tasks.frontdoor.compile_cache import enable_compile_cache
from tunix_tasks.policy.build import build_sampler
from tunix_tasks.policy.chat import ChatFormat
from tunix_tasks.policy.sampling import Sampler
from tunix_tasks.storage.layout import RunLayout
from tunix_tasks.storage.runs import read_config
from tunix_tasks.storage.weights import load_snapshot, published_version

DEFAULT_EPISODES = 64


def held_out_seeds(n: int = DEFAULT_EPISODES) -> list[int]:
    """The first `n` held-out seeds (at most 2**31 - HELD_OUT_SEED_BASE)."""
    if not 0 <= n <= (1 << 31) - HELD_OUT_SEED_BASE:
        raise ValueError(f"held-out seeds: need 0 <= n <= {(1 << 31) - HELD_OUT_SEED_BASE}")
    return [HELD_OUT_SEED_BASE + i for i in range(n)]


HARNESSES = ("env", "program")


def default_harness(cfg: RunConfig) -> str:
    return "program" if cfg.actor.kind == "agent" else "env"


async def _evaluate(
    cfg: RunConfig,
    chat: ChatFormat,
    sampler: Sampler,
    seeds: list[int],
    *,
    greedy: bool,
    harness: str,
) -> list[tuple[float, int, str]]:
    limits = EpisodeLimits.from_config(cfg)
    policy = BatchingPolicy(
        sampler,
        max_new_tokens=cfg.actor.max_new_tokens,
        temperature=cfg.actor.temperature,
        top_k=1 if greedy else cfg.actor.top_k,
        seed=cfg.seed,
    )

    def env() -> Environment:
        return make_env(cfg.env.name, **cfg.env.kwargs)

    async with policy:
        if harness == "program":
            return await play_program(cfg, chat, policy, seeds, env)
        records = await asyncio.gather(
            *(play_episode(env(), policy, seed=s, limits=limits, chat=chat) for s in seeds)
        )
    return [(ep.reward, ep.num_turns, ep.status) for ep in records]


def evaluate_params(
    cfg: RunConfig,
    flat: dict[str, np.ndarray] | None,
    seeds: list[int],
    *,
    greedy: bool = True,
    adapters: bool = False,
    harness: str | None = None,
) -> dict[str, Any]:
    """Evaluate given params (None: the initial random weights; `adapters`: LoRA adapters
    on the configured base) on `seeds`, played by `harness` (default: `actor.kind`'s)."""
    harness = harness or default_harness(cfg)
    if harness not in HARNESSES:
        raise ValueError(f"harness {harness!r}: expected one of {list(HARNESSES)}")
    if harness == "program" and not cfg.actor.agent.program:
        raise ValueError("harness 'program' needs actor.agent.program in the run's config")
    chat, sampler = build_sampler(cfg.model, seed=cfg.seed)
    if flat is not None:
        sampler.update_params(flat, only=nnx.LoRAParam if adapters else nnx.Param)
    t0 = time.perf_counter()
    results = asyncio.run(_evaluate(cfg, chat, sampler, seeds, greedy=greedy, harness=harness))
    rewards = np.asarray([r for r, _, _ in results], np.float64)
    statuses: dict[str, int] = {}
    for _, _, st in results:
        statuses[st] = statuses.get(st, 0) + 1
    return {
        "env": cfg.env.name,
        "episodes": len(seeds),
        "reward_mean": float(rewards.mean()) if rewards.size else 0.0,
        "success_rate": float((rewards > 0).mean()) if rewards.size else 0.0,
        # full marks: partial scores (reasoning-gym's 0.01 for a wrong number) excluded
        "solved_rate": float((rewards >= 1.0).mean()) if rewards.size else 0.0,
        "turns_mean": float(np.mean([t for _, t, _ in results])) if results else 0.0,
        "status": statuses,
        "greedy": greedy,
        "harness": harness,
        "wall_s": time.perf_counter() - t0,
    }


def evaluate_snapshot(
    run_uri: str,
    version: int | None = None,
    *,
    seeds: list[int] | None = None,
    greedy: bool = True,
    harness: str | None = None,
) -> dict[str, Any]:
    enable_compile_cache()
    cfg, store = read_config(run_uri)
    version = published_version(store, version)
    flat, manifest = load_snapshot(store, version)
    adapters = manifest.kind == "adapter"  # on the base the config names
    result = {
        "run_uri": run_uri,
        "version": version,
        "step": manifest.step,
        **evaluate_params(
            cfg, flat, seeds or held_out_seeds(), greedy=greedy, adapters=adapters, harness=harness
        ),
        "time": time.time(),
    }
    store.write_bytes(RunLayout.eval_result(version), json.dumps(result, indent=2).encode())
    return result
