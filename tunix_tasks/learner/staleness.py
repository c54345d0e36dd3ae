"""Staleness: how many weights versions an episode's policy is behind the learner.

The one formula, `learner_version - policy_version` (the episode's oldest version), that
the flow's drop rules, the packed batch's per-token staleness and the step record's
histogram all use, and the buckets the mismatch metrics split it into. Pure numpy.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike

__all__ = ["STALENESS_BUCKETS", "staleness"]

#: Staleness buckets of the mismatch metrics (`rl_math.staleness_stats`): (suffix,
#: lowest, highest or None).
STALENESS_BUCKETS: tuple[tuple[str, int, int | None], ...] = (
    ("s0", 0, 0),
    ("s1_2", 1, 2),
    ("s3p", 3, None),
)


def staleness(learner_version: ArrayLike, policy_versions: ArrayLike) -> np.ndarray:
    """`learner_version - policy_version`, elementwise (0: the learner's current weights)."""
    return np.asarray(learner_version) - np.asarray(policy_versions)
