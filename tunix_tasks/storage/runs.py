"""A run's root: its frozen config, the DONE marker, and quarantine records.

Layout under the run root (see docs/architecture.md for the full table):

    config.json                  the RunConfig, written by `prepare` (a resume may change
                                 only `config.RESUMABLE` fields)
    run_id                       32 hex digits, written when `prepare` creates the run (a
                                 resume keeps it): tells a run re-created under the same
                                 URI from the one deleted there
    control/DONE                 {"reason": ..., "time": ...}: actors stop when it appears
    control/fleet.json           {"active": n, "reason": ..., "time": ...}: the autopilot's
                                 fleet; actor ids >= n park (admit no new episodes)
    quarantine/<shard key>       a shard that failed validation (moved here) ...
    quarantine/<shard key>.reason.json   ... and why

A process joins one incarnation of the run (`join_run`: its `run_id`, or the one its
caller prepared); actors and the learner write through a `RunFence`, which stops every
write once the run at the URI is another incarnation or gone (`RunReplaced`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any, TypeVar

from tunix_tasks.config import ConfigError, RunConfig, check_resume, config_from_dict
from tunix_tasks.storage.layout import RunLayout
from tunix_tasks.storage.metrics import read_metrics
from tunix_tasks.storage.store import (
    NotAFile,
    NotFound,
    ObjectStore,
    PreconditionFailed,
    StoreError,
    open_store,
    read_small,
)
from tunix_tasks.storage.uri import join_uri
from tunix_tasks.untrusted import json_loads

#: A run's config.json is a few KB; far more is not a config (and is not read into memory).
MAX_CONFIG_BYTES = 16 << 20
#: A DONE marker is a few dozen bytes; a larger one is not read (it still means done).
MAX_DONE_BYTES = 64 << 10
MAX_EPOCH_S = 253_402_300_800  # 10000-01-01: `datetime` shows no later time
#: What `<run>/run_id` holds (and `--run-id` takes: "" for a run from before ids).
RUN_ID_FORM = re.compile(r"[0-9a-f]{32}")

log = logging.getLogger(__name__)
T = TypeVar("T")


def write_config(cfg: RunConfig) -> ObjectStore:
    """Write config.json under the run root (idempotent) and clear an old DONE marker.

    Of an existing run only the fields a resume may change may differ from its stored
    config (`config.check_resume`): any other change raises `ConfigError`, nothing written."""
    store = open_store(cfg.run_uri)
    stored = stored_config(store)
    if stored is not None:
        check_resume(stored, cfg)
    else:  # a new run, or one created again where another was deleted: a new incarnation
        # A local run deleted as its contents (`rm -r runs/NAME/*`) leaves the hidden
        # generations of its id (`.run_id.gens/`) without the id itself: written over.
        # Read before the id: a concurrent prepare's id, once seen here, is seen there too.
        versioned = store.read_versioned(RunLayout.RUN_ID)
        stale = versioned[1] if versioned is not None and _no_id_after_a_wait(store) else 0
        with contextlib.suppress(PreconditionFailed):  # a concurrent prepare's came first
            store.write_if_generation(RunLayout.RUN_ID, uuid.uuid4().hex.encode(), stale)
    store.write_bytes(RunLayout.CONFIG, cfg.to_json().encode())
    store.delete(RunLayout.DONE)
    store.delete(RunLayout.FLEET)  # a resumed run starts with actor.num_actors active
    return store


def _no_id_after_a_wait(store: ObjectStore) -> bool:
    """No `run_id` now nor a second later: a concurrent prepare's id is briefly in its
    generation files before its plain file (locally), and must not be taken for one
    left by a run deleted as its contents."""
    if run_id(store):
        return False
    time.sleep(1.0)
    return not run_id(store)


def stored_config(store: ObjectStore) -> RunConfig | None:
    """The run's config.json (None before the run exists); `ConfigError` if corrupt, not
    a regular file, or over `MAX_CONFIG_BYTES`."""
    try:
        data = read_small(store, RunLayout.CONFIG, MAX_CONFIG_BYTES, error=ConfigError)
    except NotAFile as err:  # there, but no file: "no config.json" would mislead
        raise ConfigError(str(err)) from None
    except NotFound:
        return None
    try:
        raw = json_loads(data)
    except ValueError as err:
        where = join_uri(store.uri, RunLayout.CONFIG)
        raise ConfigError(f"{where} is corrupt: not valid JSON ({err})") from None
    return config_from_dict(raw)


def run_id(store: ObjectStore) -> str:
    """This incarnation of the run (`write_config`): 32 hex digits, or "" for a run created
    before runs had one; `ConfigError` when the file is not such an id. Written once, by
    compare-and-swap, so concurrent prepares of a new run agree on it; readers start once
    `config.json`, written after it, is there."""
    try:
        data = read_small(store, RunLayout.RUN_ID, 64, error=ConfigError)
    except NotAFile as err:  # a FIFO, a device: "no id" would hide it
        raise ConfigError(str(err)) from None
    except NotFound:
        return ""
    text = data.decode("ascii", "replace").strip()
    if not RUN_ID_FORM.fullmatch(text):
        where = join_uri(store.uri, RunLayout.RUN_ID)
        raise ConfigError(
            f"{where} is corrupt: not 32 hex digits ({text[:40]!r}); it names the run's "
            "incarnation: delete it (in a local folder with its .run_id.gens/) to run on "
            "without one"
        )
    return text


class RunReplaced(RuntimeError):
    """The run a process joined is gone from its URI: deleted, or deleted and created
    again (another `run_id`). The process writes nothing more there and stops; a retry
    would only join the other run."""


def replaced_since(store: ObjectStore, joined: str) -> str | None:
    """Why the run at `store` is no longer the incarnation whose `run_id` was `joined`
    ("" for a run from before ids), or None while it still is. A `run_id` that is gone
    while `config.json` is there (a delete cut short) is still the run. `StoreError`
    when the store cannot say."""
    try:
        now = run_id(store)
    except ConfigError as err:  # written over by hand or by something broken
        return f"the run's id is no longer readable: {err}"
    if not now and not store.exists(RunLayout.CONFIG):
        return (
            f"{store.uri} holds no run: deleted (or never created there: no "
            f"{RunLayout.RUN_ID}, no {RunLayout.CONFIG})"
        )
    if now in (joined, ""):
        return None
    was = f"run_id {joined}" if joined else "a run from before run ids"
    return f"{store.uri} was created again (run_id {now}) after this process joined {was}"


def replaced_if_known(store: ObjectStore, joined: str) -> str | None:
    """`replaced_since`, with None also when the store cannot say: for a caller that is
    already ending on another failure and only asks whether the run is the reason."""
    try:
        return replaced_since(store, joined)
    except (StoreError, OSError):  # locally also a permission or I/O error on the id
        return None


def join_run(run_uri: str, expected: str | None = None) -> tuple[RunConfig, ObjectStore, str]:
    """The config, store and `run_id` of an existing run, for a process that joins it.
    `expected`: the id the caller's run was prepared with (a DAG run's, `train`'s), so a
    retry of its task never joins a run created again there (`RunReplaced`). The id is
    read before the config: should the run be created again between the two reads, the
    process is fenced at its first write (`RunFence`), never trained on another config."""
    store = open_store(run_uri)
    if expected is None:
        expected = run_id(store)
    elif why := replaced_since(store, expected):
        raise RunReplaced(why)
    return _existing_config(store), store, expected


#: The `ObjectStore` reads a `RunFence` passes through (`local_path` for messages).
_FENCE_READS = frozenset(
    {"read_bytes", "read_head", "size", "read_versioned", "list", "list_folders", "exists"}
    | {"open_input", "read_to", "local_path"}
)


class RunFence:
    """An `ObjectStore` that writes only while its run is the incarnation it joined.

    A write looks at the run's `run_id` (32 bytes: one small request on gs://) first and
    raises `RunReplaced` once it names another run, or the run is gone; from then on
    every write raises without looking, and `on_replaced(reason)` (an actor's or the
    learner's `request_stop`) is called once. The look and the write are two requests,
    so the run may be replaced between them:

    - a key only its writer writes (`RunLayout.written_once`: a shard, a metrics chunk),
      or an object a compare-and-swap created, gets a second look after the write, which
      takes the write back (deletes it, if it still holds what was written) when the run
      was replaced meanwhile: such a key in the new run can only be this writer's;
    - another key (a snapshot file, the flow report, DONE) cannot be taken back without
      perhaps deleting the new run's own: its write may land there, once;
    - a write that failed as the run's folder went (a local temp file renamed away with
      it) is `RunReplaced`, not a storage failure;
    - deleting a written-once key is not looked at: it cannot be another run's.

    `fresh_s` > 0 lets a write of a key under `fresh_for` skip the look before it when
    the last look is younger (the learner's metrics and flow report, written on its
    train loop: one look a second, not one a write); every other write, the second look
    and `check()` always read the id. Reads pass through; handles that could
    write around the looks (`arrow_filesystem`, `orbax_path`) are not there.

        fence = RunFence(store, run_id(store), on_replaced=actor.request_stop)
        ShardWriter(fence, ...).flush()     # RunReplaced once the run is replaced
        fence.replaced                      # the reason, "" while the run is the same
    """

    def __init__(
        self,
        store: ObjectStore,
        joined: str,
        *,
        on_replaced: Callable[[str], None] = lambda _why: None,
        fresh_s: float = 0.0,
        fresh_for: tuple[str, ...] = (),
    ) -> None:
        self._store, self.joined, self._on_replaced = store, joined, on_replaced
        self.uri = store.uri
        self.replaced = ""
        self._fresh_s, self._fresh_for = fresh_s, fresh_for
        self._looked = -float("inf")  # monotonic time of the last look that found the run
        self._lock = threading.Lock()  # writers on several threads find it at once

    def __getattr__(self, name: str) -> Any:
        if name not in _FENCE_READS:  # a handle that could write around the check
            raise AttributeError(
                f"RunFence passes reads through ({', '.join(sorted(_FENCE_READS))}) and "
                f"checks writes; not {name!r}"
            )
        return getattr(self._store, name)

    def check(self) -> None:
        """Raise `RunReplaced` if the run is no longer the one joined (reads the id)."""
        if self.replaced:
            raise RunReplaced(self.replaced)
        looked = time.monotonic()
        why = replaced_since(self._store, self.joined)
        if why is None:
            self._looked = max(self._looked, looked)
            return
        with self._lock:  # another writer's thread may have found it meanwhile
            first = not self.replaced
            if first:
                self.replaced = why
        if first:
            self._on_replaced(why)
        raise RunReplaced(self.replaced)

    def _check_before(self, key: str) -> None:
        fresh = time.monotonic() - self._looked < self._fresh_s and key.startswith(self._fresh_for)
        if self.replaced or not fresh:
            self.check()

    def write_bytes(self, key: str, data: Any) -> None:
        self._between_looks(
            key,
            lambda: self._store.write_bytes(key, data),
            lambda _: self._store.read_bytes(key) == memoryview(data).tobytes(),
            once=RunLayout.written_once(key),
        )

    def write_if_generation(self, key: str, data: bytes, generation: int) -> int:
        # Only a write that created the object can be taken back exactly; one over an
        # existing generation found, at best, the deleted run's (on gs:// a new run's
        # objects have other generations, so its precondition fails there).
        return self._between_looks(
            key,
            lambda: self._store.write_if_generation(key, data, generation),
            lambda written: self._generation(key) == written,
            once=generation == 0,
        )

    def _generation(self, key: str) -> int:
        versioned = self._store.read_versioned(key)
        return versioned[1] if versioned is not None else 0

    def _between_looks(
        self, key: str, write: Callable[[], T], ours: Callable[[T], bool], *, once: bool
    ) -> T:
        """`write()` between the look before it and, for a key that can be taken back
        (`once`), the look after it."""
        self._check_before(key)
        try:
            result = write()
        except (OSError, StoreError):
            with contextlib.suppress(StoreError):  # the store cannot say: its own error
                self.check()
            raise
        if not once:
            return result
        try:
            self.check()
        except RunReplaced:
            with contextlib.suppress(NotFound):
                if ours(result):
                    self._store.delete(key)
                    log.warning("%s: written as the run was replaced; taken back", key)
            raise
        except StoreError:  # written; the next write looks again (no second copy now)
            pass
        return result

    def delete(self, key: str) -> None:
        if RunLayout.written_once(key):  # cannot be another run's (a consumed shard)
            if self.replaced:
                raise RunReplaced(self.replaced)
        else:
            self._check_before(key)
        self._store.delete(key)


def read_config(run_uri: str) -> tuple[RunConfig, ObjectStore]:
    """The config of an existing run and its store; `ConfigError` if missing or corrupt."""
    store = open_store(run_uri)
    return _existing_config(store), store


def _existing_config(store: ObjectStore) -> RunConfig:
    cfg = stored_config(store)
    if cfg is None:
        raise ConfigError(
            f"{store.uri} has no {RunLayout.CONFIG}; create the run first "
            "(tunix-tasks train / prepare)"
        )
    return cfg


def prepared_at(store: ObjectStore) -> float | None:
    """When the run was last prepared (its config.json written, by `train` / `prepare` or
    a resume), seconds since the epoch; None without one. `env.latency_schedule` counts
    from it, so every actor of a run, whenever it started, sees the same schedule."""
    infos = [i for i in store.list(RunLayout.CONFIG) if i.key == RunLayout.CONFIG]
    return infos[0].updated if infos else None


def mark_done(store: ObjectStore, reason: str) -> None:
    store.write_bytes(RunLayout.DONE, json.dumps({"reason": reason, "time": time.time()}).encode())


def is_done(store: ObjectStore) -> dict[str, Any] | None:
    """The run's DONE record, `{"reason": str, "time": float | None}`, or None while the
    run is not done. The marker's presence is what counts: a body that is not what
    `mark_done` writes (hand-written, cut short, empty, too large to read) still means
    done, and its reason says so; no reader stops on it with a traceback."""
    try:
        body = json_loads(read_small(store, RunLayout.DONE, MAX_DONE_BYTES, error=ValueError))
    except NotFound:
        return None
    except ValueError as err:
        return {"reason": f"(DONE marker unreadable: {err})", "time": None}
    if not isinstance(body, dict):
        return {"reason": "(DONE marker not a JSON object)", "time": None}
    return {"reason": str(body.get("reason", "")), "time": _epoch_s(body.get("time"))}


def _epoch_s(value: Any) -> float | None:
    """`value` as seconds since the epoch, if it is one a date can show (0 to year 9999)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if 0 <= value < MAX_EPOCH_S else None


def finished_step(store: ObjectStore, max_steps: int) -> int | None:
    """The learner's last step if the run is finished (DONE, and its step records reached
    `max_steps`); None if it is not: running, stopped early, crashed, or `max_steps` was
    raised since."""
    if is_done(store) is None:
        return None
    records = read_metrics(store, "learner")
    last = max((int(r["step"]) for r in records if "step" in r and "loss" in r), default=0)
    return last if last >= max_steps else None


def write_fleet(store: ObjectStore, active: int, reason: str) -> None:
    """Ask the run's actors with ids `active` and above to park (the autopilot's
    `ParkedFleet`); those below admit episodes as flow control lets them."""
    body = {"active": int(active), "reason": reason, "time": time.time()}
    store.write_bytes(RunLayout.FLEET, json.dumps(body).encode())


def read_fleet(store: ObjectStore) -> int | None:
    """The active fleet `write_fleet` asked for; None before any. A control file that
    does not hold a count >= 0 raises ValueError naming it."""
    try:
        raw = store.read_bytes(RunLayout.FLEET)
    except NotFound:
        return None
    return parse_fleet(raw)


def parse_fleet(raw: bytes) -> int:
    """The active count of a fleet control file's bytes (`read_fleet`)."""
    try:
        active = json_loads(raw)["active"]
    except (ValueError, KeyError, TypeError) as err:
        raise ValueError(f"{RunLayout.FLEET}: not a fleet control file ({err!r})") from None
    if isinstance(active, bool) or not isinstance(active, int) or active < 0:
        raise ValueError(f"{RunLayout.FLEET}: 'active' must be a count >= 0, got {active!r}")
    return active


def quarantine(store: ObjectStore, key: str, *, reason: str, detail: str) -> str:
    """Move a bad shard under quarantine/ with a reason record; returns the new key."""
    dest = RunLayout.quarantined(key)
    with contextlib.suppress(NotFound):  # already moved by an earlier attempt
        store.write_bytes(dest, store.read_bytes(key))
    store.write_bytes(
        RunLayout.quarantine_reason(key),
        json.dumps(
            {"shard": key, "reason": reason, "detail": detail, "time": time.time()}
        ).encode(),
    )
    store.delete(key)
    return dest
