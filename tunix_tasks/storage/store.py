"""The object-store contract: the `ObjectStore` Protocol, its errors, and `open_store`.

Everything that crosses a process boundary goes through an `ObjectStore` rooted at a
run URI (`file:///abs/dir`, `gs://bucket/prefix`, or any scheme registered in `uri.py`).
Keys are relative '/'-separated paths under that root. Guarantees, identical on every
backend (`backends/`):

- `write_bytes` is atomic: a reader sees the old object, the new one, or none, never a
  partial one (local: temp file + fsync + rename; GCS: one upload, visible on finalize).
- `write_if_generation` is a compare-and-swap for small pointer objects (`weights/LATEST`,
  the learner lease): it succeeds only if the object's generation is still the one the
  caller read (0 = must not exist), else raises `PreconditionFailed`.
- `size` answers from metadata (no read), so a reader can refuse an object larger than
  it expects before reading a byte of it (`weights.py`).
- Only regular files are objects: locally a key naming a FIFO, a socket or a device
  raises `NotAFile` (a `NotFound`) on `size` and every read, before a byte is read (a
  FIFO blocked its reader forever); a folder does not exist, as a bucket's prefix.
- `read_head` reads at most the first N bytes of an object in one request: `read_small`
  reads an object its reader knows to be small (a manifest, a run's config, the id a
  `RunFence` reads before and after a write) that way, never more than one byte past
  its bound.
- `read_to` streams an object into the reader's own memory, a chunk at a time:
  `read_bytes` and `open_input` (random access, for Parquet) may hold the whole object,
  which for a weight snapshot doubled a reload's peak on gs://.
- `delete` of an object also removes its folder when that leaves it empty (locally; a
  bucket has no empty folders): a prefix with no objects is not listed by `list_folders`.
- A remote backend retries transient errors (429, 5xx, connection resets) with
  exponential backoff for up to `retry_deadline_s()` per call, each retry logged; then
  `StoreError`.

    store = open_store("file:///tmp/runs/demo")
    store.write_bytes("config.json", b"{}")
    data, gen = store.read_versioned("weights/LATEST") or (None, 0)
    store.write_if_generation("weights/LATEST", b'{"version": 3}', gen)
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, TypeAlias, runtime_checkable

from tunix_tasks.storage.uri import backend_for, join_uri, normalize_uri

if TYPE_CHECKING:
    import numpy as np
    import pyarrow as pa
    import pyarrow.fs as pafs

__all__ = [
    "RETRY_DEADLINE_ENV",
    "ByteSink",
    "Data",
    "NotAFile",
    "NotFound",
    "ObjectInfo",
    "ObjectStore",
    "PreconditionFailed",
    "StoreError",
    "check_head",
    "check_key",
    "open_store",
    "read_small",
    "retry_deadline_s",
]

RETRY_DEADLINE_ENV = "TUNIX_STORE_RETRY_DEADLINE_S"


class StoreError(RuntimeError):
    """A storage operation failed after retries."""


class NotFound(StoreError, FileNotFoundError):
    """The object does not exist."""


class NotAFile(NotFound):
    """Something that is not a regular file (a FIFO, a socket, a device) is at the key:
    refused unread, as if no object were there, with a message saying what it is."""


class PreconditionFailed(StoreError):
    """A compare-and-swap lost: the object's generation changed since it was read."""


@dataclass(frozen=True)
class ObjectInfo:
    key: str
    size: int
    updated: float  # seconds since the epoch


#: What `write_bytes` takes: bytes, or a contiguous buffer (a 1-D uint8 array: a weight
#: snapshot, filled without holding the GIL, is written without a copy to `bytes`).
Data: TypeAlias = "bytes | bytearray | memoryview | np.ndarray"


class ByteSink(Protocol):
    """Where `ObjectStore.read_to` writes: bytes in order, each buffer valid only during
    its call (copy it)."""

    def write(self, data: bytes | memoryview, /) -> object: ...


@runtime_checkable
class ObjectStore(Protocol):
    """Byte objects under one root. Typical use by a writer and a reader:

    store.write_bytes("shards/a/0001.parquet", data)      # atomic
    for info in store.list("shards/"):                     # sorted by key
        blob = store.read_bytes(info.key)
    store.list_folders("shards/"); store.list("shards/a/", start_after="shards/a/0001.parquet")
    """

    uri: str

    def read_bytes(self, key: str) -> bytes: ...
    def read_head(self, key: str, max_bytes: int) -> bytes:
        """The first `max_bytes` (> 0) bytes of `key`, all of it when smaller, in one
        request; NotFound if none."""
        ...

    def size(self, key: str) -> int:
        """The object's size in bytes, from its metadata (nothing read); NotFound if none."""
        ...

    def write_bytes(self, key: str, data: Data) -> None: ...
    def read_versioned(self, key: str) -> tuple[bytes, int] | None: ...
    def write_if_generation(self, key: str, data: bytes, generation: int) -> int: ...
    def list(self, prefix: str = "", *, start_after: str | None = None) -> list[ObjectInfo]: ...
    def list_folders(self, prefix: str) -> list[str]: ...
    def exists(self, key: str) -> bool: ...
    def delete(self, key: str) -> None: ...
    def open_input(self, key: str) -> pa.NativeFile: ...
    def read_to(self, key: str, sink: ByteSink) -> None:
        """`key`'s bytes written to `sink` front to back, a chunk at a time (no copy of the
        whole object on the way); NotFound if none. After an error `sink` holds a prefix."""
        ...

    def arrow_filesystem(self) -> tuple[pafs.FileSystem, str]: ...
    def orbax_path(self, key: str) -> str | os.PathLike[str]:
        """Where orbax (the learner's checkpoints) reads and writes the folder `key`."""
        ...

    def local_path(self, key: str = "") -> Path | None:
        """The file or folder of `key` (the root for "") on this machine; None remote."""
        ...


def check_key(key: str) -> str:
    """`key` without a leading '/'; ValueError if empty or with '', '.', '..' parts."""
    key = key.lstrip("/")
    if not key or any(part in ("", ".", "..") for part in key.split("/")):
        raise ValueError(f"invalid object key {key!r}")
    return key


def check_head(max_bytes: int) -> int:
    """`max_bytes` of a `read_head`; ValueError below 1."""
    if max_bytes < 1:
        raise ValueError(f"read_head reads at least 1 byte, not {max_bytes}")
    return max_bytes


def read_small(store: ObjectStore, key: str, max_bytes: int, *, error: type[Exception]) -> bytes:
    """The bytes of `key`, an object its reader knows to be small (a manifest, a run's
    config), in one request (`read_head`); `error` when it holds more than `max_bytes`,
    having read one byte more (a sparse 100 GB file would be read whole otherwise);
    NotFound if none."""
    data = store.read_head(key, max_bytes + 1)
    if len(data) <= max_bytes:
        return data
    try:  # for the message only: the object may be gone or rewritten meanwhile
        size = store.size(key)
    except StoreError:
        size = 0
    held = f"{size} bytes" if size > max_bytes else f"over {max_bytes} bytes"
    raise error(
        f"{join_uri(store.uri, key)} holds {held}, more than the {max_bytes} it may: refused"
    )


def retry_deadline_s(explicit: float | None = None) -> float:
    """How long one call of a remote backend keeps retrying: `explicit`, else the
    environment's TUNIX_STORE_RETRY_DEADLINE_S, else 120 s."""
    return explicit or float(os.environ.get(RETRY_DEADLINE_ENV) or 120.0)


#: What a backend must implement (the Protocol's methods).
_METHODS = tuple(name for name, v in vars(ObjectStore).items() if callable(v) and name[0] != "_")


def open_store(uri: str) -> ObjectStore:
    """Open the store rooted at `uri` with the backend registered for its scheme; a
    `TypeError` naming what a registered backend lacks of the contract (one written
    before a method was added), not an `AttributeError` at its first use."""
    uri = normalize_uri(uri)
    store = backend_for(uri)(uri)
    missing = [name for name in _METHODS if not callable(getattr(store, name, None))]
    if missing:
        raise TypeError(
            f"the store backend {type(store).__qualname__} for {uri} lacks "
            f"{', '.join(missing)} of the ObjectStore contract (tunix_tasks/storage/store.py)"
        )
    return store
