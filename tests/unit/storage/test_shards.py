"""Shard format v1: writer, stream position, crash safety, metadata."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pyarrow.parquet as pq
import pytest

from tunix_tasks.learner.source import EpisodeSource
from tunix_tasks.storage.shards import SHARD_SCHEMA, ShardWriter
from tunix_tasks.storage.store import open_store
from tunix_tasks.testing.shard_factory import make_episode


def _write(store, n, *, per_shard=8, actor="actor-0", seed=0):
    rng = np.random.default_rng(seed)
    writer = ShardWriter(store, actor_id=actor, max_episodes=per_shard)
    eps = [make_episode(rng, length=int(rng.integers(4, 200)), actor_id=actor) for _ in range(n)]
    for e in eps:
        writer.add(e)
    writer.close()
    return eps, writer.shards_written


def test_shard_is_plain_parquet_sorted_with_metadata(store_uri):
    store = open_store(store_uri)
    _eps, keys = _write(store, 20, per_shard=8)
    assert len(keys) == 3  # 8 + 8 + 4
    fs, base = store.arrow_filesystem()
    table = pq.read_table(f"{base}/{keys[0]}", filesystem=fs)
    assert table.schema.remove_metadata().equals(SHARD_SCHEMA)
    lengths = table.column("length").to_pylist()
    assert lengths == sorted(lengths) and table.num_rows == 8
    meta = table.schema.metadata
    assert meta[b"tunix.schema_version"] == b"1"
    hist = json.loads(meta[b"tunix.length_histogram"])
    assert sum(hist["counts"]) == 8
    assert pq.ParquetFile(store.open_input(keys[0])).metadata.num_row_groups >= 1


def test_time_based_flush(tmp_path):
    store = open_store(str(tmp_path))
    writer = ShardWriter(store, actor_id="a", max_episodes=100, max_interval_s=0.0)
    writer.add(make_episode(np.random.default_rng(0), length=10))
    assert writer.maybe_flush() is not None
    assert writer.maybe_flush() is None and writer.pending == 0


def test_writer_killed_mid_shard_leaves_no_partial_shard(tmp_path):
    """SIGKILL an actor-like writer repeatedly; every visible shard is complete and valid."""
    uri = f"file://{tmp_path}/run"
    script = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, {os.getcwd()!r})
        import numpy as np
        from tunix_tasks.testing.shard_factory import make_episode
        from tunix_tasks.storage.shards import ShardWriter
        from tunix_tasks.storage.store import open_store
        store = open_store({uri!r})
        rng = np.random.default_rng()
        w = ShardWriter(store, actor_id="a", max_episodes=64)
        print("ready", flush=True)
        while True:
            w.add(make_episode(rng, length=int(rng.integers(100, 2000))))
        """
    )
    for delay in (0.5, 1.1, 1.7):
        proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE)
        assert proc.stdout.readline().strip() == b"ready"
        try:
            proc.wait(timeout=delay)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
    store = open_store(uri)
    keys = [i.key for i in store.list("shards/")]
    assert keys, "the writer should have committed some shards before being killed"
    source = EpisodeSource(store, vocab_size=103)
    blocks = source.poll(max_shards=10_000)  # validates every shard
    assert sum(len(b) for b in blocks) == 64 * len(keys)
    assert not source.quarantined
    leftovers = [
        p for p in (tmp_path / "run").rglob("*") if p.is_file() and p.name.startswith(".tmp")
    ]
    # Temp files of killed writers may remain, but they are invisible to list().
    assert all(".tmp" not in k for k in keys) and len(leftovers) <= 3


def test_episodes_read_back_equal_those_written_field_by_field(tmp_path):
    """`table_episodes` builds episodes without `Episode.__post_init__` (the shard's
    validation checked the columns): every field must still come back as the constructor
    would have normalised it, type included."""
    import dataclasses

    from tunix_tasks.episode import Episode, EpisodeStatus
    from tunix_tasks.storage.shards import table_episodes
    from tunix_tasks.storage.validation import read_shard

    store = open_store(str(tmp_path))
    rng = np.random.default_rng(5)
    written = [make_episode(rng, length=int(rng.integers(4, 200))) for _ in range(12)]
    written[3] = dataclasses.replace(written[3], status=EpisodeStatus.TRUNCATED)
    writer = ShardWriter(store, actor_id="actor-0", max_episodes=100)
    writer.add_group(written)
    key = writer.close()
    read = list(table_episodes(read_shard(store, key, vocab_size=103), shard=key))
    by_id = {ep.episode_id: ep for ep in written}
    for row, got in enumerate(read):
        want = by_id[got.episode_id]
        rebuilt = Episode(**{f.name: getattr(got, f.name) for f in dataclasses.fields(Episode)})
        for f in dataclasses.fields(Episode):
            value, normalised = getattr(got, f.name), getattr(rebuilt, f.name)
            assert type(value) is type(normalised), f.name
            if isinstance(value, np.ndarray):
                assert value.dtype == normalised.dtype and value.ndim == 1
                np.testing.assert_array_equal(value, getattr(want, f.name))
            elif f.name == "source":
                assert value == (key, row)
            elif f.name in ("reward", "created_at"):
                assert value == pytest.approx(getattr(want, f.name), rel=1e-6, abs=1e-3)
            else:
                assert value == getattr(want, f.name), f.name
    assert {ep.status for ep in read} == {EpisodeStatus.OK, EpisodeStatus.TRUNCATED}
