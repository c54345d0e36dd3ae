"""Weight snapshots: the learner publishes them, actors reload them.

Layout under the run root (the formats: `snapshot_format.py`):

    weights/v00000042/params.safetensors   tensors (safetensors: no pickle, safe to load)
    weights/v00000043/delta.bin            or: a delta against a full snapshot's params
    weights/v00000042/manifest.json        version, step, sha256 of params, kind, base, model
    weights/LATEST                         {"version": 42, "path": "weights/v00000042", "step": 7}

Kinds: "full" (all params), "adapter" (only adapter tensors; `base` names the frozen base
model, which the actor checks), "delta" (with `WeightsPublisher(full_every=K)`, versions
that are not multiples of K: rebuilt by the client from `base`, the last full snapshot,
and checked against the manifest's sha256 of the full params).

The snapshot is written first, `LATEST` last, with a compare-and-swap on the pointer's
generation, so a reader that follows `LATEST` always finds a complete snapshot, and a
learner that is no longer the only writer finds out (`PublishConflict`: it is fenced off)
instead of overwriting.

Nothing read from the store names a path: a pointer is valid only if its `version` is a
non-negative JSON integer and its `path` is exactly `RunLayout.snapshot(version)`, and a
snapshot (or a delta's base, by its version) is always read from
`RunLayout.snapshot(version)`. A pointer that is not valid (`PointerError`) is refused by
actors (once, they keep their weights) and superseded by the next learner that starts
(`WeightsPublisher` CASes over its generation).

    publisher = WeightsPublisher(store, full_every=10)
    publisher.publish(flat_params, version=3, step=60, model={...})   # learner
    client = WeightsClient(store)
    update = client.poll(apply)  # actor, between episodes: None, or new (flat, manifest)
"""

from __future__ import annotations

import hashlib
import logging
import re
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np

from tunix_tasks.storage.layout import RunLayout
from tunix_tasks.storage.snapshot_format import (
    Blob,
    BlobError,
    FullBlob,
    Manifest,
    apply_delta,
    decode_safetensors,
    delta_base,
    encode_delta,
    encode_pointer,
    encode_snapshot,
    non_finite,
    parse_pointer,
    short_repr,
)
from tunix_tasks.storage.store import NotFound, ObjectStore, PreconditionFailed, read_small
from tunix_tasks.storage.uri import join_uri

log = logging.getLogger(__name__)

PARAMS_FILE = "params.safetensors"
DELTA_FILE = "delta.bin"
MANIFEST_FILE = "manifest.json"
MAX_MANIFEST_BYTES = 1 << 20  # a manifest is ~1 KB; a larger one is refused unread
_READ_CHUNK = 8 << 20  # bytes hashed at a time as a snapshot streams in
_SNAPSHOT_DIR = re.compile(re.escape(RunLayout.WEIGHTS) + r"v(\d+)/")


class WeightsError(RuntimeError):
    """A snapshot is missing, corrupt, fails its checksum, or does not fit the model."""


class NonFiniteWeights(WeightsError):
    """The learner was about to publish weights holding NaN or Inf (a diverged update).
    Nothing is published: actors keep the last good weights, and the learner stops."""


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


def _where(store: ObjectStore, version: int) -> str:
    return join_uri(store.uri, RunLayout.snapshot(version))


def read_manifest(store: ObjectStore, version: int) -> Manifest:
    """The manifest of one snapshot; WeightsError if missing, invalid or of another version."""
    where, key = _where(store, version), f"{RunLayout.snapshot(version)}/{MANIFEST_FILE}"
    try:
        manifest = Manifest.from_json(
            read_small(store, key, MAX_MANIFEST_BYTES, error=WeightsError)
        )
    except NotFound as err:  # or not a regular file (`NotAFile`: a FIFO would block)
        raise WeightsError(f"snapshot {where} is incomplete: {err}") from None
    except (ValueError, KeyError, TypeError) as err:
        raise WeightsError(f"snapshot {where} has an invalid manifest: {err}") from None
    if manifest.version != version:
        raise WeightsError(f"snapshot {where} manifest says version {short_repr(manifest.version)}")
    return manifest


def _read(
    store: ObjectStore, version: int, name: str, sha256: str | None, size: int, what: str
) -> np.ndarray:
    """One file of a snapshot, as a read-only uint8 array. Its size is asked of the store
    first and must be `size` (its manifest's): a file of another size is refused unread,
    so what a manifest says bounds the time and memory a reader spends. It is then
    hashed as it streams in (no second pass) and checked against `sha256` when given."""
    key, where = f"{RunLayout.snapshot(version)}/{name}", _where(store, version)
    try:
        found = store.size(key)
        if found != size:
            raise WeightsError(
                f"{what} {where}: {name} has {found} bytes, its manifest says "
                f"{short_repr(size)}; not read"
            )
        data, digest = _read_hashed(store, key, size)
    except NotFound as err:
        raise WeightsError(f"{what} {where} is incomplete: {err}") from None
    if sha256 is not None and digest != sha256:
        raise WeightsError(
            f"{what} {where} fails its checksum: sha256 {digest[:12]}… != {str(sha256)[:12]}…"
        )
    return data


def _read_hashed(store: ObjectStore, key: str, size: int) -> tuple[np.ndarray, str]:
    """(the `size` bytes of `key` as a read-only uint8 array, their sha256), streamed
    straight into the array (`ObjectStore.read_to`: the array is the only copy, on every
    backend); WeightsError if the object turns out not to be `size` bytes long (replaced
    since its size was asked)."""
    sink = _HashingArray(size, join_uri(store.uri, key))
    if size:
        store.read_to(key, sink)
    return sink.result()


class _HashingArray:
    """A `ByteSink` that fills a preallocated array in order and hashes it as it fills,
    `_READ_CHUNK` at a time (the writes may be a few KB each: gs:// hands over each
    response chunk). Refuses a byte past the size it was told."""

    def __init__(self, size: int, where: str) -> None:
        self.out = np.empty(size, np.uint8)
        self._view = memoryview(self.out)
        self._where = where
        self._digest = hashlib.sha256()
        self._pos = self._hashed = 0

    def write(self, data: bytes | memoryview, /) -> int:
        end = self._pos + len(data)
        if end > len(self.out):
            raise self._changed()
        self._view[self._pos : end] = data
        self._pos = end
        if end - self._hashed >= _READ_CHUNK:
            self._hash_to(end)
        return len(data)

    def result(self) -> tuple[np.ndarray, str]:
        if self._pos != len(self.out):
            raise self._changed()
        self._hash_to(self._pos)
        self._view.release()
        self.out.flags.writeable = False
        return self.out, self._digest.hexdigest()

    def _hash_to(self, end: int) -> None:
        self._digest.update(self._view[self._hashed : end])
        self._hashed = end

    def _changed(self) -> WeightsError:
        return WeightsError(f"{self._where} changed while read: not {len(self.out)} bytes")


def _mismatch(data: Blob, sha256: str) -> str | None:
    """None if `data` hashes to `sha256`, else the two digests, shortened."""
    digest = hashlib.sha256(data).hexdigest()
    return None if digest == sha256 else f"sha256 {digest[:12]}… != {str(sha256)[:12]}…"


def _base_size(store: ObjectStore, version: int, what: str) -> int:
    """The size of full snapshot `version`'s params, as its manifest says."""
    try:
        return read_manifest(store, version).num_bytes
    except WeightsError as err:
        raise WeightsError(f"{what}: {err}") from None


def load_params(
    store: ObjectStore, manifest: Manifest, held: FullBlob | None = None
) -> tuple[dict[str, np.ndarray], FullBlob | None, int]:
    """(the snapshot's tensors: read-only views into its one checksum-verified params
    blob; the full blob deltas apply to: this one, a delta's base, None for an adapter;
    the tensor bytes read from the store). A delta is applied to `held` when that is its
    base, else to the base's params read from `RunLayout.snapshot(base version)`."""
    version, where = manifest.version, _where(store, manifest.version)
    if manifest.kind != "delta":
        blob = _read(store, version, PARAMS_FILE, manifest.sha256, manifest.num_bytes, "snapshot")
        held = FullBlob(version, manifest.sha256, blob) if manifest.kind == "full" else None
        nbytes = len(blob)
    else:
        base_version, base_sha = delta_base(manifest.base, version)
        nbytes = 0
        if held is None or (held.version, held.sha256) != (base_version, base_sha):
            what = f"base v{base_version} of delta"
            size = _base_size(store, base_version, what)
            base = _read(store, base_version, PARAMS_FILE, base_sha, size, what)
            held, nbytes = FullBlob(base_version, base_sha, base), len(base)
        delta = _read(store, version, DELTA_FILE, None, manifest.num_bytes, "delta snapshot")
        nbytes += len(delta)
        try:
            blob = apply_delta(delta, held.data)
        except BlobError as err:
            raise WeightsError(f"delta {where} is corrupt: {err}") from None
        if mismatch := _mismatch(blob, manifest.sha256):
            raise WeightsError(
                f"delta {where} rebuilds params that fail their checksum: {mismatch}"
            )
    try:
        flat = decode_safetensors(blob)
    except BlobError as err:
        raise WeightsError(f"snapshot {where} is not valid safetensors: {err}") from None
    if bad := non_finite(flat):
        raise WeightsError(f"snapshot {where} holds non-finite weights: {bad}")
    return flat, held, nbytes


def published_version(store: ObjectStore, version: int | None) -> int:
    """`version`, or (None) the latest published one; WeightsError when none is."""
    if version is not None:
        return version
    latest = read_latest(store)
    if latest is None:
        raise WeightsError(f"{store.uri}: no weights published yet")
    return latest[0]


def load_snapshot(store: ObjectStore, version: int) -> tuple[dict[str, np.ndarray], Manifest]:
    """Read and verify one snapshot (a delta: with its base); raises WeightsError on any
    problem. The tensors are read-only views into the one params blob."""
    manifest = read_manifest(store, version)
    return load_params(store, manifest)[0], manifest


class WeightsPublisher:
    """Learner side. Remembers the pointer generation it wrote last, so a second writer
    (or a stale learner after failover) is detected on its next publish.

    A `LATEST` that is missing or not a valid pointer is superseded: `latest_version` is
    then the newest snapshot folder under `weights/` (valid or not, so no version number an
    actor may hold or have refused is reused), and the first publish CASes over the bad
    pointer's generation."""

    def __init__(self, store: ObjectStore, *, full_every: int = 0) -> None:
        if full_every < 0:
            raise ValueError(f"full_every must be >= 0, got {full_every}")
        self._store = store
        self.full_every = full_every
        self._base: FullBlob | None = None  # the last full snapshot published, for deltas
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
        self,
        flat: dict[str, np.ndarray],
        *,
        version: int,
        step: int,
        model: dict[str, Any],
        kind: str = "full",
        base: dict[str, str] | None = None,
    ) -> Manifest:
        """Write the snapshot, then move `LATEST` to it. `kind="adapter"`: `flat` is only
        the adapter tensors, `base` ({"fingerprint", "uri"}) the frozen base model. Kind
        "full" with `full_every` K > 1: a version that is not a multiple of K is stored as
        a delta against the last full snapshot this publisher wrote, when it has one of the
        same tensor layout (else as a full one, the next base)."""
        if version <= self.latest_version:
            raise ValueError(f"version {version} is not newer than published {self.latest_version}")
        if bad := non_finite(flat):
            raise NonFiniteWeights(
                f"the weights after step {step} hold non-finite values ({bad}): v{version} "
                "is not published (actors keep their weights) and the learner stops"
            )
        blob, manifest = encode_snapshot(
            flat,
            version=version,
            step=step,
            model=model,
            kind=kind,
            base=base,
            full_every=self.full_every,
        )
        name, data, manifest = self._as_delta(blob, manifest)
        prefix = RunLayout.snapshot(version)
        self._store.write_bytes(f"{prefix}/{name}", data)
        self._store.write_bytes(f"{prefix}/{MANIFEST_FILE}", manifest.to_json())
        pointer = encode_pointer(version, step)
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
        if manifest.kind == "full" and self.full_every > 1:
            self._base = FullBlob(version, manifest.sha256, blob)
        return manifest

    def _as_delta(self, blob: Blob, manifest: Manifest) -> tuple[str, Blob, Manifest]:
        """(file name, its bytes, manifest): the full params, or a delta when one is due."""
        base = self._base
        if (
            manifest.kind == "full"
            and base is not None
            and self.full_every > 1
            and manifest.version % self.full_every
        ):
            delta = encode_delta(blob, base.data)
            if delta is not None:
                based = {"version": base.version, "sha256": base.sha256}
                manifest = replace(manifest, kind="delta", base=based, num_bytes=len(delta))
                return DELTA_FILE, delta, manifest
        return PARAMS_FILE, blob, manifest

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

    A corrupt or mismatched snapshot (a file whose size is not its manifest's: refused
    unread; one that fails its checksum, holds NaN/Inf, or that `apply` refuses
    with a ValueError: a missing / extra tensor, a wrong shape or dtype) is refused with a
    logged error and remembered, so the actor keeps its current weights and does not retry
    the same bad version. `version` only advances once `apply` succeeded. A `LATEST` that
    is not a valid pointer is refused too, logged once per pointer generation.

    A delta is handed to `apply` rebuilt into full params: on the base full blob the
    client holds (kept once the run has deltas), else on the base read from its version's
    folder; a missing or corrupt base or delta, or a result that fails the manifest's
    sha256, is refused like a corrupt snapshot."""

    def __init__(self, store: ObjectStore) -> None:
        self._store = store
        self.version = -1
        self.refused: dict[int, str] = {}
        self.refused_pointer: str | None = None  # why the current LATEST is refused
        self._refused_generation: int | None = None
        self.last_reload_s = 0.0  # load + apply of the last version taken
        self.last_reload_bytes = 0  # tensor bytes it read: params, or delta (+ its base)
        self._full: FullBlob | None = None  # the base for deltas, once the run has them

    def poll(
        self,
        apply: Callable[[dict[str, np.ndarray], Manifest], None] | None = None,
        *,
        ahead: int = 1,
    ) -> tuple[dict[str, np.ndarray], Manifest] | None:
        """New (flat, manifest), after `apply(flat, manifest)` took them; None otherwise.
        Once it holds weights, only a version at least `ahead` past them is new (1: any
        newer one; more forces staleness, `actor.reload_every_versions`)."""
        try:
            latest = read_latest(self._store)
        except PointerError as err:
            if err.generation != self._refused_generation:
                self._refused_generation, self.refused_pointer = err.generation, str(err)
                log.error("refusing weights pointer, keeping v%d: %s", self.version, err)
            return None
        self._refused_generation = self.refused_pointer = None
        newest = self.version + (ahead if self.version >= 0 else 1) - 1
        if latest is None or latest[0] <= newest or latest[0] in self.refused:
            return None
        version = latest[0]
        t0 = time.perf_counter()
        try:
            manifest = read_manifest(self._store, version)
            if manifest.kind == "full":
                self._full = None  # it supersedes the base we hold: never hold two
            flat, full, nbytes = load_params(self._store, manifest, self._full)
            if full is not None and (manifest.kind == "delta" or manifest.full_every > 1):
                self._full = full
            if apply is not None:
                apply(flat, manifest)
        except (WeightsError, ValueError) as err:
            self.refused[version] = str(err)
            log.error("refusing weights v%d, keeping v%d: %s", version, self.version, err)
            return None
        self.version = version
        self.last_reload_s = time.perf_counter() - t0
        self.last_reload_bytes = nbytes
        return flat, manifest

    def refusals(self) -> str:
        """What was refused so far, for an error message ('' if nothing)."""
        reasons = [f"v{v}: {why}" for v, why in sorted(self.refused.items())]
        if self.refused_pointer:
            reasons.append(self.refused_pointer)
        return "; ".join(reasons)
