"""The local store's temp files: written beside their target, then renamed into place; the
ones a killed writer left behind are collected.

`LocalStore` writes every object as a hidden `.tmp-<uuid>` file in the target's folder
(write, fsync, then rename or link). A writer killed in between leaves that file behind;
nothing lists it, so without collection it would stay forever. `TempSweeper` deletes
`.tmp-*` files (generation folders included) not modified for `max_age_s`: default 1 h,
or the environment's `TUNIX_STORE_TMP_MAX_AGE_S`. A file that old is no write in
progress: a write touches its file as it goes and takes seconds. The store calls
`maybe_sweep()` when it lists, so the learner's and the launcher's polling collect them;
a sweep walks the whole run folder at most every `every_s` (default: max_age / 4, at most
10 minutes).

    tmp = write_temp(directory, data)          # then os.replace(tmp, target)
    TempSweeper(root).maybe_sweep()            # number of stale temp files removed
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
import uuid
from pathlib import Path
from typing import BinaryIO

from tunix_tasks.storage.store import Data, StoreError

log = logging.getLogger(__name__)

PREFIX = ".tmp-"
MAX_AGE_ENV = "TUNIX_STORE_TMP_MAX_AGE_S"
DEFAULT_MAX_AGE_S = 3600.0


def write_temp(directory: Path, data: Data) -> Path:
    """`data` in a new hidden temp file of `directory` (created if missing), fsynced. A
    failed write leaves no temp file; a full disk is a `StoreError` (the callers' outage
    handling retries it: space may be freed), naming the folder and what is free."""
    tmp = directory / f"{PREFIX}{uuid.uuid4().hex}"
    try:
        with _create(tmp) as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except OSError as err:
        tmp.unlink(missing_ok=True)
        if err.errno in (errno.ENOSPC, errno.EDQUOT):
            raise StoreError(
                f"{directory}: {err.strerror} writing {memoryview(data).nbytes:,} bytes "
                f"({_free_bytes(directory):,} bytes free); free space or use another store"
            ) from None
        raise
    return tmp


def _free_bytes(directory: Path) -> int:
    try:
        st = os.statvfs(directory)
    except OSError:
        return 0
    return st.f_bavail * st.f_frsize


def _create(path: Path, tries: int = 3) -> BinaryIO:
    """`path` opened for writing, its folder created first: again if it was removed
    between its creation and the file's (a delete emptied it, `LocalStore.delete`)."""
    while True:
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            return open(path, "wb")  # the caller closes it
        except FileNotFoundError:
            tries -= 1
            if not tries:
                raise


def sweep_temp_files(root: Path, max_age_s: float, *, now: float | None = None) -> list[Path]:
    """Delete the temp files under `root` not modified for `max_age_s`; the paths removed."""
    cutoff = (time.time() if now is None else now) - max_age_s
    removed: list[Path] = []
    for dirpath, _dirs, names in os.walk(root):
        for name in names:
            if not name.startswith(PREFIX):
                continue
            path = Path(dirpath) / name
            try:
                if path.stat().st_mtime < cutoff:
                    path.unlink()
                    removed.append(path)
            except FileNotFoundError:  # renamed or removed meanwhile
                continue
    return removed


class TempSweeper:
    """Throttled `sweep_temp_files` over one store root; safe to call from any thread."""

    def __init__(
        self, root: Path, *, max_age_s: float | None = None, every_s: float | None = None
    ) -> None:
        if max_age_s is None:
            max_age_s = float(os.environ.get(MAX_AGE_ENV) or DEFAULT_MAX_AGE_S)
        if max_age_s <= 0:
            raise ValueError(f"temp file max age must be > 0, got {max_age_s}")
        self.root = root
        self.max_age_s = max_age_s
        self.every_s = min(600.0, max_age_s / 4) if every_s is None else every_s
        self._next = 0.0
        self._lock = threading.Lock()

    def maybe_sweep(self) -> int:
        """Sweep unless one ran less than `every_s` ago; the number of files removed."""
        with self._lock:
            now = time.monotonic()
            if now < self._next:
                return 0
            self._next = now + self.every_s
        try:
            removed = sweep_temp_files(self.root, self.max_age_s)
        except OSError as err:  # housekeeping never fails the caller's operation
            log.warning("collecting stale temp files under %s failed: %r", self.root, err)
            return 0
        if removed:
            log.info(
                "removed %d temp files older than %.0fs under %s (left by killed writers)",
                len(removed),
                self.max_age_s,
                self.root,
            )
        return len(removed)
