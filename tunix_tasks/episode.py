"""`Episode`: the one record of an episode, from the actor through the shard to the packer.

The actor's rollout builds it, `storage.shards` writes it as one Parquet row (format v1)
and reads it back, the learner's source adds the learner-side fields (`advantage`, and
`source`: where it was read, which is what acknowledging it marks), and the packer lays
its arrays into batches.

    ep = Episode("ep-1", tokens, loss_mask, behavior_logprobs, reward=1.0, policy_version=3)
    ep.length                                          # number of tokens
    dataclasses.replace(ep, advantage=0.7, source=ShardRow("shards/a/1.parquet", 4))

It also owns the two vocabularies every side spells the same: `EpisodeStatus` (how an
episode ended: the shard's `status` column) and `DropReason` (why the learner accounted
an episode without training on it: the ledger's and the `dropped` counters' keys). Both
are `StrEnum`s: their values are the strings the shards, ledgers and metrics hold.
"""

from __future__ import annotations

import dataclasses
import math
import time
from enum import StrEnum
from typing import NamedTuple

import numpy as np

# The valid range of an episode's reward: finite and |reward| <= 1e6. Rewards are stored as
# float32, which still resolves 1/16 at 1e6 (integers exactly up to 2^24), and every sum
# the learner forms from them (group means and variances, reward x ratio in the loss,
# metric totals over 10^9 episodes) stays far from float32's 3.4e38; a reward of 3e38
# makes those inf. Built-in environments reward within [0, 1].
MAX_ABS_REWARD = 1e6


def reward_in_range(reward: float) -> bool:
    """Whether `reward` may be stored: finite and within +-MAX_ABS_REWARD. Actors check an
    environment's (or agent program's) rewards with it, so one bad value ends its own
    episode as env_error / agent_error instead of the learner quarantining the shard."""
    return math.isfinite(reward) and abs(reward) <= MAX_ABS_REWARD


class EpisodeStatus(StrEnum):
    """How an episode ended (the shard's `status` column)."""

    OK = "ok"
    TRUNCATED = "truncated"  # out of turns or tokens before the env finished
    ENV_ERROR = "env_error"  # the environment raised, or its results did not match the calls
    ENV_TIMEOUT = "env_timeout"  # the environment was too slow


class DropReason(StrEnum):
    """Why the learner accounted an episode without training on it."""

    STALE = "stale"  # its policy version is too old for the flow policy
    DUPLICATE = "duplicate"  # a replay of an episode id already accounted or in flight
    ZERO_VARIANCE = "zero_variance"  # its group's rewards are all equal (no signal)
    ENV_ERROR = "env_error"  # status env_error: says nothing about the policy
    ENV_TIMEOUT = "env_timeout"  # status env_timeout: likewise


class ShardRow(NamedTuple):
    """Where an episode was read from: the unit the learner acknowledges."""

    shard: str
    row: int


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class Episode:
    """Arrays are per token and of equal length; `loss_mask` is 1 on policy tokens and
    `behavior_logprobs` is the sampler's log-prob there (0 elsewhere).

    `seed` is the environment seed that reproduces the episode's task, the same for every
    member of a GRPO group (`group_id`): `env.reset(seed)` for an asyncio environment,
    `vec_env.reset(jax.random.key(seed))` for a vectorized one (the twins draw different
    tasks from one seed). Actors derive it per group (new ones each incarnation): the
    asynchronous actor as `actor.runtime.episode_seed(run_seed, actor_key, group)`
    (actor_key: `<actor_id>/<incarnation>`; below `HELD_OUT_SEED_BASE`, where held-out
    evaluation's seeds start), the vectorized one (< 2**31) on the device from its env
    key (`actor.vectorized.device_loop.group_seed`). Demonstrations use seeds >= 2**31.
    `actor.episodes.EpisodeBuilder` assembles every episode an actor writes."""

    episode_id: str
    tokens: np.ndarray  # int32 [n]
    loss_mask: np.ndarray  # int8 [n]
    behavior_logprobs: np.ndarray  # float32 [n]
    _: dataclasses.KW_ONLY
    reward: float = 0.0
    # The oldest weights version that produced any of its tokens (staleness is measured
    # from it); 0 for demonstrations, which the learner only imitates.
    policy_version: int = 0
    actor_id: str = ""
    env: str = ""
    group_id: str = ""
    seed: int = 0
    num_turns: int = 0
    status: EpisodeStatus = EpisodeStatus.OK
    created_at: float = dataclasses.field(default_factory=time.time)
    # Learner side only, never stored in a shard:
    advantage: float = 0.0
    source: ShardRow | None = None

    def __post_init__(self) -> None:
        tokens = _vector(self.tokens, np.int32)
        mask = _vector(self.loss_mask, np.int8)
        blp = _vector(self.behavior_logprobs, np.float32)
        if tokens.size == 0:
            raise ValueError(f"episode {self.episode_id!r} has no tokens")
        if not tokens.size == mask.size == blp.size:
            raise ValueError(
                f"episode {self.episode_id!r}: tokens/loss_mask/behavior_logprobs lengths "
                f"differ ({tokens.size}, {mask.size}, {blp.size})"
            )
        try:
            status = EpisodeStatus(self.status)  # a shard read hands over the plain string
        except ValueError:
            valid = [s.value for s in EpisodeStatus]
            raise ValueError(
                f"episode {self.episode_id!r}: status {self.status!r} not in {valid}"
            ) from None
        # Frozen: normalise dtypes once, so writers and the packer copy slices blindly.
        object.__setattr__(self, "tokens", tokens)
        object.__setattr__(self, "loss_mask", mask)
        object.__setattr__(self, "behavior_logprobs", blp)
        object.__setattr__(self, "status", status)
        object.__setattr__(self, "advantage", float(self.advantage))
        object.__setattr__(self, "policy_version", int(self.policy_version))

    @property
    def length(self) -> int:
        return int(self.tokens.size)

    @classmethod
    def from_validated(cls, *values: object) -> Episode:
        """An episode from its fields in declaration order (`source` last), every one
        already of its normalised type: 1-D numpy arrays of the three dtypes, an
        `EpisodeStatus`, Python ints and floats. For rows of a validated shard
        (`storage.validation`), whose checks ran over whole columns: skipping
        `__post_init__`'s per-episode checks makes a shard read ~4x cheaper per row."""
        episode = object.__new__(cls)
        for name, value in zip(_FIELDS, values, strict=True):
            object.__setattr__(episode, name, value)
        return episode


_FIELDS = tuple(f.name for f in dataclasses.fields(Episode))


def _vector(values: object, dtype: type) -> np.ndarray:
    # Shard reads hand over 1-D views of the right dtype already: keep those as they are.
    if isinstance(values, np.ndarray) and values.dtype == dtype and values.ndim == 1:
        return values
    return np.asarray(values, dtype=dtype).reshape(-1)
