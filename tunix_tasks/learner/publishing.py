"""Background weight publishing, in version order, only while the learner holds the lease.

The params are copied to host memory when `publish` is called (the next update donates
their device buffers); serializing, checksumming and uploading run in one background
thread, so versions land in order and a slow store does not stall the train step.

    pub = SnapshotPublisher(store, lease, model=model_meta(cfg.model))
    pub.publish(trainer.flat_params(), version=3, step=60)
    pub.wait()          # raises a failed publish (e.g. PublishConflict) here
    pub.close()
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from tunix_tasks.storage.lease import Lease
from tunix_tasks.storage.outage import StoreOutage
from tunix_tasks.storage.retention import SnapshotRetention
from tunix_tasks.storage.store import ObjectStore
from tunix_tasks.storage.weights import WeightsPublisher

log = logging.getLogger(__name__)


class SnapshotPublisher:
    """Publishes in the background; a store outage is ridden out (retried with backoff,
    up to the outage limit) rather than ending the learner; `retention` prunes old
    snapshots after each publish."""

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
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="publish")
        self._pending: Future | None = None

    @property
    def latest_version(self) -> int:
        """The newest version published (by anyone, as read at start), -1 if none. With a
        missing or invalid `LATEST`: the newest snapshot folder under `weights/`."""
        return self._weights.latest_version

    def publish(self, flat: dict[str, np.ndarray], *, version: int, step: int) -> None:
        self._lease.ensure()  # LeaseLost: a learner without the lease never publishes
        self.wait()  # keeps versions in order
        self._pending = self._pool.submit(self._publish, flat, version, step)

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

    def wait(self) -> None:
        if self._pending is not None:
            done, self._pending = self._pending, None
            done.result()

    def close(self) -> None:
        self._pool.shutdown(wait=True)
