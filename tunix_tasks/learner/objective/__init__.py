"""The learner's RL objective: off-policy corrections as a registry.

inputs.py       `LossInputs` (a batch's arrays), `CorrectionParams`, `CorrectionOutput`
registry.py     `register_correction`, `get_correction`: name -> `Correction` (loss, needs)
corrections.py  the built-ins: none, token_tis, sequence_tis, gspo, ppo, decoupled_ppo
loss.py         `policy_loss`: the chosen correction's loss and the shared metrics

A new correction: a function ``(LossInputs, CorrectionParams) -> CorrectionOutput``
decorated with ``@register_correction()`` in your module, chosen with
``learner.correction: your_pkg.your_module:your_function`` (docs/architecture.md, "A new
correction"). The maths the corrections share is in `tunix_tasks.learner.rl_math`.
"""

from tunix_tasks.learner.objective import corrections
from tunix_tasks.learner.objective.inputs import CorrectionOutput, CorrectionParams, LossInputs
from tunix_tasks.learner.objective.loss import policy_loss
from tunix_tasks.learner.objective.registry import (
    Correction,
    get_correction,
    register_correction,
    registered,
)

__all__ = [
    "Correction",
    "CorrectionOutput",
    "CorrectionParams",
    "LossInputs",
    "corrections",
    "get_correction",
    "policy_loss",
    "register_correction",
    "registered",
]
