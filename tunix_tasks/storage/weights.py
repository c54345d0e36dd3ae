"""Weight snapshots: the learner publishes them, actors reload them.

Layout under the run root:

    weights/v00000042/params.safetensors   tensors (safetensors: no pickle, safe to load)
    weights/v00000042/manifest.json        version, step, sha256 of params, created_at, model
    weights/LATEST                         {"version": 42, "path": "weights/v00000042"}

The snapshot is written first, `LATEST` last, with a compare-and-swap on the pointer's
generation, so a reader that follows `LATEST` always finds a complete snapshot, and a
learner that is no longer the only writer finds out instead of overwriting.

    publisher = WeightsPublisher(store)
    publisher.publish(flat_params, version=3, step=60, model={...})   # learner
    client = WeightsClient(store)
    update = client.poll()      # actor, between episodes: None, or new (flat, manifest)
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
from safetensors.numpy import load as st_load
from safetensors.numpy import save as st_save

from tunix_tasks.storage.store import NotFound, ObjectStore, PreconditionFailed, join_uri

log = logging.getLogger(__name__)

LATEST_KEY = "weights/LATEST"
PARAMS_FILE = "params.safetensors"
MANIFEST_FILE = "manifest.json"


class WeightsError(RuntimeError):
    """A snapshot is missing, corrupt, or fails its checksum."""


class PublishConflict(RuntimeError):
    """`weights/LATEST` moved under us: another learner is publishing to this run."""


def snapshot_prefix(version: int) -> str:
    return f"weights/v{version:08d}"


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


def read_latest(store: ObjectStore) -> tuple[int, str, int] | None:
    """(version, snapshot prefix, pointer generation) of the newest snapshot, or None."""
    got = store.read_versioned(LATEST_KEY)
    if got is None:
        return None
    data, generation = got
    try:
        pointer = json.loads(data)
        return int(pointer["version"]), str(pointer["path"]), generation
    except (ValueError, KeyError, TypeError) as err:
        raise WeightsError(
            f"{join_uri(store.uri, LATEST_KEY)} is not a valid pointer: {err}"
        ) from None


def load_snapshot(store: ObjectStore, version: int) -> tuple[dict[str, np.ndarray], Manifest]:
    """Read and verify one snapshot; raises WeightsError on any problem."""
    prefix = snapshot_prefix(version)
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
            f"snapshot {where} fails its checksum: sha256 {digest[:12]}… != manifest {manifest.sha256[:12]}…"
        )
    if manifest.version != version:
        raise WeightsError(f"snapshot {where} manifest says version {manifest.version}")
    try:
        flat = st_load(blob)
    except Exception as err:  # safetensors raises its own error types
        raise WeightsError(f"snapshot {where} is not valid safetensors: {err}") from None
    return flat, manifest


class WeightsPublisher:
    """Learner side. Remembers the pointer generation it wrote last, so a second writer
    (or a stale learner after failover) is detected on its next publish."""

    def __init__(self, store: ObjectStore) -> None:
        self._store = store
        latest = read_latest(store)
        self._generation = latest[2] if latest else 0
        self.latest_version = latest[0] if latest else -1

    def publish(
        self, flat: dict[str, np.ndarray], *, version: int, step: int, model: dict[str, Any]
    ) -> Manifest:
        if version <= self.latest_version:
            raise ValueError(f"version {version} is not newer than published {self.latest_version}")
        blob, manifest = encode_snapshot(flat, version=version, step=step, model=model)
        prefix = snapshot_prefix(version)
        self._store.write_bytes(f"{prefix}/{PARAMS_FILE}", blob)
        self._store.write_bytes(f"{prefix}/{MANIFEST_FILE}", manifest.to_json())
        pointer = json.dumps({"version": version, "path": prefix, "step": step}).encode()
        try:
            self._generation = self._store.write_if_generation(
                LATEST_KEY, pointer, self._generation
            )
        except PreconditionFailed as err:
            raise PublishConflict(
                f"{join_uri(self._store.uri, LATEST_KEY)} was moved by another writer; "
                "is a second learner running on this run?"
            ) from err
        self.latest_version = version
        return manifest


class WeightsClient:
    """Actor side: `poll()` between episodes returns new weights when LATEST moves.

    A corrupt or mismatched snapshot is refused with a logged error and remembered, so
    the actor keeps its current weights and does not retry the same bad version."""

    def __init__(self, store: ObjectStore) -> None:
        self._store = store
        self.version = -1
        self.refused: dict[int, str] = {}
        self.last_reload_s = 0.0

    def poll(self) -> tuple[dict[str, np.ndarray], Manifest] | None:
        latest = read_latest(self._store)
        if latest is None or latest[0] <= self.version or latest[0] in self.refused:
            return None
        version = latest[0]
        t0 = time.perf_counter()
        try:
            flat, manifest = load_snapshot(self._store, version)
        except WeightsError as err:
            self.refused[version] = str(err)
            log.error("refusing weights v%d, keeping v%d: %s", version, self.version, err)
            return None
        self.version = version
        self.last_reload_s = time.perf_counter() - t0
        return flat, manifest

    def wait(self, timeout_s: float, poll_s: float = 0.5) -> tuple[dict[str, np.ndarray], Manifest]:
        """Block until a first snapshot is available (actors start before the learner)."""
        deadline = time.monotonic() + timeout_s
        while True:
            got = self.poll()
            if got is not None:
                return got
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"no weights published under {join_uri(self._store.uri, LATEST_KEY)} "
                    f"within {timeout_s:.0f}s; is the learner running?"
                )
            time.sleep(poll_s)
