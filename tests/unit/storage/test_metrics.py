"""Metrics: the writer's chunks, `read_metrics`, and the incremental `MetricsTail` that the
live display and the report share."""

from __future__ import annotations

import json
import time

import pytest

from tunix_tasks.storage.metrics import MetricsTail, MetricsWriter, Stopwatch, read_metrics
from tunix_tasks.storage.store import StoreError, open_store
from tunix_tasks.storage.tensorboard import read_scalars


def _chunk(store, process: str, ms: int, *steps: int, tag: str = "0000") -> str:
    """A chunk as MetricsWriter names it, stamped `ms` by the writer's clock."""
    key = f"metrics/{process}/{ms:013d}-{tag}.jsonl"
    lines = [
        json.dumps({"time": ms / 1000 + i * 1e-6, "process": process, "step": s})
        for i, s in enumerate(steps)
    ]
    store.write_bytes(key, ("\n".join(lines) + "\n").encode())
    return key


def _steps(records) -> list[int]:
    return [r["step"] for r in records]


class _CountingStore:
    """Wraps a store; records list prefixes and can fail reads."""

    def __init__(self, store) -> None:
        self._store = store
        self.uri = store.uri
        self.listed: list[str] = []
        self.list_sizes: list[int] = []
        self.fail_reads = 0

    def list(self, prefix: str = ""):
        self.listed.append(prefix)
        out = self._store.list(prefix)
        self.list_sizes.append(len(out))
        return out

    def read_bytes(self, key: str) -> bytes:
        if self.fail_reads:
            self.fail_reads -= 1
            raise StoreError(f"injected failure reading {key}")
        return self._store.read_bytes(key)


def test_writer_chunks_and_read_metrics(store_uri):
    store = open_store(store_uri)
    w = MetricsWriter(store, "learner", flush_interval_s=3600)
    w.log(step=1, loss=float("nan"))
    w.log(step=2, loss=0.5)
    assert read_metrics(store) == []  # buffered until the interval or close
    w.close()
    a = MetricsWriter(store, "actor/actor-0000", flush_interval_s=0)
    a.log(episodes=3)
    records = read_metrics(store)
    assert [r["process"] for r in records] == ["learner", "learner", "actor/actor-0000"]
    assert records[0]["loss"] is None and records[1]["loss"] == 0.5  # NaN -> null
    assert _steps(read_metrics(store, "learner")) == [1, 2]
    assert [r["episodes"] for r in read_metrics(store, "actor/")] == [3]
    keys = [i.key for i in store.list("metrics/") if "/tensorboard/" not in f"/{i.key}"]
    assert len(keys) == 2 and all(k.endswith(".jsonl") for k in keys)


def test_writer_commits_each_record_within_the_interval(tmp_path):
    store = open_store(str(tmp_path))
    w = MetricsWriter(store, "learner", flush_interval_s=2.0)  # > a stalled host's burst
    for step in range(5):  # a burst, then nothing: a timer commits it, in one chunk
        w.log(step=step)
    assert read_metrics(store, "learner") == []
    deadline = time.monotonic() + 10
    while not read_metrics(store, "learner") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _steps(read_metrics(store, "learner")) == [0, 1, 2, 3, 4]
    assert len(store.list("metrics/learner/")) == 1
    w.log(step=5)
    w.close()  # flushes now, and no timer fires after close
    assert _steps(read_metrics(store, "learner")) == list(range(6))


def test_writer_keeps_records_when_a_commit_fails(tmp_path):
    store = open_store(str(tmp_path))

    class Flaky:
        uri = store.uri
        fail = 1

        def write_bytes(self, key, data):
            if self.fail:
                self.fail -= 1
                raise StoreError("injected")
            store.write_bytes(key, data)

    w = MetricsWriter(Flaky(), "learner", flush_interval_s=0)
    with pytest.raises(StoreError):
        w.log(step=1)
    w.log(step=2)
    assert _steps(read_metrics(store, "learner")) == [1, 2]


def test_tail_returns_only_new_records(store_uri):
    store = open_store(store_uri)
    tail = MetricsTail(store, "learner")
    assert tail.poll() == []
    w = MetricsWriter(store, "learner", flush_interval_s=0)  # one chunk per record
    w.log(step=1)
    w.log(step=2)
    assert _steps(tail.poll()) == [1, 2]
    assert tail.poll() == []
    w.log(step=3)
    MetricsWriter(store, "actor/actor-0000", flush_interval_s=0).log(step=99)  # other process
    assert _steps(tail.poll()) == [3]
    assert _steps(read_metrics(store, "learner")) == [1, 2, 3]


def test_tail_reads_chunks_that_appear_out_of_order(tmp_path):
    store = open_store(str(tmp_path))
    t0 = int(time.time() * 1000)
    tail = MetricsTail(store, "learner", settle_s=10)
    _chunk(store, "learner", t0 + 2000, 3)
    assert _steps(tail.poll()) == [3]
    # Older stamps that show up later (a slow upload, a clock step): still returned,
    # as long as they are within settle_s of the newest chunk read.
    _chunk(store, "learner", t0 + 1000, 2)
    _chunk(store, "learner", t0 - 7000, 1)
    _chunk(store, "learner", t0 + 3000, 4)
    assert _steps(tail.poll()) == [1, 2, 4]
    # A straggler older than the watermark (newest - settle_s) is skipped by the tail ...
    _chunk(store, "learner", t0 - 20000, 0)
    assert tail.poll() == []
    # ... but a full read still has it.
    assert _steps(read_metrics(store, "learner")) == [0, 1, 2, 3, 4]


def test_tail_state_is_bounded_and_listing_narrow(tmp_path):
    store = _CountingStore(open_store(str(tmp_path)))
    t0 = int(time.time() * 1000) - 3_000_000  # a run that started 50 minutes ago
    for i in range(300):  # one chunk every 10 s for 50 minutes
        _chunk(store._store, "learner", t0 + 10_000 * i, i)
    tail = MetricsTail(store, "learner", settle_s=60)
    assert _steps(tail.poll()) == list(range(300))
    assert store.listed == ["metrics/learner/"]  # first poll: the whole folder
    assert tail.tracked_keys <= 7  # only keys within settle_s of the newest
    got = []
    for i in range(300, 500):  # keeps going, polled after every chunk
        _chunk(store._store, "learner", t0 + 10_000 * i, i)
        got += _steps(tail.poll())
        assert tail.tracked_keys <= 7
    assert got == list(range(300, 500))
    # Later polls list 100 s stamp blocks around the watermark, not the whole folder.
    later = store.listed[1:]
    assert later and all(len(p) == len("metrics/learner/") + 8 for p in later)
    assert max(store.list_sizes[1:]) <= 10  # of 300-500 chunks in the folder


def test_tail_discovers_processes_and_skips_other_files(tmp_path):
    store = open_store(str(tmp_path))
    tail = MetricsTail(store)  # every process
    group = MetricsTail(store, "actor/")
    MetricsWriter(store, "learner", flush_interval_s=0).log(step=1)
    assert [r["process"] for r in tail.poll()] == ["learner"]
    assert group.poll() == []
    MetricsWriter(store, "actor/actor-0001", flush_interval_s=0).log(step=2)
    store.write_bytes("metrics/actor/actor-0001/notes.txt", b"not a chunk")
    assert [r["process"] for r in tail.poll()] == ["actor/actor-0001"]
    assert [r["process"] for r in group.poll()] == ["actor/actor-0001"]
    assert tail.poll() == [] and group.poll() == []


def test_tail_keeps_its_position_when_the_store_fails(tmp_path):
    store = _CountingStore(open_store(str(tmp_path)))
    t0 = int(time.time() * 1000)
    tail = MetricsTail(store, "learner", max_workers=1)
    _chunk(store._store, "learner", t0, 1)
    _chunk(store._store, "learner", t0 + 1, 2)
    store.fail_reads = 1
    with pytest.raises(StoreError):
        tail.poll()
    assert _steps(tail.poll()) == [1, 2]  # nothing lost, nothing twice
    assert tail.poll() == []


def test_stopwatch_shares():
    watch = Stopwatch()
    with watch.timed("train"):
        time.sleep(0.02)
    time.sleep(0.02)
    assert 0.05 < watch.share("train") < 1.0
    assert watch.share("other") == 0.0
    watch.add("train", 0.5)  # time measured elsewhere
    assert watch.totals["train"] >= 0.52


def test_writer_writes_tensorboard_scalars(store_uri):
    store = open_store(store_uri)
    w = MetricsWriter(store, "learner", flush_interval_s=0)
    w.log(warm_start_step=1, nll=2.0)  # the warm start: a series of its own
    w.log(warm_start_step=2, nll=1.5)
    w.log(step=1, loss=0.5, reward_mean=0.25, name="x", done=False, status={"ok": 1})
    w.log(step=2, loss=float("inf"), reward_mean=0.75, episodes=7)
    a = MetricsWriter(store, "actor/actor-0000", flush_interval_s=0)
    a.log(episodes=3, reward_mean=0.5)  # no `step`: the writer's record count
    a.log(episodes=5)
    assert read_scalars(store, "learner") == {}  # events commit every 30 s and at close
    w.close()
    a.close()
    scalars = read_scalars(store, "learner")
    assert scalars == {  # numeric scalars only; NaN/inf, bools, strings, dicts skipped
        "warm_start/nll": [(1, 2.0), (2, 1.5)],
        "loss": [(1, 0.5)],
        "reward_mean": [(1, 0.25), (2, 0.75)],
        "episodes": [(2, 7.0)],
    }
    assert read_scalars(store, "actor/actor-0000") == {
        "episodes": [(0, 3.0), (1, 5.0)],
        "reward_mean": [(0, 0.5)],
    }
    keys = [i.key for i in store.list("metrics/tensorboard/")]
    assert len(keys) == 2 and all(".out.tfevents." in k for k in keys)
    assert read_metrics(store, "learner")[2]["loss"] == 0.5  # the JSON-lines are unchanged


def test_tensorboard_reads_the_event_files(tmp_path):
    """TensorBoard's own loader, when installed, sees the same scalars."""
    accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    store = open_store(str(tmp_path))
    w = MetricsWriter(store, "learner", flush_interval_s=0)
    for step in range(3):
        w.log(step=step, loss=1.0 / (step + 1))
        w._events.commit(force=True)  # one event file per record: read in name order
    w.close()
    acc = accumulator.EventAccumulator(str(tmp_path / "metrics" / "tensorboard" / "learner"))
    acc.Reload()
    got = [(e.step, round(e.value, 6)) for e in acc.Scalars("loss")]
    assert got == [(0, 1.0), (1, 0.5), (2, 0.333333)]


def test_tensorboard_failures_never_break_metrics(tmp_path, caplog):
    store = open_store(str(tmp_path))

    class NoEvents:
        uri = store.uri

        def write_bytes(self, key, data):
            if "tfevents" in key:
                raise StoreError("injected")
            store.write_bytes(key, data)

    w = MetricsWriter(NoEvents(), "learner", flush_interval_s=0)
    w.log(step=1, loss=0.5)
    w.close()
    assert _steps(read_metrics(store, "learner")) == [1]
    assert "tensorboard events of learner not written" in caplog.text
    assert MetricsWriter(store, "x", tensorboard=False)._events is None
    w = MetricsWriter(store, "big", flush_interval_s=0)
    w.log(step=1 << 70, loss=1.0)  # beyond an int64 step: that event is skipped
    w.log(step=2, loss=2.0)
    w.close()
    assert read_scalars(store, "big") == {"loss": [(2, 2.0)]}
    assert "tensorboard event of big skipped" in caplog.text
