"""A local folder written whole or not at all (a GGUF import's checkpoint, an export):
its files go into a temporary sibling folder, synced to disk, then renamed to the
destination, so the destination is complete or absent: a crash or power loss leaves no
half folder (a killed writer leaves its hidden `.<dest>.*.tmp` sibling, never `dest`).

    check_free(dest, error=ExportError)          # early, before any expensive work
    with folder_in_place(dest) as tmp:           # write into tmp; renamed on success,
        (tmp / "config.json").write_text(...)    # removed on any error
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

__all__ = ["check_free", "folder_in_place"]


def check_free(dest: Path, *, error: type[Exception]) -> None:
    """`error` unless `dest` is absent or an empty folder (or a symlink to one)."""
    if dest.is_symlink() and not dest.exists():
        raise error(f"{dest}: a symlink to nothing ({os.readlink(dest)}): name a folder")
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise error(f"{dest}: already exists and is not an empty folder")


@contextlib.contextmanager
def folder_in_place(dest: Path) -> Iterator[Path]:
    """A temporary sibling of `dest` to write into, renamed to `dest` when the block
    ends (`dest` absent or empty), removed if it raises. A `dest` that is a symlink to an
    empty folder is filled: the files go where it points (renamed onto that folder,
    beside it, so as atomically) and the link is left as it was."""
    dest = dest.resolve()
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", suffix=".tmp", dir=dest.parent))
    tmp.chmod(0o755)  # mkdtemp's 0700 would make the folder private once renamed
    try:
        yield tmp
        for path in tmp.iterdir():  # on disk before the name is: a power loss leaves no
            _fsync(path)  # truncated file under `dest`
        _fsync(tmp)
        if dest.exists():  # an empty folder: rename(2) would refuse to replace it
            dest.rmdir()
        tmp.rename(dest)
        _fsync(dest.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
