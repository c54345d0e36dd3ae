"""Background weight publishing that the train step never waits on, under the lease.

The params' copies to host memory are queued before `publish` is called
(`Trainer.snapshot_params`: the next update still donates their device buffers); the
background thread waits for them. Converting to float32, checking, serializing,
checksumming and uploading run in that one thread, fed by a one-slot
mailbox: a publish requested while another is still uploading waits in the slot, and a
newer one replaces it there (coalesced: the newest version wins, so versions reach the
store in increasing order and a slow store costs versions, not step time).

    pub = SnapshotPublisher(store, lease, model=model_meta(cfg.model))
    pub.publish(trainer.snapshot_params(), version=3, step=60)   # returns at once
    pub.check()         # each step: raises a failed publish (PublishConflict, NonFiniteWeights)
    pub.wait()          # at a checkpoint: every version asked for is out (or raises)
    pub.close()         # flushes, then stops the thread

A failed publish stops the publisher: what is waiting is dropped, nothing later is
published, and `check` / `wait` / `publish` raise that error until the learner stops.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import ArrayLike

from tunix_tasks.storage.lease import Lease
from tunix_tasks.storage.outage import StoreOutage
from tunix_tasks.storage.retention import SnapshotRetention
from tunix_tasks.storage.store import ObjectStore
from tunix_tasks.storage.weights import WeightsPublisher

log = logging.getLogger(__name__)

#: Niceness added to the publisher's thread (Linux: per thread): where the train step runs
#: on the same CPU cores, the step comes first and a slow publish is coalesced instead.
PUBLISH_NICE = 10


@dataclass(frozen=True)
class _Request:
    flat: dict[str, ArrayLike]  # the publisher's own dict: emptied as it converts
    version: int
    step: int


def _float32(flat: dict[str, ArrayLike]) -> dict[str, np.ndarray]:
    """`flat` as float32 numpy, emptying it as it goes. Waits here, not on the step's path,
    for copies still landing (`Trainer.snapshot_params`); each host copy is dropped once
    converted (a sharded array's or a bfloat16 one's conversion is a copy of its own), so
    a snapshot is held about once, not twice."""
    return {name: np.asarray(flat.pop(name), np.float32) for name in sorted(flat)}


def _release(flat: dict[str, np.ndarray]) -> None:
    """Free `flat`'s tensors one at a time, letting the learner's thread run between: a
    free holds the GIL (a 454 MB snapshot freed at once stalled the train loop ~200 ms,
    `benchmarks/publishing.py --pin`)."""
    while flat:
        flat.popitem()
        time.sleep(0)


class SnapshotPublisher:
    """Publishes in the background; a store outage is ridden out (retried with backoff,
    up to the outage limit) rather than ending the learner; `retention` prunes old
    snapshots after each publish.

    Counters for the step records: `coalesced` (versions replaced in the mailbox by a
    newer one, never published), `last_publish_s` (the background time of the newest
    publish done: check, encode, upload, `LATEST`, pruning)."""

    def __init__(
        self,
        store: ObjectStore,
        lease: Lease,
        *,
        model: dict[str, Any],
        retention: SnapshotRetention | None = None,
        outage: StoreOutage | None = None,
        adapter_base: dict[str, str] | None = None,
        full_every: int = 1,
    ) -> None:
        """`adapter_base` ({"fingerprint", "uri"}): snapshots hold LoRA adapters for that
        base; else full params, as deltas between full snapshots every `full_every`."""
        self._weights = WeightsPublisher(store, full_every=1 if adapter_base else full_every)
        self._adapter_base = adapter_base
        self._lease = lease
        self._model = model
        self.retention = retention
        self._outage = outage or StoreOutage()
        self._cond = threading.Condition()
        self._slot: _Request | None = None  # the one publish waiting for the thread
        self._busy = False  # the thread is publishing a request it took from the slot
        self._closing = False
        self._error: BaseException | None = None
        self._asked = self._weights.latest_version  # newest version asked for
        self.coalesced = 0
        self.last_publish_s = 0.0
        self._thread = threading.Thread(target=self._serve, name="publish", daemon=True)
        self._thread.start()

    @property
    def latest_version(self) -> int:
        """The newest version published (by anyone, as read at start), -1 if none. With a
        missing or invalid `LATEST`: the newest snapshot folder under `weights/`."""
        return self._weights.latest_version

    def publish(self, flat: Mapping[str, ArrayLike], *, version: int, step: int) -> None:
        """Hand `flat` (arrays in host memory, or still being copied there; not modified
        afterwards) to the thread and return; replaces a publish still waiting in the
        slot. `version` must be newer than any asked for before (ValueError)."""
        self._lease.ensure()  # LeaseLost: a learner without the lease never publishes
        with self._cond:
            self._raise_failed()
            if version <= self._asked:
                raise ValueError(f"version {version} is not newer than v{self._asked}")
            if self._closing:
                raise RuntimeError("the snapshot publisher is closed")
            if self._slot is not None:
                self.coalesced += 1
                log.debug("weights v%d superseded by v%d", self._slot.version, version)
            self._slot, self._asked = _Request(dict(flat), version, step), version
            self._cond.notify_all()

    def check(self) -> None:
        """Raise the error of a failed background publish, if any; never blocks."""
        with self._cond:
            self._raise_failed()

    def wait(self) -> None:
        """Block until every version asked for is published (or superseded by a newer
        one that is), then raise a failed publish's error, if any."""
        with self._cond:
            self._cond.wait_for(lambda: self._idle() or self._error is not None)
            self._raise_failed()

    def close(self) -> None:
        """Publish what is waiting, then stop the thread (a failure is not raised here:
        `wait` before `close` to see it)."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join()

    def _idle(self) -> bool:
        return self._slot is None and not self._busy

    def _raise_failed(self) -> None:
        if self._error is not None:
            raise self._error

    def _serve(self) -> None:
        if sys.platform == "linux":
            tid = threading.get_native_id()
            nice = min(os.getpriority(os.PRIO_PROCESS, tid) + PUBLISH_NICE, 19)
            os.setpriority(os.PRIO_PROCESS, tid, nice)
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._slot is not None or self._closing)
                if self._slot is None:  # closing, nothing left
                    return
                request, self._slot, self._busy = self._slot, None, True
            t0 = time.perf_counter()
            try:
                flat = _float32(request.flat)  # empties the request: one copy held, not two
                self._publish(flat, request.version, request.step)
                _release(flat)  # nor one while idle
            except BaseException as err:  # kept for the learner's thread, which stops on it
                with self._cond:
                    self._error, self._slot, self._busy = err, None, False
                    self._cond.notify_all()
                return
            with self._cond:
                self._busy = False
                self.last_publish_s = time.perf_counter() - t0
                self._cond.notify_all()

    def _publish(self, flat: dict[str, np.ndarray], version: int, step: int) -> None:
        def publish() -> None:
            kind = "adapter" if self._adapter_base else "full"  # "full": deltas when due
            self._weights.publish(
                flat,
                version=version,
                step=step,
                model=self._model,
                kind=kind,
                base=self._adapter_base,
            )

        self._outage.call(f"publishing weights v{version}", publish)
        log.info("published weights v%d at step %d", version, step)
        if self.retention is not None:
            self.retention.prune(version)
