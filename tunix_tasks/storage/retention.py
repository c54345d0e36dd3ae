"""Retention: what a long run deletes, so that its storage does not grow with its history.

- Weight snapshots: after each publish the learner's background publisher runs
  `SnapshotRetention.prune`, which keeps the newest `keep_last` (>= 2) versions, every
  version that is a multiple of `keep_every` (0: none), the version `weights/LATEST`
  names, anything newer than it, anything at or above `protect_from()` when that is
  given (e.g. the oldest version an actor is known to hold), and the base (full)
  snapshot of every kept delta snapshot; everything else is deleted, manifest first, so
  a reader sees a snapshot complete or incomplete, never changed. A snapshot folder
  older than `LATEST` that has no manifest (a publish killed midway: its params only, or
  nothing but temp files, or nothing at all) can never be loaded: it is deleted whatever
  the rule keeps. Its temp files go with the store's collection of killed writers' temp
  files (`backends/local_tempfiles.py`), its then empty folder at the next prune.
- Consumed shards: `learner.delete_consumed_shards` has the source delete a shard once a
  committed checkpoint holds it done (`learner/source.py`); a bucket lifecycle rule on
  `shards/` and `quarantine/` is the alternative (docs/configuration.md).

Actors load only what `LATEST` names and keep loaded weights in memory, so an old
snapshot is read only by an actor that read `LATEST` just before `keep_last` newer
versions were published; a refused (vanished) snapshot just makes it wait for the next.

    retention = SnapshotRetention(store, keep_last=16, keep_every=50)
    retention.prune()                         # -> the versions deleted
    plan_pruning([1, 2, 3, 4, 5], keep_last=2, keep_every=2, latest=5)   # -> [1, 3]
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

from tunix_tasks.storage.layout import RunLayout
from tunix_tasks.storage.store import ObjectStore, StoreError
from tunix_tasks.storage.weights import (
    DELTA_FILE,
    MANIFEST_FILE,
    WeightsError,
    read_latest,
    read_manifest,
)

log = logging.getLogger(__name__)


def plan_pruning(
    versions: Iterable[int],
    *,
    keep_last: int,
    keep_every: int,
    latest: int | None,
    protect_from: int | None = None,
) -> list[int]:
    """The versions to delete (pure): all but the newest `keep_last`, multiples of
    `keep_every`, `latest` and newer, and `protect_from` and newer."""
    if keep_last < 2:
        raise ValueError(
            f"keep_last must be >= 2 (an actor may be loading the previous one), got {keep_last}"
        )
    if keep_every < 0:
        raise ValueError(f"keep_every must be >= 0, got {keep_every}")
    if latest is None:  # no pointer (yet): nothing is known to be unused
        return []
    ordered = sorted(set(versions))
    keep = set(ordered[-keep_last:])
    if keep_every > 0:
        keep |= {v for v in ordered if v % keep_every == 0}
    floor = latest if protect_from is None else min(latest, protect_from)
    return [v for v in ordered if v not in keep and v < floor]


def _version(key: str) -> int | None:
    """The version of the snapshot folder `key` lies in, if any: only folders named
    exactly `RunLayout.snapshot(version)` count."""
    folder, sep, _ = key.partition("/")[2].partition("/")
    if not (sep and key.startswith(RunLayout.WEIGHTS) and folder[1:].isdigit()):
        return None
    version = int(folder[1:])
    return version if key.startswith(f"{RunLayout.snapshot(version)}/") else None


def snapshot_files(store: ObjectStore) -> dict[int, list[str]]:
    """Version -> keys of its files, from one listing of `weights/`."""
    out: dict[int, list[str]] = {}
    for info in store.list(RunLayout.WEIGHTS):
        version = _version(info.key)  # None: LATEST
        if version is not None:
            out.setdefault(version, []).append(info.key)
    return out


def torn_snapshots(store: ObjectStore, files: dict[int, list[str]], latest: int | None) -> set[int]:
    """Versions older than `latest` whose folder has no manifest: publishes killed midway
    (a folder with no object at all is found by `list_folders`: only locally, where
    folders outlive their files). Newer ones may be a publish in progress."""
    if latest is None:
        return set()
    folders = {v for f in store.list_folders(RunLayout.WEIGHTS) if (v := _version(f)) is not None}
    return {
        v
        for v in folders | set(files)
        if v < latest and not any(key.endswith(f"/{MANIFEST_FILE}") for key in files.get(v, []))
    }


def delta_bases(store: ObjectStore, files: dict[int, list[str]], kept: Iterable[int]) -> set[int]:
    """The base versions of the kept delta snapshots (one manifest read per kept delta).
    A delta whose manifest cannot be read or is invalid protects nothing: it cannot be
    loaded anyway."""
    bases = set()
    for version in kept:
        if any(key.endswith(f"/{DELTA_FILE}") for key in files.get(version, [])):
            try:
                manifest = read_manifest(store, version)
            except WeightsError:
                continue
            if manifest.kind == "delta":
                bases.add(manifest.base["version"])
    return bases


class SnapshotRetention:
    """Deletes old weight snapshots by the rule in the module docstring."""

    def __init__(
        self,
        store: ObjectStore,
        *,
        keep_last: int,
        keep_every: int = 0,
        protect_from: Callable[[], int | None] | None = None,
    ) -> None:
        plan_pruning([], keep_last=keep_last, keep_every=keep_every, latest=None)  # validates
        self._store = store
        self.keep_last = keep_last
        self.keep_every = keep_every
        self._protect_from = protect_from
        self.deleted: list[int] = []

    def prune(self, published: int | None = None) -> list[int]:
        """Delete what the rule allows; never raises (a failed delete is retried next
        time). `published` is the version just published (for the log only)."""
        try:
            latest = read_latest(self._store)
            latest_version = None if latest is None else latest[0]
            files = snapshot_files(self._store)
            doomed = plan_pruning(
                files,
                keep_last=self.keep_last,
                keep_every=self.keep_every,
                latest=latest_version,
                protect_from=self._protect_from() if self._protect_from else None,
            )
            bases = delta_bases(self._store, files, set(files) - set(doomed))
            torn = torn_snapshots(self._store, files, latest_version)
            doomed = sorted({v for v in doomed if v not in bases} | torn)
            for version in doomed:
                # Manifest first: a reader then finds the snapshot incomplete, not torn. It
                # is deleted even when absent: that removes an empty folder (LocalStore).
                manifest = f"{RunLayout.snapshot(version)}/{MANIFEST_FILE}"
                for key in [manifest, *(k for k in files.get(version, []) if k != manifest)]:
                    self._store.delete(key)
                self.deleted.append(version)
        except (StoreError, WeightsError) as err:
            log.warning("snapshot retention after v%s failed: %s", published, err)
            return []
        if doomed:
            log.info("retention: deleted snapshots %s after v%s", doomed, published)
        return doomed
