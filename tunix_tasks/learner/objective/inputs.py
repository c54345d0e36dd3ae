"""What a correction is given and what it returns: `LossInputs`, `CorrectionParams`,
`CorrectionOutput`.

Arrays are laid out as `PackedBatch` lays them out (``[B, L]``, aligned with target
positions; see `tunix_tasks.learner.rl_math`). `policy_loss` builds the inputs once per
update, so every correction sees the same cleaned arrays: finite log-probs on loss
tokens, a float32 mask and advantages, and the proximal log-probs only for a correction
registered with ``needs_proximal``.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from tunix_tasks.config.objective import ObjectiveConfig

__all__ = ["CorrectionOutput", "CorrectionParams", "LossInputs"]


@dataclasses.dataclass(frozen=True)
class CorrectionParams:
    """The corrections' hyperparameters (`learner.rho_max`, `ppo_clip`, `ppo_dual_clip`,
    `gspo_clip_low`, `gspo_clip_high`). Hashable, so a jitted loss can take it as a static
    argument."""

    rho_max: float = 2.0  # truncation of importance ratios
    ppo_clip: float = 0.2  # PPO ratio clip epsilon
    dual_clip: float = 3.0  # dual-clip bound c on the A < 0 side
    gspo_clip_low: float = 3e-4  # GSPO's sequence-ratio clip: [1 - low, 1 + high]
    gspo_clip_high: float = 4e-4

    @classmethod
    def from_config(cls, objective: ObjectiveConfig) -> CorrectionParams:
        return cls(
            rho_max=float(objective.rho_max),
            ppo_clip=float(objective.ppo_clip),
            dual_clip=float(objective.ppo_dual_clip),
            gspo_clip_low=float(objective.gspo_clip_low),
            gspo_clip_high=float(objective.gspo_clip_high),
        )


@dataclasses.dataclass(frozen=True)
class LossInputs:
    """One batch's arrays, ``[B, L]``. ``pi``: the policy being trained, ``mu``: the
    behaviour policy that sampled the tokens, ``rho = pi / mu``."""

    logp_new: jax.Array  # log pi, floored on loss tokens, 0 elsewhere; carries the gradient
    logp_behavior: jax.Array  # log mu, from the shards (garbage off the mask)
    advantages: jax.Array  # float32
    mask: jax.Array  # float32, 1 on loss tokens
    segment_ids: jax.Array | None = None  # packed sequences (None: each row is one)
    # The proximal policy's log-probs, without gradient: set iff the correction is
    # registered with needs_proximal.
    logp_prox: jax.Array | None = None

    @property
    def log_ratio(self) -> jax.Array:
        """``log rho`` on loss tokens, 0 elsewhere (behaviour values off the mask may be
        garbage)."""
        return jnp.where(self.mask > 0, self.logp_new - self.logp_behavior, 0.0)


class CorrectionOutput(NamedTuple):
    """A correction's per-token objective ``s`` (maximised: the loss is minus its mean
    over the loss tokens) and the metrics it owns. `policy_loss` fills the shared ones it
    leaves out: ``is_weight_*`` / ``is_clipped_frac`` of the token weights, and
    ``ppo_clip_frac`` (0 for a correction that never clips)."""

    objective: jax.Array
    metrics: dict[str, jax.Array]
