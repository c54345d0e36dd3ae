"""The env seed ranges every role agrees on: owns where training, held-out evaluation and
demonstration seeds lie, so an environment can tell them apart without importing a role.

    seed_range(123)                    # "train": actors' groups, [0, HELD_OUT_SEED_BASE)
    seed_range(HELD_OUT_SEED_BASE)     # "held_out": evaluation, [HELD_OUT_SEED_BASE, 2**31)
    seed_range(DEMO_SEED_BASE + 5)     # "demonstration": the warm start, >= 2**31

The ranges are disjoint, so evaluation never scores a training seed. The actors draw
theirs with `actor.runtime.episode_seed`, evaluation with `frontdoor.evaluate.held_out_seeds`
and the warm start in `actor.demonstrations`. Standard library only.
"""

from __future__ import annotations

from typing import Literal

__all__ = ["DEMO_SEED_BASE", "HELD_OUT_SEED_BASE", "SeedRange", "seed_range"]

HELD_OUT_SEED_BASE = 3 << 29
DEMO_SEED_BASE = 1 << 31

SeedRange = Literal["train", "held_out", "demonstration"]


def seed_range(seed: int) -> SeedRange:
    """Which of the three ranges ``seed`` lies in (negative seeds are not env seeds)."""
    if seed < 0:
        raise ValueError(f"env seeds are >= 0, got {seed}")
    if seed < HELD_OUT_SEED_BASE:
        return "train"
    return "held_out" if seed < DEMO_SEED_BASE else "demonstration"
