"""JSON-lines metrics: every process appends records; the report reads them all.

Object stores cannot append, so a writer buffers records and commits them as chunk
objects `metrics/<process>/<start_ms>-<rand>.jsonl` every few seconds (and at close).
A crash loses at most one flush interval of metrics, never training data.

    metrics = MetricsWriter(store, "learner")
    metrics.log(step=3, loss=0.12)        # adds "time" and "process"
    metrics.close()
    records = read_metrics(store, "learner")
"""

from __future__ import annotations

import json
import math
import threading
import time
import uuid
from typing import Any

from tunix_tasks.storage.store import ObjectStore

METRICS_PREFIX = "metrics/"


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if hasattr(value, "item"):  # numpy / jax scalars
        return _clean(value.item())
    return value


class MetricsWriter:
    def __init__(self, store: ObjectStore, process: str, *, flush_interval_s: float = 5.0) -> None:
        self._store = store
        self.process = process
        self.flush_interval_s = flush_interval_s
        self._buffer: list[str] = []
        self._last_flush = time.monotonic()
        self._lock = threading.Lock()

    def log(self, **fields: Any) -> None:
        record = {"time": time.time(), "process": self.process}
        record.update({k: _clean(v) for k, v in fields.items()})
        with self._lock:
            self._buffer.append(json.dumps(record, default=str))
        if time.monotonic() - self._last_flush >= self.flush_interval_s:
            self.flush()

    def flush(self) -> None:
        with self._lock:
            if not self._buffer:
                return
            lines, self._buffer = self._buffer, []
            self._last_flush = time.monotonic()
        key = f"{METRICS_PREFIX}{self.process}/{int(time.time() * 1000):013d}-{uuid.uuid4().hex[:6]}.jsonl"
        self._store.write_bytes(key, ("\n".join(lines) + "\n").encode())

    def close(self) -> None:
        self.flush()


def read_metrics(store: ObjectStore, process: str | None = None) -> list[dict[str, Any]]:
    """All records (of one process name prefix, or all), sorted by time."""
    prefix = METRICS_PREFIX + (f"{process}" if process else "")
    records: list[dict[str, Any]] = []
    for info in store.list(prefix):
        if not info.key.endswith(".jsonl"):
            continue
        for line in store.read_bytes(info.key).decode().splitlines():
            if line.strip():
                try:
                    records.append(json.loads(line))
                except ValueError:
                    continue  # a torn line never happens with atomic writes, but be lenient
    records.sort(key=lambda r: r.get("time", 0))
    return records
