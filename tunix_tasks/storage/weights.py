"""Weight snapshots: the learner publishes them, actors reload them.

Layout under the run root:

    weights/v00000042/params.safetensors   tensors (safetensors: no pickle, safe to load)
    weights/v00000042/manifest.json        version, step, sha256 of params, created_at, model
    weights/LATEST                         {"version": 42, "path": "weights/v00000042", "step": 7}

The snapshot is written first, `LATEST` last, with a compare-and-swap on the pointer's
generation, so a reader that follows `LATEST` always finds a complete snapshot, and a
learner that is no longer the only writer finds out (`PublishConflict`: it is fenced off)
instead of overwriting.

Nothing read from the store names a path: a pointer is valid only if its `version` is a
non-negative JSON integer and its `path` is exactly `RunLayout.snapshot(version)`, and a
snapshot is always read from `RunLayout.snapshot(version)`. A pointer that is not valid
(`PointerError`) is refused by actors (once, they keep their weights) and superseded by
the next learner that starts (`WeightsPublisher` CASes over its generation).

    publisher = WeightsPublisher(store)
    publisher.publish(flat_params, version=3, step=60, model={...})   # learner
    client = WeightsClient(store)
    update = client.poll(apply)  # actor, between episodes: None, or new (flat, manifest)
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
from safetensors.numpy import load as st_load
from safetensors.numpy import save as st_save

from tunix_tasks.storage.layout import RunLayout
from tunix_tasks.storage.store import NotFound, ObjectStore, PreconditionFailed, join_uri

log = logging.getLogger(__name__)

PARAMS_FILE = "params.safetensors"
MANIFEST_FILE = "manifest.json"
_SNAPSHOT_DIR = re.compile(re.escape(RunLayout.WEIGHTS) + r"v(\d+)/")


class WeightsError(RuntimeError):
    """A snapshot is missing, corrupt, fails its checksum, or does not fit the model."""


class PointerError(WeightsError):
    """`weights/LATEST` is not a valid pointer. `generation` is the bad pointer's, so the
    learner can replace it by compare-and-swap, and actors can tell it from a new one."""

    def __init__(self, message: str, generation: int) -> None:
        super().__init__(message)
        self.generation = generation

    def __reduce__(self):
        return type(self), (str(self), self.generation)


class PublishConflict(RuntimeError):
    """`weights/LATEST` moved under us: another learner published to this run, so this one
    is fenced off. `theirs` is the version the pointer holds now (None if unreadable),
    `ours` the version that was not published."""

    def __init__(self, message: str, *, theirs: int | None = None, ours: int = -1) -> None:
        super().__init__(message)
        self.theirs = theirs
        self.ours = ours

    def __reduce__(self):
        return _publish_conflict, (str(self), self.theirs, self.ours)


def _publish_conflict(message: str, theirs: int | None, ours: int) -> PublishConflict:
    return PublishConflict(message, theirs=theirs, ours=ours)


@dataclass(frozen=True)
class Manifest:
    version: int
    step: int
    sha256: str
    created_at: float
    num_bytes: int
    model: dict[str, Any]

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), indent=2, sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes) -> Manifest:
        raw = json.loads(data)
        return cls(**{k: raw[k] for k in cls.__dataclass_fields__})


def encode_snapshot(
    flat: dict[str, np.ndarray], *, version: int, step: int, model: dict[str, Any]
) -> tuple[bytes, Manifest]:
    """Serialize params (safetensors) and describe them (manifest with their sha256)."""
    blob = st_save({k: np.ascontiguousarray(v) for k, v in flat.items()})
    manifest = Manifest(
        version=version,
        step=step,
        sha256=hashlib.sha256(blob).hexdigest(),
        created_at=time.time(),
        num_bytes=len(blob),
        model=model,
    )
    return blob, manifest


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def parse_pointer(data: bytes) -> int:
    """The version a `LATEST` pointer names; ValueError unless `version` is a non-negative
    JSON integer and `path` is exactly that version's snapshot key (so no pointer can send
    a reader outside the run, or to another version's files)."""
    pointer = json.loads(data)  # UnicodeDecodeError / JSONDecodeError are ValueErrors
    if not isinstance(pointer, dict):
        raise ValueError(f"not a JSON object: {_short(pointer)}")
    version = pointer.get("version")
    if type(version) is not int or version < 0:  # bool is an int subclass: refused too
        raise ValueError(f"version {_short(version)} is not a non-negative integer")
    path = pointer.get("path")
    if path != RunLayout.snapshot(version):
        raise ValueError(
            f"path {_short(path)} is not {RunLayout.snapshot(version)!r}, the snapshot of v{version}"
        )
    return version


def read_latest(store: ObjectStore) -> tuple[int, str, int] | None:
    """(version, snapshot prefix, pointer generation) of the newest snapshot, or None.

    Raises `PointerError` (with the pointer's generation) if `LATEST` is not valid."""
    got = store.read_versioned(RunLayout.LATEST)
    if got is None:
        return None
    data, generation = got
    try:
        version = parse_pointer(data)
    except ValueError as err:
        raise PointerError(
            f"{join_uri(store.uri, RunLayout.LATEST)} is not a valid pointer: {err}", generation
        ) from None
    return version, RunLayout.snapshot(version), generation


def snapshot_versions(store: ObjectStore) -> list[int]:
    """Versions of the snapshot folders under `weights/` (complete or not), ascending.
    Only folders named exactly `RunLayout.snapshot(version)` count."""
    versions = set()
    for info in store.list(RunLayout.WEIGHTS):
        m = _SNAPSHOT_DIR.match(info.key)
        if m and f"{RunLayout.snapshot(int(m.group(1)))}/" == m.group(0):
            versions.add(int(m.group(1)))
    return sorted(versions)


def load_snapshot(store: ObjectStore, version: int) -> tuple[dict[str, np.ndarray], Manifest]:
    """Read and verify one snapshot; raises WeightsError on any problem."""
    prefix = RunLayout.snapshot(version)
    where = join_uri(store.uri, prefix)
    try:
        manifest = Manifest.from_json(store.read_bytes(f"{prefix}/{MANIFEST_FILE}"))
        blob = store.read_bytes(f"{prefix}/{PARAMS_FILE}")
    except NotFound as err:
        raise WeightsError(f"snapshot {where} is incomplete: {err}") from None
    except (ValueError, KeyError, TypeError) as err:
        raise WeightsError(f"snapshot {where} has an invalid manifest: {err}") from None
    digest = hashlib.sha256(blob).hexdigest()
    if digest != manifest.sha256:
        raise WeightsError(
            f"snapshot {where} fails its checksum: sha256 {digest[:12]}… != manifest {str(manifest.sha256)[:12]}…"
        )
    if manifest.version != version:
        raise WeightsError(f"snapshot {where} manifest says version {_short(manifest.version)}")
    try:
        flat = st_load(blob)
    except Exception as err:  # safetensors raises its own error types
        raise WeightsError(f"snapshot {where} is not valid safetensors: {err}") from None
    return flat, manifest


class WeightsPublisher:
    """Learner side. Remembers the pointer generation it wrote last, so a second writer
    (or a stale learner after failover) is detected on its next publish.

    A `LATEST` that is missing or not a valid pointer is superseded: `latest_version` is
    then the newest snapshot folder under `weights/` (valid or not, so no version number an
    actor may hold or have refused is reused), and the first publish CASes over the bad
    pointer's generation."""

    def __init__(self, store: ObjectStore) -> None:
        self._store = store
        self.pointer_found = True  # a LATEST object existed at start (valid or not)
        try:
            latest = read_latest(store)
        except PointerError as err:
            self._generation = err.generation
            self.latest_version = max(snapshot_versions(store), default=-1)
            log.warning(
                "%s; the next publish (newer than v%d) replaces it", err, self.latest_version
            )
            return
        if latest is None:
            self.pointer_found = False
            self._generation = 0
            self.latest_version = max(snapshot_versions(store), default=-1)
        else:
            self.latest_version, _, self._generation = latest

    def publish(
        self, flat: dict[str, np.ndarray], *, version: int, step: int, model: dict[str, Any]
    ) -> Manifest:
        if version <= self.latest_version:
            raise ValueError(f"version {version} is not newer than published {self.latest_version}")
        blob, manifest = encode_snapshot(flat, version=version, step=step, model=model)
        prefix = RunLayout.snapshot(version)
        self._store.write_bytes(f"{prefix}/{PARAMS_FILE}", blob)
        self._store.write_bytes(f"{prefix}/{MANIFEST_FILE}", manifest.to_json())
        pointer = json.dumps({"version": version, "path": prefix, "step": step}).encode()
        try:
            self._generation = self._store.write_if_generation(
                RunLayout.LATEST, pointer, self._generation
            )
        except PreconditionFailed as err:
            # A retried CAS whose first attempt landed (its reply was lost) finds our own
            # pointer: that is success, not a second learner.
            got = self._store.read_versioned(RunLayout.LATEST)
            if got is None or got[0] != pointer:
                raise self._conflict(version) from err
            self._generation = got[1]
        self.latest_version = version
        return manifest

    def _conflict(self, ours: int) -> PublishConflict:
        where = join_uri(self._store.uri, RunLayout.LATEST)
        try:
            latest = read_latest(self._store)
        except Exception:  # the message matters more than what the pointer holds now
            latest = None
        theirs = latest[0] if latest else None
        return PublishConflict(
            f"another learner published {f'v{theirs}' if theirs is not None else 'a version'} "
            f"over ours: this learner is fenced off and stops; its v{ours} was not published "
            f"and {where} is left to the other learner (a second learner ran on this run)",
            theirs=theirs,
            ours=ours,
        )


class WeightsClient:
    """Actor side: `poll(apply)` between episodes returns new weights when LATEST moves.

    A corrupt or mismatched snapshot (one that fails its checksum, or that `apply` refuses
    with a ValueError: a missing / extra tensor, a wrong shape or dtype) is refused with a
    logged error and remembered, so the actor keeps its current weights and does not retry
    the same bad version. `version` only advances once `apply` succeeded. A `LATEST` that
    is not a valid pointer is refused too, logged once per pointer generation."""

    def __init__(self, store: ObjectStore) -> None:
        self._store = store
        self.version = -1
        self.refused: dict[int, str] = {}
        self.refused_pointer: str | None = None  # why the current LATEST is refused
        self._refused_generation: int | None = None
        self.last_reload_s = 0.0

    def poll(
        self, apply: Callable[[dict[str, np.ndarray], Manifest], None] | None = None
    ) -> tuple[dict[str, np.ndarray], Manifest] | None:
        """New (flat, manifest), after `apply(flat, manifest)` took them; None otherwise."""
        try:
            latest = read_latest(self._store)
        except PointerError as err:
            if err.generation != self._refused_generation:
                self._refused_generation, self.refused_pointer = err.generation, str(err)
                log.error("refusing weights pointer, keeping v%d: %s", self.version, err)
            return None
        self._refused_generation = self.refused_pointer = None
        if latest is None or latest[0] <= self.version or latest[0] in self.refused:
            return None
        version = latest[0]
        t0 = time.perf_counter()
        try:
            flat, manifest = load_snapshot(self._store, version)
            if apply is not None:
                apply(flat, manifest)
        except (WeightsError, ValueError) as err:
            self.refused[version] = str(err)
            log.error("refusing weights v%d, keeping v%d: %s", version, self.version, err)
            return None
        self.version = version
        self.last_reload_s = time.perf_counter() - t0
        return flat, manifest

    def refusals(self) -> str:
        """What was refused so far, for an error message ('' if nothing)."""
        reasons = [f"v{v}: {why}" for v, why in sorted(self.refused.items())]
        if self.refused_pointer:
            reasons.append(self.refused_pointer)
        return "; ".join(reasons)

    def wait(
        self,
        timeout_s: float,
        poll_s: float = 0.5,
        apply: Callable[[dict[str, np.ndarray], Manifest], None] | None = None,
    ) -> tuple[dict[str, np.ndarray], Manifest]:
        """Block until a first snapshot is available (actors start before the learner)."""
        deadline = time.monotonic() + timeout_s
        while True:
            got = self.poll(apply)
            if got is not None:
                return got
            if time.monotonic() > deadline:
                refused = self.refusals()
                raise TimeoutError(
                    f"no weights published under {join_uri(self._store.uri, RunLayout.LATEST)} "
                    f"within {timeout_s:.0f}s; is the learner running?"
                    + (f" (refused: {refused})" if refused else "")
                )
            time.sleep(poll_s)
