"""A local folder written whole or not at all (a GGUF import's checkpoint, an export):
its files go into a temporary sibling folder renamed to the destination at the end, so
the destination is complete or absent, and a crash leaves no half folder.

    check_free(dest, error=ExportError)          # early, before any expensive work
    with folder_in_place(dest) as tmp:           # write into tmp; renamed on success,
        (tmp / "config.json").write_text(...)    # removed on any error
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

__all__ = ["check_free", "folder_in_place"]


def check_free(dest: Path, *, error: type[Exception]) -> None:
    """`error` unless `dest` is absent or an empty folder."""
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise error(f"{dest}: already exists and is not an empty folder")


@contextlib.contextmanager
def folder_in_place(dest: Path) -> Iterator[Path]:
    """A temporary sibling of `dest` to write into, renamed to `dest` when the block
    ends (`dest` absent or empty), removed if it raises."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", suffix=".tmp", dir=dest.parent))
    tmp.chmod(0o755)  # mkdtemp's 0700 would make the folder private once renamed
    try:
        yield tmp
        if dest.exists():  # an empty folder: rename(2) would refuse to replace it
            dest.rmdir()
        tmp.rename(dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
