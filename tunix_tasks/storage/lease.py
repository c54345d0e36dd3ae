"""The learner lease: at most one learner trains and publishes for a run.

`learner/LEASE` holds the owner and an expiry time, replaced only by compare-and-swap.
A learner acquires it at start (a second learner is refused with `LeaseHeldError`), a
background thread renews it every ttl/3, and if a renewal ever loses the swap the lease
is marked lost: the learner must then stop publishing (`ensure()` raises `LeaseLost`).

    lease = Lease(store, ttl_s=30)
    lease.acquire()            # or LeaseHeldError
    lease.start_renewing()
    ...
    lease.ensure()             # before every publish (the flag the renewals keep)
    lease.confirm()            # before every checkpoint: also reads the lease
    lease.release()

A lease left by a crashed process on the same host is taken over at once (its pid is
gone); otherwise it is free when it expires. Clocks are assumed roughly in sync.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from typing import Any

import psutil

from tunix_tasks.storage.layout import RunLayout
from tunix_tasks.storage.store import ObjectStore, PreconditionFailed, StoreError
from tunix_tasks.storage.uri import join_uri

log = logging.getLogger(__name__)


class LeaseHeldError(RuntimeError):
    """Another learner holds this run's lease."""


class LeaseLost(RuntimeError):
    """This learner no longer holds the lease and must stop publishing."""


class Lease:
    def __init__(self, store: ObjectStore, *, ttl_s: float = 30.0) -> None:
        self._store = store
        self.ttl_s = ttl_s
        self.owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self._generation = 0
        self._lost = False
        self._held = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    @property
    def where(self) -> str:
        return join_uri(self._store.uri, RunLayout.LEASE)

    def _record(self) -> bytes:
        now = time.time()
        return json.dumps(
            {
                "owner": self.owner,
                "host": socket.gethostname(),
                "pid": os.getpid(),
                "renewed_at": now,
                "expires_at": now + self.ttl_s,
            }
        ).encode()

    @staticmethod
    def _is_free(holder: dict[str, Any]) -> bool:
        if holder.get("released"):
            return True
        if time.time() > float(holder.get("expires_at", 0)):
            return True
        same_host = holder.get("host") == socket.gethostname()
        return bool(same_host and holder.get("pid") and not psutil.pid_exists(int(holder["pid"])))

    def acquire(self) -> None:
        got = self._store.read_versioned(RunLayout.LEASE)
        generation = 0
        if got is not None:
            data, generation = got
            try:
                holder = json.loads(data)
            except ValueError:
                holder = {}
            if holder and not self._is_free(holder):
                left = float(holder.get("expires_at", 0)) - time.time()
                raise LeaseHeldError(
                    f"run is held by learner {holder.get('owner')!r} (lease {self.where}, "
                    f"expires in {left:.0f}s); refusing to start a second learner"
                )
        try:
            self._generation = self._store.write_if_generation(
                RunLayout.LEASE, self._record(), generation
            )
        except PreconditionFailed:
            raise LeaseHeldError(
                f"another learner acquired {self.where} at the same moment"
            ) from None
        self._held = True
        self._lost = False

    def renew(self) -> None:
        with self._lock:
            if not self._held or self._lost:
                return
            try:
                self._generation = self._store.write_if_generation(
                    RunLayout.LEASE, self._record(), self._generation
                )
            except PreconditionFailed:
                self._lost = True
                log.error(
                    "lost the learner lease %s: another learner took over, or the run was "
                    "deleted (the learner's last line says which)",
                    self.where,
                )

    def start_renewing(self) -> None:
        if self._thread is not None:
            return

        def loop() -> None:
            while not self._stop.wait(self.ttl_s / 3):
                try:
                    self.renew()
                except StoreError as err:  # transient: try again next period
                    log.warning("lease renewal failed: %s", err)
                if self._lost:
                    return

        self._thread = threading.Thread(target=loop, name="lease-renewal", daemon=True)
        self._thread.start()

    @property
    def lost(self) -> bool:
        return self._lost

    def ensure(self) -> None:
        if self._lost:
            raise LeaseLost(
                f"another learner took over {self.where}: this learner ({self.owner}) is "
                "fenced off and stops; it publishes and checkpoints nothing more"
            )
        if not self._held:
            raise LeaseLost(f"this learner ({self.owner}) does not hold {self.where}")

    def confirm(self) -> None:
        """`ensure`, then read the lease: it must still be the generation this learner
        wrote. Catches, before a write a later learner would build on (a checkpoint it
        resumes from), what the next renewal (every ttl/3) would: the run deleted (the
        lease gone), or created again, or taken over. A store that does not answer
        leaves it to the renewals."""
        self.ensure()
        with self._lock:
            try:
                got = self._store.read_versioned(RunLayout.LEASE)
            except StoreError as err:
                log.warning("lease check before a checkpoint failed: %s", err)
                return
            if got is not None and got[1] == self._generation:
                return
            self._lost = True
        if got is None:
            raise LeaseLost(
                f"{self.where} is gone: the run was deleted; this learner ({self.owner}) is "
                "fenced off and stops; it publishes and checkpoints nothing more"
            )
        self.ensure()  # another learner's generation: the takeover message

    def abandon(self) -> None:
        """Stop renewing and let the lease go without writing to it: its run was deleted
        or created again, and nothing of this learner's belongs there."""
        self._stop_renewing()
        with self._lock:
            self._held = False

    def _stop_renewing(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def release(self) -> None:
        self._stop_renewing()
        with self._lock:
            if self._held and not self._lost:
                record = json.loads(self._record())
                record["released"] = True
                try:
                    self._store.write_if_generation(
                        RunLayout.LEASE, json.dumps(record).encode(), self._generation
                    )
                except (PreconditionFailed, StoreError) as err:
                    log.warning("could not release lease: %s", err)
            self._held = False
