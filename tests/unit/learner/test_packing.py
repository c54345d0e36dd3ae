"""Packing: exact layout on a hand example, invariants on random data, density, baselines."""

from __future__ import annotations

import numpy as np
import pytest

from tunix_tasks.episode import Episode
from tunix_tasks.learner.packing import (
    PackResult,
    bucket_no_pack,
    choose_bucket,
    pack,
    pad_to_max,
    plan,
)

BUCKETS = (256, 512, 1024, 2048)


def _seq(idx: int, length: int, rng: np.random.Generator | None = None, version: int = 0):
    """Episode whose tokens encode (episode, position), so any misplacement is visible."""
    rng = rng or np.random.default_rng(idx)
    mask = (rng.random(length) < 0.6).astype(np.int8)
    blp = np.where(mask == 1, -rng.random(length), 0.0).astype(np.float32)
    tokens = idx * 10_000 + np.arange(length) + 1  # never 0, so padding is distinguishable
    return Episode(f"ep{idx}", tokens, mask, blp, advantage=idx * 0.5, policy_version=version)


def _lognormal(n: int, seed: int = 0) -> list[Episode]:
    rng = np.random.default_rng(seed)
    lengths = np.clip(np.exp(rng.normal(np.log(300), 1.0, n)), 16, 2048).astype(int)
    return [_seq(i, int(n_), rng) for i, n_ in enumerate(lengths)]


def _check_layout(result: PackResult, given: list[Episode], batch_rows: int, buckets):
    """Every episode exactly once (batch or leftover), at the right place, target-aligned."""
    by_id = {s.episode_id: s for s in given}
    seen: list[str] = [s.episode_id for s in result.leftover]
    max_len = max(buckets)
    for b in result.batches:
        assert b.shape == (batch_rows, b.bucket_len) and b.bucket_len in buckets
        assert b.tokens.dtype == b.targets.dtype == b.positions.dtype == np.int32
        assert b.segment_ids.dtype == b.episode_index.dtype == np.int32
        assert b.loss_mask.dtype == b.behavior_logprobs.dtype == b.advantages.dtype == np.float32
        assert len(b.policy_versions) == len(b.episode_ids)
        pad = b.segment_ids == 0
        assert (b.tokens[pad] == 0).all() and (b.episode_index[pad] == -1).all()
        assert (b.loss_mask[pad] == 0).all() and (b.advantages[pad] == 0).all()
        for r in range(batch_rows):
            segs = b.segment_ids[r]
            used = int(np.count_nonzero(segs))
            assert (segs[used:] == 0).all()  # padding only at the end of a row
            if used:  # segments numbered 1..k, contiguous, in order
                assert segs[0] == 1 and set(np.diff(segs[:used])) <= {0, 1}
            for k in range(1, int(segs.max(initial=0)) + 1):
                pos = np.flatnonzero(segs == k)
                start, end = pos[0], pos[-1] + 1
                assert end - start == pos.size
                eps = set(b.episode_index[r, start:end].tolist())
                assert len(eps) == 1
                ei = eps.pop()
                s = by_id[b.episode_ids[ei]]
                n = min(s.length, max_len)
                assert end - start == n
                assert b.policy_versions[ei] == s.policy_version
                np.testing.assert_array_equal(b.tokens[r, start:end], s.tokens[:n])
                np.testing.assert_array_equal(b.positions[r, start:end], np.arange(n))
                # Target alignment: position p carries token p+1's target/mask/logprob.
                np.testing.assert_array_equal(b.targets[r, start : end - 1], s.tokens[1:n])
                np.testing.assert_array_equal(b.loss_mask[r, start : end - 1], s.loss_mask[1:n])
                np.testing.assert_array_equal(
                    b.behavior_logprobs[r, start : end - 1], s.behavior_logprobs[1:n]
                )
                # The last token never predicts the next segment's first token.
                assert b.targets[r, end - 1] == 0 and b.loss_mask[r, end - 1] == 0
                assert b.behavior_logprobs[r, end - 1] == 0
                np.testing.assert_array_equal(b.advantages[r, start:end], np.float32(s.advantage))
                seen.append(s.episode_id)
    assert sorted(seen) == sorted(by_id)  # exactly once, nothing lost or duplicated
    assert result.stats.num_packed + result.stats.num_leftover == len(given)


# --------------------------------------------------------------------------- buckets


def test_choose_bucket() -> None:
    assert choose_bucket(1, (512, 256)) == 256
    assert choose_bucket(256, (256, 512)) == 256
    assert choose_bucket(257, (256, 512)) == 512
    assert choose_bucket(5000, (256, 512)) == 512  # too long: largest, caller truncates
    with pytest.raises(ValueError):
        choose_bucket(1, ())


def test_sequence_example_validates() -> None:
    with pytest.raises(ValueError, match="lengths differ"):
        Episode("x", [1, 2, 3], [0, 1], [0, 0, 0])
    with pytest.raises(ValueError, match="no tokens"):
        Episode("x", [], [], [])


# --------------------------------------------------------------------------- exact layout


def test_hand_example_exact_arrays() -> None:
    a = Episode("A", [10, 11, 12, 13, 14, 15], [0, 0, 1, 1, 0, 1],
                        [0, 0, -0.1, -0.2, 0, -0.3], advantage=1.5, policy_version=3)  # fmt: skip
    b = Episode("B", [20, 21, 22, 23, 24], [0, 1, 1, 1, 1], [0, -1, -2, -3, -4], advantage=-1.0)
    c = Episode("C", [30, 31, 32], [0, 1, 1], [0, -0.5, -0.6], advantage=0.25)
    d = Episode("D", [40, 41], [0, 1], [0, -0.7], advantage=2.0)
    res = pack([c, a, d, b], buckets=(8, 16), batch_rows=2)
    # Candidates for the longest (6): bucket 8 fills both rows 100% ([6,2], [5,3]);
    # bucket 16 would fit all four in one row and leave row 2 empty.
    assert [x.bucket_len for x in res.batches] == [8] and res.leftover == []
    (x,) = res.batches
    assert x.episode_ids == ("A", "D", "B", "C")
    np.testing.assert_array_equal(x.policy_versions, [3, 0, 0, 0])
    np.testing.assert_array_equal(
        x.tokens, [[10, 11, 12, 13, 14, 15, 40, 41], [20, 21, 22, 23, 24, 30, 31, 32]]
    )
    np.testing.assert_array_equal(
        x.targets, [[11, 12, 13, 14, 15, 0, 41, 0], [21, 22, 23, 24, 0, 31, 32, 0]]
    )
    np.testing.assert_array_equal(x.positions, [[0, 1, 2, 3, 4, 5, 0, 1], [0, 1, 2, 3, 4, 0, 1, 2]])
    np.testing.assert_array_equal(
        x.segment_ids, [[1, 1, 1, 1, 1, 1, 2, 2], [1, 1, 1, 1, 1, 2, 2, 2]]
    )
    np.testing.assert_array_equal(
        x.episode_index, [[0, 0, 0, 0, 0, 0, 1, 1], [2, 2, 2, 2, 2, 3, 3, 3]]
    )
    np.testing.assert_array_equal(x.loss_mask, [[0, 1, 1, 0, 1, 0, 1, 0], [1, 1, 1, 1, 0, 1, 1, 0]])
    np.testing.assert_allclose(
        x.behavior_logprobs,
        [[0, -0.1, -0.2, 0, -0.3, 0, -0.7, 0], [-1, -2, -3, -4, 0, -0.5, -0.6, 0]],
        rtol=0,
        atol=1e-7,
    )
    np.testing.assert_array_equal(x.advantages, [[1.5] * 6 + [2.0] * 2, [-1.0] * 5 + [0.25] * 3])
    assert res.stats.density == 1.0 and res.stats.truncated == 0


# --------------------------------------------------------------------------- invariants


@pytest.mark.parametrize("flush", [False, True])
@pytest.mark.parametrize("strategy", [pack, bucket_no_pack, pad_to_max])
def test_every_token_once_at_its_place(strategy, flush: bool) -> None:
    rng = np.random.default_rng(7)
    lengths = [*rng.integers(1, 80, size=60).tolist(), 150, 200]  # 150/200: truncated to 128
    given = [_seq(i, n, rng, version=i % 3) for i, n in enumerate(lengths)]
    buckets = (32, 64, 128)
    res = strategy(given, buckets=buckets, batch_rows=4, flush=flush)
    _check_layout(res, given, 4, buckets)
    assert res.stats.truncated == 2
    assert len({b.shape for b in res.batches}) <= len(buckets)
    if flush:
        assert res.leftover == []


def test_leftover_roundtrip_and_flush() -> None:
    given = [_seq(i, 100) for i in range(3)]
    res = pack(given, buckets=BUCKETS, batch_rows=8)
    assert res.batches == [] and [s.episode_id for s in res.leftover] == ["ep0", "ep1", "ep2"]
    # The caller keeps leftovers and retries with more data.
    more = res.leftover + [_seq(i, 100) for i in range(3, 20)]
    res2 = pack(more, buckets=BUCKETS, batch_rows=8)
    assert [b.bucket_len for b in res2.batches] == [256]  # 8 rows x 2 episodes of 100
    assert res2.stats.num_packed == 16 and res2.stats.num_leftover == 4
    _check_layout(res2, more, 8, BUCKETS)
    flushed = pack(res2.leftover, buckets=BUCKETS, batch_rows=8, flush=True)
    assert flushed.leftover == [] and flushed.stats.num_packed == 4
    (b,) = flushed.batches
    assert b.shape == (8, 256) and (b.segment_ids[2:] == 0).all()  # empty rows pad it


def test_truncation_keeps_prefix_and_counts() -> None:
    long = _seq(1, 3000)
    res = pack([long], buckets=BUCKETS, batch_rows=1)
    assert res.stats.truncated == 1
    (b,) = res.batches
    np.testing.assert_array_equal(b.tokens[0], long.tokens[:2048])
    # A truncated leftover is not counted again when it comes back.
    again = pack([long, _seq(2, 3000)], buckets=BUCKETS, batch_rows=4)
    assert again.stats.truncated == 2 and again.leftover[0].length == 2048
    assert pack(again.leftover, buckets=BUCKETS, batch_rows=4).stats.truncated == 0


def test_deterministic() -> None:
    given = _lognormal(200, seed=3)
    r1 = pack(given, buckets=BUCKETS, batch_rows=8)
    r2 = pack(list(given), buckets=BUCKETS, batch_rows=8)
    assert [b.episode_ids for b in r1.batches] == [b.episode_ids for b in r2.batches]
    for b1, b2 in zip(r1.batches, r2.batches, strict=True):
        np.testing.assert_array_equal(b1.tokens, b2.tokens)
        np.testing.assert_array_equal(b1.segment_ids, b2.segment_ids)
    assert [s.episode_id for s in r1.leftover] == [s.episode_id for s in r2.leftover]


# --------------------------------------------------------------------------- density


def test_density_lognormal() -> None:
    given = _lognormal(1024)
    packed = pack(given, buckets=BUCKETS, batch_rows=8)
    _check_layout(packed, given, 8, BUCKETS)
    by_bucket = bucket_no_pack(given, buckets=BUCKETS, batch_rows=8)
    padded = pad_to_max(given, buckets=BUCKETS, batch_rows=8)
    assert packed.stats.density >= 0.95
    assert packed.stats.num_leftover < 0.05 * len(given)
    assert packed.stats.density > by_bucket.stats.density > padded.stats.density
    # Flushing the tail costs little density when there is enough data.
    assert pack(given, buckets=BUCKETS, batch_rows=8, flush=True).stats.density >= 0.95


def test_stats_consistent() -> None:
    given = _lognormal(64, seed=1)
    res = pack(given, buckets=BUCKETS, batch_rows=4, flush=True)
    s = res.stats
    assert s.real_tokens == sum(x.length for x in given)  # no truncation: max is 2048
    assert s.total_slots == sum(b.tokens.size for b in res.batches)
    assert s.num_batches == len(res.batches) == sum(s.batches_per_bucket.values())
    assert 0 < s.density <= 1


def test_plan_places_the_first_tier_before_any_other() -> None:
    """`first` sequences go into the first rows, largest first, and the rest fills the room
    they leave; without `first` the longest win the first batch."""
    lengths = [72, 72, 78, 78, 78, 78, 30, 20]
    first = [True, True] + [False] * 6
    planned, left = plan(lengths, buckets=(128,), batch_rows=2, first=first)
    (bucket, rows), *_ = planned
    assert bucket == 128 and rows == [[0, 6, 7], [1]]  # 72 + 30 + 20, then 72 (no 78 fits)
    by_length, _ = plan(lengths, buckets=(128,), batch_rows=2)
    assert by_length[0][1] == [[2, 6, 7], [3]]  # 78 + 30 + 20, 78: the short ones wait
    placed = [i for _, rows in planned for row in rows for i in row]
    assert sorted(placed + left) == list(range(8))  # every sequence once
