"""Fleet planning: how many actors keep a learner busy, how stale their episodes arrive,
and how many chips each role needs.

The latency audit (`audit.py`) says which side of a *running* fleet waits; this is the
same arithmetic before a run, from a handful of rates (each one a figure the audit, the
report or `benchmarks/` measures):

- an actor plays `envs_per_actor` episodes at once; an episode is `turns` x (environment
  latency + policy latency per turn), so an actor supplies `envs / episode_s` episodes/s,
  unless its sampler's throughput (`actor_tokens_per_s`, optional) caps it first;
- the learner trains `episodes_per_step` per `learner_step_s`: its capacity;
- actors needed = capacity / supply per actor, rounded up;
- staleness: an episode is trained roughly `episode_s` + the wait for its shard to be
  committed + the wait for the learner to take it after its weights were published, and a
  version lasts `publish_every` x `learner_step_s` when the learner never waits. The
  version lag is that time over a version's; above `learner.max_staleness` episodes are
  dropped (`publish_every` or the bound must grow, or episodes get shorter).

    python -m tunix_tasks.frontdoor.planning --env-latency-s 2 --policy-latency-s 0.5 \\
        --turns 3 --envs-per-actor 64 --learner-step-s 0.4 --episodes-per-step 64

Chips, from a spec's memory (`policy/costs.py`) and an accelerator's HBM, `HEADROOM` (20%)
of it kept free for gathered weights, activations, XLA temporaries and fragmentation:

- learner chips: the smallest power of two n with the FSDP-sharded state / n within the
  other 80%; rows per chip: what the HBM left beside the state and the largest gathered
  weight holds of one training row's activations (0: use 2n chips or shorter rows);
- actor chips: the smallest power of two n with the weights / n within 80% (n > 1 is
  tensor parallelism over the heads); sequences per replica: what the rest of the 80%
  holds of KV caches, split at most n_kv_heads ways (beyond that the KV heads are
  replicated, not split further).

These are budgets from shapes, not measurements (`benchmarks/model_memory.py` tabulates
them for published models).
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass
from typing import Any

from tunix_tasks.frontdoor.audit import rounded
from tunix_tasks.policy import costs
from tunix_tasks.policy.spec import DecoderSpec

__all__ = [
    "ACCELERATORS",
    "HEADROOM",
    "Accelerator",
    "actor_chips",
    "learner_chips",
    "min_chips",
    "plan_fleet",
    "rows_per_chip",
    "sequences_per_replica",
]

GiB = 2**30
HEADROOM = costs.HEADROOM  # of HBM, kept free when sizing the chips for state or weights


@dataclass(frozen=True)
class Accelerator:
    name: str
    hbm_bytes: int


ACCELERATORS = (
    Accelerator("TPU v5e", 16 * GiB),
    Accelerator("TPU v5p", 95 * GiB),
    Accelerator("H200", 139 * GiB),  # 141 GB on the datasheet; ~139 GiB allocatable
)


def plan_fleet(
    *,
    env_latency_s: float,
    policy_latency_s: float,
    turns: float,
    envs_per_actor: int,
    learner_step_s: float,
    episodes_per_step: float,
    actor_tokens_per_s: float | None = None,
    policy_tokens_per_episode: float | None = None,
    publish_every: int = 2,
    episodes_per_shard: int = 32,
    shard_interval_s: float = 30.0,
    max_staleness: int = 4,
) -> dict[str, Any]:
    """The fleet that keeps the learner busy, and the staleness it will see (module doc)."""
    for name, value in (
        ("turns", turns),
        ("envs_per_actor", envs_per_actor),
        ("learner_step_s", learner_step_s),
        ("episodes_per_step", episodes_per_step),
        ("publish_every", publish_every),
    ):
        if not value > 0:
            raise ValueError(f"{name} must be > 0, got {value}")
    episode_s = turns * (env_latency_s + policy_latency_s)
    per_actor = envs_per_actor / episode_s
    sampler_bound = False
    if actor_tokens_per_s and policy_tokens_per_episode:
        cap = actor_tokens_per_s / policy_tokens_per_episode
        sampler_bound = cap < per_actor
        per_actor = min(per_actor, cap)
    capacity = episodes_per_step / learner_step_s
    actors = max(1, math.ceil(capacity / per_actor))
    # An episode waits for its shard (full, or the interval) and then, on average, half
    # of the shard's fill time more in the learner's buffer when the fleet matches it.
    shard_wait_s = min(shard_interval_s, episodes_per_shard / per_actor)
    version_s = publish_every * learner_step_s
    lag = (episode_s + shard_wait_s) / version_s
    return {
        "episode_s": episode_s,
        "actor_supply_eps_per_s": per_actor,
        "sampler_bound": sampler_bound,
        "learner_capacity_eps_per_s": capacity,
        "actors_needed": actors,
        "envs_needed": actors * envs_per_actor,
        "version_s": version_s,
        "expected_staleness": lag,
        "within_max_staleness": lag <= max_staleness,
    }


def min_chips(nbytes: int, hbm_bytes: int) -> int:
    """Smallest power of two n with nbytes / n <= (1 - HEADROOM) * hbm_bytes."""
    n = 1
    while nbytes / n > (1 - HEADROOM) * hbm_bytes:
        n *= 2
    return n


def learner_chips(spec: DecoderSpec, acc: Accelerator, regime: str) -> int:
    """Chips whose HBM holds the learner's FSDP-sharded state in `regime` (module doc)."""
    return min_chips(costs.learner_state_bytes(spec, regime), acc.hbm_bytes)


def rows_per_chip(spec: DecoderSpec, acc: Accelerator, tokens: int, regime: str = "bf16") -> int:
    """Training rows of `tokens` tokens one learner chip holds beside its state."""
    state = costs.learner_state_bytes(spec, regime) / learner_chips(spec, acc, regime)
    free = acc.hbm_bytes - state - costs.gathered_bytes(spec)
    return max(0, math.floor(free / costs.activation_bytes(spec, tokens)["total"]))


def actor_chips(spec: DecoderSpec, acc: Accelerator) -> int:
    """Chips of one actor replica: those whose HBM holds its bfloat16 weights."""
    return min_chips(costs.weight_bytes(spec), acc.hbm_bytes)


def sequences_per_replica(spec: DecoderSpec, acc: Accelerator, context: int) -> int:
    """Concurrent sequences of `context` tokens one actor replica (`actor_chips` chips)
    holds: each chip keeps 1/n of the weights and 1/min(n, n_kv_heads) of every KV cache."""
    n = actor_chips(spec, acc)
    free_per_chip = (1 - HEADROOM) * acc.hbm_bytes - costs.weight_bytes(spec) / n
    kv_per_chip = costs.kv_bytes(spec, context) / min(n, spec.n_kv_heads)
    return max(0, math.floor(free_per_chip / kv_per_chip))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    for name in ("env-latency-s", "policy-latency-s", "turns", "learner-step-s"):
        p.add_argument(f"--{name}", type=float, required=True)
    p.add_argument("--envs-per-actor", type=int, required=True)
    p.add_argument("--episodes-per-step", type=float, required=True)
    p.add_argument("--actor-tokens-per-s", type=float)
    p.add_argument("--policy-tokens-per-episode", type=float)
    p.add_argument("--publish-every", type=int, default=2)
    p.add_argument("--episodes-per-shard", type=int, default=32)
    p.add_argument("--shard-interval-s", type=float, default=30.0)
    p.add_argument("--max-staleness", type=int, default=4)
    args = vars(p.parse_args(argv))
    try:
        plan = plan_fleet(**args)
    except ValueError as err:
        p.error(str(err))
    print(json.dumps(rounded(plan), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
