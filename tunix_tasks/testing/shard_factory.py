"""Realistic episodes for tests and benchmarks: random tokens, a loss mask over ~40% of
them, behaviour log-probs where it is set, and log-normal lengths (many short, a long tail)."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from tunix_tasks.episode import Episode

if TYPE_CHECKING:
    from tunix_tasks.learner.blocks import EpisodeBlock


def make_episode(
    rng: np.random.Generator,
    *,
    length: int,
    actor_id: str = "actor-0",
    policy_version: int = 0,
    vocab_size: int = 103,
    reward: float | None = None,
    group_id: str = "g0",
) -> Episode:
    """One episode of `length` tokens from `rng` (reward drawn in [0, 1) unless given)."""
    mask = (rng.random(length) < 0.4).astype(np.int8)
    logprobs = np.where(mask == 1, -rng.exponential(1.0, length), 0.0).astype(np.float32)
    return Episode(
        episode_id=uuid.uuid4().hex,
        actor_id=actor_id,
        env="calculator",
        group_id=group_id,
        seed=int(rng.integers(0, 1 << 30)),
        policy_version=policy_version,
        tokens=rng.integers(0, vocab_size, length).astype(np.int32),
        loss_mask=mask,
        behavior_logprobs=logprobs,
        reward=float(rng.random()) if reward is None else reward,
        num_turns=int(rng.integers(1, 5)),
    )


def realistic_lengths(rng: np.random.Generator, n: int, lo: int = 16, hi: int = 2048) -> np.ndarray:
    """Log-normal lengths clipped to [lo, hi]: many short episodes, a long tail."""
    return np.clip(rng.lognormal(mean=5.0, sigma=1.0, size=n), lo, hi).astype(np.int64)


def block_episodes(blocks: Sequence[EpisodeBlock]) -> list[Episode]:
    """Every entry of the source's blocks (`EpisodeSource.poll`) as an `Episode`."""
    return [b.episode(j) for b in blocks for j in range(len(b))]
