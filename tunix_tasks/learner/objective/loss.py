"""`policy_loss`: the registered correction's loss over one batch, and the metrics every
correction shares.

    loss, metrics = policy_loss(logp, behavior_logprobs, advantages, loss_mask,
                                correction="token_tis", params=CorrectionParams())

The loss is ``-sum(mask * s) / sum(mask)`` with ``s`` the correction's per-token
objective: averaged over all loss tokens of the batch (token-level aggregation, as in
DAPO, Yu et al. 2025, arXiv:2503.14476), so packing rows differently never changes it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from tunix_tasks.learner.objective.inputs import CorrectionParams, LossInputs
from tunix_tasks.learner.objective.registry import get_correction
from tunix_tasks.learner.rl_math import (
    finite_logprobs,
    k3,
    masked_mean,
    truncated_importance_weights,
)

__all__ = ["policy_loss"]

ArrayLike = jax.typing.ArrayLike


def policy_loss(
    logp_new: ArrayLike,
    logp_behavior: ArrayLike,
    advantages: ArrayLike,
    mask: ArrayLike,
    *,
    correction: str = "token_tis",
    params: CorrectionParams = CorrectionParams(),
    logp_prox: ArrayLike | None = None,
    segment_ids: ArrayLike | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Off-policy policy-gradient loss of the correction registered as `correction`.

    ``logp_prox``: the proximal policy's log-probs, for a correction registered with
    ``needs_proximal``; None means ``sg(logp_new)``, the first (or only) update of a batch.

    Metrics: ``pg_loss``, ``num_loss_tokens``, ``advantage_mean``; ``ratio_mean``,
    ``ratio_max`` of ``rho = pi/mu``; ``approx_kl``, the k3 estimate of ``KL(mu || pi)``
    on the loss tokens (sampler-vs-learner mismatch plus staleness); ``ppo_clip_frac``;
    ``is_weight_mean/max``, ``is_clipped_frac`` of ``min(rho, rho_max)`` per token (a
    correction may report its own, as ``sequence_tis`` does its sequence weights').
    """
    spec = get_correction(correction)
    mask = jnp.asarray(mask, jnp.float32)
    logp = finite_logprobs(logp_new, mask)
    prox = None
    if spec.needs_proximal:
        prox = logp if logp_prox is None else finite_logprobs(logp_prox, mask)
        prox = jax.lax.stop_gradient(prox)
    x = LossInputs(
        logp_new=logp,
        logp_behavior=jnp.asarray(logp_behavior),
        advantages=jnp.asarray(advantages, jnp.float32),
        mask=mask,
        segment_ids=None if segment_ids is None else jnp.asarray(segment_ids),
        logp_prox=prox,
    )
    per_token, own = spec.loss(x, params)
    loss = -jnp.sum(mask * per_token) / jnp.maximum(jnp.sum(mask), 1.0)
    # Diagnostics of every correction (XLA shares the weights a TIS correction computed).
    _, metrics = truncated_importance_weights(logp, x.logp_behavior, mask, rho_max=params.rho_max)
    metrics["ppo_clip_frac"] = jnp.zeros((), jnp.float32)
    metrics.update(own)
    on = mask > 0
    lr = jax.lax.stop_gradient(x.log_ratio)
    metrics.update(
        pg_loss=loss,
        num_loss_tokens=jnp.sum(mask),
        ratio_mean=masked_mean(jnp.exp(lr), mask),
        ratio_max=jnp.max(jnp.where(on, jnp.exp(lr), 0.0)),
        approx_kl=masked_mean(k3(lr), mask),
        advantage_mean=masked_mean(x.advantages, mask),
    )
    return loss, metrics
