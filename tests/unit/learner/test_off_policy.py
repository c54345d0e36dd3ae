"""What the learner trains on: dropped statuses out of group statistics, zero-variance
groups filtered (and ledgered), the entropy of the sampling distribution chunk-wise."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tunix_tasks.config import load_config
from tunix_tasks.learner.accounting import Accounting
from tunix_tasks.learner.batcher import Batcher
from tunix_tasks.learner.flow import AsyncFlow
from tunix_tasks.learner.source import EpisodeSource, PrefetchingSource
from tunix_tasks.policy.distribution import chunked_target_logprobs, sampling_log_probs
from tunix_tasks.storage.shards import ShardWriter
from tunix_tasks.storage.store import open_store
from tunix_tasks.testing.shard_factory import block_episodes, make_episode

# group -> (reward, status) of its episodes
GROUPS = {
    "mixed": [(1.0, "ok"), (0.0, "ok"), (0.0, "env_timeout"), (-3.0, "env_error")],
    "flat": [(1.0, "ok"), (1.0, "truncated")],
    "signal": [(0.0, "ok"), (1.0, "ok")],
}


def _write_groups(tmp_path):
    store = open_store(str(tmp_path))
    rng = np.random.default_rng(0)
    writer = ShardWriter(store, actor_id="actor-0", max_episodes=100)
    for group, members in GROUPS.items():
        writer.add_group(
            [
                dataclasses.replace(
                    make_episode(rng, length=12, reward=r, group_id=group), status=status
                )
                for r, status in members
            ]
        )
    writer.close()
    return store


def _source(tmp_path, *, filter_zero_variance: bool):
    source = EpisodeSource(
        _write_groups(tmp_path),
        vocab_size=103,
        advantage="group",
        filter_zero_variance=filter_zero_variance,
    )
    return PrefetchingSource(source)


@pytest.mark.parametrize(("normalize", "magnitude"), [("true", 1.0), ("false", 0.5)])
def test_normalize_advantage_std_reaches_the_advantages(tmp_path, normalize, magnitude):
    """`learner.normalize_advantage_std: false` (Dr. GRPO) reaches the source the learner
    builds: the kept rewards 1 and 0 of a group get +-0.5 (centred), not +-1 (over the
    std 0.5)."""
    cfg = load_config(None, [f"learner.normalize_advantage_std={normalize}"])
    source = EpisodeSource.from_config(_write_groups(tmp_path), cfg.learner, vocab_size=103)
    got = {(e.group_id, e.status, e.reward): e.advantage for e in block_episodes(source.poll())}
    source.close()
    for group in ("mixed", "signal"):
        assert got[(group, "ok", 1.0)] == pytest.approx(magnitude, abs=1e-4)
        assert got[(group, "ok", 0.0)] == pytest.approx(-magnitude, abs=1e-4)


@pytest.mark.parametrize("filter_zero_variance", [False, True])
def test_dropped_statuses_and_zero_variance_groups(tmp_path, filter_zero_variance):
    source = _source(tmp_path, filter_zero_variance=filter_zero_variance)
    source.poll_once()
    cfg = load_config(None, ["learner.min_episodes_per_step=100"])
    acct = Accounting(source)
    flow = AsyncFlow(min_episodes=100, max_staleness=4, publish_every=1)
    batcher = Batcher(source, flow, acct, cfg.learner)
    assert batcher.next_batch(0) is None  # drains, drops, waits for more
    got = {(e.group_id, e.status, e.reward): e.advantage for e in batcher.buffered_episodes()}
    # The two kept episodes of "mixed" are normalised between themselves: the timeout
    # and the error (reward -3) move neither their mean nor their std.
    assert got[("mixed", "ok", 1.0)] == pytest.approx(1.0, abs=1e-4)
    assert got[("mixed", "ok", 0.0)] == pytest.approx(-1.0, abs=1e-4)
    assert got[("signal", "ok", 1.0)] == pytest.approx(1.0, abs=1e-4)
    ledger = acct.take_ledger()
    dropped = {reason: len(ids) for reason, ids in ledger["dropped"].items()}
    expected = {"env_timeout": 1, "env_error": 1}
    if filter_zero_variance:
        expected["zero_variance"] = 2  # "flat": both rewards 1, no signal
    assert dropped == expected and acct.counters["dropped"] == expected
    assert batcher.buffered == 4 + (0 if filter_zero_variance else 2)
    source.stop()


def test_filter_needs_group_advantages():
    from tunix_tasks.config import ConfigError

    with pytest.raises(ConfigError, match="filter_zero_variance_groups needs"):
        load_config(None, ["learner.filter_zero_variance_groups=true", "learner.advantage=batch"])


@pytest.mark.parametrize("top_k", [0, 3])
def test_chunked_entropy_against_numpy(top_k):
    rng = np.random.default_rng(0)
    hidden = jnp.asarray(rng.normal(size=(2, 11, 8)), jnp.float32)
    w_out = jnp.asarray(rng.normal(size=(8, 13)), jnp.float32)
    targets = jnp.asarray(rng.integers(0, 13, (2, 11)))

    def run(h):
        return chunked_target_logprobs(h, w_out, targets, 0.7, top_k, chunk=4, with_entropy=True)

    logp, entropy = run(hidden)
    full = np.asarray(sampling_log_probs(hidden @ w_out, 0.7, top_k), np.float64)
    p = np.exp(full)
    expected = -np.sum(np.where(p > 0, p * np.where(p > 0, full, 0.0), 0.0), axis=-1)
    np.testing.assert_allclose(entropy, expected, rtol=1e-5)
    np.testing.assert_allclose(logp, chunked_target_logprobs(hidden, w_out, targets, 0.7, top_k))
    grad = jax.grad(lambda h: run(h)[1].sum())(hidden)  # top-k's -inf must not leak NaN
    assert np.isfinite(np.asarray(grad)).all() and np.abs(np.asarray(grad)).max() > 0


def test_advantages_are_recentred_over_what_survives_a_stale_drop(tmp_path):
    """A group of 8, rewards (1, 1, 0, 0) at version 3 and (0, 0, 0, 0) at version 0: at
    learner version 3 with max_staleness 1 the version-0 half is dropped as stale. Its
    zeros were in the source's baseline (advantages of the survivors summed to +2.31);
    recentred over the survivors they are +-1 and sum to 0."""
    store = open_store(str(tmp_path))
    rng = np.random.default_rng(1)
    rewards_versions = [(1.0, 3), (1.0, 3), (0.0, 3), (0.0, 3)] + [(0.0, 0)] * 4
    writer = ShardWriter(store, actor_id="actor-0", max_episodes=100)
    writer.add_group(
        [
            make_episode(rng, length=12, reward=r, group_id="g", policy_version=v)
            for r, v in rewards_versions
        ]
    )
    writer.close()
    source = PrefetchingSource(EpisodeSource(store, vocab_size=103, advantage="group"))
    source.poll_once()
    cfg = load_config(None, ["learner.min_episodes_per_step=100"])
    acct = Accounting(source)
    flow = AsyncFlow(min_episodes=100, max_staleness=1, publish_every=1)
    batcher = Batcher(source, flow, acct, cfg.learner)
    assert batcher.next_batch(3) is None  # drains, drops the stale half, waits for more
    assert acct.counters["dropped"] == {"stale": 4}
    got = sorted((e.reward, e.advantage) for e in batcher.buffered_episodes())
    assert [r for r, _ in got] == [0.0, 0.0, 1.0, 1.0]
    np.testing.assert_allclose([a for _, a in got], [-1.0, -1.0, 1.0, 1.0], atol=1e-4)
    source.stop()
