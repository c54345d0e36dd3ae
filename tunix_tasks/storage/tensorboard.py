"""TensorBoard event files of the metrics records, so `tensorboard --logdir RUN/metrics` works.

`MetricsWriter` hands every record it logs to an `EventChunks`, which turns the record's
numeric scalars (ints and finite floats; not bools, strings, lists or dicts; not `time`)
into one TensorBoard event at the record's wall time. Its step is the record's `step`.
A record without `step` but with a `<name>_step` field (the warm start's
`warm_start_step`) is a series of its own: tags `<name>/<field>` at that step, so the
warm start's `nll` and the RL steps' `nll` do not share an axis. Otherwise (actors) the
step is the number of records this writer logged before. The events are tensorboardX
protobufs (no TensorFlow; imported on first use: it loads google-cloud-storage).

Object stores cannot append, so the events are committed like the JSON-lines chunks, as
whole objects through the `ObjectStore` (file:// and gs:// alike), at most one per
`interval_s` (30 s) and at close:

    metrics/tensorboard/<process>/events.out.tfevents.<13-digit ms>.<rand>

Each object is a complete TFRecord event file; names sort by commit time, which is the
order TensorBoard reads a folder's files in. TensorBoard shows one run per process
(`tensorboard/learner`, `tensorboard/actor/actor-0000`). The JSON-lines records stay the
source of truth: a crash loses at most `interval_s` of events, and a failed commit keeps
the events for the next one (up to `MAX_PENDING`).

    scalars = read_scalars(store, "learner")   # {"loss": [(step, value), ...], ...}
"""

from __future__ import annotations

import logging
import math
import struct
import threading
import time
import uuid
from typing import Any

from tunix_tasks.storage.layout import RunLayout
from tunix_tasks.storage.store import ObjectStore

log = logging.getLogger(__name__)

PREFIX = RunLayout.METRICS + "tensorboard/"
INTERVAL_S = 30.0  # at most 120 event objects per hour and process
MAX_PENDING = 100_000  # events kept while commits fail; the oldest are dropped beyond
_SKIP = frozenset({"time", "step"})


def _tbx() -> Any:
    """tensorboardX's protobufs and crc, imported when first needed."""
    from tensorboardX import record_writer
    from tensorboardX.proto import event_pb2, summary_pb2

    return event_pb2.Event, summary_pb2.Summary, record_writer.masked_crc32c


def events_prefix(process: str) -> str:
    return f"{PREFIX}{process}/"


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def scalar_values(record: dict[str, Any]) -> dict[str, float]:
    """The record's fields that TensorBoard gets as scalars (tags as in the docstring)."""
    step_key = next((k for k in record if k.endswith("_step")), None)
    if _int(record.get("step")) is not None:
        step_key = None
    series = step_key[: -len("_step")] if step_key else ""
    out = {}
    for key, value in record.items():
        if key in _SKIP or key == step_key or isinstance(value, bool):
            continue
        if not isinstance(value, int | float):
            continue
        if math.isfinite(value):
            out[f"{series}/{key}" if series else key] = float(value)
    return out


def scalar_step(record: dict[str, Any]) -> int | None:
    """The record's own step (`step`, else a `<name>_step` field); None: use a count."""
    step = _int(record.get("step"))
    if step is None:
        step = next((_int(v) for k, v in record.items() if k.endswith("_step")), None)
    return step


def _frame(data: bytes) -> bytes:
    """One TFRecord: length, its masked crc32c, the data, its masked crc32c."""
    masked_crc32c = _tbx()[2]
    header = struct.pack("<Q", len(data))
    return (
        header
        + struct.pack("<I", masked_crc32c(header))
        + data
        + struct.pack("<I", masked_crc32c(data))
    )


def _unframe(blob: bytes) -> list[bytes]:
    masked_crc32c = _tbx()[2]
    records, i = [], 0
    while i < len(blob):
        header = blob[i : i + 8]
        (n,) = struct.unpack("<Q", header)
        (crc,) = struct.unpack("<I", blob[i + 8 : i + 12])
        data = blob[i + 12 : i + 12 + n]
        (data_crc,) = struct.unpack("<I", blob[i + 12 + n : i + 16 + n])
        if crc != masked_crc32c(header) or data_crc != masked_crc32c(data):
            raise ValueError("corrupt TFRecord (crc mismatch)")
        records.append(data)
        i += 16 + n
    return records


class EventChunks:
    """Buffers one process's scalar events; `commit()` writes them as one event file."""

    def __init__(self, store: ObjectStore, process: str, *, interval_s: float = INTERVAL_S):
        self._store = store
        self.process = process
        self.interval_s = interval_s
        self._pending: list[bytes] = []
        self._count = 0
        self._last_commit = time.monotonic()
        self._last_ms = 0  # object names strictly increase, even within one millisecond
        self._warned = False
        self._lock = threading.Lock()  # the buffer
        self._commit_lock = threading.Lock()  # one commit at a time: names sort in order

    def add(self, record: dict[str, Any]) -> None:
        """Buffer the record's scalars as one event; never raises (a bad value, or no
        tensorboardX, is logged once and its events skipped)."""
        try:
            self._add(record)
        except Exception as err:
            if not self._warned:
                self._warned = True
                log.warning("tensorboard event of %s skipped: %r", self.process, err)

    def _add(self, record: dict[str, Any]) -> None:
        values = scalar_values(record)
        step = scalar_step(record)
        step = self._count if step is None else step
        self._count += 1
        if not values:
            return
        Event, Summary, _ = _tbx()
        event = Event(
            wall_time=float(record.get("time", time.time())),
            step=step,
            summary=Summary(
                value=[Summary.Value(tag=k, simple_value=v) for k, v in values.items()]
            ),
        )
        data = _frame(event.SerializeToString())
        with self._lock:
            self._pending.append(data)
            if len(self._pending) > MAX_PENDING:
                del self._pending[: len(self._pending) - MAX_PENDING]

    def commit(self, *, force: bool = False) -> None:
        """Write the pending events as one object if `interval_s` passed (or `force`).
        Raises if the store fails; the events stay pending."""
        with self._commit_lock:
            with self._lock:
                due = force or time.monotonic() - self._last_commit >= self.interval_s
                if not self._pending or not due:
                    return
                events, self._pending = self._pending, []
                self._last_commit = time.monotonic()
            head = _tbx()[0](wall_time=time.time(), file_version="brain.Event:2")
            self._last_ms = max(int(time.time() * 1000), self._last_ms + 1)
            name = f"events.out.tfevents.{self._last_ms:013d}.{uuid.uuid4().hex[:8]}"
            try:
                self._store.write_bytes(
                    events_prefix(self.process) + name,
                    _frame(head.SerializeToString()) + b"".join(events),
                )
            except Exception:
                with self._lock:
                    self._pending[:0] = events
                raise


def read_scalars(store: ObjectStore, process: str) -> dict[str, list[tuple[int, float]]]:
    """Every scalar of `process`'s event files, per tag, as (step, value) in file order."""
    Event = _tbx()[0]
    out: dict[str, list[tuple[int, float]]] = {}
    for info in sorted(store.list(events_prefix(process)), key=lambda i: i.key):
        if "tfevents" not in info.key.rsplit("/", 1)[-1]:
            continue
        for data in _unframe(store.read_bytes(info.key)):
            event = Event.FromString(data)
            for value in event.summary.value:
                out.setdefault(value.tag, []).append((event.step, value.simple_value))
    return out
