"""The learner's RL maths: staleness, truncated importance weights, advantages, the loss.

Owns pure functions only. The loss-side functions take ``jax.numpy`` arrays, have no
Python control flow on values and are ``jax.jit``-able (string/flag arguments are
static). Advantages are computed on the host with numpy, per episode, before packing.

Arrays here are laid out as ``tunix_tasks.learner.packing.PackedBatch`` lays them out: ``[B, L]``
aligned with TARGET positions (``logp_new[r, p]`` is the new policy's log-prob of
``targets[r, p]``), so every loss term is elementwise and masked by ``loss_mask``.

Choices (see each function for details):

* Off-policy correction is truncated importance sampling, ``min(pi/mu, rho_max)`` with the
  weight under ``stop_gradient`` -- the truncated-IS policy gradient of IMPALA/V-trace
  (Espeholt et al. 2018, arXiv:1802.01561), as used for the sampler/learner mismatch in
  "Your efficient RL framework secretly brings you off-policy RL training" (Yao et al.,
  2025, "TIS"). Token level by default; sequence level optional (GSPO-style sequence
  ratios, Zheng et al. 2025, arXiv:2507.18071, but truncated rather than clipped).
* Advantages default to GRPO group normalisation (Shao et al. 2024, DeepSeekMath,
  arXiv:2402.03300), because episodes sharing an env seed are the natural baseline and
  need no value network.
* The loss is averaged over all loss tokens of the batch (token-level aggregation, as in
  DAPO, Yu et al. 2025, arXiv:2503.14476), so packing rows differently never changes it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "batch_advantages",
    "group_advantages",
    "masked_mean",
    "policy_loss",
    "truncated_importance_weights",
]

Array = jax.Array
ArrayLike = jax.typing.ArrayLike


# --------------------------------------------------------------------------- helpers


def masked_mean(x: ArrayLike, mask: ArrayLike) -> Array:
    """Mean of ``x`` over ``mask``; 0 when the mask is empty (never NaN)."""
    mask = jnp.asarray(mask, jnp.float32)
    return jnp.sum(jnp.asarray(x) * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def _sequence_sum(x: Array, segment_ids: Array | None) -> Array:
    """Sum ``x`` over each sequence and broadcast back to its tokens.

    ``segment_ids=None``: each row is one sequence. Otherwise row-local ids in ``[0, L]``
    as ``pack`` writes them (0 = padding, its own throwaway segment).
    """
    if segment_ids is None:
        return jnp.broadcast_to(jnp.sum(x, axis=-1, keepdims=True), x.shape)
    rows, length = x.shape
    ids = jnp.clip(jnp.asarray(segment_ids, jnp.int32), 0, length)
    # Row-offset ids make segments of different rows distinct; the bound is static.
    flat = (ids + (length + 1) * jnp.arange(rows, dtype=jnp.int32)[:, None]).reshape(-1)
    sums = jax.ops.segment_sum(x.reshape(-1), flat, num_segments=rows * (length + 1))
    return sums[flat].reshape(x.shape)


# --------------------------------------------------------------------------- IS weights


def truncated_importance_weights(
    logp_new: ArrayLike,
    logp_behavior: ArrayLike,
    mask: ArrayLike,
    *,
    rho_max: float,
    level: Literal["token", "sequence"] = "token",
    segment_ids: ArrayLike | None = None,
) -> tuple[Array, dict[str, Array]]:
    """Truncated importance weights ``min(pi/mu, rho_max)``, gradient stopped.

    ``level="token"``: ``w_t = min(exp(logp_new_t - logp_b_t), rho_max)``.
    ``level="sequence"``: ``w = min(exp(sum_{t in seq, mask_t} (logp_new_t - logp_b_t)),
    rho_max)`` broadcast to the sequence's tokens; sequences are rows
    (``segment_ids=None``) or the segments of packed rows (``PackedBatch.segment_ids``).

    Computed in log space, so a huge sequence ratio truncates instead of overflowing.
    Weights are 0 where ``mask`` is 0. Stats over masked tokens: ``is_weight_mean``,
    ``is_weight_max``, ``is_clipped_frac`` (fraction of tokens whose weight was truncated).
    """
    mask = jnp.asarray(mask, jnp.float32)
    on = mask > 0
    # where() before exp: padding/prompt positions may hold garbage log-probs.
    log_ratio = jnp.where(on, jnp.asarray(logp_new) - jnp.asarray(logp_behavior), 0.0)
    log_ratio = jax.lax.stop_gradient(log_ratio)
    if level == "sequence":
        log_ratio = _sequence_sum(log_ratio, segment_ids)
    elif level != "token":
        raise ValueError(f"level must be 'token' or 'sequence', got {level!r}")
    log_rho = jnp.log(jnp.asarray(rho_max, jnp.float32))
    clipped = on & (log_ratio > log_rho)
    weights = jnp.where(on, jnp.exp(jnp.minimum(log_ratio, log_rho)), 0.0)
    stats = {
        "is_weight_mean": masked_mean(weights, mask),
        "is_weight_max": jnp.max(jnp.where(on, weights, 0.0)),
        "is_clipped_frac": masked_mean(clipped, mask),
    }
    return weights, stats


# --------------------------------------------------------------------------- advantages


def group_advantages(
    rewards: ArrayLike,
    group_ids: Sequence[object] | np.ndarray,
    *,
    eps: float = 1e-6,
    fallback_baseline: float | None = None,
    normalize_std: bool = True,
    ddof: int = 0,
) -> np.ndarray:
    """GRPO advantages: ``(r - mean_group) / (std_group + eps)`` (Shao et al. 2024).

    The default advantage of the system: the episodes of a group share an env seed, so
    their mean reward is a baseline for exactly that task, with no critic to train.

    * A group of one has no peers: advantage 0 (it carries no learning signal), or
      ``r - fallback_baseline`` (unnormalised) when a fallback baseline is given.
    * A zero-variance group (all rewards equal) gets 0, not NaN: its numerator is 0.
    * ``ddof=0``: population std (DeepSeekMath does not specify; TRL/verl use ``ddof=1``).
    * ``normalize_std=False`` drops the division (Dr. GRPO, Liu et al. 2025,
      arXiv:2503.20783, argue it over-weights too-easy and too-hard groups).
    """
    r = np.asarray(rewards, np.float64).reshape(-1)
    _, inverse, counts = np.unique(
        np.asarray(group_ids, dtype=object).astype(str), return_inverse=True, return_counts=True
    )
    if inverse.size != r.size:
        raise ValueError(f"{r.size} rewards but {inverse.size} group ids")
    sums = np.bincount(inverse, weights=r)
    mean = (sums / counts)[inverse]
    centred = r - mean
    adv = centred
    if normalize_std:
        sq = np.bincount(inverse, weights=centred**2)
        dof = np.maximum(counts - ddof, 1)
        adv = centred / (np.sqrt(sq / dof)[inverse] + eps)
    single = counts[inverse] == 1
    adv = np.where(single, 0.0 if fallback_baseline is None else r - fallback_baseline, adv)
    return adv.astype(np.float32)


def batch_advantages(rewards: ArrayLike, *, eps: float = 1e-6) -> np.ndarray:
    """Batch-normalised advantages ``(r - mean) / (std + eps)`` over all episodes given.

    Use when episodes have no meaningful groups (e.g. one episode per env seed).
    """
    r = np.asarray(rewards, np.float64).reshape(-1)
    if r.size == 0:
        return r.astype(np.float32)
    return ((r - r.mean()) / (r.std() + eps)).astype(np.float32)


# --------------------------------------------------------------------------- loss


def policy_loss(
    logp_new: ArrayLike,
    logp_behavior: ArrayLike,
    advantages: ArrayLike,
    mask: ArrayLike,
    is_weights: ArrayLike | None,
    *,
    ppo_clip: float = 0.0,
) -> tuple[Array, dict[str, Array]]:
    """Off-policy policy-gradient loss, averaged over the batch's loss tokens.

    ``ppo_clip == 0`` (default), truncated-IS REINFORCE::

        loss = -sum(mask * sg(is_w) * A * logp_new) / sum(mask)

    With fresh data (``logp_new == logp_behavior``) every weight is exactly 1 and this is
    the on-policy REINFORCE loss, value and gradient, bit for bit (DESIGN.md: staleness 0
    must give the synchronous update).

    ``ppo_clip = eps > 0``, PPO's clipped surrogate (Schulman et al. 2017,
    arXiv:1707.06347) with the behaviour policy as the old policy::

        ratio = exp(logp_new - logp_behavior)
        loss  = -sum(mask * min(ratio * A, clip(ratio, 1-eps, 1+eps) * A)) / sum(mask)

    ``is_weights`` is NOT applied in this mode: ``ratio`` already is the full ``pi/mu``
    correction, and multiplying by a truncated ``pi/mu`` would count it twice. (Pass
    ``None`` or the weights; they are ignored and only the metrics change.)

    Metrics: ``pg_loss``, ``num_loss_tokens``, ``ratio_mean``, ``approx_kl`` (k3 estimate
    of KL(mu || pi) over loss tokens, Schulman 2020, "Approximating KL divergence"),
    ``ppo_clip_frac`` (0 when ``ppo_clip == 0``), ``advantage_mean``.
    """
    mask = jnp.asarray(mask, jnp.float32)
    logp = jnp.asarray(logp_new)
    adv = jnp.asarray(advantages, jnp.float32)
    denom = jnp.maximum(jnp.sum(mask), 1.0)
    # where() keeps garbage log-probs at unmasked positions out of exp (and its gradient).
    log_ratio = jnp.where(mask > 0, logp - jnp.asarray(logp_behavior), 0.0)
    ratio = jnp.exp(log_ratio)
    if ppo_clip > 0.0:
        clipped_ratio = jnp.clip(ratio, 1.0 - ppo_clip, 1.0 + ppo_clip)
        surrogate = jnp.minimum(ratio * adv, clipped_ratio * adv)
        loss = -jnp.sum(mask * surrogate) / denom
        clip_frac = masked_mean(ratio * adv > clipped_ratio * adv, mask)
    else:
        w = jnp.ones_like(mask) if is_weights is None else jnp.asarray(is_weights)
        w = jax.lax.stop_gradient(w)
        loss = -jnp.sum(mask * w * adv * logp) / denom
        clip_frac = jnp.zeros((), jnp.float32)
    sg_ratio = jax.lax.stop_gradient(ratio)
    metrics = {
        "pg_loss": loss,
        "num_loss_tokens": jnp.sum(mask),
        "ratio_mean": masked_mean(sg_ratio, mask),
        "approx_kl": masked_mean(sg_ratio - 1.0 - jax.lax.stop_gradient(log_ratio), mask),
        "ppo_clip_frac": jax.lax.stop_gradient(clip_frac),
        "advantage_mean": masked_mean(adv, mask),
    }
    return loss, metrics
