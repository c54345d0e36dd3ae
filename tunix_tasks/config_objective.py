"""`ObjectiveConfig`: the learner's RL objective (off-policy correction, advantages,
stability terms). `LearnerConfig` (`tunix_tasks.config`) inherits these fields, so they
stay flat `learner.*` keys (`learner.correction`, `learner.kl_coef`, ...); split out so
each module stays small. The maths is in `tunix_tasks.learner.rl_math`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from tunix_tasks.config_model import _Frozen

__all__ = ["CORRECTIONS", "Correction", "ObjectiveConfig"]

Correction = Literal["none", "token_tis", "sequence_tis", "ppo", "decoupled_ppo"]
CORRECTIONS: tuple[str, ...] = Correction.__args__  # type: ignore[attr-defined]


class ObjectiveConfig(_Frozen):
    """What the learner optimises on (possibly stale) actor data."""

    rho_max: float = Field(2.0, gt=0.0, description="truncation of importance ratios")
    correction: Correction = Field(
        "token_tis",
        description="off-policy correction: none (plain REINFORCE), token_tis (token "
        "truncated IS), sequence_tis (length-normalised sequence ratio, truncated), ppo "
        "(dual-clipped surrogate against the behaviour policy), decoupled_ppo (AReaL)",
    )
    ppo_clip: float = Field(
        0.2, ge=0.0, description="PPO ratio clip epsilon (ppo, decoupled_ppo); must be > 0 there"
    )
    ppo_dual_clip: float = Field(
        3.0, gt=1.0, description="dual-clip bound c on the A<0 side: the loss is at most -c*A"
    )
    updates_per_batch: int = Field(
        1, ge=1, le=16, description="optimizer updates on each batch (PPO mini-epochs)"
    )
    advantage: Literal["group", "batch"] = "group"
    filter_zero_variance_groups: bool = Field(
        False, description="drop groups whose rewards are all equal (no signal) as zero_variance"
    )
    kl_coef: float = Field(
        0.0, ge=0.0, description="k3 KL penalty to the frozen reference policy; 0: off"
    )
    entropy_coef: float = Field(0.0, ge=0.0, description="entropy bonus on loss tokens; 0: off")

    @model_validator(mode="after")
    def _check(self) -> ObjectiveConfig:
        if self.correction in ("ppo", "decoupled_ppo") and self.ppo_clip <= 0.0:
            raise ValueError(
                f"learner.ppo_clip must be > 0 with learner.correction={self.correction} "
                f"(got {self.ppo_clip}); e.g. 0.2, or use correction=token_tis"
            )
        if self.filter_zero_variance_groups and self.advantage != "group":
            raise ValueError(
                "learner.filter_zero_variance_groups needs learner.advantage=group (with "
                "batch advantages a group of equal rewards still has a signal)"
            )
        return self
