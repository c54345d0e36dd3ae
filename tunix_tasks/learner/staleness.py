"""Staleness: how far an episode's policy is behind the learner, in versions and in updates.

`staleness`: the one formula, `learner_version - policy_version` (the episode's oldest
version), that the flow's drop rules and the step record's histogram use.
`updates_since`: the learner steps taken since the behaviour weights were published,
which the mismatch metrics are bucketed by (`STALENESS_BUCKETS`): the weights move at
every step, a version only every `publish_every` steps, so a version lag of 0 is no
guarantee that the learner still holds the weights that sampled. Pure numpy.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
from numpy.typing import ArrayLike

__all__ = ["STALENESS_BUCKETS", "UNKNOWN_LAG", "staleness", "updates_since"]

#: Buckets of the mismatch metrics (`rl_math.staleness_stats`) over the learner steps
#: since the behaviour weights (`updates_since`): (suffix, lowest, highest or None).
#: ``s0``: the learner's weights are the ones that sampled (numerics alone).
STALENESS_BUCKETS: tuple[tuple[str, int, int | None], ...] = (
    ("s0", 0, 0),
    ("s1_2", 1, 2),
    ("s3p", 3, None),
)


#: `updates_since` of a version the learner has no publish step for: the oldest bucket.
UNKNOWN_LAG = 1 << 30


def staleness(learner_version: ArrayLike, policy_versions: ArrayLike) -> np.ndarray:
    """`learner_version - policy_version`, elementwise (0: the learner's current version;
    its weights may have moved since it was published, see `updates_since`)."""
    return np.asarray(learner_version) - np.asarray(policy_versions)


def updates_since(
    step: int, policy_versions: ArrayLike, published_at: Mapping[int, int]
) -> np.ndarray:
    """Learner steps between each version's publication and `step` (the steps done before
    the update about to run), elementwise: 0 means the update runs on the very weights
    that sampled. `published_at`: version -> the step after which it was published. A
    version not in it (older than the learner remembers, or published by a learner that
    crashed before checkpointing: weights of lost updates) gets `UNKNOWN_LAG`."""
    versions = np.asarray(policy_versions, np.int64).reshape(-1)
    lag = [step - published_at[v] if v in published_at else UNKNOWN_LAG for v in versions.tolist()]
    return np.asarray(lag, np.int64).reshape(np.shape(policy_versions))
