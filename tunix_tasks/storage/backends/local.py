"""`LocalStore`: the `file://` backend, a directory on this machine (or a shared mount).

Writes are atomic through a temp file renamed into place (`local_tempfiles.py`, which also
collects the temp files of killed writers); listings from a position read only the
folders that can hold a later key (`local_listing.py`).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from urllib.parse import urlparse

import pyarrow as pa
import pyarrow.fs as pafs

from tunix_tasks.storage.backends.local_listing import list_dirs, list_files
from tunix_tasks.storage.backends.local_tempfiles import TempSweeper, write_temp
from tunix_tasks.storage.store import (
    NotFound,
    ObjectInfo,
    PreconditionFailed,
    StoreError,
    check_key,
)
from tunix_tasks.storage.uri import join_uri, normalize_uri

__all__ = ["LocalStore"]


class LocalStore:
    """A directory. CAS pointers keep numbered generation files created with link(2),
    which fails if the target exists, so two writers can never both win."""

    _KEEP_GENERATIONS = 64

    def __init__(self, uri: str) -> None:
        self.uri = normalize_uri(uri)
        self.root = Path(urlparse(self.uri).path)
        self._sweeper = TempSweeper(self.root)  # temp files of killed writers

    def _path(self, key: str) -> Path:
        return self.root / check_key(key)

    def _gens_dir(self, key: str) -> Path:
        p = self._path(key)
        return p.parent / f".{p.name}.gens"

    def read_bytes(self, key: str) -> bytes:
        versioned = self.read_versioned(key) if self._gens_dir(key).is_dir() else None
        if versioned is not None:
            return versioned[0]
        try:
            return self._path(key).read_bytes()
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            raise NotFound(f"{join_uri(self.uri, key)} does not exist") from None

    def write_bytes(self, key: str, data: bytes) -> None:
        path = self._path(key)
        tmp = write_temp(path.parent, data)
        os.replace(tmp, path)

    def _latest_generation(self, key: str) -> int:
        gens = self._gens_dir(key)
        try:
            names = [n for n in os.listdir(gens) if n.isdigit()]
        except FileNotFoundError:
            return 0
        return max((int(n) for n in names), default=0)

    def read_versioned(self, key: str) -> tuple[bytes, int] | None:
        for _ in range(16):  # a concurrent prune can remove the file we just listed
            gen = self._latest_generation(key)
            if gen == 0:
                return None
            with contextlib.suppress(FileNotFoundError):
                return (self._gens_dir(key) / f"{gen:020d}").read_bytes(), gen
        raise StoreError(f"{join_uri(self.uri, key)}: generation files keep changing")

    def write_if_generation(self, key: str, data: bytes, generation: int) -> int:
        current = self._latest_generation(key)
        if current != generation:
            raise PreconditionFailed(
                f"{join_uri(self.uri, key)}: expected generation {generation}, found {current}"
            )
        gens = self._gens_dir(key)
        tmp = write_temp(gens, data)
        new = generation + 1
        try:
            os.link(tmp, gens / f"{new:020d}")
        except FileExistsError:
            raise PreconditionFailed(
                f"{join_uri(self.uri, key)}: generation {generation} was replaced concurrently"
            ) from None
        finally:
            tmp.unlink(missing_ok=True)
        # Mirror for humans (`cat LATEST`); readers of this key use the generation files.
        mirror = write_temp(self._path(key).parent, data)
        os.replace(mirror, self._path(key))
        for old in range(new - self._KEEP_GENERATIONS - 8, new - self._KEEP_GENERATIONS):
            if old > 0:
                (gens / f"{old:020d}").unlink(missing_ok=True)
        return new

    def list(self, prefix: str = "", *, start_after: str | None = None) -> list[ObjectInfo]:
        self._sweeper.maybe_sweep()  # at most every few minutes
        after = start_after.lstrip("/") if start_after else ""
        # Reads only folders that can hold keys after `after` (local_listing.py).
        found = list_files(self.root, prefix.lstrip("/"), after)
        return [ObjectInfo(key=k, size=size, updated=mtime) for k, size, mtime in found]

    def list_folders(self, prefix: str) -> list[str]:  # ["shards/a/", ...]
        return list_dirs(self.root, prefix)

    def exists(self, key: str) -> bool:
        return self._path(key).is_file() or self._latest_generation(key) > 0

    def delete(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)
        gens = self._gens_dir(key)
        if gens.is_dir():
            for f in gens.iterdir():
                f.unlink(missing_ok=True)
            with contextlib.suppress(OSError):
                gens.rmdir()

    def open_input(self, key: str) -> pa.NativeFile:
        try:
            return pa.memory_map(str(self._path(key)), "r")
        except FileNotFoundError:
            raise NotFound(f"{join_uri(self.uri, key)} does not exist") from None

    def arrow_filesystem(self) -> tuple[pafs.FileSystem, str]:
        return pafs.LocalFileSystem(), str(self.root)

    def orbax_path(self, key: str) -> str:
        return str(self._path(key))  # orbax commits a step by renaming its temp folder

    def local_path(self, key: str = "") -> Path:
        return self._path(key) if key else self.root
