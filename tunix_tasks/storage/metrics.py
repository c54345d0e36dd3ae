"""JSON-lines metrics: the one telemetry channel. Every process appends records; the live
display of `tunix-tasks train` and the report read them back through `MetricsTail`.

Object stores cannot append, so a writer buffers records and commits them as chunk
objects `metrics/<process>/<ms>-<rand>.jsonl` once a record arrives at least
`flush_interval_s` after the last commit (and at close). A crash loses at most one flush
interval of metrics, never training data.

    metrics = MetricsWriter(store, "learner")
    metrics.log(step=3, loss=0.12)        # adds "time" and "process"
    metrics.close()
    records = read_metrics(store, "learner")   # everything, sorted by time

Each writer also commits its records' numeric scalars as TensorBoard event files under
`metrics/tensorboard/<process>/` (storage/tensorboard.py), so `tensorboard --logdir
RUN/metrics` shows them; `tensorboard=False` turns that off. With `tracker` (a
`storage/trackers.py` sink: `tracker: mlflow` in the config), the same scalars also go to
the user's experiment tracker.

    tail = MetricsTail(store, "learner")  # incremental: only records not returned before
    while running:
        show(tail.poll())

`Stopwatch` measures where a loop's wall time goes (in the spirit of clu's
`ReportProgress.timed`): the learner's duty cycle is the share spent in "train".

    watch = Stopwatch()
    with watch.timed("train"):
        ...
    watch.share("train")                  # fraction of wall time since start/reset
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from tunix_tasks.storage.layout import RunLayout
from tunix_tasks.storage.store import NotFound, ObjectStore
from tunix_tasks.storage.tensorboard import EventChunks, scalar_step, scalar_values
from tunix_tasks.storage.trackers import TrackerSink

log = logging.getLogger(__name__)

# A record is committed at most this long after it is logged (a timer flushes a buffer
# that no later record does), and a writer commits at most one chunk per interval. 1 s:
# the live display, which polls about as often, then lags the learner by ~1-2 s, and a
# long run still makes at most 3600 small objects per hour and process (the report reads
# them all, concurrently; see MetricsTail).
FLUSH_INTERVAL_S = 1.0


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if hasattr(value, "item"):  # numpy / jax scalars
        return _clean(value.item())
    return value


class MetricsWriter:
    """Buffers records; commits them as one chunk per `flush_interval_s` at most, and each
    record within `flush_interval_s` of being logged (on the next `log` or by a timer).
    With `tensorboard`, numeric scalars also go to TensorBoard event files (committed after
    a chunk, at most every 30 s, and at close; their failures are logged, never raised);
    with `tracker`, to that sink as each record is logged (its failures likewise)."""

    def __init__(
        self,
        store: ObjectStore,
        process: str,
        *,
        flush_interval_s: float = FLUSH_INTERVAL_S,
        tensorboard: bool = True,
        tracker: TrackerSink | None = None,
    ) -> None:
        self._store = store
        self.process = process
        self.flush_interval_s = flush_interval_s
        self._buffer: list[str] = []
        self._last_flush = time.monotonic()
        self._lock = threading.Lock()
        self._timer: threading.Timer | None = None
        self._closed = False
        self._events = EventChunks(store, process) if tensorboard else None
        self._tracker = tracker
        self._tracked = 0  # records sent to the tracker: the step of one without its own
        self._tracker_failed = False

    def log(self, **fields: Any) -> None:
        record = {"time": time.time(), "process": self.process}
        record.update({k: _clean(v) for k, v in fields.items()})
        with self._lock:
            self._buffer.append(json.dumps(record, default=str))
            if self._events is not None:
                self._events.add(record)
            wait = self._last_flush + self.flush_interval_s - time.monotonic()
            if wait > 0 and self._timer is None and not self._closed:
                self._timer = threading.Timer(wait, self._flush_on_timer)
                self._timer.daemon = True
                self._timer.start()
        if wait <= 0:
            self.flush()
        if self._tracker is not None:
            self._track(record)

    def _track(self, record: dict[str, Any]) -> None:
        step = scalar_step(record)
        self._tracked += 1
        try:
            self._tracker.log(scalar_values(record), self._tracked if step is None else step)
        except Exception as err:  # a view of the records, never fatal
            if not self._tracker_failed:
                self._tracker_failed = True
                log.warning("tracker of %s: metrics not sent: %r", self.process, err)

    def _flush_on_timer(self) -> None:
        with self._lock:
            self._timer = None
        try:
            self.flush()
        except Exception as err:  # kept in the buffer; the next flush retries
            log.warning("metrics flush of %s failed: %r", self.process, err)

    def flush(self) -> None:
        with self._lock:
            if not self._buffer:
                return
            lines, self._buffer = self._buffer, []
            self._last_flush = time.monotonic()
        key = RunLayout.metrics_chunk(self.process)
        try:
            self._store.write_bytes(key, ("\n".join(lines) + "\n").encode())
        except Exception:
            with self._lock:
                self._buffer[:0] = lines
            raise
        self._commit_events(force=False)

    def _commit_events(self, *, force: bool) -> None:
        if self._events is None:
            return
        try:
            self._events.commit(force=force)
        except Exception as err:  # kept pending; TensorBoard files are a view, never fatal
            log.warning("tensorboard events of %s not written: %r", self.process, err)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            timer, self._timer = self._timer, None
        if timer is not None:
            timer.cancel()
        try:
            self.flush()
            self._commit_events(force=True)
        finally:  # the tracker is closed even when the store refuses the last records
            if self._tracker is not None:
                try:
                    self._tracker.close()
                except Exception as err:
                    log.warning("tracker of %s not closed: %r", self.process, err)


def read_metrics(store: ObjectStore, process: str | None = None) -> list[dict[str, Any]]:
    """All records of one process ("learner", "actor/actor-0003"), of a group ("actor/"),
    or of every process (None), sorted by time: one poll of a fresh `MetricsTail`."""
    return MetricsTail(store, process).poll()


def _chunk_ms(key: str) -> int | None:
    """The writer's clock (ms) in a chunk name `<13-digit ms>-<rand>.jsonl`, if it has one."""
    head = key.rsplit("/", 1)[-1].split("-", 1)[0]
    return int(head) if head.isdigit() else None


@dataclass
class _Folder:
    """Read position in one process's chunk folder."""

    floor: int = -1  # chunks stamped at or before this (ms) are settled: never read again
    newest: int = -1  # newest stamp read
    seen: set[str] = field(default_factory=set)  # keys read, stamped above `floor`


class MetricsTail:
    """Incremental reader: each `poll()` returns the records of chunks not read before,
    sorted by time. `process` names one process ("learner"), a group ending in "/"
    ("actor/"), or None for all.

    The position is bounded: per process folder, a watermark `floor` = newest stamp read
    minus `settle_s`, and the keys read above it. A chunk that appears out of order (its
    stamp older than one already read) is still returned if its stamp is above the floor,
    i.e. if it shows up within `settle_s` of the newest chunk of its writer (stamps come
    from the writer's own clock, so reader/writer clock skew does not matter); an older
    straggler is skipped here (`read_metrics` of a fresh tail still sees it).

    For one process, polls list only the stamp ranges above the floor (a few listing
    calls of at most ~100 keys on GCS, whatever the run's length) instead of the folder.
    """

    _BLOCK_DIGITS = 5  # list by 10^5 ms (100 s) stamp blocks ...
    _MAX_BLOCKS = 8  # ... or by their common prefix when more than this many

    def __init__(
        self,
        store: ObjectStore,
        process: str | None = None,
        *,
        settle_s: float = 120.0,
        max_workers: int = 16,
    ) -> None:
        self._store = store
        self._group = process is None or process.endswith("/")
        self._prefix = RunLayout.METRICS + (process or "")
        if not self._group:
            self._prefix += "/"
        self._settle_ms = int(settle_s * 1000)
        self._max_workers = max_workers
        self._folders: dict[str, _Folder] = {}

    @property
    def tracked_keys(self) -> int:
        """Keys remembered above the watermarks (bounded by chunks per `settle_s`)."""
        return sum(len(f.seen) for f in self._folders.values())

    def _list_prefixes(self) -> list[str]:
        folder = self._folders.get(self._prefix.rstrip("/"))
        if self._group or folder is None or folder.floor < 0:
            return [self._prefix]
        now_ms = int(time.time() * 1000)
        lo, hi = folder.floor, max(folder.newest, now_ms) + self._settle_ms
        step = 10**self._BLOCK_DIGITS
        if hi // step - lo // step < self._MAX_BLOCKS:
            return [
                f"{self._prefix}{block:0{13 - self._BLOCK_DIGITS}d}"
                for block in range(lo // step, hi // step + 1)
            ]
        a, b = f"{lo:013d}", f"{hi:013d}"
        n = 0
        while n < 13 and a[n] == b[n]:
            n += 1
        return [self._prefix + a[:n]]

    def _read(self, key: str) -> list[dict[str, Any]]:
        try:
            text = self._store.read_bytes(key).decode()
        except NotFound:
            return []
        out = []
        for line in text.splitlines():
            if line.strip():
                try:
                    out.append(json.loads(line))
                except ValueError:
                    continue  # a torn line never happens with atomic writes, but be lenient
        return out

    def poll(self) -> list[dict[str, Any]]:
        """Records of chunks that appeared since the last call, sorted by time. If the
        store fails, raises and keeps the position (the next poll retries)."""
        fresh: list[tuple[str, str, int | None]] = []
        for prefix in self._list_prefixes():
            for info in self._store.list(prefix):
                if not info.key.endswith(".jsonl"):
                    continue
                name = info.key.rpartition("/")[0]
                folder = self._folders.get(name)
                ms = _chunk_ms(info.key)
                if folder is not None and (
                    info.key in folder.seen or (ms is not None and ms <= folder.floor)
                ):
                    continue
                fresh.append((info.key, name, ms))
        keys = [key for key, _, _ in fresh]
        if len(keys) > 4 and self._max_workers > 1:  # a report on GCS: many small GETs
            with ThreadPoolExecutor(min(self._max_workers, len(keys))) as pool:
                chunks = list(pool.map(self._read, keys))
        else:
            chunks = [self._read(key) for key in keys]
        for key, name, ms in fresh:  # everything read: now move the position
            folder = self._folders.setdefault(name, _Folder())
            folder.seen.add(key)
            if ms is not None:
                folder.newest = max(folder.newest, ms)
        for name in {name for _, name, _ in fresh}:
            folder = self._folders[name]
            folder.floor = max(folder.floor, folder.newest - self._settle_ms)
            folder.seen = {
                k for k in folder.seen if (ms := _chunk_ms(k)) is None or ms > folder.floor
            }
        records = [r for chunk in chunks for r in chunk]
        records.sort(key=lambda r: r.get("time", 0))
        return records


class Stopwatch:
    """Wall time per named section since `reset()` (or construction)."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self._t0 = time.monotonic()
        self.totals: dict[str, float] = {}

    @contextlib.contextmanager
    def timed(self, name: str) -> Iterator[None]:
        t0 = time.monotonic()
        try:
            yield
        finally:
            self.add(name, time.monotonic() - t0)

    def add(self, name: str, seconds: float) -> None:
        """Account time measured elsewhere (e.g. a device step timed by its own clock)."""
        self.totals[name] = self.totals.get(name, 0.0) + seconds

    @property
    def wall_s(self) -> float:
        return time.monotonic() - self._t0

    def share(self, name: str) -> float:
        """Fraction of the wall time spent in `name` (the duty cycle, for "train")."""
        return self.totals.get(name, 0.0) / max(self.wall_s, 1e-9)
