"""Issue #16: the buffer at fleet scale. Polls cost what is new, not the run's history; a
backlog is read without listing again; shards are cut by bytes too; a writer facing a
store that is down keeps its episodes and blocks its callers instead of losing them."""

from __future__ import annotations

import json
import os
import threading
import time

import numpy as np
import pyarrow.parquet as pq
import pytest

from tunix_tasks.learner.position import ShardPosition
from tunix_tasks.learner.source import EpisodeSource
from tunix_tasks.storage.backends import local_listing
from tunix_tasks.storage.layout import RunLayout
from tunix_tasks.storage.outage import StoreOutage
from tunix_tasks.storage.shards import ShardWriter, episodes_to_table, table_to_parquet_bytes
from tunix_tasks.storage.store import RETRY_DEADLINE_ENV, StoreError, open_store
from tunix_tasks.testing.shard_factory import block_episodes, make_episode

T0 = 1_700_000_000.0  # simulated creation times: one shard per actor every 10 s


class _Counting:
    """Forwards to a store; counts its listing calls and the entries they return."""

    def __init__(self, store) -> None:
        self._store = store
        self.lists = self.entries = 0

    def list(self, prefix: str = "", **kw):
        out = self._store.list(prefix, **kw)
        self.lists += 1
        self.entries += len(out)
        return out

    def __getattr__(self, name):
        return getattr(self._store, name)


def _poll(source, max_shards=16):
    return block_episodes(source.poll(max_shards))


def test_poll_after_10000_shards_reads_only_the_new_ones(tmp_path, monkeypatch):
    """10 actors x 1,000 consumed shards, then 3 new ones: a poll returns the new shards
    and each actor's 10 s grace window, and reads the names of the recent time folders
    only, not the 10,000 shards (a local folder cannot be listed from a name on)."""
    inner = open_store(str(tmp_path))
    store = _Counting(inner)
    rng = np.random.default_rng(0)
    first = RunLayout.shard_key("actor-00", T0)
    inner.write_bytes(
        first, table_to_parquet_bytes(episodes_to_table([make_episode(rng, length=8)]))
    )
    keys = [first]
    for i in range(1000):  # the history: hard links of one real shard (writing is not tested)
        for a in range(10):
            if i == a == 0:
                continue
            key = RunLayout.shard_key(f"actor-{a:02d}", T0 + 10 * i + a / 100)
            (tmp_path / key).parent.mkdir(parents=True, exist_ok=True)
            os.link(tmp_path / first, tmp_path / key)
            keys.append(key)
    assert len(keys) == 10_000 and len({RunLayout.shard_actor(k) for k in keys}) == 10
    # The position a learner that consumed them all checkpoints: watermarks, a few done keys.
    pos = ShardPosition()
    for key in keys:
        pos.opened(key, 1)
        pos.ack(key, [0])
    pos.compact(keys)
    state = json.loads(json.dumps({**pos.get_state(), "seen": {}}))
    assert len(json.dumps(state)) < 4_000 and len(state["done"]) <= 20

    source = EpisodeSource(store, vocab_size=103)
    source.set_state(state)
    for a in range(3):
        writer = ShardWriter(inner, actor_id=f"actor-{a:02d}", clock=lambda: T0 + 10_005)
        writer.add(make_episode(rng, length=8))
        writer.close()
    inner.list("control/")  # the store's first listing also collects stale temp files
    names = []
    real_scandir = os.scandir
    monkeypatch.setattr(
        local_listing.os, "scandir", lambda p: names.extend(real_scandir(p)) or real_scandir(p)
    )
    t = time.perf_counter()
    got = _poll(source)
    took = time.perf_counter() - t
    print(
        f"one poll over 10,003 shards: {store.entries} keys listed, {len(names)} names read, {took * 1e3:.0f} ms"
    )
    assert len(got) == 3 and {e.source.shard.split("/")[1] for e in got} == {
        "actor-00",
        "actor-01",
        "actor-02",
    }
    assert store.lists == 10 and store.entries <= 3 + 10 * 2  # new + grace window of each
    assert len(names) < 600  # per actor: its folder, then ~10 names on each time level
    store.entries, names[:] = 0, []
    assert _poll(source) == [] and store.entries <= 10 * 2 and len(names) < 600


def test_a_backlog_is_read_without_listing_again(store_uri):
    """The learner lists each actor folder once, then reads its backlog poll after poll
    without listing; a shard written meanwhile comes after the backlog, and a restored
    position lists again (every unacknowledged row comes back)."""
    inner = open_store(store_uri)
    store = _Counting(inner)
    rng = np.random.default_rng(1)
    for a in range(3):
        writer = ShardWriter(inner, actor_id=f"actor-{a}", max_episodes=1)
        for _ in range(12):
            writer.add(make_episode(rng, length=8))
    source = EpisodeSource(store, vocab_size=103)
    got = _poll(source, max_shards=8)
    assert store.lists == 3 and len(got) == 8 and source.backlog_shards == 36
    late = ShardWriter(inner, actor_id="actor-9", max_episodes=1)
    late.add(make_episode(rng, length=8))
    state = json.loads(json.dumps(source.get_state()))  # nothing acknowledged yet
    seen = [e.source.shard for e in got]
    for e in got:
        source.ack(e)
    while batch := _poll(source, max_shards=8):
        seen += [e.source.shard for e in batch]
        for e in batch:
            source.ack(e)
        if len(seen) < 36:
            assert store.lists == 3, "the backlog was read without listing again"
    assert len(seen) == 37 == len(set(seen)) and seen[-1] == late.shards_written[0]
    assert store.lists == 3 + 4 + 4  # the sweep that found the late shard, and the empty one
    restored = EpisodeSource(store, vocab_size=103)
    restored.set_state(state)
    again = [e.source.shard for e in _poll(restored, max_shards=64)]
    assert sorted(again) == sorted(seen)
    restored.set_state(json.loads(json.dumps(source.get_state())))
    assert _poll(restored, max_shards=64) == [] and source.backlog_shards == 0


def test_shards_are_cut_by_bytes_and_named_by_their_clock(tmp_path):
    store = open_store(str(tmp_path))
    rng = np.random.default_rng(2)
    writer = ShardWriter(store, actor_id="a", max_episodes=1000, max_bytes=20_000, clock=lambda: T0)
    for _ in range(10):
        writer.add(make_episode(rng, length=1000))  # ~9 KB each before compression
        assert writer.pending_bytes < 20_000
    writer.close()
    rows = [pq.read_metadata(tmp_path / k).num_rows for k in writer.shards_written]
    assert rows == [3, 3, 3, 1]
    folders = "shards/a/170000/1700000/17000000/1700000000000-"
    assert all(k.startswith(folders) for k in writer.shards_written)


@pytest.mark.gcs
def test_writer_keeps_its_episodes_and_blocks_while_the_store_is_down(monkeypatch):
    """A real fake-gcs-server goes down. Producers calling the writer as the actor does
    (commit; on failure retry through `StoreOutage`) block: the buffer stays bounded by
    one shard plus one group per producer, and once the store is back every episode is
    written exactly once."""
    from tunix_tasks.testing.gcs_outage import OutageGcs

    monkeypatch.setenv(RETRY_DEADLINE_ENV, "1")
    with OutageGcs() as gcs:
        store = open_store(gcs.new_bucket_uri())
        writer = ShardWriter(store, actor_id="actor-0", max_episodes=8)
        outage = StoreOutage(limit_s=60, backoff_s=(0.2, 0.5))
        lock = threading.Lock()
        produced: list[str] = []
        peak = [0]

        def locked(fn, *args):
            with lock:
                out = fn(*args)
                peak[0] = max(peak[0], writer.pending)
                return out

        def producer(k: int) -> None:
            rng = np.random.default_rng(k)
            for g in range(6):
                group = [make_episode(rng, length=16, group_id=f"{k}/{g}") for _ in range(2)]
                with lock:
                    produced.extend(e.episode_id for e in group)
                try:
                    locked(writer.add_group, group)
                except StoreError as err:  # still buffered: retried until it lands
                    outage.call("shard commit", locked, writer.flush, failed=err)

        gcs.down()
        threads = [threading.Thread(target=producer, args=(k,)) for k in range(3)]
        for t in threads:
            t.start()
        time.sleep(4.0)  # several store deadlines: everyone is blocked, nothing written
        blocked = len(produced)
        assert writer.episodes_written == 0 and blocked <= 8 + 3 * 2
        assert all(t.is_alive() for t in threads)
        gcs.up()
        for t in threads:
            t.join(timeout=60)
        locked(writer.close)
        assert outage.outages >= 1 and peak[0] <= 8 + 3 * 2
        written = [
            eid
            for key in writer.shards_written
            for eid in pq.read_table(store.open_input(key)).column("episode_id").to_pylist()
        ]
        assert sorted(written) == sorted(produced) and len(produced) == 36
