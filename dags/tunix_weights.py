"""The `tunix_weights` asset, and how a run's new weight snapshots are announced.

The learner is one long task, and Airflow only emits `outlets` events when a task
*succeeds*, so the learner task runs a `WeightsWatcher` next to the learner: a thread
that polls the run's `weights/LATEST` pointer (through `tunix_tasks.storage.weights`)
and, for every new version, has a `WeightsEventPublisher` post one asset event through
the REST API (`POST /api/v2/assets/events`) with `extra={"run_uri", "version", "path"}`.
The same watcher serves both launchers: the learner in the task's own process and the
learner in a Kubernetes pod write the same pointer. Versions published within one poll
interval are announced once, as the newest (the eval DAG evaluates the newest anyway).

The same thread also runs `on_poll` callbacks, e.g. a `LearnerProgressLog`: one concise
INFO line per `TUNIX_LOG_EVERY_STEPS` learner steps (default 10) in the task log, read
from the run's metrics (`MetricsTail`), so the log shows step / reward / loss whether
the learner runs in the task's process or in a pod.

`TUNIX_AIRFLOW_ASSET_EVENTS=0` turns the events off (e.g. for `dag.test()` without an
API server); `TUNIX_WEIGHTS_POLL_S` sets the poll interval (default 5 s).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from typing import Any

from airflow.sdk import Asset

log = logging.getLogger(__name__)

#: One asset for every run's weight snapshots; the event's extra says which run/version.
WEIGHTS_ASSET = Asset(name="tunix_weights", uri="tunix://weights", group="tunix")


def events_enabled() -> bool:
    return os.environ.get("TUNIX_AIRFLOW_ASSET_EVENTS", "1").lower() not in ("0", "false", "off")


class WeightsEventPublisher:
    """`(version, snapshot_uri)` callback: posts a `tunix_weights` asset event.

    Never raises: a lost event only means one snapshot is not evaluated, which must not
    kill a training run. Failures (after the client's retries) are logged and counted.
    """

    def __init__(self, run_uri: str, client: Any = None) -> None:
        self.run_uri = run_uri
        self.client = client  # a tunix_api.AirflowApiClient; built on first use
        self.posted: list[int] = []
        self.failed: list[int] = []

    def __call__(self, version: int, snapshot_uri: str) -> None:
        extra = {"run_uri": self.run_uri, "version": int(version), "path": snapshot_uri}
        if not events_enabled():
            log.info("asset events disabled (TUNIX_AIRFLOW_ASSET_EVENTS): %s", extra)
            return
        try:
            if self.client is None:
                from tunix_api import AirflowApiClient

                self.client = AirflowApiClient.from_environment()
            self.client.post_asset_event(WEIGHTS_ASSET.name, extra)
        except Exception as err:
            log.warning("%s event for v%s lost: %s", WEIGHTS_ASSET.name, version, err)
            self.failed.append(int(version))
        else:
            log.info("posted %s event: %s", WEIGHTS_ASSET.name, extra)
            self.posted.append(int(version))


class WeightsWatcher:
    """Calls `on_new(version, snapshot_uri)` each time the run's `weights/LATEST` moves.

    A context manager: entering records the current version (announced before, e.g. by
    the previous attempt) and starts the polling thread; leaving stops it and checks a
    last time, so the final snapshot is announced too.
    """

    def __init__(
        self,
        run_uri: str,
        on_new: Callable[[int, str], None],
        poll_s: float | None = None,
        on_poll: Callable[[], None] | None = None,
    ) -> None:
        self.run_uri = run_uri
        self.on_new = on_new
        self.on_poll = on_poll  # also called each poll (and at stop), e.g. LearnerProgressLog
        self.poll_s = float(poll_s or os.environ.get("TUNIX_WEIGHTS_POLL_S") or 5.0)
        self.seen: int | None = None
        self._store: Any = None
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._loop, name="tunix-weights-watcher", daemon=True
        )

    def __enter__(self) -> WeightsWatcher:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        latest = self._latest()
        self.seen = latest[0] if latest else None
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self.poll_s + 30)
        self.check()  # the final snapshot

    def _latest(self) -> tuple[int, str] | None:
        """(version, snapshot URI) of the run's LATEST pointer, or None (none / unreadable)."""
        from tunix_params import ensure_library_importable

        ensure_library_importable()
        from tunix_tasks.storage.store import open_store
        from tunix_tasks.storage.uri import join_uri
        from tunix_tasks.storage.weights import read_latest

        try:
            if self._store is None:
                self._store = open_store(self.run_uri)
            latest = read_latest(self._store)
        except Exception as err:  # a transient store error must not end the watch
            log.warning("reading the weights pointer of %s failed: %s", self.run_uri, err)
            return None
        if latest is None:
            return None
        version, prefix, _generation = latest
        return version, join_uri(self.run_uri, prefix)

    def check(self) -> None:
        """Announce LATEST if it is newer than the last version seen (and run `on_poll`)."""
        if self.on_poll is not None:
            try:
                self.on_poll()
            except Exception:
                log.exception("on_poll of the weights watcher of %s failed", self.run_uri)
        latest = self._latest()
        if latest is not None and (self.seen is None or latest[0] > self.seen):
            self.seen = latest[0]
            try:
                self.on_new(*latest)
            except Exception:
                log.exception("announcing weights v%s of %s failed", latest[0], self.run_uri)

    def _loop(self) -> None:
        while not self._stop.wait(self.poll_s):
            self.check()


class LearnerProgressLog:
    """`on_poll` callback: logs one INFO line per `every` learner steps (and, at `flush()`,
    the newest step not logged yet), read from the run's learner metrics (`MetricsTail`)."""

    FIELDS = (("reward_mean", ".3f"), ("loss", ".4g"), ("tokens_per_s", ".0f"), ("version", "d"))

    def __init__(self, run_uri: str, every: int | None = None) -> None:
        self.run_uri = run_uri
        self.every = max(1, int(every or os.environ.get("TUNIX_LOG_EVERY_STEPS") or 10))
        self.logged_step: int | None = None
        self._pending: dict[str, Any] | None = None
        self._tail: Any = None

    def __call__(self) -> None:
        from tunix_params import ensure_library_importable

        ensure_library_importable()
        from tunix_tasks.storage.metrics import MetricsTail
        from tunix_tasks.storage.store import open_store

        try:
            if self._tail is None:
                self._tail = MetricsTail(open_store(self.run_uri), "learner")
            records = self._tail.poll()
        except Exception as err:  # the next poll retries
            log.warning("reading the learner metrics of %s failed: %s", self.run_uri, err)
            return
        for rec in records:
            step = rec.get("step")
            if not isinstance(step, int) or "loss" not in rec:
                continue
            if self.logged_step is None or step >= self.logged_step + self.every:
                self._log(rec)
            elif step > self.logged_step:
                self._pending = rec

    def flush(self) -> None:
        self()
        if self._pending is not None and self._pending["step"] > (self.logged_step or -1):
            self._log(self._pending)

    def _log(self, rec: dict[str, Any]) -> None:
        parts = []
        for name, fmt in self.FIELDS:
            value = rec.get(name)
            if isinstance(value, int | float):
                parts.append(f"{name}={format(value, fmt if fmt != 'd' else '')}")
        log.info("learner step %d: %s", rec["step"], " ".join(parts))
        self.logged_step, self._pending = rec["step"], None
