"""The learner's RL maths: importance weights, the clipped surrogate, regularisers, metrics.

Owns pure functions only. They take ``jax.numpy`` arrays, have no Python control flow on
values and are ``jax.jit``-able (string/flag arguments are static). Advantages are
computed on the host before packing (``advantages.py``); the off-policy corrections built
from these pieces, and ``policy_loss``, are in ``tunix_tasks.learner.objective``.

Arrays here are laid out as ``tunix_tasks.learner.packing.PackedBatch`` lays them out: ``[B, L]``
aligned with TARGET positions (``logp_new[r, p]`` is the new policy's log-prob of
``targets[r, p]``), so every loss term is elementwise and masked by ``loss_mask``.
``pi`` is the policy being trained, ``mu`` the behaviour policy that sampled the tokens
(its log-probs are in the shards), ``rho = pi/mu``. Truncated importance weights
``min(rho, rho_max)`` carry no gradient (IMPALA/V-trace, Espeholt et al. 2018,
arXiv:1802.01561), per token or per sequence (GSPO's length-normalised ratio, Zheng et al.
2025, arXiv:2507.18071); PPO's clipped surrogate (Schulman et al. 2017, arXiv:1707.06347)
has a dual clip (Ye et al. 2020, arXiv:1912.09729).
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp

from tunix_tasks.learner.staleness import STALENESS_BUCKETS

__all__ = [
    "LOGP_FLOOR",
    "clipped_surrogate",
    "finite_logprobs",
    "k3",
    "masked_mean",
    "regularized_loss",
    "sequence_mean",
    "sequence_mean_weights",
    "staleness_stats",
    "truncated_importance_weights",
]

Array = jax.Array
ArrayLike = jax.typing.ArrayLike


#: The lowest learner log-prob a loss term sees (see `finite_logprobs`).
LOGP_FLOOR = -50.0

# --------------------------------------------------------------------------- helpers


def finite_logprobs(logp: ArrayLike, mask: ArrayLike) -> Array:
    """``logp`` on loss tokens, floored at ``LOGP_FLOOR``; 0 elsewhere.

    With top-k sampling the learner's log-prob of a token outside its top k is ``-inf``:
    every prompt / environment / padding target may be one, and ``0 * -inf`` is NaN in
    ``mask * logp``. A sampled token can fall outside the learner's top k too (a dtype
    mismatch breaking a tie): floored, its ratio is ~0 (weight 0) and its gradient 0,
    instead of a NaN loss. ``where`` keeps the gradient of masked positions at 0.
    """
    return jnp.where(jnp.asarray(mask) > 0, jnp.maximum(jnp.asarray(logp), LOGP_FLOOR), 0.0)


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


def sequence_mean(x: ArrayLike, mask: ArrayLike, segment_ids: ArrayLike | None) -> Array:
    """Mean of ``x`` over each sequence's loss tokens, broadcast back to its tokens
    (differentiable in ``x``). Sequences: rows (``segment_ids=None``) or the segments of
    packed rows (``PackedBatch.segment_ids``)."""
    mask = jnp.asarray(mask, jnp.float32)
    ids = None if segment_ids is None else jnp.asarray(segment_ids)
    count = jnp.maximum(_sequence_sum(mask, ids), 1.0)
    return _sequence_sum(jnp.where(mask > 0, jnp.asarray(x), 0.0), ids) / count


def sequence_mean_weights(mask: ArrayLike, segment_ids: ArrayLike | None) -> Array:
    """Per-token factors ``c_t = N / (G * n_seq(t))`` (``N`` loss tokens, ``G`` sequences
    with at least one, ``n_seq(t)`` the loss tokens of t's sequence), 0 off the mask.

    The loss averages a per-token objective over the batch's loss tokens
    (`objective.loss.policy_loss`), which weighs a sequence by its length; a per-sequence
    objective ``J_i`` broadcast to its tokens and multiplied by ``c_t`` averages to
    ``mean_i J_i`` instead: every sequence counts once, whatever its length.
    """
    mask = jnp.asarray(mask, jnp.float32)
    ids = None if segment_ids is None else jnp.asarray(segment_ids)
    per_seq = jnp.maximum(_sequence_sum(mask, ids), 1.0)
    inv = jnp.where(mask > 0, 1.0 / per_seq, 0.0)
    sequences = jnp.maximum(jnp.sum(inv), 1.0)  # each sequence's tokens sum to 1
    return jnp.sum(mask) * inv / sequences


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
    ``level="sequence"``: GSPO's length-normalised sequence ratio (Zheng et al. 2025,
    arXiv:2507.18071), the geometric mean of the token ratios over the sequence's loss
    tokens, truncated::

        w = min(exp(mean_{t in seq, mask_t} (logp_new_t - logp_b_t)), rho_max)

    broadcast to the sequence's tokens; sequences are rows (``segment_ids=None``) or the
    segments of packed rows (``PackedBatch.segment_ids``). The raw product of the token
    ratios would grow exponentially with the length (a 0.01 log-ratio per token is a
    weight of 2.7 after 100 tokens) and truncate almost every long sequence.

    In the sequence mean each token's log-ratio is bounded below by ``-log(rho_max)``
    (its ratio by ``1 / rho_max``), symmetric to the truncation above: a sampled token
    outside the learner's top k has ``log pi`` floored at ``LOGP_FLOOR`` (-50), and one
    such token would otherwise pull a sequence of 8 from 0.917 to 0.004 and drop all of
    its tokens. Bounded, it lowers the weight by at most ``rho_max^(1/n)`` (0.917 ->
    0.850 for that sequence, ``rho_max`` 2). Token level keeps the raw ratio: a token's
    tiny weight silences that token alone.

    Computed in log space, so a huge sequence ratio truncates instead of overflowing.
    Weights are 0 where ``mask`` is 0. Stats over masked tokens: ``is_weight_mean``,
    ``is_weight_max``, ``is_clipped_frac`` (fraction of tokens whose weight was truncated).
    """
    mask = jnp.asarray(mask, jnp.float32)
    on = mask > 0
    # where() before exp: padding/prompt positions may hold garbage log-probs.
    log_ratio = jnp.where(on, jnp.asarray(logp_new) - jnp.asarray(logp_behavior), 0.0)
    log_ratio = jax.lax.stop_gradient(log_ratio)
    log_rho = jnp.log(jnp.asarray(rho_max, jnp.float32))
    if level == "sequence":
        log_ratio = sequence_mean(jnp.maximum(log_ratio, -log_rho), mask, segment_ids)
    elif level != "token":
        raise ValueError(f"level must be 'token' or 'sequence', got {level!r}")
    clipped = on & (log_ratio > log_rho)
    weights = jnp.where(on, jnp.exp(jnp.minimum(log_ratio, log_rho)), 0.0)
    stats = {
        "is_weight_mean": masked_mean(weights, mask),
        "is_weight_max": jnp.max(jnp.where(on, weights, 0.0)),
        "is_clipped_frac": masked_mean(clipped, mask),
    }
    return weights, stats


# --------------------------------------------------------------------------- loss terms


def k3(log_ratio: ArrayLike) -> Array:
    """Per-sample k3 estimate of ``KL(q || p)`` from samples of ``q``, with
    ``log_ratio = log p - log q`` (Schulman 2020, "Approximating KL divergence")::

        k3 = exp(log_ratio) - 1 - log_ratio     (>= 0; unbiased, low variance)

    As ``expm1(lr) - lr``: near 0 (fresh data) ``exp(lr) - 1`` would cancel in float32.
    """
    lr = jnp.asarray(log_ratio, jnp.float32)
    return jnp.expm1(lr) - lr


def clipped_surrogate(
    ratio: ArrayLike,
    advantages: ArrayLike,
    *,
    clip: float,
    dual_clip: float | None,
    clip_high: float | None = None,
) -> tuple[Array, Array]:
    """PPO's clipped surrogate per token (an objective: maximise it), with a dual clip::

        s = min(r * A, clip(r, 1 - eps, 1 + eps_high) * A)      (Schulman et al. 2017)
        s = max(s, c * A)   where A < 0                         (Ye et al. 2020, c > 1)

    ``eps_high`` is ``clip_high``, ``eps`` (``clip``) when None. Without the dual clip
    (``dual_clip=None``) the A < 0 side is unbounded: ``min`` picks ``r * A`` for every
    ``r > 1 + eps``, so a token that became 3x likelier gets 3x the weight. With it a
    token's loss is at most ``-c * A``. Returns ``(s, clipped)``, ``clipped`` marking the
    tokens whose gradient a clip removed.
    """
    r = jnp.asarray(ratio)
    adv = jnp.asarray(advantages, jnp.float32)
    high = clip if clip_high is None else clip_high
    clipped_r = jnp.clip(r, 1.0 - clip, 1.0 + high)
    surrogate = jnp.minimum(r * adv, clipped_r * adv)
    if dual_clip is None:
        return surrogate, r * adv > clipped_r * adv
    floor = dual_clip * adv
    dual = (adv < 0) & (surrogate < floor)
    return jnp.where(dual, floor, surrogate), (r * adv > clipped_r * adv) | dual


def regularized_loss(
    pg_loss: ArrayLike,
    logp_new: ArrayLike,
    mask: ArrayLike,
    *,
    logp_ref: ArrayLike | None = None,
    entropy: ArrayLike | None = None,
    kl_coef: float = 0.0,
    entropy_coef: float = 0.0,
    logp_behavior: ArrayLike | None = None,
    rho_max: float = 2.0,
) -> tuple[Array, dict[str, Array]]:
    """The policy loss plus the stability terms, each a mean over loss tokens::

        loss = pg_loss + kl_coef * mean_t w_t k3(logp_ref_t - logp_t) - entropy_coef * mean_t H_t

    The KL term is GRPO's penalty to a frozen reference policy (Shao et al. 2024). Its
    VALUE is the k3 estimate of ``KL(pi || pi_ref)``; its GRADIENT (through ``logp``, the
    sampled tokens fixed) is ``(1 - pi_ref/pi) * grad logp`` per token, whose expectation
    over tokens drawn from ``pi`` is ``-sum_x pi_ref(x) grad log pi(x)``, i.e.
    ``grad KL(pi_ref || pi)``: the reverse direction, not ``grad KL(pi || pi_ref)``
    (which would need the score-function term ``log(pi/pi_ref) * grad logp``). Both vanish
    at ``pi == pi_ref`` and pull towards it; this one is mass-covering (it penalises
    ``pi`` for losing tokens the reference likes), as in GRPO's implementations. Kept
    as is, and said here (`tests/unit/learner/test_rl_math.py` checks the direction).

    The expectation above is over ``pi``, but stale tokens were drawn from the behaviour
    policy ``mu``: with ``logp_behavior`` each token's term is weighted by the truncated
    importance weight ``w_t = sg(min(pi/mu, rho_max))`` (exactly 1 on fresh data), so
    the gradient stays ``grad KL(pi_ref || pi)`` on stale data up to the truncation;
    without it ``w_t = 1``. ``H_t`` is the entropy of the sampling distribution at
    position t (``entropy``, with its gradient), an exact per-position quantity that
    needs no weight: the bonus keeps the policy from collapsing early. A term is skipped
    when its input is None. Metrics: ``kl_ref`` (the weighted k3 mean), ``entropy``
    (those computed).
    """
    loss = jnp.asarray(pg_loss)
    metrics: dict[str, Array] = {}
    if logp_ref is not None:
        logp = finite_logprobs(logp_new, mask)
        lr = jnp.where(jnp.asarray(mask) > 0, finite_logprobs(logp_ref, mask) - logp, 0.0)
        per_token = k3(lr)
        if logp_behavior is not None:
            w, _ = truncated_importance_weights(logp, logp_behavior, mask, rho_max=rho_max)
            per_token = w * per_token
        kl = masked_mean(per_token, mask)
        loss = loss + kl_coef * kl
        metrics["kl_ref"] = jax.lax.stop_gradient(kl)
    if entropy is not None:
        h = masked_mean(entropy, mask)
        loss = loss - entropy_coef * h
        metrics["entropy"] = jax.lax.stop_gradient(h)
    return loss, metrics


def staleness_stats(
    logp_new: ArrayLike,
    logp_behavior: ArrayLike,
    mask: ArrayLike,
    lag: ArrayLike,
    *,
    rho_max: float,
) -> dict[str, Array]:
    """Mismatch metrics per bucket of ``STALENESS_BUCKETS``, gradient-free.

    ``lag[r, p]``: learner steps since the behaviour weights of the token's episode were
    published (`staleness.updates_since`), not versions: a version is published every
    ``publish_every`` steps, and the weights move at each. For each bucket ``b``:
    ``tokens_b`` (loss tokens), ``approx_kl_b`` (k3 of ``KL(mu || pi)``),
    ``max_abs_logprob_diff_b`` (``max |log pi - log mu|``), ``ratio_mean_b``
    (``pi/mu``), ``is_clipped_frac_b`` (``pi/mu > rho_max``). At lag 0 the behaviour
    policy IS the learner's current weights, so ``approx_kl_s0`` and
    ``max_abs_logprob_diff_s0`` measure the sampler-vs-learner numerical mismatch alone
    (dtype, e.g. bfloat16 sampling; kernels; a temperature or top-k mismatch): the mean
    cost and the worst token. Later buckets add the policy's drift. Empty buckets give
    zeros (``tokens_b == 0`` says so).
    """
    on = jnp.asarray(mask) > 0
    lr = jax.lax.stop_gradient(
        jnp.where(on, finite_logprobs(logp_new, on) - jnp.asarray(logp_behavior), 0.0)
    )
    s = jnp.asarray(lag)
    out: dict[str, Array] = {}
    for name, lo, hi in STALENESS_BUCKETS:
        sel = on & (s >= lo) & (s <= (hi if hi is not None else jnp.iinfo(jnp.int32).max))
        m = sel.astype(jnp.float32)
        out[f"tokens_{name}"] = jnp.sum(m)
        out[f"approx_kl_{name}"] = masked_mean(k3(lr), m)
        out[f"max_abs_logprob_diff_{name}"] = jnp.max(jnp.where(sel, jnp.abs(lr), 0.0))
        out[f"ratio_mean_{name}"] = masked_mean(jnp.exp(lr), m)
        out[f"is_clipped_frac_{name}"] = masked_mean(lr > jnp.log(rho_max), m)
    return out
