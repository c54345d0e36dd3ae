"""The learner's input: exactly-once position, quarantine, whole-group advantages, bounded state."""

from __future__ import annotations

import json
import os

import numpy as np
import pyarrow as pa
import pytest

from tunix_tasks.learner import source as source_mod
from tunix_tasks.learner.advantages import batch_advantages, group_advantages
from tunix_tasks.learner.source import EpisodeSource, PrefetchingSource, ShardPosition
from tunix_tasks.storage.layout import SHARD_FOLDER_DIGITS, RunLayout
from tunix_tasks.storage.shards import (
    RUN_ID_KEY,
    ShardWriter,
    episodes_to_table,
    table_to_parquet_bytes,
)
from tunix_tasks.storage.store import StoreError, open_store
from tunix_tasks.testing.shard_factory import block_episodes, make_episode


def _poll(source, max_shards=16):
    return block_episodes(source.poll(max_shards))


def _flagged(source, max_shards=16):
    """One round's episodes, and those the source flagged as replays."""
    blocks = source.poll(max_shards)
    dups = [b.episode(j) for b in blocks for j in np.flatnonzero(b.duplicate)]
    return block_episodes(blocks), {e.source for e in dups}


def _write(store, n, *, per_shard=8, actor="actor-0", seed=0, group=1):
    rng = np.random.default_rng(seed)
    writer = ShardWriter(store, actor_id=actor, max_episodes=per_shard)
    eps = [
        make_episode(
            rng, length=int(rng.integers(4, 200)), actor_id=actor, group_id=f"g{i // group}"
        )
        for i in range(n)
    ]
    for start in range(0, n, group):
        writer.add_group(eps[start : start + group])
    writer.close()
    return eps, writer.shards_written


def test_yields_all_and_resumes_from_state(store_uri):
    store = open_store(store_uri)
    eps, _ = _write(store, 30, per_shard=8)
    source = EpisodeSource(store, vocab_size=103)
    got = _poll(source)
    assert sorted(e.episode_id for e in got) == sorted(e.episode_id for e in eps)
    by_id = {e.episode_id: e for e in eps}
    for e in got:
        np.testing.assert_array_equal(e.tokens, by_id[e.episode_id].tokens)
        assert e.source is not None and e.source.shard.startswith(RunLayout.SHARDS)
    # ack half, checkpoint, "crash", restore: exactly the unacked half comes back.
    for e in got[::2]:
        source.ack(e)
    state = json.loads(json.dumps(source.get_state()))
    fresh = EpisodeSource(store, vocab_size=103)
    fresh.set_state(state)
    again = _poll(fresh)
    assert {e.episode_id for e in again} == {e.episode_id for e in got[1::2]}
    assert _poll(fresh) == []  # nothing new until more shards arrive
    for e in again:
        fresh.ack(e)
    assert fresh.get_state()["partial"] == {}
    assert all(fresh.position.is_done(k) for k in {e.source.shard for e in got})
    more, _ = _write(store, 5, per_shard=8, seed=1)
    assert {e.episode_id for e in _poll(fresh)} == {e.episode_id for e in more}


def test_state_version_checked():
    with pytest.raises(ValueError, match="version"):
        EpisodeSource(open_store("/tmp"), vocab_size=10).set_state({"version": 99})


def test_invalid_shard_is_quarantined_with_its_reason(tmp_path):
    store = open_store(str(tmp_path))
    _write(store, 4)
    bad = "shards/actor-0/0000000000000-bad.parquet"
    store.write_bytes(bad, b"not parquet")
    source = EpisodeSource(store, vocab_size=103)
    assert len(_poll(source)) == 4
    assert source.quarantined == [{"shard": bad, "reason": "corrupt"}]
    assert not store.exists(bad) and store.exists(RunLayout.quarantined(bad))
    reason = json.loads(store.read_bytes(RunLayout.quarantine_reason(bad)))
    assert reason["reason"] == "corrupt"
    assert _poll(source) == []


def test_a_leftover_learner_of_a_deleted_run_quarantines_none_of_the_new_runs_shards(
    tmp_path, caplog
):
    """The run was deleted and created again while its learner still ran (its lease ends
    it within seconds): an `other_run` shard is then the new run's, left where its own
    learner reads it; the leftover learner says so once. A shard of another incarnation
    in a run that is still this learner's is quarantined (test_learner.py)."""
    store = open_store(str(tmp_path))
    store.write_if_generation(RunLayout.RUN_ID, b"a" * 32, 0)
    source = EpisodeSource(store, vocab_size=103, run_id="a" * 32)
    store.delete(RunLayout.RUN_ID)  # deleted, then created again
    store.write_if_generation(RunLayout.RUN_ID, b"b" * 32, 0)
    store.write_bytes(RunLayout.CONFIG, b"{}")
    writer = ShardWriter(store, actor_id="new", max_episodes=4, metadata={RUN_ID_KEY: "b" * 32})
    for e in _write(open_store(str(tmp_path / "scratch")), 4)[0]:
        writer.add(e)
    writer.close()
    with caplog.at_level("ERROR", logger=source_mod.__name__):
        assert _poll(source) == [] and _poll(source) == []
    assert source.quarantined == [] and store.list("quarantine/") == []
    assert [i.key for i in store.list("shards/")] == writer.shards_written
    assert [r.getMessage() for r in caplog.records] == [
        f"{store.uri} was created again (run_id {'b' * 32}) after this process joined run_id "
        f"{'a' * 32}: quarantining none of that run's shards"
    ]


def test_a_fifo_named_like_a_shard_is_no_shard_and_blocks_nothing(tmp_path):
    store = open_store(str(tmp_path))
    _write(store, 4)
    fifo = "shards/actor-0/0000000000000-fifo.parquet"
    os.mkfifo(tmp_path / fifo)  # opening it to read would wait for a writer forever
    source = EpisodeSource(store, vocab_size=103)
    assert len(_poll(source)) == 4 and source.quarantined == []
    assert fifo not in [i.key for i in store.list("shards/")]
    with pytest.raises(OSError, match="not a regular file"):
        store.open_input(fifo)


def test_a_shard_deleted_after_the_listing_is_recorded_not_retried_forever(tmp_path):
    store = open_store(str(tmp_path))
    eps, keys = _write(store, 24, per_shard=8)
    source = EpisodeSource(store, vocab_size=103)
    assert len(_poll(source, max_shards=1)) == 8  # the listing of all three is kept
    store.delete(keys[1])
    assert {e.episode_id for e in _poll(source)} == {e.episode_id for e in eps[16:]}
    assert source.quarantined == [{"shard": keys[1], "reason": "not_found"}]
    assert _poll(source) == []


def test_advantages_after_restart_use_the_whole_group(tmp_path):
    """Part of a group trained before a crash still counts in the group's statistics."""
    store = open_store(str(tmp_path))
    _write(store, 8, per_shard=8, group=4)
    source = EpisodeSource(store, vocab_size=103, advantage="group")
    got = _poll(source)
    advantage = {e.episode_id: e.advantage for e in got}
    assert any(abs(a) > 0.1 for a in advantage.values())
    for e in got[:3]:
        source.ack(e)
    resumed = EpisodeSource(store, vocab_size=103, advantage="group")
    resumed.set_state(source.get_state())
    again = _poll(resumed)
    assert len(again) == 5
    for e in again:
        assert e.advantage == pytest.approx(advantage[e.episode_id])


@pytest.mark.parametrize("mode", ["group", "batch"])
def test_a_rounds_shards_get_the_advantages_each_would_alone(tmp_path, mode):
    """A round is validated and normalised at once; two actors' shards that reuse a
    group id are still two groups, and each shard its own baseline in batch mode."""
    store = open_store(str(tmp_path))
    for actor in ("actor-0", "actor-1", "actor-2"):
        _write(store, 8, per_shard=8, group=4, actor=actor, seed=len(actor) + ord(actor[-1]))
    blocks = EpisodeSource(store, vocab_size=103, advantage=mode).poll()
    assert len(blocks) == 3
    for block in blocks:
        alone = EpisodeSource(store, vocab_size=103, advantage=mode)._decode([block.shard])[0]
        np.testing.assert_array_equal(block.advantage, alone.advantage)
        expected = (
            group_advantages(block.reward, block.group_id)
            if mode == "group"
            else batch_advantages(block.reward)
        )
        np.testing.assert_array_equal(block.advantage, expected)
        assert np.abs(block.advantage).max() > 0.1
        np.testing.assert_array_equal(block.columns.offsets[0], alone.columns.offsets[0])
        assert block.columns.tokens.size == block.columns.offsets[0][-1]  # its own rows only


def test_one_bad_shard_in_a_round_is_quarantined_alone(tmp_path):
    store = open_store(str(tmp_path))
    eps, keys = _write(store, 24, per_shard=8)
    bad = _good_table_with(eps[:8], status="weird")
    store.write_bytes(keys[1], table_to_parquet_bytes(bad))
    source = EpisodeSource(store, vocab_size=103)
    got = _poll(source)
    assert {e.episode_id for e in got} == {e.episode_id for e in eps[:8] + eps[16:]}
    assert source.quarantined == [{"shard": keys[1], "reason": "bad_status"}]


def test_ids_that_are_not_utf8_quarantine_their_shard_not_the_round(tmp_path):
    """Arrow does not check UTF-8 when it decodes: the checks must name such a shard
    (a digest of its ids taken before them escaped `poll` and stalled every round)."""
    store = open_store(str(tmp_path))
    eps, keys = _write(store, 24, per_shard=8)
    table = episodes_to_table(eps[8:16])
    ids = [e.episode_id.encode() for e in eps[8:16]]
    ids[3] = b"bad\xff"
    raw = pa.array(ids, pa.binary())
    bad_ids = pa.Array.from_buffers(pa.string(), len(raw), raw.buffers())  # unchecked UTF-8
    table = table.set_column(table.schema.get_field_index("episode_id"), "episode_id", bad_ids)
    store.write_bytes(keys[1], table_to_parquet_bytes(table))
    source = EpisodeSource(store, vocab_size=103)
    got = _poll(source)
    assert {e.episode_id for e in got} == {e.episode_id for e in eps[:8] + eps[16:]}
    assert source.quarantined == [{"shard": keys[1], "reason": "unreadable"}]


def test_a_store_error_late_in_a_round_loses_none_of_its_shards(tmp_path, monkeypatch):
    """A round reads its shards concurrently and checks the first while the last are read;
    a failed read (an outage past the retries) fails the whole round before any shard is
    handed out, and the next round hands out every one."""
    store = open_store(str(tmp_path))
    eps, keys = _write(store, 8 * (source_mod.CHECK_EVERY + 2), per_shard=8)
    source = EpisodeSource(store, vocab_size=103)
    read = source._read

    def outage(key):
        if key == keys[-1]:
            raise StoreError(f"{key}: unavailable")
        return read(key)

    monkeypatch.setattr(source, "_read", outage)
    with pytest.raises(StoreError):
        source.poll(max_shards=len(keys))
    monkeypatch.setattr(source, "_read", read)
    got = _poll(source, max_shards=len(keys))
    assert sorted(e.episode_id for e in got) == sorted(e.episode_id for e in eps)


def _good_table_with(episodes, *, status):
    table = episodes_to_table(episodes)
    i = table.schema.get_field_index("status")
    return table.set_column(i, "status", pa.array([status] * len(episodes)))


def test_prefetching_source_composes_state(tmp_path):
    store = open_store(str(tmp_path))
    _write(store, 16, per_shard=8)
    pre = PrefetchingSource(EpisodeSource(store, vocab_size=103))
    pre.start()
    try:
        got = block_episodes(pre.drain(timeout_s=10))
        while len(got) < 16:
            got += block_episodes(pre.drain(timeout_s=10))
        for e in got[:5]:
            pre.ack(e)
        state = pre.get_state()
    finally:
        pre.stop()
    assert set(state) == {"parent"}
    again = EpisodeSource(store, vocab_size=103)
    again.set_state(state["parent"])
    assert len(_poll(again)) == 11
    old = PrefetchingSource(EpisodeSource(store, vocab_size=103))
    old.set_state(state["parent"])  # a checkpoint from before the composition
    assert old.get_state() == state


def _key(actor: str, ms: int, i: int, *, flat: bool = False) -> str:
    """A shard key as `RunLayout.shard_key` spells it (time folder), or as before #16."""
    stamp = f"{ms:013d}-{i:08x}"
    folders = "" if flat else "".join(f"{stamp[:d]}/" for d in SHARD_FOLDER_DIGITS)
    return f"{RunLayout.SHARDS}{actor}/{folders}{stamp}.parquet"


def test_position_stays_bounded_over_10000_shards():
    """Four actors commit a shard a second each; the learner acknowledges them a little
    out of order. The checkpointed position must not grow with the number of shards."""
    rng = np.random.default_rng(0)
    pos = ShardPosition(grace_ms=10_000)
    listed: list[str] = []
    held: list[str] = []  # shards whose last row the learner acknowledges a round later
    sizes = []
    for i in range(2500):
        for a in range(4):
            key = _key(f"actor-{a:04d}", 1_700_000_000_000 + 1000 * i + a, i)
            listed.append(key)
            pos.opened(key, 2)
            pos.ack(key, [0])
            if rng.random() < 0.3:
                held.append(key)
            else:
                pos.ack(key, [1])
        if i % 25 == 24:
            for key in held:
                pos.ack(key, [1])
            held = []
            pos.compact(listed)
            sizes.append(len(json.dumps(pos.get_state())))
    assert all(pos.is_done(k) for k in listed)
    naive = sum(len(k) + 4 for k in listed)  # the old state: every done key
    assert naive > 400_000
    assert max(sizes) < 8_000, sizes[-5:]
    assert max(sizes[len(sizes) // 2 :]) <= max(sizes[: len(sizes) // 2]) + 200  # flat


def test_watermark_waits_for_an_unacknowledged_shard():
    pos = ShardPosition(grace_ms=0)
    keys = [_key("actor-0000", 1000 * i, i) for i in range(5)]
    for k in keys:
        pos.opened(k, 1)
    for k in keys[:1] + keys[2:]:
        pos.ack(k, [0])
    pos.compact(keys)
    assert not pos.is_done(keys[1])  # the watermark stops before it, whatever follows
    state = pos.get_state()
    assert state["watermarks"] == {"actor-0000": keys[0].rsplit("/", 1)[-1]}
    restored = ShardPosition(grace_ms=0)
    restored.set_state(json.loads(json.dumps(state)))
    assert [restored.is_done(k) for k in keys] == [True, False, True, True, True]
    restored.ack(keys[1], [0])
    restored.compact(keys)
    assert restored.get_state()["done"] == [] and all(restored.is_done(k) for k in keys)


def test_version_1_state_still_loads():
    pos = ShardPosition()
    pos.set_state({"version": 1, "done": ["shards/a/1-x.parquet"], "partial": {}, "rows": {}})
    assert pos.is_done("shards/a/1-x.parquet")


# ------------------------------------------------------- issue #11: 4, 5, 6, 11


def _put(store, key, eps) -> None:
    store.write_bytes(key, table_to_parquet_bytes(episodes_to_table(eps)))


def test_future_version_and_too_long_shards_are_quarantined(tmp_path):
    """#11.4: a shard from weights newer than any published version was trained
    (staleness -999993); #11.6: an episode over the length limit was accepted."""
    store = open_store(str(tmp_path))
    rng = np.random.default_rng(0)
    good = [make_episode(rng, length=50, policy_version=7) for _ in range(4)]
    _put(store, _key("actor-0", 1000, 1), good)
    _put(
        store,
        _key("actor-0", 2000, 2),
        [make_episode(rng, length=50, policy_version=7 + 1_000_000)],
    )
    _put(store, _key("actor-1", 1500, 3), [make_episode(rng, length=193, policy_version=7)])
    source = EpisodeSource(store, vocab_size=103, max_length=192)
    source.newest_version = 7
    got = _poll(source)
    assert {e.episode_id for e in got} == {e.episode_id for e in good}
    assert sorted(source.quarantined, key=lambda q: q["shard"]) == [
        {"shard": _key("actor-0", 2000, 2), "reason": "future_version"},
        {"shard": _key("actor-1", 1500, 3), "reason": "too_long"},
    ]
    reason = json.loads(store.read_bytes(RunLayout.quarantine_reason(_key("actor-1", 1500, 3))))
    assert "max_length=192" in reason["detail"]


def test_replayed_shard_is_flagged_duplicate_also_after_a_restart(tmp_path):
    """#11.5: a shard copied under a new name was accounted twice."""
    store = open_store(str(tmp_path))
    eps, (key,) = _write(store, 6, per_shard=8)
    replay = _key("actor-0", 9_000_000_000_000, 1)  # sorts after the original
    store.write_bytes(replay, store.read_bytes(key))
    source = EpisodeSource(store, vocab_size=103)
    got, flagged = _flagged(source)
    assert len(got) == 12
    dups = [e for e in got if e.source in flagged]
    assert {e.source.shard for e in dups} == {replay}
    assert {e.episode_id for e in dups} == {e.episode_id for e in eps}
    for e in got:
        source.ack(e)
    assert source.position.is_done(key) and source.position.is_done(replay)
    state = json.loads(json.dumps(source.get_state()))
    # After a restart the memory of accounted ids comes back with the position.
    again = EpisodeSource(store, vocab_size=103)
    again.set_state(state)
    late = _key("actor-1", 9_000_000_000_000, 2)
    store.write_bytes(late, store.read_bytes(key))
    got, flagged = _flagged(again)
    assert len(got) == 6 and all(e.source in flagged for e in got)


def test_a_duplicate_dropped_before_its_original_is_acked_does_not_hide_it(tmp_path):
    """Crash after the copy was dropped but before the original was trained: on restart
    the original is handed out again as an original (the copy's id was not remembered)."""
    store = open_store(str(tmp_path))
    _, (key,) = _write(store, 4, per_shard=8)
    replay = _key("actor-0", 9_000_000_000_000, 1)
    store.write_bytes(replay, store.read_bytes(key))
    source = EpisodeSource(store, vocab_size=103)
    got, flagged = _flagged(source)
    for e in got:
        if e.source in flagged:
            source.ack(e)
    again = EpisodeSource(store, vocab_size=103)
    again.set_state(source.get_state())
    got, flagged = _flagged(again)
    assert len(got) == 4 and {e.source.shard for e in got} == {key}
    assert not flagged


def test_dedup_memory_is_bounded():
    from tunix_tasks.learner.accounting import RecentIds

    ids = RecentIds(capacity=1000)
    for i in range(10_000):
        ids.add(f"ep-{i}")
    assert len(ids) == 1000 and "ep-9999" in ids and "ep-8999" not in ids
    state = json.loads(json.dumps(ids.get_state()))
    assert len(json.dumps(state)) < 11_000 + 100  # ~11 bytes an id, whatever was added
    back = RecentIds(capacity=500)  # a smaller window keeps the newest
    back.set_state(state)
    assert len(back) == 500 and "ep-9999" in back and "ep-9499" not in back


def test_dedup_recognises_ids_accounted_before_a_restart_and_since():
    """In memory the window holds this process's ids as strings and restored ones by
    digest; a replay of either is recognised, and restored digests age out like ids."""
    from tunix_tasks.learner.accounting import RecentIds

    before = RecentIds(capacity=4)
    for i in range(3):
        before.add(f"old-{i}")
    ids = RecentIds(capacity=4)
    ids.set_state(before.get_state())
    assert ids.holds_any(["new", "old-1"]) and "old-2" in ids and not ids.holds_any(["new"])
    ids.add("new-0")
    assert ids.holds_any(["x", "new-0"]) and "new-0" in ids and len(ids) == 4
    ids.add("old-2")  # already there (by digest): not added twice
    assert len(ids) == 4
    for i in range(1, 4):
        ids.add(f"new-{i}")
    assert not ids.holds_any(["old-0", "old-1", "old-2"]) and ids.holds_any(["new-3"])
    assert json.loads(json.dumps(ids.get_state())) == ids.get_state()


class _CountingStore:
    """Forwards to a store; counts the keys its listings return."""

    def __init__(self, store) -> None:
        self._store = store
        self.listed = 0

    def list(self, prefix: str = "", **kw):
        out = self._store.list(prefix, **kw)
        self.listed += len(out)
        return out

    def __getattr__(self, name):
        return getattr(self._store, name)


def test_listing_cost_follows_new_shards_not_history(store_uri):
    """#11.11: every poll re-listed the whole `shards/` prefix. Two actors commit a shard a
    second; after 2 x 150 consumed shards, a poll lists the new shards plus the ones
    within the watermark's 10 s grace window, not the history."""
    inner = open_store(store_uri)
    store = _CountingStore(inner)
    rng = np.random.default_rng(0)
    t0 = 1_700_000_000_000
    for i in range(150):
        for a in range(2):
            _put(inner, _key(f"actor-{a}", t0 + 1000 * i, i), [make_episode(rng, length=8)])
    source = EpisodeSource(store, vocab_size=103)
    while got := _poll(source, max_shards=64):
        for e in got:
            source.ack(e)
    _poll(source)  # folds the consumed shards into the watermarks
    for i in range(150, 153):
        _put(inner, _key("actor-0", t0 + 1000 * i, i), [make_episode(rng, length=8)])
    store.listed = 0
    got = _poll(source)
    assert len(got) == 3
    print(f"keys listed by one poll: {store.listed} (history: {len(inner.list('shards/'))})")
    assert store.listed <= 3 + 2 * 10  # new + grace window of each actor
    assert len(inner.list("shards/")) == 303


def test_shards_from_before_time_folders_are_read_exactly_once(tmp_path):
    """#16 put shards in time folders. A run resumed from a checkpoint whose watermark is
    a flat key still reads every unacknowledged flat shard and every new one, once."""
    store = open_store(str(tmp_path))
    rng = np.random.default_rng(0)
    t0 = 1_700_000_000_000
    flat = [_key("actor-0", t0 + 1000 * i, i, flat=True) for i in range(30)]
    for key in flat:
        _put(store, key, [make_episode(rng, length=8)])
    source = EpisodeSource(store, vocab_size=103)
    seen = []
    for _ in range(2):  # two rounds acknowledged, then a checkpoint
        for e in _poll(source, max_shards=10):
            seen.append(e.source.shard)
            source.ack(e)
    _poll(source, max_shards=0)  # the next sweep folds them into the watermark
    state = json.loads(json.dumps(source.get_state()))
    assert state["watermarks"]["actor-0"] == flat[19].rsplit("/", 1)[-1]  # 10 s grace
    new = [_key("actor-0", t0 + 30_000 + 1000 * i, 100 + i) for i in range(5)]
    for key in new:
        _put(store, key, [make_episode(rng, length=8)])
    resumed = EpisodeSource(store, vocab_size=103)
    resumed.set_state(state)
    while got := _poll(resumed, max_shards=7):
        seen += [e.source.shard for e in got]
        for e in got:
            resumed.ack(e)
    assert sorted(seen) == sorted(flat + new) and len(seen) == 35


def test_consumed_shards_deleted_only_once_committed(tmp_path):
    """#11.11 (optional retention): a consumed shard is deleted only after the state that
    holds it done was checkpointed, so a crash can never lose unaccounted episodes."""
    store = open_store(str(tmp_path))
    _, keys = _write(store, 16, per_shard=8)
    early = EpisodeSource(store, vocab_size=103, delete_consumed=True)
    for e in _poll(early):
        early.ack(e)
    early.committed()  # no checkpoint (get_state) since the acks: nothing may go
    early.close()
    assert all(store.exists(k) for k in keys)

    source = EpisodeSource(store, vocab_size=103, delete_consumed=True)
    got = _poll(source)
    assert {e.source.shard for e in got[:8]} == {keys[0]}
    for e in got[:8]:
        source.ack(e)
    state = source.get_state()  # the checkpoint: holds keys[0] done
    for e in got[8:]:
        source.ack(e)  # keys[1] is consumed after it
    source.committed()
    source.close()  # waits for the background deletes
    assert not store.exists(keys[0]) and store.exists(keys[1])

    kept = EpisodeSource(store, vocab_size=103)  # the default: nothing is deleted
    kept.set_state(state)
    for e in _poll(kept):
        kept.ack(e)
    kept.get_state()
    kept.committed()
    kept.close()
    assert store.exists(keys[1])
