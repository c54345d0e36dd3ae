"""`ObjectiveConfig`: the learner's RL objective (off-policy correction, advantages,
stability terms). `LearnerConfig` (`run.py`) inherits these fields, so they stay flat
`learner.*` keys (`learner.correction`, `learner.kl_coef`, ...). The corrections are a registry in `tunix_tasks.learner.objective`
(the maths in `tunix_tasks.learner.rl_math`); this module validates `learner.correction`
without importing JAX: a built-in name, or the import path of your own.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator, model_validator

from tunix_tasks.config.base import Float, Frozen, Int

__all__ = ["BUILTIN_CORRECTIONS", "ObjectiveConfig"]

#: The corrections `tunix_tasks/learner/objective/corrections.py` registers (a test
#: checks the two agree): named here so that loading a config never imports JAX.
BUILTIN_CORRECTIONS = ("none", "token_tis", "sequence_tis", "gspo", "ppo", "decoupled_ppo")
#: `package.module:function`: a correction registered with `@register_correction()` in
#: your module, which the learner imports when it builds its trainer.
_IMPORT_PATH = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*")


class ObjectiveConfig(Frozen):
    """What the learner optimises on (possibly stale) actor data."""

    rho_max: Float = Field(2.0, gt=0.0, description="truncation of importance ratios")
    correction: str = Field(
        "token_tis",
        description="off-policy correction: none (plain REINFORCE), token_tis (token "
        "truncated IS), sequence_tis (length-normalised sequence ratio, truncated), gspo "
        "(GSPO: the sequence ratio clipped PPO-style, one term per sequence), ppo "
        "(dual-clipped surrogate against the behaviour policy), decoupled_ppo (AReaL), or "
        "package.module:function, your own registered with @register_correction()",
    )
    ppo_clip: Float = Field(0.2, gt=0.0, description="PPO ratio clip epsilon (ppo, decoupled_ppo)")
    ppo_dual_clip: Float = Field(
        3.0, gt=1.0, description="dual-clip bound c on the A<0 side: the loss is at most -c*A"
    )
    gspo_clip_low: Float = Field(
        3e-4, gt=0.0, lt=1.0, description="GSPO sequence-ratio clip below 1 (gspo): 1 - low"
    )
    gspo_clip_high: Float = Field(
        4e-4, gt=0.0, description="GSPO sequence-ratio clip above 1 (gspo): 1 + high"
    )
    updates_per_batch: Int = Field(
        1, ge=1, le=16, description="optimizer updates on each batch (PPO mini-epochs)"
    )
    advantage: Literal["group", "batch"] = "group"
    normalize_advantage_std: bool = Field(
        True,
        description="divide advantages by their group's (or batch's) std, as GRPO does; "
        "false: only centre them (Dr. GRPO, Liu et al. 2025: the std over-weights groups "
        "that are almost all solved or all failed)",
    )
    filter_zero_variance_groups: bool = Field(
        False, description="drop groups whose rewards are all equal (no signal) as zero_variance"
    )
    kl_coef: Float = Field(
        0.0, ge=0.0, description="k3 KL penalty to the frozen reference policy; 0: off"
    )
    entropy_coef: Float = Field(0.0, ge=0.0, description="entropy bonus on loss tokens; 0: off")

    @field_validator("correction")
    @classmethod
    def _known_correction(cls, name: str) -> str:
        if name in BUILTIN_CORRECTIONS or _IMPORT_PATH.fullmatch(name):
            return name
        builtins = ", ".join(repr(n) for n in BUILTIN_CORRECTIONS)
        raise ValueError(
            f"unknown correction {name!r}: one of {builtins}, or 'package.module:function' "
            "naming a correction registered with @register_correction()"
        )

    @model_validator(mode="after")
    def _check(self) -> ObjectiveConfig:
        if self.filter_zero_variance_groups and self.advantage != "group":
            raise ValueError(
                "learner.filter_zero_variance_groups needs learner.advantage=group (with "
                "batch advantages a group of equal rewards still has a signal)"
            )
        return self
