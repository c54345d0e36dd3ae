"""Every validation failure, each with a crafted bad file; the error names file and reason."""

from __future__ import annotations

import io

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tunix_tasks.storage.shards import episodes_to_table, table_to_parquet_bytes
from tunix_tasks.storage.store import open_store
from tunix_tasks.storage.validation import ShardValidationError, read_shard
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
    yield "bad_status", _raw_bytes(_set_column(t, "status", pa.array(["ok"] * 5 + ["weird"])))
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
