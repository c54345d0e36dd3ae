"""Stale-drop bias: the pure statistics (`learner/drop_bias.py`) and what the learner's
accounting keeps of real stale drops (shards in a real store, the batcher's flow)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tunix_tasks.config import load_config
from tunix_tasks.learner import drop_bias
from tunix_tasks.learner.accounting import Accounting
from tunix_tasks.learner.batcher import Batcher
from tunix_tasks.learner.flow import AsyncFlow
from tunix_tasks.learner.source import EpisodeSource, PrefetchingSource
from tunix_tasks.storage.shards import ShardWriter
from tunix_tasks.storage.store import open_store
from tunix_tasks.testing.shard_factory import make_episode


def _dist(lengths, turns, rewards):
    return drop_bias.add(drop_bias.empty(), lengths, turns, rewards)


def test_add_is_cumulative_exact_in_means_and_leaves_its_input():
    first = _dist([20, 40], [1, 3], [0.0, 1.0])
    both = drop_bias.add(first, [100], [5], [0.5])
    assert first["n"] == 2 and both["n"] == 3  # the input is unchanged
    d = drop_bias.describe(both)
    assert d["episodes"] == 3
    assert d["length_mean"] == pytest.approx(160 / 3)
    assert d["turns_mean"] == pytest.approx(3.0)
    assert d["reward_mean"] == pytest.approx(0.5)
    assert d["reward_sd"] == pytest.approx(np.std([0.0, 1.0, 0.5]))
    assert d["length_sd"] == pytest.approx(np.std([20, 40, 100]))
    assert (both["min"]["length"], both["max"]["length"]) == (20, 100)
    assert drop_bias.add(both, [], [], [])["max"] == both["max"]
    # Fixed bins: 20 in [19, 23), 40 in [38, 45), 100 in [91, 108); reward 1.0 in [1, 2).
    length = drop_bias.EDGES["length"]
    held = [i for i, c in enumerate(both["bins"]["length"]) for _ in range(c)]
    assert [(length[i], length[i + 1]) for i in held] == [(19, 23), (38, 45), (91, 108)]
    edges = drop_bias.EDGES["reward"]
    assert both["bins"]["reward"][edges.index(1.0)] == 1
    json.dumps(both)  # a checkpoint's counters and a metrics record hold it


def test_size_is_bounded_whatever_the_count():
    rng = np.random.default_rng(0)
    small = json.dumps(_dist([10], [1], [0.0]))
    n = 100_000
    big = _dist(rng.integers(1, 10**6, n), rng.integers(0, 1000, n), rng.normal(0, 1e3, n))
    assert big["n"] == n and sum(big["bins"]["turns"]) == n
    assert len(json.dumps(big)) < 2 * len(small) + 400


def test_quantiles_interpolate_within_the_bins():
    # 100 lengths spread evenly over [64, 128): the median bin-estimate is ~96.
    d = drop_bias.describe(_dist(np.arange(64, 128, 0.64), np.full(100, 2), np.zeros(100)))
    assert d["length_p50"] == pytest.approx(96, abs=1)
    assert d["length_p90"] == pytest.approx(121.6, abs=1)
    # Narrowed to the values seen: a repeated value is exact, also in an open-ended bin.
    one = drop_bias.describe(_dist([10**6] * 3, [2] * 3, [5.0] * 3))
    assert (one["length_p50"], one["turns_p90"], one["reward_p50"]) == (10**6, 2, 5.0)
    mixed = drop_bias.describe(_dist([100] * 4, [1, 2, 2, 3], [0.0, 1.0] * 2))
    assert mixed["reward_p90"] == 1.0  # not past the largest reward
    assert mixed["turns_p50"] == 2  # whole turns: the bin [2, 3) holds 2 alone
    empty = drop_bias.describe(drop_bias.empty())
    assert empty["episodes"] == 0 and empty["length_mean"] is None and empty["turns_p90"] is None


def test_add_refuses_arrays_of_different_sizes():
    with pytest.raises(ValueError, match="differ in size"):
        _dist([1, 2], [1], [0.0, 1.0])


def test_hint_names_the_bias_only_when_drops_are_significant():
    n = 200
    trained = _dist(np.full(n, 100), np.full(n, 2), np.tile([0.0, 1.0], n // 2))
    long_hard = _dist(np.full(40, 180), np.full(40, 4), np.zeros(40))
    assert drop_bias.hint(trained, long_hard) == (
        "stale drops vs trained: 1.8x longer, 2.0x more turns, reward 0.00 vs 0.50"
    )
    c = drop_bias.compare(trained, long_hard)
    assert c["stale_share"] == pytest.approx(40 / 240) and c["length_ratio"] == pytest.approx(1.8)
    short = _dist(np.full(40, 50), np.full(40, 2), np.tile([0.0, 1.0], 20))
    assert drop_bias.hint(trained, short) == "stale drops vs trained: 2.0x shorter"
    alike = _dist(np.full(40, 110), np.full(40, 2), np.tile([0.0, 1.0], 20))
    assert drop_bias.hint(trained, alike) == ""  # 1.1x: no bias worth a word
    few = _dist(np.full(10, 180), np.full(10, 4), np.zeros(10))
    assert drop_bias.hint(trained, few) == ""  # too few drops (under SIGNIFICANT_COUNT)
    many_trained = _dist(np.full(10_000, 100), np.full(10_000, 2), np.zeros(10_000))
    assert drop_bias.hint(many_trained, long_hard) == ""  # 0.4% of the episodes
    assert drop_bias.hint(drop_bias.empty(), drop_bias.empty()) == ""
    no_turns = _dist(np.full(40, 100), np.zeros(40), np.tile([0.0, 1.0], 20))
    assert drop_bias.hint(trained, no_turns) == ""  # a ratio of 0 is no "infx fewer"


def test_accounting_keeps_the_lengths_of_stale_drops_apart(tmp_path):
    """Shards of short fresh episodes and long stale ones through the learner's source,
    batcher and flow: the stale drops' distribution is the long episodes', the trained
    one the short; both survive a checkpoint (the counters) and an old checkpoint's
    counters, without them, start empty."""
    store = open_store(str(tmp_path))
    rng = np.random.default_rng(2)
    fresh = [
        make_episode(rng, length=16, policy_version=3, group_id=f"f{i // 4}") for i in range(8)
    ]
    stale = [
        make_episode(rng, length=96, policy_version=0, group_id=f"s{i // 4}") for i in range(8)
    ]
    writer = ShardWriter(store, actor_id="actor-0", max_episodes=100)
    for i in range(0, 8, 4):
        writer.add_group(fresh[i : i + 4])
        writer.add_group(stale[i : i + 4])
    writer.close()
    source = PrefetchingSource(EpisodeSource(store, vocab_size=103, advantage="group"))
    source.poll_once()
    cfg = load_config(None, ["learner.min_episodes_per_step=100"])
    acct = Accounting(source)
    flow = AsyncFlow(min_episodes=100, max_staleness=1, publish_every=1)
    batcher = Batcher(source, flow, acct, cfg.learner)
    assert batcher.next_batch(3) is None  # drains, drops the stale ones, waits for more
    acct.trained(
        batcher.buffered_episodes(), real_tokens=0, longest_bucket=max(cfg.learner.buckets)
    )
    source.stop()
    bias = json.loads(json.dumps(acct.counters))["drop_bias"]  # as checkpointed
    t, s = (drop_bias.describe(bias[side]) for side in ("trained", "stale"))
    assert acct.counters["dropped"] == {"stale": 8} and s["episodes"] == t["episodes"] == 8
    assert s["length_mean"] == 96 and t["length_mean"] == 16
    assert s["turns_mean"] == pytest.approx(np.mean([e.num_turns for e in stale]))
    assert s["reward_mean"] == pytest.approx(np.mean([e.reward for e in stale]), rel=1e-6)
    assert (
        Accounting(source, counters=json.loads(json.dumps(acct.counters))).counters == acct.counters
    )
    old = Accounting(source, counters={"trained_episodes": 8, "dropped": {}, "trained_tokens": 0})
    assert old.counters["drop_bias"]["stale"] == drop_bias.empty()


@pytest.mark.parametrize("due_first", [True, False])
def test_packing_does_not_starve_shorter_episodes_into_staleness(tmp_path, due_first):
    """More data than the learner trains, the shorter episodes oldest: each step brings
    a batch's worth of longer ones. Packing by density alone keeps choosing the longer ones
    until the short ones go stale (the stale-drop bias benchmarks/autopilot.py showed);
    episodes the next publish would drop are packed first, so they are trained."""
    store = open_store(str(tmp_path))
    rng = np.random.default_rng(3)
    writer = ShardWriter(store, actor_id="actor-0", max_episodes=1000)

    def arrive(length: int, version: int, n: int, tag: str) -> list:
        eps = [
            make_episode(rng, length=length, policy_version=version, group_id=f"{tag}{i // 4}")
            for i in range(n)
        ]
        for i in range(0, n, 4):
            writer.add_group(eps[i : i + 4])
        writer.flush()
        return eps

    short = arrive(72, 0, 8, "s")
    arrive(78, 0, 16, "l0-")
    source = PrefetchingSource(EpisodeSource(store, vocab_size=103, advantage="group"))
    cfg = load_config(None, ["learner.batch_rows=8", "learner.buckets=[128]"])
    acct = Accounting(source)
    flow = AsyncFlow(min_episodes=8, max_staleness=2, publish_every=1)
    if not due_first:  # what packing did before: density alone
        flow.due = lambda versions, version: np.zeros(np.shape(versions), bool)
    batcher = Batcher(source, flow, acct, cfg.learner)
    trained: list[str] = []
    try:
        for version in range(6):
            source.poll_once()
            got = batcher.next_batch(version)
            assert got is not None
            _, episodes = got
            acct.trained(episodes, real_tokens=0, longest_bucket=128)
            trained += [ep.episode_id for ep in episodes]
            arrive(78, version + 1, 8, f"l{version + 1}-")  # the actors keep up
    finally:
        source.stop()
    short_trained = {ep.episode_id for ep in short} & set(trained)
    if due_first:
        assert len(short_trained) == 8, "every short episode trained before going stale"
    else:
        assert not short_trained and acct.counters["dropped"]["stale"] >= 8
