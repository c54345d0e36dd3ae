"""Riding out an object-store outage: retry with backoff, keep the data, give up clearly.

Every store call retries transient errors itself for up to the store's retry deadline
(`TUNIX_STORE_RETRY_DEADLINE_S`, 120 s by default), then raises `StoreError`. An actor
must survive longer outages without losing what it produced, so it goes through a
`StoreOutage`, which knows since when the store has been failing:

- `call(what, fn, ...)`: a call that must succeed (committing a shard). Retried with
  exponential backoff (1 s doubling to 30 s) until it succeeds; the data stays buffered
  meanwhile, and the caller is blocked, so the actor produces nothing new. Returns None
  early when the actor is asked to stop (the final flush retries once more), and raises
  `StoreUnavailable` once the store has failed for `limit_s` (default 1 h, or the
  environment's `TUNIX_ACTOR_STORE_OUTAGE_S`) or past `deadline`.
- `tolerate(what, fn, ...)`: a call that may fail (polling weights or DONE, metrics):
  on `StoreError` it returns None, and the caller tries again on its next round.

A command's first contact with a store is the exception: nothing is buffered yet, and a
store that never answered is more likely mistyped or down than in a passing outage.
`first_contact(uri, fn, ...)` gives that call at most `TUNIX_STORE_CONNECT_DEADLINE_S`
(30 s), however the backend retries or hangs, then raises `StoreUnavailable` (`train`
starts with it).

The outage ends with the first store call that works: `observe(store)` wraps the store
so that every successful call (or a NotFound: the store answered) says so. A call that
did nothing (a flush with nothing due) proves nothing, so `tolerate` never ends an outage
itself. Each outage is logged when it starts (and every 30 s), and when it ends.

    outage = StoreOutage(should_stop=actor_should_stop)
    store = outage.observe(store)                   # hand this one to writers and readers
    outage.call("shard commit", writer.flush)
    done = outage.tolerate("DONE check", is_done, store)
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from tunix_tasks.storage.store import NotFound, StoreError

log = logging.getLogger(__name__)

T = TypeVar("T")
LIMIT_ENV = "TUNIX_ACTOR_STORE_OUTAGE_S"
DEFAULT_LIMIT_S = 3600.0
CONNECT_ENV = "TUNIX_STORE_CONNECT_DEADLINE_S"
DEFAULT_CONNECT_S = 30.0


class StoreUnavailable(StoreError):
    """The object store kept failing for longer than the actor waits for it."""


def first_contact(uri: str, fn: Callable[..., T], *args: Any, deadline_s: float | None = None) -> T:
    """`fn(*args)`, a command's first call to the store at `uri`, within `deadline_s`
    (default: the environment's TUNIX_STORE_CONNECT_DEADLINE_S, else 30 s). Its own
    errors propagate; past the deadline (retries or a request that hangs) it raises
    `StoreUnavailable` and leaves the call to finish in a daemon thread."""
    if deadline_s is None:
        deadline_s = float(os.environ.get(CONNECT_ENV) or DEFAULT_CONNECT_S)
    box: dict[str, Any] = {}

    def call() -> None:
        try:
            box["result"] = fn(*args)
        except BaseException as err:  # handed to the caller's thread
            box["error"] = err

    thread = threading.Thread(target=call, name="store-first-contact", daemon=True)
    thread.start()
    thread.join(deadline_s)
    if thread.is_alive():
        raise StoreUnavailable(
            f"{uri}: unreachable: no answer within {deadline_s:.0f} s ({CONNECT_ENV}); "
            "check the URI, the network and the credentials"
        )
    if "error" in box:
        raise box["error"]
    return box["result"]


class StoreOutage:
    def __init__(
        self,
        *,
        should_stop: Callable[[], bool] = lambda: False,
        limit_s: float | None = None,
        backoff_s: tuple[float, float] = (1.0, 30.0),
    ) -> None:
        if limit_s is None:
            limit_s = float(os.environ.get(LIMIT_ENV) or DEFAULT_LIMIT_S)
        self.limit_s = limit_s
        self.backoff_s = backoff_s
        self._should_stop = should_stop
        self._lock = threading.Lock()
        self._since: float | None = None  # monotonic time of the first failure
        self._last_warning = 0.0
        self.outages = 0  # outages seen (for metrics and tests)
        self.failures = 0  # failed calls

    @property
    def down_s(self) -> float:
        """How long the store has been failing (0 when the last call worked)."""
        since = self._since
        return 0.0 if since is None else time.monotonic() - since

    def _failed(self, what: str, err: Exception) -> None:
        now = time.monotonic()
        with self._lock:
            self.failures += 1
            if self._since is None:
                self._since, self._last_warning = now, now
                self.outages += 1
                log.warning(
                    "object store unreachable (%s: %s); keeping the data and retrying with "
                    "backoff for up to %.0fs",
                    what,
                    err,
                    self.limit_s,
                )
            elif now - self._last_warning >= 30.0:
                self._last_warning = now
                log.warning("object store still unreachable after %.0fs (%s)", self.down_s, what)

    def _worked(self) -> None:
        if self._since is not None:
            with self._lock:
                if self._since is not None:
                    log.warning("object store reachable again after %.0fs", self.down_s)
                    self._since = None

    def observe(self, store: Any) -> _Observed:
        """`store`, whose calls that work end the outage."""
        return _Observed(store, self)

    def tolerate(self, what: str, fn: Callable[..., T], *args: Any) -> T | None:
        """`fn(*args)`, or None if the store failed (logged; the outage is counted) or the
        object was not found."""
        try:
            return fn(*args)
        except NotFound as err:  # the store answered: no outage (a pruned snapshot, say)
            log.warning("%s: %s", what, err)
            return None
        except StoreError as err:
            self._failed(what, err)
            return None

    def call(
        self,
        what: str,
        fn: Callable[..., T],
        *args: Any,
        failed: StoreError | None = None,
        deadline: float | None = None,
    ) -> T | None:
        """`fn(*args)`, retried with backoff while the store fails. `failed`: the error of
        a first attempt the caller made itself. With `deadline` (monotonic) a stop request
        does not end the retries; without, it does (returning None)."""
        delay, max_delay = self.backoff_s
        while True:
            if failed is None:
                try:
                    result = fn(*args)
                except NotFound:
                    raise
                except StoreError as err:
                    failed = err
                else:
                    self._worked()
                    return result
            self._failed(what, failed)
            if self.down_s > self.limit_s or (deadline is not None and time.monotonic() > deadline):
                raise StoreUnavailable(
                    f"{what}: object store unreachable for {self.down_s:.0f}s, giving up "
                    f"(limit {self.limit_s:.0f}s, {LIMIT_ENV}); last error: {failed}"
                ) from failed
            failed = None
            end = time.monotonic() + delay
            while time.monotonic() < end:
                if deadline is None and self._should_stop():
                    return None
                time.sleep(min(0.25, max(0.0, end - time.monotonic())))
            delay = min(max_delay, delay * 2)


class _Observed:
    """An object store whose calls report to a `StoreOutage` when they work."""

    def __init__(self, store: Any, outage: StoreOutage) -> None:
        self._store, self._outage = store, outage
        self.uri = store.uri

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._store, name)
        if not callable(attr):
            return attr

        def observed(*args: Any, **kwargs: Any) -> Any:
            try:
                result = attr(*args, **kwargs)
            except NotFound:
                self._outage._worked()  # the store answered
                raise
            self._outage._worked()
            return result

        return observed
