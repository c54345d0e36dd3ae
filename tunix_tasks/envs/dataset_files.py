"""Reading the rows of a task dataset, once per process: owns the sources (a JSONL or
Parquet file, local or in the object store; a Hugging Face dataset), the size bound and the
per-process cache the ``dataset`` environment's many instances share.

    rows = read_rows("examples/dataset_task/problems.jsonl").rows   # tuple of dicts
    read_rows("gs://bucket/data/train.parquet", max_bytes=64 << 20)  # through open_store
    read_rows("hf:openai/gsm8k:main@test")        # name[:config][@split]; needs `datasets`

Files are read through the project's store (``open_store`` on the parent folder, then the
file's key), so every scheme the store knows works. A file larger than ``max_bytes`` is
refused before it is read. The cache keys a local file by its path, size and modification
time (an edited file is read again) and a remote one or a Hugging Face dataset by its URI
alone (a bucket listing per episode would cost more than the episode): replace a remote
file under a new name. Parsing errors, a missing file and an unknown suffix raise
``DatasetError`` (a ``ValueError``) with the source in the message.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Any

from tunix_tasks.storage.store import StoreError, open_store
from tunix_tasks.storage.uri import normalize_uri

__all__ = ["DEFAULT_MAX_BYTES", "FORMATS", "DatasetError", "Rows", "read_rows"]

DEFAULT_MAX_BYTES = 256 << 20
FORMATS = (".jsonl", ".parquet")
_HF = "hf:"


class DatasetError(ValueError):
    """A dataset source that cannot be read as rows (the message names it)."""


@dataclass(frozen=True, eq=False)  # hashed by identity: one object per version read
class Rows:
    """The rows of one version of a source, as read (shared: do not mutate)."""

    source: str
    rows: tuple[dict[str, Any], ...]


def read_rows(source: str, *, max_bytes: int = DEFAULT_MAX_BYTES) -> Rows:
    """The rows of ``source`` (module docstring: the forms), read once per process."""
    if source.startswith(_HF):
        return _hf_rows(source)
    uri = normalize_uri(source)
    if not uri.endswith(FORMATS):
        raise DatasetError(f"dataset {source!r}: unknown format; valid: {', '.join(FORMATS)}")
    parent, _, key = uri.rpartition("/")
    local = open_store(parent).local_path(key)
    version = None
    if local is not None:
        try:
            st = local.stat()
        except OSError as e:
            raise DatasetError(f"dataset {source!r}: no such file ({e.strerror})") from None
        version = (st.st_size, st.st_mtime_ns)
    return _file_rows(uri, version, max_bytes)


@functools.lru_cache(maxsize=8)
def _file_rows(uri: str, version: tuple[int, int] | None, max_bytes: int) -> Rows:
    parent, _, key = uri.rpartition("/")
    store = open_store(parent)
    try:
        if version is not None:
            size = version[0]
        else:
            found = [info.size for info in store.list(key) if info.key == key]
            if not found:
                raise DatasetError(f"dataset {uri}: no such object")
            size = found[0]
        if size > max_bytes:
            raise DatasetError(
                f"dataset {uri}: {size / 2**20:.1f} MB is over the limit of "
                f"{max_bytes / 2**20:.1f} MB (raise max_file_mb, or split the file)"
            )
        data = store.read_bytes(key)
    except StoreError as e:
        raise DatasetError(f"dataset {uri}: cannot read it: {e}") from None
    rows = _parquet(uri, data) if uri.endswith(".parquet") else _jsonl(uri, data)
    return Rows(uri, rows)


def _jsonl(uri: str, data: bytes) -> tuple[dict[str, Any], ...]:
    rows = []
    try:
        lines = data.decode("utf-8").splitlines()
    except UnicodeDecodeError as e:
        raise DatasetError(f"dataset {uri}: not UTF-8 text ({e})") from None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise DatasetError(f"dataset {uri}, line {n}: not JSON ({e})") from None
        if not isinstance(row, dict):
            raise DatasetError(f"dataset {uri}, line {n}: a row must be a JSON object")
        rows.append(row)
    return tuple(rows)


def _parquet(uri: str, data: bytes) -> tuple[dict[str, Any], ...]:
    import pyarrow as pa  # not at import: config validation imports the env registry
    import pyarrow.parquet as pq

    try:
        return tuple(pq.read_table(pa.BufferReader(data)).to_pylist())
    except pa.ArrowException as e:
        raise DatasetError(f"dataset {uri}: not a Parquet file ({e})") from None


@functools.lru_cache(maxsize=8)
def _hf_rows(source: str) -> Rows:
    """``hf:<name>[:<config>][@<split>]`` (split ``train`` by default) via ``datasets``."""
    spec, _, split = source.removeprefix(_HF).partition("@")
    name, _, config = spec.partition(":")
    try:
        import datasets  # optional: not a dependency of tunix-tasks
    except ImportError:
        raise DatasetError(
            f"dataset {source!r}: Hugging Face `datasets` is not installed (pip install "
            "datasets), or export the split to a .jsonl/.parquet file and give its path"
        ) from None
    try:
        loaded = datasets.load_dataset(name, config or None, split=split or "train")
    except Exception as e:  # the library raises many kinds (network, missing split, ...)
        raise DatasetError(f"dataset {source!r}: {type(e).__name__}: {e}") from None
    return Rows(source, tuple(dict(row) for row in loaded))
