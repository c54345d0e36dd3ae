"""Every validation failure, each with a crafted bad file; the error names file and reason."""

from __future__ import annotations

import contextlib
import dataclasses
import io

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tunix_tasks.storage import validation
from tunix_tasks.storage.shards import episodes_to_table, table_to_parquet_bytes
from tunix_tasks.storage.store import open_store
from tunix_tasks.storage.validation import (
    ShardValidationError,
    read_shard,
    read_shard_columns,
    read_shard_table,
    validate_table,
    validate_tables,
)
from tunix_tasks.testing.shard_factory import make_episode

VOCAB = 103


def _good_table(n=6):
    rng = np.random.default_rng(0)
    return episodes_to_table([make_episode(rng, length=int(rng.integers(5, 40))) for _ in range(n)])


def _raw_bytes(table: pa.Table) -> bytes:
    sink = io.BytesIO()
    pq.write_table(table, sink)
    return sink.getvalue()


def _set_column(table, name, array):
    return table.set_column(table.schema.get_field_index(name), name, array)


def _mutate_list(table, name, fn, value_type):
    rows = table.column(name).to_pylist()
    rows = [fn(i, list(r)) for i, r in enumerate(rows)]
    return _set_column(table, name, pa.array(rows, type=pa.list_(value_type)))


def _cases():
    t = _good_table()
    good = table_to_parquet_bytes(t)
    yield "corrupt", good[: len(good) // 2]  # truncated file
    yield "corrupt", b"PAR1" + b"\x00" * 100
    yield "missing_columns", _raw_bytes(t.drop_columns(["behavior_logprobs"]))
    yield "wrong_type", _raw_bytes(_set_column(t, "reward", t.column("reward").cast(pa.string())))
    yield (
        "length_mismatch",
        _raw_bytes(_mutate_list(t, "loss_mask", lambda i, r: r[:-1] if i == 2 else r, pa.int8())),
    )
    yield (
        "non_finite",
        _raw_bytes(_set_column(t, "reward", pa.array([0.0, np.nan, 0, 0, 0, 0], pa.float32()))),
    )
    yield (
        "non_finite",
        _raw_bytes(
            _mutate_list(
                t,
                "behavior_logprobs",
                lambda i, r: [float("inf"), *r[1:]] if i == 0 else r,
                pa.float32(),
            )
        ),
    )
    yield (
        "token_out_of_range",
        _raw_bytes(
            _mutate_list(t, "tokens", lambda i, r: [VOCAB, *r[1:]] if i == 1 else r, pa.int32())
        ),
    )
    yield (
        "token_out_of_range",
        _raw_bytes(
            _mutate_list(t, "tokens", lambda i, r: [-3, *r[1:]] if i == 1 else r, pa.int32())
        ),
    )
    yield (
        "bad_loss_mask",
        _raw_bytes(
            _mutate_list(t, "loss_mask", lambda i, r: [2, *r[1:]] if i == 0 else r, pa.int8())
        ),
    )
    for absurd in (3e38, -3e38, 1.5e6):  # finite float32, out of the documented range
        rewards = pa.array([0.0, 1.0, absurd, 0, 0, 0], pa.float32())
        yield "reward_out_of_range", _raw_bytes(_set_column(t, "reward", rewards))
    # Poison that crashed the checks themselves (and so stalled every round) before:
    yield (
        "null",  # a null inside a list, not the list
        _raw_bytes(
            _mutate_list(t, "tokens", lambda i, r: [None, *r[1:]] if i == 0 else r, pa.int32())
        ),
    )
    yield (
        "wrong_type",  # a scalar column stored as a large_list
        _raw_bytes(_set_column(t, "reward", pa.array([[0.5]] * 6, pa.large_list(pa.float32())))),
    )
    yield "bad_status", _raw_bytes(_set_column(t, "status", pa.array(["ok"] * 5 + ["weird"])))
    for reason, value in (("non_finite", float("nan")), ("bad_logprob", 0.5)):
        # In a later row: numpy's min and max propagate NaN, Python's `min` of floats not.
        yield (
            reason,
            _raw_bytes(
                _mutate_list(
                    t,
                    "behavior_logprobs",
                    lambda i, r, v=value: [*r[:-1], v] if i == 4 else r,
                    pa.float32(),
                )
            ),
        )
    ids = t.column("episode_id").to_pylist()
    yield (
        "duplicate_episode_id",
        _raw_bytes(_set_column(t, "episode_id", pa.array(ids[:5] + ids[:1]))),
    )
    yield "empty", _raw_bytes(t.slice(0, 0))
    meta = t.replace_schema_metadata({"tunix.schema_version": "7"})
    yield "schema_version", _raw_bytes(meta)


@pytest.mark.parametrize(
    "reason,data", list(_cases()), ids=lambda v: v if isinstance(v, str) else ""
)
def test_bad_shards_raise_typed_error(tmp_path, reason, data):
    store = open_store(str(tmp_path))
    store.write_bytes("shards/a/bad.parquet", data)
    with pytest.raises(ShardValidationError) as info:
        read_shard(store, "shards/a/bad.parquet", vocab_size=VOCAB)
    assert info.value.reason == reason
    assert "shards/a/bad.parquet" in str(info.value)


def _round(store, datas):
    """`read_shard_table` of each file, as a reader thread would: (keys, tables) of those
    it could decode, and the reason of each it refused."""
    keys, tables, refused = [], [], {}
    for i, data in enumerate(datas):
        key = f"shards/a/{i}.parquet"
        store.write_bytes(key, data)
        try:
            tables.append(read_shard_table(store, key))
            keys.append(key)
        except ShardValidationError as err:
            refused[key] = err.reason
    return keys, tables, refused


@pytest.mark.parametrize(
    "reason,data", list(_cases()), ids=lambda v: v if isinstance(v, str) else ""
)
def test_a_round_refuses_each_bad_shard_for_its_reason_and_keeps_the_rest(tmp_path, reason, data):
    """The learner's rounds check all their shards at once (`validate_tables`): one bad
    shard between good ones is refused for the reason `read_shard` gives, alone."""
    store = open_store(str(tmp_path))
    rng = np.random.default_rng(5)
    good = [
        table_to_parquet_bytes(episodes_to_table([make_episode(rng, length=9) for _ in range(4)]))
        for _ in range(2)
    ]
    keys, tables, refused = _round(store, [good[0], data, good[1]])
    valid = validate_tables(tables, keys, vocab_size=VOCAB)
    errors = {k: e.reason for k, e in zip(keys, valid.errors, strict=True) if e is not None}
    assert {**refused, **errors} == {"shards/a/1.parquet": reason}
    assert sum(len(c) for c in valid.columns if c is not None) == 8
    for key in ("shards/a/0.parquet", "shards/a/2.parquet"):
        part = valid.columns[keys.index(key)]
        alone = read_shard_columns(store, key, vocab_size=VOCAB)
        np.testing.assert_array_equal(part.episode_id, alone.episode_id)
        for j in range(len(alone)):
            for a, b in zip(part.arrays(j), alone.arrays(j), strict=True):
                np.testing.assert_array_equal(a, b)


def test_a_round_of_good_shards_is_checked_in_one_pass(tmp_path, monkeypatch):
    """The point of `validate_tables`: one vectorised pass, not one per shard (shards'
    metadata differ, by their length histograms, and must not force the slow path)."""
    store = open_store(str(tmp_path))
    rng = np.random.default_rng(6)
    datas = [
        table_to_parquet_bytes(
            episodes_to_table([make_episode(rng, length=n + 3) for _ in range(n)])
        )
        for n in (2, 5, 9)
    ]
    keys, tables, _ = _round(store, datas)
    calls, real = [], validation.check_table

    def counted(table, **kw):
        calls.append(table.num_rows)
        return real(table, **kw)

    monkeypatch.setattr(validation, "check_table", counted)
    valid = validate_tables(tables, keys, vocab_size=VOCAB)
    assert calls == [16] and [len(c) for c in valid.columns] == [2, 5, 9]


def test_a_round_with_a_replayed_shard_keeps_both_copies(tmp_path):
    """Episode ids must be unique within a shard, not across a round: a shard written
    twice (a replay) is valid twice, and the learner's dedup drops the copy."""
    store = open_store(str(tmp_path))
    data = table_to_parquet_bytes(_good_table())
    keys, tables, _ = _round(store, [data, data])
    valid = validate_tables(tables, keys, vocab_size=VOCAB)
    assert valid.errors == [None, None]
    assert [len(c) for c in valid.columns] == [6, 6]
    assert validate_tables([], [], vocab_size=VOCAB).columns == []


def test_good_shard_passes(tmp_path):
    store = open_store(str(tmp_path))
    store.write_bytes("shards/a/good.parquet", table_to_parquet_bytes(_good_table()))
    assert read_shard(store, "shards/a/good.parquet", vocab_size=VOCAB).num_rows == 6


def _versioned_table(versions, lengths):
    rng = np.random.default_rng(1)
    return episodes_to_table(
        [
            make_episode(rng, length=n, policy_version=v)
            for v, n in zip(versions, lengths, strict=True)
        ]
    )


def test_too_long_episode_rejected_with_the_limit_named(tmp_path):
    """Issue #11.6: an episode over the run's limit was accepted (and silently truncated)."""
    store = open_store(str(tmp_path))
    store.write_bytes(
        "shards/a/long.parquet", table_to_parquet_bytes(_versioned_table([0] * 3, [10, 300, 40]))
    )
    with pytest.raises(ShardValidationError) as info:
        read_shard(store, "shards/a/long.parquet", vocab_size=VOCAB, max_length=192)
    assert info.value.reason == "too_long"
    assert "row 2: 300 tokens" in info.value.detail  # shards store rows by length
    assert "max_length=192" in info.value.detail and "actor.max_episode_tokens" in info.value.detail
    assert (
        read_shard(store, "shards/a/long.parquet", vocab_size=VOCAB, max_length=300).num_rows == 3
    )
    assert read_shard(store, "shards/a/long.parquet", vocab_size=VOCAB).num_rows == 3  # no limit


def test_future_policy_version_rejected(tmp_path):
    """Issue #11.4: a policy_version newer than anything published was trained."""
    store = open_store(str(tmp_path))
    table = _versioned_table([3, 1_000_007, 2], [10, 10, 10])
    store.write_bytes("shards/a/future.parquet", table_to_parquet_bytes(table))
    with pytest.raises(ShardValidationError) as info:
        read_shard(store, "shards/a/future.parquet", vocab_size=VOCAB, max_version=7)
    assert info.value.reason == "future_version"
    assert "1000007" in info.value.detail and "(7)" in info.value.detail
    ok = _versioned_table([3, 7, 2], [10, 10, 10])
    store.write_bytes("shards/a/ok.parquet", table_to_parquet_bytes(ok))
    assert read_shard(store, "shards/a/ok.parquet", vocab_size=VOCAB, max_version=7).num_rows == 3


def _one_episode_shard(tokens: int) -> bytes:
    """A shard of one `tokens`-long episode of zeros: a few KB on disk, 9 bytes a token decoded."""
    ep = make_episode(np.random.default_rng(2), length=8)
    ep = dataclasses.replace(
        ep,
        tokens=np.zeros(tokens, np.int32),
        loss_mask=np.zeros(tokens, np.int8),
        behavior_logprobs=np.zeros(tokens, np.float32),
    )
    return table_to_parquet_bytes(episodes_to_table([ep]))


@contextlib.contextmanager
def _arrow_pool():
    """A fresh default Arrow memory pool: its `max_memory` is the peak Arrow allocated inside."""
    previous = pa.default_memory_pool()
    pool = pa.proxy_memory_pool(previous)
    pa.set_memory_pool(pool)
    try:
        yield pool
    finally:
        pa.set_memory_pool(previous)


def test_huge_episode_refused_from_the_metadata_before_decoding(tmp_path):
    """Issue #30.5: a small file declaring a 60 M-token episode was decoded (+331 MB)
    before being quarantined as too_long; here 1 M tokens (9 MB decoded) in a few KB."""
    store = open_store(str(tmp_path))
    data = _one_episode_shard(1_000_000)
    assert len(data) < 20_000
    store.write_bytes("shards/a/huge.parquet", data)
    with _arrow_pool() as pool, pytest.raises(ShardValidationError) as info:
        read_shard(store, "shards/a/huge.parquet", vocab_size=VOCAB, max_length=192)
    assert info.value.reason == "too_long"
    assert "row group 0 declares 1000000 tokens in 1 rows" in info.value.detail
    assert pool.max_memory() < 1 << 20  # nothing of the 9 MB was decoded
    # Without a length limit, the byte bound refuses it from the declared sizes too.
    with _arrow_pool() as pool, pytest.raises(ShardValidationError) as info:
        read_shard(store, "shards/a/huge.parquet", vocab_size=VOCAB, max_bytes=4 << 20)
    assert info.value.reason == "too_large" and "the file declares" in info.value.detail
    assert pool.max_memory() < 1 << 20
    assert read_shard(store, "shards/a/huge.parquet", vocab_size=VOCAB).num_rows == 1


def test_decoded_bytes_bounded_when_strings_expand(tmp_path):
    """A dictionary-encoded string stored once expands into every row when decoded: 2,000
    rows naming a 10 KB env declare ~30 KB and decode to 20 MB. Counted before expanding."""
    rng = np.random.default_rng(3)
    table = episodes_to_table([make_episode(rng, length=4) for _ in range(2_000)])
    table = table.set_column(
        table.schema.get_field_index("env"), "env", pa.array(["e" * 10_000] * 2_000)
    )
    store = open_store(str(tmp_path))
    store.write_bytes("shards/a/wide.parquet", table_to_parquet_bytes(table))
    with _arrow_pool() as pool, pytest.raises(ShardValidationError) as info:
        read_shard(store, "shards/a/wide.parquet", vocab_size=VOCAB, max_bytes=4 << 20)
    assert info.value.reason == "too_large" and "decode to" in info.value.detail
    assert pool.max_memory() < 4 << 20
    table = read_shard(store, "shards/a/wide.parquet", vocab_size=VOCAB)
    assert table.num_rows == 2_000 and table.schema.field("env").type == pa.string()


def test_reward_range_is_documented_and_inclusive(tmp_path):
    """Issue #30.6: finite but absurd rewards (±3e38) were trained on; the range is
    [-1e6, 1e6] (episode.MAX_ABS_REWARD), its ends included."""
    store = open_store(str(tmp_path))
    t = _good_table()
    edge = _set_column(t, "reward", pa.array([1e6, -1e6, 0, 0, 0, 0], pa.float32()))
    store.write_bytes("shards/a/edge.parquet", table_to_parquet_bytes(edge))
    assert read_shard(store, "shards/a/edge.parquet", vocab_size=VOCAB).num_rows == 6
    over = _set_column(t, "reward", pa.array([0, 0, 0, -3e38, 0, 0], pa.float32()))
    store.write_bytes("shards/a/over.parquet", table_to_parquet_bytes(over))
    with pytest.raises(ShardValidationError) as info:
        read_shard(store, "shards/a/over.parquet", vocab_size=VOCAB)
    assert info.value.reason == "reward_out_of_range"
    assert "row 3: reward -3e+38 is outside [-1e+06, 1e+06]" in info.value.detail


def test_honest_shard_over_the_strings_bound_is_counted_exactly_and_read(tmp_path):
    """The strings' cheap bound (rows x dictionary bytes) of 2,000 unique episode ids is
    ~130 MB, over a 4 MiB budget; the exact count (~70 KB) decides, so it is read."""
    rng = np.random.default_rng(4)
    table = episodes_to_table([make_episode(rng, length=4) for _ in range(2_000)])
    store = open_store(str(tmp_path))
    store.write_bytes("shards/a/many.parquet", table_to_parquet_bytes(table))
    assert read_shard(store, "shards/a/many.parquet", vocab_size=VOCAB, max_bytes=4 << 20)


def test_a_null_in_a_string_dictionary_is_a_null_row():
    """`read_shard_table` leaves strings dictionary-encoded; a null among a dictionary's
    values is a null row that the column's `null_count` does not count."""
    t = _good_table()
    status = pa.DictionaryArray.from_arrays(pa.array([0] * 5 + [1], pa.int32()), ["ok", None])
    with pytest.raises(ShardValidationError) as info:
        validate_table(_set_column(t, "status", status), where="x", vocab_size=VOCAB)
    assert info.value.reason == "null"


def test_a_round_s_columns_are_views_of_each_shard_s_own_buffers(tmp_path):
    """No copy between the decoded shard and the learner's block, and a block keeps its
    own shard's buffers alive, never its round's."""
    store = open_store(str(tmp_path))
    rng = np.random.default_rng(7)
    datas = [
        table_to_parquet_bytes(episodes_to_table([make_episode(rng, length=9) for _ in range(4)]))
        for _ in range(3)
    ]
    keys, tables, _ = _round(store, datas)
    valid = validate_tables(tables, keys, vocab_size=VOCAB)
    for i, columns in enumerate(valid.columns):
        for j, table in enumerate(tables):
            decoded = table.column("tokens").chunk(0).values.to_numpy()
            assert np.shares_memory(columns.tokens, decoded) == (i == j)
