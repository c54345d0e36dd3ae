"""RL maths against hand-computed values, and the staleness-0 == on-policy property."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tunix_tasks.episode import Episode
from tunix_tasks.learner.packing import pack
from tunix_tasks.learner.rl_math import (
    batch_advantages,
    group_advantages,
    masked_mean,
    policy_loss,
    truncated_importance_weights,
)

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
    s1 = math.exp(0.2 - 0.1)  # masked diffs of segment 1; position 2 (mask 0) ignored
    # Segment 2: exp(1.0 + 0.5) = 4.48 -> truncated to 2.
    np.testing.assert_allclose(w, [[s1, s1, 0.0, 2.0, 2.0, 0.0]], rtol=1e-6)
    np.testing.assert_allclose(st["is_clipped_frac"], 0.5)
    np.testing.assert_allclose(st["is_weight_mean"], (2 * s1 + 4.0) / 4, rtol=1e-6)
    # Without segment ids each row is one sequence: exp(0.1 + 1.5) -> 2 everywhere.
    w_rows, _ = truncated_importance_weights(logp_new, logp_b, mask, rho_max=2.0, level="sequence")
    np.testing.assert_allclose(w_rows, [[2.0, 2.0, 0.0, 2.0, 2.0, 0.0]])


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
    np.testing.assert_allclose(w, [[math.exp(0.2), math.exp(0.2), math.exp(0.1)]], rtol=1e-6)
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
        np.testing.assert_allclose(np.asarray(w)[sel], math.exp(float(diff.sum())), rtol=1e-5)


# --------------------------------------------------------------------------- advantages


def test_group_advantages_hand_example() -> None:
    rewards = [1, 0, 1, 1, 0.5, 2, 2, 3, 1]
    groups = ["a", "a", "a", "a", "b", "c", "c", "d", "d"]
    adv = group_advantages(rewards, groups)
    std_a = math.sqrt(0.1875)  # mean 0.75, population std
    expected = [0.25 / std_a, -0.75 / std_a, 0.25 / std_a, 0.25 / std_a,
                0.0,  # group of one: no peers, no signal
                0.0, 0.0,  # zero variance: 0, not NaN
                1.0, -1.0]  # fmt: skip
    assert adv.dtype == np.float32 and np.isfinite(adv).all()
    np.testing.assert_allclose(adv, expected, rtol=1e-5)
    with_fallback = group_advantages(rewards, groups, fallback_baseline=0.2)
    np.testing.assert_allclose(with_fallback[4], 0.3, rtol=1e-6)
    np.testing.assert_allclose(with_fallback[[0, 5, 7]], adv[[0, 5, 7]])
    unscaled = group_advantages(rewards, groups, normalize_std=False)
    np.testing.assert_allclose(unscaled, [0.25, -0.75, 0.25, 0.25, 0, 0, 0, 1, -1], atol=1e-7)


def test_batch_advantages() -> None:
    np.testing.assert_allclose(
        batch_advantages([1, 2, 3, 4]),
        np.array([-1.5, -0.5, 0.5, 1.5]) / math.sqrt(1.25),
        rtol=1e-5,
    )
    np.testing.assert_array_equal(batch_advantages([2.0, 2.0]), [0.0, 0.0])


# --------------------------------------------------------------------------- loss


def test_tis_loss_value_and_gradient_hand() -> None:
    logp = jnp.array([[-1.0, -2.0, -0.5]])
    adv = jnp.array([[2.0, 2.0, -1.0]])
    mask = jnp.array([[1.0, 1.0, 0.0]])
    w = jnp.array([[1.0, 0.5, 0.0]])

    def loss_fn(x):
        return policy_loss(x, x, adv, mask, w)[0]

    # -(1*1*2*(-1) + 1*0.5*2*(-2)) / 2 = 2
    np.testing.assert_allclose(loss_fn(logp), 2.0)
    np.testing.assert_allclose(jax.grad(loss_fn)(logp), [[-1.0, -0.5, 0.0]])


def test_ppo_loss_hand() -> None:
    logp_new = jnp.array([[-1.0, -1.0]])
    logp_b = jnp.array([[-1.2, -0.5]])
    adv = jnp.array([[1.0, -1.0]])
    mask = jnp.ones((1, 2))

    def loss_fn(x):
        return policy_loss(x, logp_b, adv, mask, None, ppo_clip=0.2)

    loss, m = loss_fn(logp_new)
    # ratio e^0.2 = 1.22 -> clip 1.2 (A=+1); ratio e^-0.5 = 0.61 -> clip 0.8 (A=-1).
    np.testing.assert_allclose(loss, -(1.2 - 0.8) / 2, rtol=1e-6)
    np.testing.assert_allclose(m["ppo_clip_frac"], 1.0)
    np.testing.assert_array_equal(jax.grad(lambda x: loss_fn(x)[0])(logp_new), [[0.0, 0.0]])


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


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_staleness_zero_equals_on_policy_reinforce_exactly(level: str) -> None:
    logits, targets, mask, adv, seg, logp_b = _fresh_problem()

    def tis(lg):
        logp = target_logprobs(lg, targets)
        w, _ = truncated_importance_weights(
            logp, logp_b, mask, rho_max=2.0, level=level, segment_ids=seg
        )
        return policy_loss(logp, logp_b, adv, mask, w)[0], w

    (loss, w), grad = jax.value_and_grad(tis, has_aux=True)(logits)
    ref_loss, ref_grad = jax.value_and_grad(_reinforce)(logits, targets, mask, adv)
    np.testing.assert_array_equal(np.asarray(w)[np.asarray(mask) > 0], 1.0)  # exactly 1
    np.testing.assert_array_equal(loss, ref_loss)
    np.testing.assert_array_equal(grad, ref_grad)  # bit for bit
    assert np.abs(np.asarray(grad)).max() > 0


def test_staleness_zero_ppo_matches_reinforce_gradient() -> None:
    logits, targets, mask, adv, _, logp_b = _fresh_problem()

    def ppo(lg):
        logp = target_logprobs(lg, targets)
        return policy_loss(logp, logp_b, adv, mask, None, ppo_clip=0.2)[0]

    np.testing.assert_allclose(
        jax.grad(ppo)(logits),
        jax.grad(_reinforce)(logits, targets, mask, adv),
        rtol=1e-6,
        atol=1e-8,
    )


def test_policy_loss_jit_and_metrics() -> None:
    logits, targets, mask, adv, _, logp_b = _fresh_problem()
    logp = target_logprobs(logits, targets)
    fn = jax.jit(policy_loss, static_argnames="ppo_clip")
    loss, m = fn(logp, logp_b, adv, mask, jnp.ones_like(mask))
    np.testing.assert_allclose(loss, _reinforce(logits, targets, mask, adv), rtol=1e-6)
    np.testing.assert_allclose(m["ratio_mean"], 1.0)
    np.testing.assert_allclose(m["approx_kl"], 0.0, atol=1e-7)
    assert m["num_loss_tokens"] == mask.sum()
    empty, _ = fn(logp, logp_b, adv, jnp.zeros_like(mask), jnp.ones_like(mask))
    assert empty == 0.0  # no loss tokens: 0, not NaN


def test_masked_mean() -> None:
    assert masked_mean(jnp.array([1.0, 3.0]), jnp.array([0, 0])) == 0.0
    np.testing.assert_allclose(masked_mean(jnp.array([1.0, 3.0, 5.0]), jnp.array([1, 0, 1])), 3.0)
