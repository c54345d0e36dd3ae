"""RL maths against hand-computed and numpy values, and the staleness-0 == on-policy
property, for every off-policy correction."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tunix_tasks.episode import Episode
from tunix_tasks.learner.advantages import (
    batch_advantages,
    group_advantages,
    shard_group_codes,
    zero_variance_mask,
)
from tunix_tasks.learner.objective import CorrectionParams, policy_loss
from tunix_tasks.learner.packing import pack
from tunix_tasks.learner.rl_math import (
    clipped_surrogate,
    k3,
    masked_mean,
    regularized_loss,
    staleness_stats,
    truncated_importance_weights,
)
from tunix_tasks.learner.staleness import UNKNOWN_LAG, updates_since

# --------------------------------------------------------------------------- references


def target_logprobs(logits, targets):
    """``log_softmax(logits)[..., targets]``: ``[B, L, V], [B, L] -> [B, L]`` (reference)."""
    logp = jax.nn.log_softmax(jnp.asarray(logits, jnp.float32), axis=-1)
    return jnp.take_along_axis(logp, jnp.asarray(targets)[..., None], axis=-1)[..., 0]


# --------------------------------------------------------------------------- IS weights


def test_token_level_weights_hand_values() -> None:
    logp_new = jnp.array([[-1.0, -0.5, -2.0, -0.1]])
    logp_b = jnp.array([[-1.0, -1.0, -1.0, -3.0]])
    mask = jnp.array([[1, 1, 1, 0]])
    w, st = truncated_importance_weights(logp_new, logp_b, mask, rho_max=1.5)
    # exp(0)=1, exp(0.5)=1.6487 -> 1.5, exp(-1)=0.3679, masked -> 0.
    np.testing.assert_allclose(w, [[1.0, 1.5, math.exp(-1.0), 0.0]], rtol=1e-6)
    np.testing.assert_allclose(st["is_weight_mean"], (1.0 + 1.5 + math.exp(-1.0)) / 3, rtol=1e-6)
    np.testing.assert_allclose(st["is_weight_max"], 1.5)
    np.testing.assert_allclose(st["is_clipped_frac"], 1 / 3, rtol=1e-6)


def test_sequence_level_weights_packed_segments() -> None:
    # Row: segment 1 at positions 0-2, segment 2 at 3-4, padding at 5.
    logp_new = jnp.array([[-1.0, -1.1, 9.0, -0.5, -0.5, 7.0]])
    logp_b = jnp.array([[-1.2, -1.0, 4.0, -1.5, -1.0, 0.0]])
    mask = jnp.array([[1, 1, 0, 1, 1, 0]])
    seg = jnp.array([[1, 1, 1, 2, 2, 0]])
    w, st = truncated_importance_weights(
        logp_new, logp_b, mask, rho_max=2.0, level="sequence", segment_ids=seg
    )
    # Geometric mean of the masked token ratios; position 2 (mask 0) is ignored.
    s1 = math.exp((0.2 - 0.1) / 2)
    # Segment 2: exp((1.0 + 0.5) / 2) = 2.12 -> truncated to 2.
    np.testing.assert_allclose(w, [[s1, s1, 0.0, 2.0, 2.0, 0.0]], rtol=1e-6)
    np.testing.assert_allclose(st["is_clipped_frac"], 0.5)
    np.testing.assert_allclose(st["is_weight_mean"], (2 * s1 + 4.0) / 4, rtol=1e-6)
    # Without segment ids each row is one sequence: exp((0.1 + 1.5) / 4) = 1.49.
    w_rows, _ = truncated_importance_weights(logp_new, logp_b, mask, rho_max=2.0, level="sequence")
    r = math.exp(1.6 / 4)
    np.testing.assert_allclose(w_rows, [[r, r, 0.0, r, r, 0.0]], rtol=1e-6)


def test_sequence_ratio_is_the_length_normalised_geometric_mean() -> None:
    """GSPO: exp(mean log-ratio), so a long sequence with a small drift per token is not
    truncated (the raw product exp(sum) = e^1 = 2.7 would be)."""
    rng = np.random.default_rng(3)
    n = 100
    logp_b = -rng.exponential(1.0, (1, n))
    logp_new = logp_b + 0.01
    w, st = truncated_importance_weights(
        logp_new, logp_b, np.ones((1, n)), rho_max=2.0, level="sequence"
    )
    np.testing.assert_allclose(w, np.full((1, n), math.exp(0.01)), rtol=1e-5)
    assert st["is_clipped_frac"] == 0.0


def test_sequence_level_huge_ratio_truncates_without_overflow() -> None:
    logp_new = jnp.zeros((1, 300))
    logp_b = jnp.full((1, 300), -10.0)  # sum of log ratios = 3000: exp would overflow
    w, st = truncated_importance_weights(
        logp_new, logp_b, jnp.ones((1, 300)), rho_max=3.0, level="sequence"
    )
    np.testing.assert_array_equal(w, np.full((1, 300), 3.0, np.float32))
    assert st["is_clipped_frac"] == 1.0


def test_weights_are_jittable_and_gradient_free() -> None:
    fn = jax.jit(functools.partial(truncated_importance_weights, rho_max=2.0, level="sequence"))
    lp = jnp.array([[-1.0, -2.0, -0.5]])
    w, _ = fn(lp, lp - 0.1, jnp.ones((1, 3)), segment_ids=jnp.array([[1, 1, 2]]))
    np.testing.assert_allclose(w, np.full((1, 3), math.exp(0.1)), rtol=1e-6)
    grad = jax.grad(
        lambda x: truncated_importance_weights(x, lp, jnp.ones((1, 3)), rho_max=2.0)[0].sum()
    )
    np.testing.assert_array_equal(grad(lp + 0.3), np.zeros((1, 3)))


def test_sequence_weights_on_a_packed_batch_match_per_episode() -> None:
    rng = np.random.default_rng(0)
    eps = []
    for i, n in enumerate([5, 9, 3, 7, 12, 4]):
        mask = (rng.random(n) < 0.7).astype(np.int8)
        eps.append(Episode(f"e{i}", np.arange(n) + 1, mask, np.where(mask, -rng.random(n), 0)))
    new_lp = {e.episode_id: np.where(e.loss_mask, -rng.random(e.length), 0) for e in eps}
    (batch,) = pack(eps, buckets=(16,), batch_rows=3).batches
    # Place the new log-probs target-aligned, exactly as the learner would get them.
    lp = np.zeros(batch.shape, np.float32)
    for r, p in zip(*np.nonzero(batch.segment_ids), strict=True):
        e = batch.episode_ids[batch.episode_index[r, p]]
        pos = batch.positions[r, p]
        if pos + 1 < len(new_lp[e]):
            lp[r, p] = new_lp[e][pos + 1]
    w, _ = truncated_importance_weights(
        lp,
        batch.behavior_logprobs,
        batch.loss_mask,
        rho_max=1e9,
        level="sequence",
        segment_ids=batch.segment_ids,
    )
    for e in eps:
        # Token 0 has no predicting position in the packed layout, so it never counts.
        diff = (new_lp[e.episode_id] - e.behavior_logprobs)[1:][e.loss_mask[1:] == 1]
        ids = np.asarray(batch.episode_ids)[np.maximum(batch.episode_index, 0)]
        sel = (ids == e.episode_id) & (batch.loss_mask > 0)
        np.testing.assert_allclose(np.asarray(w)[sel], math.exp(float(diff.mean())), rtol=1e-5)


@functools.partial(jax.jit, static_argnames="correction")
def _loss_grad(logp, logp_b, adv, mask, segment_ids=None, *, correction: str):
    """The gradient of `policy_loss` w.r.t. ``logp``, and its metrics (jitted: faster
    than op-by-op dispatch even with the compile)."""

    def loss(x):
        return policy_loss(x, logp_b, adv, mask, correction=correction, segment_ids=segment_ids)

    return jax.grad(loss, has_aux=True)(logp)


def test_one_token_outside_the_top_k_no_longer_zeroes_its_sequence() -> None:
    """A sequence of 8 with weight 0.917; its last token (behaviour log-prob -6.03) falls
    outside the learner's top k (log pi = -inf, floored at -50). Unbounded, that token
    alone pulled the geometric mean to 0.0038; bounded at 1/rho_max it is 0.850."""
    logp_b = jnp.array([[-1.0] * 7 + [-6.03]])
    logp = logp_b + math.log(0.917)
    adv, mask = jnp.ones((1, 8)), jnp.ones((1, 8))
    _, before = policy_loss(logp, logp_b, adv, mask, correction="sequence_tis")
    np.testing.assert_allclose(before["is_weight_mean"], 0.917, rtol=1e-5)
    outside = logp.at[0, 7].set(-jnp.inf)
    grad, after = _loss_grad(outside, logp_b, adv, mask, correction="sequence_tis")
    bounded = math.exp((7 * math.log(0.917) - math.log(2.0)) / 8)  # 0.850
    unbounded = math.exp((7 * math.log(0.917) - 50 + 6.03) / 8)  # 0.0038
    assert unbounded < 0.004 and bounded > 0.84
    np.testing.assert_allclose(after["is_weight_mean"], bounded, rtol=1e-5)
    np.testing.assert_allclose(grad[0, :7], -bounded / 8, rtol=1e-5)  # the others still learn
    assert grad[0, 7] == 0.0


def _three_sequences(deltas):
    """One packed row of three sequences of 3, 6 and 9 loss tokens, every token of
    sequence i with log(pi/mu) = deltas[i]; advantage 1."""
    seg = jnp.array([[1] * 3 + [2] * 6 + [3] * 9])
    logp_b = -jnp.linspace(0.5, 2.0, 18)[None]
    logp = logp_b + jnp.asarray(deltas, jnp.float32)[seg - 1]
    return logp, logp_b, jnp.ones((1, 18)), jnp.ones((1, 18)), seg


def _shares(correction: str, deltas) -> tuple[np.ndarray, dict]:
    """Each sequence's summed gradient of the loss w.r.t. its log-probs (its weight in
    the update), and the metrics."""
    grad, m = _loss_grad(*_three_sequences(deltas), correction=correction)
    return -np.array([grad[0, :3].sum(), grad[0, 3:9].sum(), grad[0, 9:].sum()]), m


def test_gspo_is_the_published_sequence_objective_one_share_per_sequence() -> None:
    """GSPO: loss = -mean_i min(s_i A, clip(s_i, 1 - 3e-4, 1 + 4e-4) A) with s_i the
    sequence's length-normalised ratio; each sequence of 3/6/9 tokens gets the same share
    of the gradient (1/3 each), where sequence_tis gives 3/18, 6/18, 9/18."""
    deltas = [1e-4, -2e-4, 2e-4]  # inside the clip range
    logp, logp_b, adv, mask, seg = _three_sequences(deltas)
    loss, _ = policy_loss(logp, logp_b, adv, mask, correction="gspo", segment_ids=seg)
    np.testing.assert_allclose(loss, -np.mean(np.exp(deltas)), rtol=1e-6)
    gspo_shares, m = _shares("gspo", deltas)
    np.testing.assert_allclose(gspo_shares, np.exp(deltas) / 3, rtol=1e-4)
    assert m["ppo_clip_frac"] == 0.0
    tis_shares, _ = _shares("sequence_tis", deltas)
    np.testing.assert_allclose(tis_shares, np.exp(deltas) * [3 / 18, 6 / 18, 9 / 18], rtol=1e-4)
    # Outside the range: above 1 + 4e-4 with A > 0 the sequence is clipped (no gradient),
    # below 1 - 3e-4 it is not (min picks s A): PPO's rule at the sequence level.
    clipped_shares, m = _shares("gspo", [-1e-3, 0.0, 1e-3])
    np.testing.assert_allclose(clipped_shares, [math.exp(-1e-3) / 3, 1 / 3, 0.0], atol=1e-6)
    np.testing.assert_allclose(m["ppo_clip_frac"], 9 / 18)


# --------------------------------------------------------------------------- advantages


def test_group_advantages_hand_example() -> None:
    rewards = [1, 0, 1, 1, 0.5, 2, 2, 3, 1]
    groups = ["a", "a", "a", "a", "b", "c", "c", "d", "d"]
    adv = group_advantages(rewards, groups)
    std_a = math.sqrt(0.1875)  # mean 0.75, population std
    group_a = [0.25 / std_a, -0.75 / std_a, 0.25 / std_a, 0.25 / std_a]
    group_b = [0.0]  # group of one: no peers, no signal
    group_c = [0.0, 0.0]  # zero variance: 0, not NaN
    expected = [*group_a, *group_b, *group_c, 1.0, -1.0]
    assert adv.dtype == np.float32 and np.isfinite(adv).all()
    np.testing.assert_allclose(adv, expected, rtol=1e-5)
    with_fallback = group_advantages(rewards, groups, fallback_baseline=0.2)
    np.testing.assert_allclose(with_fallback[4], 0.3, rtol=1e-6)
    np.testing.assert_allclose(with_fallback[[0, 5, 7]], adv[[0, 5, 7]])
    unscaled = group_advantages(rewards, groups, normalize_std=False)
    np.testing.assert_allclose(unscaled, [0.25, -0.75, 0.25, 0.25, 0, 0, 0, 1, -1], atol=1e-7)


def test_shard_group_codes_tell_every_group_of_every_shard_apart() -> None:
    """A round's group ids coded as one integer per (shard, group): the same id in two
    shards is two groups, and ids numpy's fixed-width strings would merge (a trailing NUL)
    stay apart, as per shard (`np.unique` on the objects)."""
    ids = np.array(["a", "a\x00", "b", "a", "a\x00", "a"], dtype=object)
    shards = np.array([0, 0, 0, 0, 1, 1])
    codes = shard_group_codes(ids, shards)
    assert len(set(codes[:4])) == 3 and codes[0] == codes[3]
    assert len(set(codes)) == 5 and codes[4] != codes[1] and codes[5] != codes[0]
    rewards = np.array([1.0, 0.0, 0.5, 0.0, 1.0, 0.25])
    together = group_advantages(rewards, codes)
    for s in (0, 1):
        own = np.unique(ids[shards == s], return_inverse=True)[1]
        np.testing.assert_array_equal(
            together[shards == s], group_advantages(rewards[shards == s], own)
        )


def test_batch_advantages() -> None:
    np.testing.assert_allclose(
        batch_advantages([1, 2, 3, 4]),
        np.array([-1.5, -0.5, 0.5, 1.5]) / math.sqrt(1.25),
        rtol=1e-5,
    )
    np.testing.assert_array_equal(batch_advantages([2.0, 2.0]), [0.0, 0.0])


def test_group_statistics_use_kept_episodes_only() -> None:
    """An env_error / env_timeout episode (keep False) neither enters its group's mean and
    std nor gets a signal: the others' advantages are those of the group without it."""
    rewards = [1.0, 0.0, 0.0, -5.0, 2.0, 2.0, 0.0]
    groups = ["a", "a", "a", "a", "b", "b", "b"]
    keep = [True, True, True, False, True, True, False]
    adv = group_advantages(rewards, groups, keep=keep)
    np.testing.assert_allclose(adv[:3], group_advantages(rewards[:3], groups[:3]), rtol=1e-6)
    np.testing.assert_array_equal(adv[[3, 6]], [0.0, 0.0])
    np.testing.assert_array_equal(adv[4:6], [0.0, 0.0])  # the kept two are equal
    b = batch_advantages(rewards, keep=keep)
    kept = np.asarray(rewards)[np.asarray(keep)]
    np.testing.assert_allclose(b[np.asarray(keep)], (kept - kept.mean()) / kept.std(), rtol=1e-5)
    assert b[3] == 0.0 and b[6] == 0.0


def test_zero_variance_mask() -> None:
    rewards = [1, 1, 1, 0, 1, 3, 3, 7, 2]
    groups = ["a", "a", "a", "b", "b", "c", "c", "d", "e"]
    keep = [True, True, True, True, True, True, False, True, True]
    # a: all equal; b: signal; c: one kept left; d, e: groups of one.
    np.testing.assert_array_equal(
        zero_variance_mask(rewards, groups, keep=keep),
        [True, True, True, False, False, True, False, True, True],
    )


# --------------------------------------------------------------------------- loss


def test_tis_loss_value_and_gradient_hand() -> None:
    logp = jnp.array([[-1.0, -2.0, -0.5]])
    logp_b = logp + jnp.array([[0.0, math.log(2.0), 0.0]])  # weights 1, 0.5
    adv = jnp.array([[2.0, 2.0, -1.0]])
    mask = jnp.array([[1.0, 1.0, 0.0]])

    def loss_fn(x):
        return policy_loss(x, logp_b, adv, mask, correction="token_tis")[0]

    # -(1*2*(-1) + 0.5*2*(-2)) / 2 = 2
    np.testing.assert_allclose(loss_fn(logp), 2.0, rtol=1e-6)
    np.testing.assert_allclose(jax.grad(loss_fn)(logp), [[-1.0, -0.5, 0.0]], rtol=1e-6)
    # none: plain REINFORCE, no weight: -(2*(-1) + 2*(-2)) / 2 = 3
    none = policy_loss(logp, logp_b, adv, mask, correction="none")[0]
    np.testing.assert_allclose(none, 3.0, rtol=1e-6)


def test_ppo_loss_hand() -> None:
    logp_new = jnp.array([[-1.0, -1.0]])
    logp_b = jnp.array([[-1.2, -0.5]])
    adv = jnp.array([[1.0, -1.0]])
    mask = jnp.ones((1, 2))

    def loss_fn(x):
        return policy_loss(x, logp_b, adv, mask, correction="ppo", params=CorrectionParams())

    loss, m = loss_fn(logp_new)
    # ratio e^0.2 = 1.22 -> clip 1.2 (A=+1); ratio e^-0.5 = 0.61 -> clip 0.8 (A=-1).
    np.testing.assert_allclose(loss, -(1.2 - 0.8) / 2, rtol=1e-6)
    np.testing.assert_allclose(m["ppo_clip_frac"], 1.0)
    np.testing.assert_array_equal(jax.grad(lambda x: loss_fn(x)[0])(logp_new), [[0.0, 0.0]])


def _np_dual_clip(ratio, adv, eps, c):
    surrogate = np.minimum(ratio * adv, np.clip(ratio, 1 - eps, 1 + eps) * adv)
    return np.where(adv < 0, np.maximum(surrogate, c * adv), surrogate)


def test_ppo_negative_advantage_is_dual_clipped() -> None:
    """A < 0 and a ratio far above 1 + eps: plain PPO's min() keeps ratio * A (a token
    5x likelier gets 5x the weight); the dual clip bounds its loss at -c * A."""
    ratio = np.array([[5.0, 2.5, 1.5, 0.5, 5.0]])
    adv = np.array([[-1.0, -2.0, -1.0, -1.0, 1.0]])
    logp_b = np.log(np.full((1, 5), 0.1))
    logp = jnp.asarray(logp_b + np.log(ratio), jnp.float32)
    mask = np.ones((1, 5))

    def loss_fn(x):
        params = CorrectionParams(ppo_clip=0.2, dual_clip=3.0)
        return policy_loss(x, logp_b, adv, mask, correction="ppo", params=params)

    (loss, m), grad = jax.value_and_grad(loss_fn, has_aux=True)(logp)
    expected = _np_dual_clip(ratio, adv, 0.2, 3.0)  # [-3, -5, -1.5, -0.8, 1.2]
    np.testing.assert_allclose(loss, -expected.mean(), rtol=1e-5)
    np.testing.assert_allclose(loss, (3 + 5 + 1.5 + 0.8 - 1.2) / 5, rtol=1e-5)
    # Clipped tokens pass no gradient: 0 (dual clip: -5 < -3), 3 and 4 (PPO clip); 1 and
    # 2 (ratio * A above the floor c * A) pass d(-ratio * A / 5) / dlogp = -ratio * A / 5.
    np.testing.assert_allclose(grad, [[0.0, 5.0 / 5, 1.5 / 5, 0.0, 0.0]], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(m["ppo_clip_frac"], 3 / 5)
    s, clipped = clipped_surrogate(jnp.asarray(ratio), adv, clip=0.2, dual_clip=3.0)
    np.testing.assert_allclose(s, expected, rtol=1e-6)
    np.testing.assert_array_equal(clipped, [[True, False, False, True, True]])


def test_decoupled_ppo_against_numpy() -> None:
    """AReaL: sg(min(pi_prox/mu, rho_max)) * dual-clipped surrogate of pi/pi_prox."""
    rng = np.random.default_rng(1)
    shape = (2, 7)
    mu = -rng.exponential(1.0, shape)
    prox = mu + rng.normal(0, 0.6, shape)
    pi = prox + rng.normal(0, 0.3, shape)
    adv = np.repeat(rng.normal(size=(2, 1)), 7, axis=1)
    mask = (rng.random(shape) < 0.8).astype(np.float32)

    def loss_fn(x):
        params = CorrectionParams(rho_max=1.5, ppo_clip=0.2, dual_clip=3.0)
        return policy_loss(
            x, mu, adv, mask, correction="decoupled_ppo", params=params, logp_prox=prox
        )

    (loss, m), grad = jax.value_and_grad(loss_fn, has_aux=True)(jnp.asarray(pi, jnp.float32))
    w = np.minimum(np.exp(prox - mu), 1.5)
    r = np.exp(pi - prox)
    s = _np_dual_clip(r, adv, 0.2, 3.0)
    np.testing.assert_allclose(loss, -(mask * w * s).sum() / mask.sum(), rtol=1e-5)
    # d/dlogp of r*A is r*A where the unclipped branch is active, else 0.
    active = np.isclose(s, r * adv) & ~np.isclose(np.clip(r, 0.8, 1.2), r)
    active |= np.abs(r - 1) < 0.2
    expected_grad = -mask * w * np.where(active, r * adv, 0.0) / mask.sum()
    np.testing.assert_allclose(grad, expected_grad, rtol=1e-4, atol=1e-7)
    assert 0 < float(m["ppo_clip_frac"]) < 1


def test_k3_and_regularized_loss_against_numpy() -> None:
    rng = np.random.default_rng(2)
    shape = (3, 5)
    logp = -rng.exponential(1.0, shape)
    ref = logp + rng.normal(0, 0.5, shape)
    ent = rng.exponential(1.0, shape)
    mask = (rng.random(shape) < 0.7).astype(np.float32)
    np.testing.assert_allclose(k3(ref - logp), np.expm1(ref - logp) - (ref - logp), rtol=2e-5)

    def loss_fn(x, h):
        return regularized_loss(
            0.5, x, mask, logp_ref=ref, entropy=h, kl_coef=0.1, entropy_coef=0.01
        )

    (loss, m), (g_logp, g_h) = jax.value_and_grad(loss_fn, argnums=(0, 1), has_aux=True)(
        jnp.asarray(logp, jnp.float32), jnp.asarray(ent, jnp.float32)
    )
    d = ref - logp
    kl = (mask * (np.exp(d) - 1 - d)).sum() / mask.sum()
    h = (mask * ent).sum() / mask.sum()
    np.testing.assert_allclose(loss, 0.5 + 0.1 * kl - 0.01 * h, rtol=1e-5)
    np.testing.assert_allclose([m["kl_ref"], m["entropy"]], [kl, h], rtol=1e-5)
    # d k3(ref - x)/dx = 1 - exp(ref - x): pushes logp towards the reference.
    np.testing.assert_allclose(g_logp, 0.1 * mask * (1 - np.exp(d)) / mask.sum(), rtol=1e-4)
    np.testing.assert_allclose(g_h, -0.01 * mask / mask.sum(), rtol=1e-5)
    plain, none = regularized_loss(0.5, logp, mask)
    assert float(plain) == 0.5 and none == {}


def test_k3_gradient_is_grad_kl_ref_to_pi_and_is_importance_weighted_on_stale_data() -> None:
    """On a 5-way categorical, the KL term's expected gradient (mask = the sampling
    probabilities: an exact expectation over sampled tokens) is grad KL(ref || pi) =
    pi - ref for softmax logits, not grad KL(pi || ref). Tokens drawn from a stale mu
    give that gradient only through the importance weight pi/mu."""
    theta = jnp.array([0.3, -1.0, 0.8, 0.0, -0.4])
    ref = jax.nn.softmax(jnp.array([0.0, 0.5, -0.5, 1.0, 0.2]))
    mu = jax.nn.softmax(jnp.array([1.0, 0.0, 0.0, -1.0, 0.5]))
    pi = jax.nn.softmax(theta)

    def kl_term(th, sampler, behaviour):
        logp = jax.nn.log_softmax(th)[None]
        loss, _ = regularized_loss(
            0.0,
            logp,
            sampler[None],
            logp_ref=jnp.log(ref)[None],
            kl_coef=1.0,
            logp_behavior=behaviour,
            rho_max=1e6,
        )
        return loss

    @jax.jit
    def grads(th):
        g = jax.grad(kl_term)
        fresh = g(th, pi, jax.nn.log_softmax(th)[None])
        return g(th, pi, None), g(th, mu, jnp.log(mu)[None]), g(th, mu, None), fresh

    def kl_pi_ref(th):  # KL(pi || ref), exact
        return jnp.sum(jax.nn.softmax(th) * (jax.nn.log_softmax(th) - jnp.log(ref)))

    on_policy, stale, unweighted, fresh = grads(theta)
    grad_ref_pi = pi - ref  # grad_theta KL(ref || softmax(theta))
    np.testing.assert_allclose(on_policy, grad_ref_pi, atol=1e-6)
    assert np.abs(np.asarray(on_policy - jax.grad(kl_pi_ref)(theta))).max() > 0.05
    np.testing.assert_allclose(stale, grad_ref_pi, atol=1e-6)  # weighted by pi/mu
    assert np.abs(np.asarray(unweighted - grad_ref_pi)).max() > 0.05  # mu's tokens, no weight
    np.testing.assert_allclose(fresh, on_policy, rtol=1e-6)  # fresh data: every weight is 1


def test_staleness_stats_against_numpy() -> None:
    rng = np.random.default_rng(4)
    shape = (2, 9)
    mu = -rng.exponential(1.0, shape)
    pi = mu + rng.normal(0, 0.8, shape)
    mask = (rng.random(shape) < 0.8).astype(np.float32)
    stale = rng.integers(0, 6, shape)
    got = staleness_stats(pi, mu, mask, stale, rho_max=1.5)
    buckets = {"s0": stale == 0, "s1_2": (stale >= 1) & (stale <= 2), "s3p": stale >= 3}
    for name, sel in buckets.items():
        m = mask * sel
        d = pi - mu
        assert got[f"tokens_{name}"] == m.sum()
        mean = lambda x, m=m: (m * x).sum() / m.sum()  # noqa: E731
        np.testing.assert_allclose(got[f"approx_kl_{name}"], mean(np.exp(d) - 1 - d), rtol=1e-4)
        np.testing.assert_allclose(got[f"ratio_mean_{name}"], mean(np.exp(d)), rtol=1e-5)
        np.testing.assert_allclose(got[f"is_clipped_frac_{name}"], mean(d > np.log(1.5)))
        np.testing.assert_allclose(got[f"max_abs_logprob_diff_{name}"], (m * abs(d)).max())
    empty = staleness_stats(pi, mu, mask, np.zeros(shape, int), rho_max=1.5)
    assert empty["tokens_s3p"] == 0 and empty["approx_kl_s3p"] == 0
    assert empty["max_abs_logprob_diff_s3p"] == 0


def test_mismatch_buckets_count_learner_steps_since_the_behaviour_weights() -> None:
    """publish_every 2: version v is published after step 2v. The update after step 8
    (before version 4 is published) runs two steps after version 3's weights: its tokens
    are not the sampler-vs-learner bucket s0 although their version lag is 0. A version
    the learner has no publish step for goes to the oldest bucket."""
    published_at = {0: 0, 1: 2, 2: 4, 3: 6}
    ones = np.ones(6, np.int8)
    eps = [Episode(f"e{v}", ones, ones, np.zeros(6), policy_version=v) for v in (3, 2, 1, 9)]
    (batch,) = pack(eps, buckets=(8,), batch_rows=4).batches
    lag = updates_since(8, batch.policy_versions, published_at)
    by_version = dict(zip(batch.policy_versions.tolist(), lag.tolist(), strict=True))
    assert by_version == {3: 2, 2: 4, 1: 6, 9: UNKNOWN_LAG}
    assert updates_since(6, [3], published_at).tolist() == [0]
    m = staleness_stats(
        np.zeros(batch.shape),
        np.zeros(batch.shape),
        batch.loss_mask,
        batch.per_token(lag),
        rho_max=2.0,
    )
    assert m["tokens_s0"] == 0 and m["tokens_s1_2"] == 5  # version 3, 2 steps on
    assert m["tokens_s3p"] == 15  # versions 2, 1 and the unknown 9


def test_max_abs_logprob_diff_by_hand() -> None:
    """max |log pi - log mu| over a bucket's loss tokens: masked-off tokens and other
    buckets never count, whatever their values (here the largest gaps)."""
    mu = np.array([[-1.0, -2.0, -0.5, -3.0], [-1.0, -1.0, -1.0, -1.0]], np.float32)
    pi = np.array([[-1.25, -1.5, -9.0, -3.0], [-1.0, -0.875, -7.0, -1.0]], np.float32)
    mask = np.array([[1, 1, 0, 1], [1, 1, 1, 0]], np.float32)
    stale = np.array([[0, 0, 0, 0], [0, 0, 5, 0]])
    got = staleness_stats(pi, mu, mask, stale, rho_max=2.0)
    # s0 loss tokens: |d| = 0.25, 0.5, 0, 0, 0.125 (row 0 col 2 is masked off).
    assert float(got["max_abs_logprob_diff_s0"]) == 0.5
    assert float(got["max_abs_logprob_diff_s3p"]) == 6.0  # row 1 col 2 alone
    assert float(got["max_abs_logprob_diff_s1_2"]) == 0.0  # empty bucket


def _fresh_problem():
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(size=(2, 6, 11)), jnp.float32)
    targets = jnp.asarray(rng.integers(0, 11, size=(2, 6)))
    mask = jnp.asarray(rng.random((2, 6)) < 0.7, jnp.float32)
    adv = jnp.asarray(np.repeat(rng.normal(size=(2, 1)), 6, axis=1), jnp.float32)
    seg = jnp.array([[1, 1, 1, 2, 2, 0], [1, 1, 1, 1, 1, 1]])
    logp_b = jax.lax.stop_gradient(target_logprobs(logits, targets))  # behaviour == learner
    return logits, targets, mask, adv, seg, logp_b


def _reinforce(logits, targets, mask, adv):
    logp = target_logprobs(logits, targets)
    return -jnp.sum(mask * adv * logp) / jnp.sum(mask)


@pytest.mark.parametrize("correction", ["none", "token_tis", "sequence_tis"])
def test_staleness_zero_equals_on_policy_reinforce_exactly(correction: str) -> None:
    logits, targets, mask, adv, seg, logp_b = _fresh_problem()

    def loss(lg):
        logp = target_logprobs(lg, targets)
        return policy_loss(logp, logp_b, adv, mask, correction=correction, segment_ids=seg)

    (loss, m), grad = jax.value_and_grad(loss, has_aux=True)(logits)
    ref_loss, ref_grad = jax.value_and_grad(_reinforce)(logits, targets, mask, adv)
    assert m["is_weight_max"] == 1.0 and m["is_clipped_frac"] == 0.0  # exactly 1
    np.testing.assert_array_equal(loss, ref_loss)
    np.testing.assert_array_equal(grad, ref_grad)  # bit for bit
    assert np.abs(np.asarray(grad)).max() > 0


@pytest.mark.parametrize("correction", ["ppo", "decoupled_ppo"])
def test_staleness_zero_ppo_matches_reinforce_gradient(correction: str) -> None:
    logits, targets, mask, adv, _, logp_b = _fresh_problem()

    def ppo(lg):
        logp = target_logprobs(lg, targets)
        return policy_loss(logp, logp_b, adv, mask, correction=correction)[0]

    np.testing.assert_allclose(
        jax.grad(ppo)(logits),
        jax.grad(_reinforce)(logits, targets, mask, adv),
        rtol=1e-6,
        atol=1e-8,
    )


def test_policy_loss_jit_and_metrics() -> None:
    logits, targets, mask, adv, _, logp_b = _fresh_problem()
    logp = target_logprobs(logits, targets)
    fn = jax.jit(policy_loss, static_argnames=("correction", "params"))
    loss, m = fn(logp, logp_b, adv, mask)
    np.testing.assert_allclose(loss, _reinforce(logits, targets, mask, adv), rtol=1e-6)
    np.testing.assert_allclose([m["ratio_mean"], m["ratio_max"]], 1.0)
    np.testing.assert_allclose(m["approx_kl"], 0.0, atol=1e-7)
    assert m["num_loss_tokens"] == mask.sum()
    empty, _ = fn(logp, logp_b, adv, jnp.zeros_like(mask))
    assert empty == 0.0  # no loss tokens: 0, not NaN


@pytest.mark.parametrize(
    "correction", ["none", "token_tis", "sequence_tis", "gspo", "ppo", "decoupled_ppo"]
)
def test_out_of_top_k_logprobs_give_finite_loss_and_gradient(correction: str) -> None:
    """With top-k the learner's log-prob of a prompt / padding target is -inf (mask 0),
    and a sampled token may fall outside the learner's top k (mask 1): no NaN."""
    logp = jnp.array([[-jnp.inf, -1.0, -jnp.inf, -0.5]])
    logp_b = jnp.array([[0.0, -1.2, -2.0, -0.4]])
    adv = jnp.array([[1.0, 1.0, -1.0, -1.0]])
    mask = jnp.array([[0.0, 1.0, 1.0, 1.0]])

    def loss_fn(x):
        loss, m = policy_loss(x, logp_b, adv, mask, correction=correction)
        reg, _ = regularized_loss(loss, x, mask, logp_ref=logp_b, kl_coef=0.1)
        return reg, m

    (loss, m), grad = jax.value_and_grad(loss_fn, has_aux=True)(logp)
    assert np.isfinite(float(loss)) and np.isfinite(np.asarray(grad)).all()
    assert np.isfinite([float(v) for v in m.values()]).all()
    assert grad[0, 0] == 0.0 and grad[0, 2] == 0.0  # no gradient into -inf


def test_masked_mean() -> None:
    assert masked_mean(jnp.array([1.0, 3.0]), jnp.array([0, 0])) == 0.0
    np.testing.assert_allclose(masked_mean(jnp.array([1.0, 3.0, 5.0]), jnp.array([1, 0, 1])), 3.0)
