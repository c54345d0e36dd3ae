"""Listing a local store's folder tree from a position, at the cost of what it returns.

`LocalStore.list(prefix, start_after=...)` must cost what is new, not the run's history:
the learner lists each actor's shards from its watermark on every poll. A folder cannot
be read from a name on (getdents has no seek), so this walk

- reads only the folders that can hold a key after `after` and under `prefix` (a folder's
  keys all lie between `<folder>/` and `<folder>0`, '0' being the character after '/'),
- compares names before it stats anything (a stat per file was 90% of the old walk).

With shards in time folders (`RunLayout.shard_key`), a listing from a watermark reads the
actor folder's names (one per ~17 minutes of run) and the recent time folders only.

    list_files(Path("/runs/demo"), "shards/actor-0/", after="shards/actor-0/170000/1700000/17000001/1700000123456-ab.parquet")
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["inside", "list_dirs", "list_files"]


def inside(real: str, real_root: str) -> bool:
    """Whether resolved path `real` is resolved folder `real_root` or lies under it."""
    return real == real_root or real.startswith(real_root.rstrip(os.sep) + os.sep)


def _escapes(entry: os.DirEntry, real_root: str) -> bool:
    """A symlink that resolves outside the root (a plain entry costs no system call)."""
    return entry.is_symlink() and not inside(os.path.realpath(entry.path), real_root)


def list_files(root: Path, prefix: str, after: str = "") -> list[tuple[str, int, float]]:
    """(key, size, mtime) of the files under `root` whose key starts with `prefix` and sorts
    after `after`, by key. Hidden names (temp files, CAS generation folders), symlinked
    folders, symlinks to files outside the root and what is no regular file (a FIFO,
    whose reader would wait for a writer forever) are skipped."""
    base = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
    out: list[tuple[str, int, float]] = []
    _walk(root / base if base else root, base, prefix, after, os.path.realpath(root), out)
    out.sort()
    return out


def list_dirs(root: Path, prefix: str) -> list[str]:
    """The folders directly under key `prefix` as `<prefix>/<name>/`, by name (the entry
    types come with the names: no stat per folder, which cost 20 ms for 1,000 actors)."""
    base = prefix.strip("/")
    try:
        entries = list(os.scandir(root / base if base else root))
    except (FileNotFoundError, NotADirectoryError):
        return []
    head = f"{base}/" if base else ""
    real_root = os.path.realpath(root)
    return sorted(
        f"{head}{e.name}/"
        for e in entries
        if e.name[0] != "." and e.is_dir() and not _escapes(e, real_root)
    )


def _walk(
    path: Path, key: str, prefix: str, after: str, real_root: str, out: list[tuple[str, int, float]]
) -> None:
    try:
        entries = list(os.scandir(path))
    except (FileNotFoundError, NotADirectoryError):
        return
    for entry in entries:
        if entry.name.startswith("."):
            continue
        child = f"{key}/{entry.name}" if key else entry.name
        try:
            is_dir, is_file = entry.is_dir(), entry.is_file()
        except OSError:  # removed meanwhile
            continue
        if is_dir:
            folder = child + "/"
            if entry.is_symlink() or (after and child + "0" <= after):
                continue  # not followed (as os.walk), or every key in it is at/before `after`
            if folder.startswith(prefix) or prefix.startswith(folder):
                _walk(Path(entry.path), child, prefix, after, real_root, out)
        elif (
            is_file
            and child > after
            and child.startswith(prefix)
            and not _escapes(entry, real_root)
        ):
            try:
                st = entry.stat()
            except FileNotFoundError:  # deleted between the listing and the stat
                continue
            out.append((child, st.st_size, st.st_mtime))
