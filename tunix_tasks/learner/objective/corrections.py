"""The built-in off-policy corrections, one registered function each (``learner.correction``).

Each maps `LossInputs` to the per-token objective ``s`` (the loss is ``-mean(s)`` over the
batch's loss tokens, `loss.policy_loss`); the maths they share (truncated IS weights, the
dual-clipped surrogate) is in `tunix_tasks.learner.rl_math`. Citations:

* ``none``: plain REINFORCE on the behaviour data.
* ``token_tis`` / ``sequence_tis``: the truncated-IS policy gradient of IMPALA/V-trace
  (Espeholt et al. 2018, arXiv:1802.01561), as used for the sampler/learner mismatch in
  "Your efficient RL framework secretly brings you off-policy RL training" (Yao et al.
  2025, "TIS"); per sequence with GSPO's length-normalised ratio (Zheng et al. 2025,
  arXiv:2507.18071), truncated rather than clipped. Both are REINFORCE averaged per
  token: a sequence's weight in the loss grows with its length.
* ``gspo``: GSPO's sequence-level objective as published (Zheng et al. 2025,
  arXiv:2507.18071): the sequence ratio clipped PPO-style, one term per sequence.
* ``ppo``: PPO's clipped surrogate (Schulman et al. 2017, arXiv:1707.06347) with a dual
  clip (Ye et al. 2020, arXiv:1912.09729).
* ``decoupled_ppo``: AReaL's decoupled PPO (Fu et al. 2025, arXiv:2505.24298).

Keep the names in step with `tunix_tasks.config.objective.BUILTIN_CORRECTIONS` (the
config validates them without importing JAX; a test checks the two agree).
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp

from tunix_tasks.learner.objective.inputs import CorrectionOutput, CorrectionParams, LossInputs
from tunix_tasks.learner.objective.registry import register_correction
from tunix_tasks.learner.rl_math import (
    clipped_surrogate,
    masked_mean,
    sequence_mean,
    sequence_mean_weights,
    truncated_importance_weights,
)

__all__ = ["decoupled_ppo", "gspo", "no_correction", "ppo", "sequence_tis", "token_tis"]


@register_correction("none")
def no_correction(x: LossInputs, params: CorrectionParams) -> CorrectionOutput:
    """``s = A * log pi``: no weight."""
    return CorrectionOutput(x.advantages * x.logp_new, {})


def _truncated_is(
    x: LossInputs, params: CorrectionParams, level: Literal["token", "sequence"]
) -> CorrectionOutput:
    w, stats = truncated_importance_weights(
        x.logp_new,
        x.logp_behavior,
        x.mask,
        rho_max=params.rho_max,
        level=level,
        segment_ids=x.segment_ids,
    )
    return CorrectionOutput(w * x.advantages * x.logp_new, stats)


@register_correction("token_tis")
def token_tis(x: LossInputs, params: CorrectionParams) -> CorrectionOutput:
    """``s = sg(min(rho_t, rho_max)) * A * log pi``. With fresh data (``pi == mu``) every
    weight is exactly 1 and this is on-policy REINFORCE, value and gradient, bit for bit
    (staleness 0 = the synchronous update)."""
    return _truncated_is(x, params, "token")


@register_correction("sequence_tis")
def sequence_tis(x: LossInputs, params: CorrectionParams) -> CorrectionOutput:
    """As `token_tis` with GSPO's length-normalised sequence weight
    (``truncated_importance_weights(level="sequence")``); its ``is_*`` metrics are the
    sequence weights'. Averaged per token like `token_tis`, so a sequence's share of the
    gradient grows with its length (`gspo` gives each sequence one share)."""
    return _truncated_is(x, params, "sequence")


@register_correction("gspo")
def gspo(x: LossInputs, params: CorrectionParams) -> CorrectionOutput:
    """GSPO (Zheng et al. 2025, arXiv:2507.18071, eq. 5-7), the behaviour policy as the
    old one::

        s_i = exp(mean_{t in i} log(pi_t / mu_t))             (the sequence ratio)
        J   = mean_i min(s_i A_i, clip(s_i, 1 - eps_low, 1 + eps_high) A_i)

    with the paper's small clip range (``gspo_clip_low`` 3e-4, ``gspo_clip_high`` 4e-4)
    and no dual clip. The gradient flows through ``s_i`` (``s_i * mean_t grad log pi_t``:
    every token of a sequence weighted alike); each sequence counts once whatever its
    length (`sequence_mean_weights`), the advantage being the episode's. As published, a
    sampled token outside the learner's top k (``log pi`` floored at -50) makes ``s_i``
    tiny and its sequence clipped: it carries no gradient, as any sequence far off-policy.
    ``ppo_clip_frac``: the share of loss tokens whose sequence was clipped.
    """
    s = jnp.exp(sequence_mean(x.log_ratio, x.mask, x.segment_ids))
    objective, clipped = clipped_surrogate(
        s,
        x.advantages,
        clip=params.gspo_clip_low,
        clip_high=params.gspo_clip_high,
        dual_clip=None,
    )
    weights = sequence_mean_weights(x.mask, x.segment_ids)
    return CorrectionOutput(weights * objective, {"ppo_clip_frac": masked_mean(clipped, x.mask)})


def _surrogate(
    ratio: jax.Array, x: LossInputs, params: CorrectionParams
) -> tuple[jax.Array, dict[str, jax.Array]]:
    s, clipped = clipped_surrogate(
        ratio, x.advantages, clip=params.ppo_clip, dual_clip=params.dual_clip
    )
    return s, {"ppo_clip_frac": masked_mean(clipped, x.mask)}


@register_correction("ppo")
def ppo(x: LossInputs, params: CorrectionParams) -> CorrectionOutput:
    """``s = clipped_surrogate(rho, A)`` (dual-clipped), the behaviour policy as the old one."""
    return CorrectionOutput(*_surrogate(jnp.exp(x.log_ratio), x, params))


@register_correction("decoupled_ppo", needs_proximal=True)
def decoupled_ppo(x: LossInputs, params: CorrectionParams) -> CorrectionOutput:
    """The proximal policy ``pi_prox`` (``logp_prox``: the parameters at the start of the
    batch's updates) splits the correction in two::

        s = sg(min(pi_prox / mu, rho_max)) * clipped_surrogate(pi / pi_prox, A)

    The clip bounds each update's move from ``pi_prox`` (a trust region), the weight
    corrects the staleness of ``mu``. On the first (or only) update ``pi == pi_prox`` and
    the gradient is `token_tis`'s.
    """
    assert x.logp_prox is not None, "registered with needs_proximal: policy_loss sets it"
    w_prox, _ = truncated_importance_weights(
        x.logp_prox, x.logp_behavior, x.mask, rho_max=params.rho_max
    )
    ratio = jnp.exp(jnp.where(x.mask > 0, x.logp_new - x.logp_prox, 0.0))
    s, metrics = _surrogate(ratio, x, params)
    return CorrectionOutput(w_prox * s, metrics)
