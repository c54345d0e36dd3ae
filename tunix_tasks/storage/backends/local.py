"""`LocalStore`: the `file://` backend, a directory on this machine (or a shared mount).

Writes are atomic through a temp file renamed into place (`local_tempfiles.py`, which also
collects the temp files of killed writers); listings from a position read only the
folders that can hold a later key (`local_listing.py`).

Nothing is opened or listed outside the root: a key whose path resolves (through a
symlink) outside the resolved root raises `OutsideRoot` naming the key, and listings skip
such links. Roots are compared resolved, so a run under a symlinked folder (`/tmp` on
some systems) works as any other.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar
from urllib.parse import urlparse

import pyarrow as pa
import pyarrow.fs as pafs

from tunix_tasks.storage.backends.local_listing import inside, list_dirs, list_files
from tunix_tasks.storage.backends.local_tempfiles import TempSweeper, write_temp
from tunix_tasks.storage.store import (
    ByteSink,
    Data,
    NotAFile,
    NotFound,
    ObjectInfo,
    PreconditionFailed,
    StoreError,
    check_head,
    check_key,
)
from tunix_tasks.storage.uri import join_uri, normalize_uri

__all__ = ["LocalStore", "OutsideRoot"]

T = TypeVar("T")

READ_CHUNK_BYTES = 8 << 20  # what `read_to` hands its sink at a time

# Where the kernel names each open file by its descriptor (Linux), or "" (no such folder).
_FD_PATHS = "/proc/self/fd" if os.path.isdir("/proc/self/fd") else ""


class OutsideRoot(NotFound):
    """A key whose local path resolves outside the store's root (a symlink out of the
    run): refused as if it did not exist, so no file outside the run is read or written."""


_KINDS = {
    stat.S_IFIFO: "a FIFO",
    stat.S_IFSOCK: "a socket",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
}


def _check_regular(mode: int, where: str) -> None:
    """NotFound for a folder (as a bucket's prefix: no object), `NotAFile` for anything
    else that is not a regular file: a FIFO blocks its reader, a device never ends."""
    if stat.S_ISDIR(mode):
        raise NotFound(f"{where} does not exist")
    if not stat.S_ISREG(mode):
        kind = _KINDS.get(stat.S_IFMT(mode), "not a regular file")
        raise NotAFile(f"{where} is {kind}, not a regular file: refused unread")


#: A generation is its file's number (link(2) makes each number one writer's) shifted
#: above the low 32 bits of its file's mtime in microseconds.
_SEQ_SHIFT = 32


def _generation(seq: int, st: os.stat_result) -> int:
    """The generation of file number `seq`: numbers start at 1 again when a key is deleted
    and written anew (a run created again in the same folder), its time does not, so a
    leftover writer's compare-and-swap (a deleted run's learner renewing its lease) never
    matches the new key's by chance, as on GCS, whose generations are times."""
    return seq << _SEQ_SHIFT | (st.st_mtime_ns // 1000) & 0xFFFFFFFF


def _bounded(limit: int, fd: int) -> int:
    """What to ask `read` for: `limit` (-1: all) capped one byte past the file's size, as a
    read of n bytes allocates n up front (16 MiB for a 2-byte config, bounded at that)."""
    return -1 if limit < 0 else min(limit, os.fstat(fd).st_size + 1)


class LocalStore:
    """A directory. CAS pointers keep numbered generation files created with link(2),
    which fails if the target exists, so two writers can never both win."""

    _KEEP_GENERATIONS = 64

    def __init__(self, uri: str) -> None:
        self.uri = normalize_uri(uri)
        self.root = Path(urlparse(self.uri).path)
        self._real_root = os.path.realpath(self.root)
        self._sweeper = TempSweeper(self.root)  # temp files of killed writers

    def _path(self, key: str) -> Path:
        """The path of `key`; `OutsideRoot` if it resolves outside the root."""
        path = self.root / check_key(key)
        self._refuse_outside(key, os.path.realpath(path))
        return path

    def _refuse_outside(self, key: str, real: str) -> None:
        if not inside(real, self._real_root):
            self._real_root = os.path.realpath(self.root)  # the root may be new since
            if not inside(real, self._real_root):
                raise OutsideRoot(
                    f"{join_uri(self.uri, key)} resolves to {real}, outside the run root "
                    f"{self._real_root}: refused"
                )

    def _gens_dir(self, key: str) -> Path:
        p = self._path(key)
        return p.parent / f".{p.name}.gens"

    def read_bytes(self, key: str) -> bytes:
        return self._read(key, -1)

    def read_head(self, key: str, max_bytes: int) -> bytes:
        return self._read(key, check_head(max_bytes))

    def _read(self, key: str, limit: int) -> bytes:
        """Up to `limit` bytes of `key` (-1: all). A compare-and-swap key is read from its
        newest generation file while its mirror is there: a mirror deleted by hand (`rm -r
        runs/NAME/*` leaves the hidden generations) is an object deleted, as `size` says."""
        if self._gens_dir(key).is_dir():
            if not os.path.lexists(self._path(key)):
                raise NotFound(f"{join_uri(self.uri, key)} does not exist")
            versioned = self._read_versioned(key, limit)
            if versioned is not None:
                return versioned[0]
        return self._read_file(key, limit)

    def size(self, key: str) -> int:
        path = self._path(key)
        try:
            st = path.stat()
        except (FileNotFoundError, NotADirectoryError):
            raise NotFound(f"{join_uri(self.uri, key)} does not exist") from None
        _check_regular(st.st_mode, join_uri(self.uri, key))
        return st.st_size

    def write_bytes(self, key: str, data: Data) -> None:
        path = self._path(key)
        tmp = write_temp(path.parent, data)
        os.replace(tmp, path)

    def _latest_seq(self, key: str) -> int:
        """The number of `key`'s newest generation file (0: none)."""
        try:
            names = [n for n in os.listdir(self._gens_dir(key)) if n.isdigit()]
        except FileNotFoundError:
            return 0
        return max((int(n) for n in names), default=0)

    def _latest_generation(self, key: str) -> int:
        return self._on_newest(key, lambda seq, path: _generation(seq, path.stat())) or 0

    def read_versioned(self, key: str) -> tuple[bytes, int] | None:
        return self._read_versioned(key, -1)

    def _read_versioned(self, key: str, limit: int) -> tuple[bytes, int] | None:
        def read(seq: int, path: Path) -> tuple[bytes, int]:
            fd, _ = self._open_file(key, path)
            with os.fdopen(fd, "rb") as f:
                return f.read(_bounded(limit, fd)), _generation(seq, os.fstat(fd))

        return self._on_newest(key, read)

    def _on_newest(self, key: str, use: Callable[[int, Path], T]) -> T | None:
        """`use(number, path)` of `key`'s newest generation file; None without one."""
        for _ in range(16):  # a concurrent prune can remove the file just listed
            seq = self._latest_seq(key)
            if seq == 0:
                return None
            try:
                return use(seq, self._gens_dir(key) / f"{seq:020d}")
            except (NotAFile, OutsideRoot):
                raise
            except FileNotFoundError:  # pruned since listed (a `NotFound` too)
                continue
        raise StoreError(f"{join_uri(self.uri, key)}: generation files keep changing")

    def write_if_generation(self, key: str, data: bytes, generation: int) -> int:
        current = self._latest_generation(key)
        if current != generation:
            raise PreconditionFailed(
                f"{join_uri(self.uri, key)}: expected generation {generation}, found {current}"
            )
        gens = self._gens_dir(key)
        tmp = write_temp(gens, data)
        now = time.time_ns()  # the clock's, finer than the coarse time the kernel stamps
        os.utime(tmp, ns=(now, now))
        seq = (generation >> _SEQ_SHIFT) + 1
        new = _generation(seq, tmp.stat())  # of the file linked: the link keeps its mtime
        try:
            os.link(tmp, gens / f"{seq:020d}")
        except FileExistsError:
            raise PreconditionFailed(
                f"{join_uri(self.uri, key)}: generation {generation} was replaced concurrently"
            ) from None
        finally:
            tmp.unlink(missing_ok=True)
        # Mirror for humans (`cat LATEST`); readers of this key use the generation files.
        mirror = write_temp(self._path(key).parent, data)
        os.replace(mirror, self._path(key))
        for old in range(seq - self._KEEP_GENERATIONS - 8, seq - self._KEEP_GENERATIONS):
            if old > 0:
                (gens / f"{old:020d}").unlink(missing_ok=True)
        return new

    def list(self, prefix: str = "", *, start_after: str | None = None) -> list[ObjectInfo]:
        self._sweeper.maybe_sweep()  # at most every few minutes
        after = start_after.lstrip("/") if start_after else ""
        prefix = prefix.lstrip("/")
        self._check_folder(prefix.rsplit("/", 1)[0] if "/" in prefix else "")
        # Reads only folders that can hold keys after `after` (local_listing.py).
        found = list_files(self.root, prefix, after)
        return [ObjectInfo(key=k, size=size, updated=mtime) for k, size, mtime in found]

    def list_folders(self, prefix: str) -> list[str]:  # ["shards/a/", ...]
        self._check_folder(prefix.strip("/"))
        return list_dirs(self.root, prefix)

    def _check_folder(self, folder: str) -> None:
        """`OutsideRoot` if the folder a listing starts from resolves outside the root."""
        if folder:
            self._path(folder)

    def exists(self, key: str) -> bool:
        return self._path(key).is_file() or self._latest_generation(key) > 0

    def delete(self, key: str) -> None:
        """Delete the object, and its folder if that leaves it empty (as in a bucket, a
        folder exists while it holds something: e.g. a snapshot folder a killed publish
        left, once its files are collected). A writer that finds its folder removed
        meanwhile creates it again (`write_temp`)."""
        path = self._path(key)
        path.unlink(missing_ok=True)
        gens = self._gens_dir(key)
        if gens.is_dir():
            for f in gens.iterdir():
                f.unlink(missing_ok=True)
            with contextlib.suppress(OSError):
                gens.rmdir()
        if path.parent != self.root:
            with contextlib.suppress(OSError):  # not empty, or already gone
                path.parent.rmdir()

    def open_input(self, key: str) -> pa.NativeFile:
        """`key` memory-mapped (`_open_file`: the file checked is the file mapped)."""
        fd, opened = self._open_file(key)
        try:
            return pa.memory_map(opened, "r")
        finally:
            os.close(fd)

    def _read_file(self, key: str, limit: int) -> bytes:
        fd, _ = self._open_file(key)
        with os.fdopen(fd, "rb") as f:
            return f.read(_bounded(limit, fd))

    def _open_file(self, key: str, path: Path | None = None) -> tuple[int, str]:
        """(a descriptor open on the regular file of `key`, a path naming that very file);
        `path`: where it is when not at the key's (a generation file). NotFound when
        absent or a folder, `NotAFile` when not a regular file, `OutsideRoot`.

        Where the kernel names open files (`/proc/self/fd`), the file is opened first and
        the check is of the file opened: one system call instead of one per path component
        (`realpath`, the learner's reader paid it per shard, #29), and no window between
        the check and the open."""
        if path is None:
            path = self._path(key) if not _FD_PATHS else self.root / check_key(key)
        where = join_uri(self.uri, key)
        try:  # O_NONBLOCK: a FIFO opens at once (to be refused), not when a writer comes
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        except (FileNotFoundError, NotADirectoryError):
            raise NotFound(f"{where} does not exist") from None
        except OSError as err:
            if err.errno == errno.ENXIO:  # a socket
                raise NotAFile(f"{where} is not a regular file: refused unread") from None
            raise
        try:
            opened = f"{_FD_PATHS}/{fd}" if _FD_PATHS else str(path)
            if _FD_PATHS:
                self._refuse_outside(key, os.readlink(opened))
            _check_regular(os.fstat(fd).st_mode, where)
        except BaseException:
            os.close(fd)
            raise
        return fd, opened

    def read_to(self, key: str, sink: ByteSink) -> None:
        with self.open_input(key) as f:
            while chunk := f.read_buffer(READ_CHUNK_BYTES):  # views into the mapping
                sink.write(memoryview(chunk).cast("B"))

    def arrow_filesystem(self) -> tuple[pafs.FileSystem, str]:
        return pafs.LocalFileSystem(), str(self.root)

    def orbax_path(self, key: str) -> str:
        return str(self._path(key))  # orbax commits a step by renaming its temp folder

    def local_path(self, key: str = "") -> Path:
        return self._path(key) if key else self.root
