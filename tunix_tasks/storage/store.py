"""Object store: the only module that talks to google-cloud-storage or the local disk.

Everything that crosses a process boundary goes through an `ObjectStore` rooted at a
run URI (`file:///abs/dir` or `gs://bucket/prefix`). Keys are relative '/'-separated
paths under that root. Guarantees, identical on both backends:

- `write_bytes` is atomic: a reader sees the old object, the new one, or none, never a
  partial one (local: temp file + fsync + rename; GCS: one upload, visible on finalize).
- `write_if_generation` is a compare-and-swap for small pointer objects (`weights/LATEST`,
  the learner lease): it succeeds only if the object's generation is still the one the
  caller read (0 = must not exist), else raises `PreconditionFailed`.
- Transient GCS errors (429, 5xx, connection resets) are retried with exponential backoff
  for up to `retry_deadline_s` per call, each retry logged; then `StoreError`.

    store = open_store("file:///tmp/runs/demo")
    store.write_bytes("config.json", b"{}")
    data, gen = store.read_versioned("weights/LATEST") or (None, 0)
    store.write_if_generation("weights/LATEST", b'{"version": 3}', gen)
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable
from urllib.parse import urlparse

import pyarrow as pa
import pyarrow.fs as pafs

from tunix_tasks.storage.local_listing import list_dirs, list_files
from tunix_tasks.storage.tempfiles import TempSweeper, write_temp

__all__ = [
    "InvalidURI",
    "NotFound",
    "ObjectInfo",
    "ObjectStore",
    "PreconditionFailed",
    "StoreError",
    "join_uri",
    "normalize_uri",
    "open_store",
]

SCHEMES = ("file", "gs")
RETRY_DEADLINE_ENV = "TUNIX_STORE_RETRY_DEADLINE_S"
log = logging.getLogger(__name__)


class StoreError(RuntimeError):
    """A storage operation failed after retries."""


class InvalidURI(ValueError):
    """A store URI that is empty, lacks a bucket, or has an unsupported scheme."""


class NotFound(StoreError, FileNotFoundError):
    """The object does not exist."""


class PreconditionFailed(StoreError):
    """A compare-and-swap lost: the object's generation changed since it was read."""


@dataclass(frozen=True)
class ObjectInfo:
    key: str
    size: int
    updated: float  # seconds since the epoch


def normalize_uri(uri: str) -> str:
    """`file://rel`, `/abs` or `rel` -> `file:///abs`; `gs://b/p` kept; else ValueError."""
    uri = uri.strip()
    if not uri:
        raise InvalidURI("store URI is empty; use file:///abs/dir or gs://bucket/prefix")
    if "://" not in uri:
        return "file://" + str(Path(uri).expanduser().resolve())
    parsed = urlparse(uri)
    if parsed.scheme == "file":
        path = (parsed.netloc + parsed.path) if parsed.netloc else parsed.path
        return "file://" + str(Path(path).expanduser().resolve())
    if parsed.scheme == "gs":
        if not parsed.netloc:
            raise InvalidURI(f"gs:// URI needs a bucket: {uri!r}")
        return f"gs://{parsed.netloc}/{parsed.path.strip('/')}".rstrip("/")
    raise InvalidURI(f"unsupported store scheme {parsed.scheme!r} in {uri!r}; valid: file, gs")


def join_uri(root: str, key: str) -> str:
    return f"{root.rstrip('/')}/{key.lstrip('/')}"


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
    def write_bytes(self, key: str, data: bytes) -> None: ...
    def read_versioned(self, key: str) -> tuple[bytes, int] | None: ...
    def write_if_generation(self, key: str, data: bytes, generation: int) -> int: ...
    def list(self, prefix: str = "", *, start_after: str | None = None) -> list[ObjectInfo]: ...
    def list_folders(self, prefix: str) -> list[str]: ...
    def exists(self, key: str) -> bool: ...
    def delete(self, key: str) -> None: ...
    def open_input(self, key: str) -> pa.NativeFile: ...
    def arrow_filesystem(self) -> tuple[pafs.FileSystem, str]: ...


def _check_key(key: str) -> str:
    key = key.lstrip("/")
    if not key or any(part in ("", ".", "..") for part in key.split("/")):
        raise ValueError(f"invalid object key {key!r}")
    return key


class LocalStore:
    """A directory. CAS pointers keep numbered generation files created with link(2),
    which fails if the target exists, so two writers can never both win."""

    _KEEP_GENERATIONS = 64

    def __init__(self, uri: str) -> None:
        self.uri = normalize_uri(uri)
        self.root = Path(urlparse(self.uri).path)
        self._sweeper = TempSweeper(self.root)  # temp files of killed writers (tempfiles.py)

    def _path(self, key: str) -> Path:
        return self.root / _check_key(key)

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


class GcsStore:
    """A bucket prefix, through google-cloud-storage (honours STORAGE_EMULATOR_HOST)."""

    def __init__(
        self, uri: str, *, client: object | None = None, retry_deadline_s: float | None = None
    ) -> None:
        from google.api_core import exceptions as gexc
        from google.api_core.retry import Retry
        from google.cloud import storage
        from google.cloud.storage.retry import DEFAULT_RETRY

        self.uri = normalize_uri(uri)
        parsed = urlparse(self.uri)
        self.bucket_name = parsed.netloc
        self.prefix = parsed.path.strip("/")
        if client is None:
            if os.environ.get("STORAGE_EMULATOR_HOST"):
                from google.auth.credentials import AnonymousCredentials

                client = storage.Client(project="tunix-local", credentials=AnonymousCredentials())
            else:
                client = storage.Client()
        self._client = client
        self._bucket = client.bucket(self.bucket_name)  # type: ignore[attr-defined]
        import requests

        self._gexc = gexc
        # Errors that survive the retry policy; all become StoreError subclasses.
        self._errors = (gexc.GoogleAPICallError, gexc.RetryError, requests.RequestException)
        # How long one call keeps retrying (default 120 s, or TUNIX_STORE_RETRY_DEADLINE_S),
        # on the errors GCS calls transient; each retry is logged (never a silent wait).
        deadline = retry_deadline_s or float(os.environ.get(RETRY_DEADLINE_ENV) or 120.0)
        self._retry = Retry(predicate=DEFAULT_RETRY._predicate, timeout=deadline, on_error=lambda err: log.warning("%s: %r; retrying for up to %.0f s", self.uri, err, deadline))  # fmt: skip

    def _name(self, key: str) -> str:
        key = _check_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    def _key(self, name: str) -> str:
        return name[len(self.prefix) + 1 :] if self.prefix else name

    def _wrap(self, key: str, err: Exception) -> StoreError:
        where = self.uri if key == "." else join_uri(self.uri, key)  # "." : a listing
        if isinstance(err, self._gexc.NotFound):
            return NotFound(f"{where} does not exist")
        if isinstance(err, self._gexc.PreconditionFailed):
            return PreconditionFailed(f"{where}: generation changed concurrently")
        if isinstance(err, self._gexc.RetryError):  # .cause: the last transient error
            return StoreError(f"{where}: unreachable, gave up after retrying for {self._retry.timeout:.0f} s (last error: {err.cause!r})")  # fmt: skip
        return StoreError(f"{where}: {type(err).__name__}: {err}")

    def read_bytes(self, key: str) -> bytes:
        try:
            return self._bucket.blob(self._name(key)).download_as_bytes(retry=self._retry)
        except self._errors as err:
            raise self._wrap(key, err) from None

    def write_bytes(self, key: str, data: bytes) -> None:
        # Keys written this way are write-once or last-writer-wins, so retrying is safe.
        try:
            self._bucket.blob(self._name(key)).upload_from_string(data, retry=self._retry)
        except self._errors as err:
            raise self._wrap(key, err) from None

    def read_versioned(self, key: str) -> tuple[bytes, int] | None:
        try:
            blob = self._bucket.get_blob(self._name(key), retry=self._retry)
            if blob is None:
                return None
            data = blob.download_as_bytes(if_generation_match=blob.generation, retry=self._retry)
            return data, int(blob.generation)
        except self._gexc.NotFound:
            return None
        except self._gexc.PreconditionFailed:
            return self.read_versioned(key)  # replaced between metadata and download
        except self._errors as err:
            raise self._wrap(key, err) from None

    def write_if_generation(self, key: str, data: bytes, generation: int) -> int:
        blob = self._bucket.blob(self._name(key))
        try:
            blob.upload_from_string(data, if_generation_match=generation, retry=self._retry)
        except self._errors as err:
            raise self._wrap(key, err) from None
        return int(blob.generation)

    def list(self, prefix: str = "", *, start_after: str | None = None) -> list[ObjectInfo]:
        base = self.prefix + "/" if self.prefix else ""
        offset = base + start_after.lstrip("/") if start_after else None  # inclusive
        try:
            blobs = list(self._client.list_blobs(self._bucket, prefix=base + prefix.lstrip("/"), start_offset=offset, retry=self._retry))  # type: ignore[attr-defined]  # fmt: skip
        except self._errors as err:
            raise self._wrap(prefix or ".", err) from None
        blobs = [b for b in blobs if offset is None or b.name > offset]
        out = [ObjectInfo(self._key(b.name), int(b.size or 0), b.updated.timestamp() if b.updated else 0.0) for b in blobs]  # fmt: skip
        return sorted(out, key=lambda i: i.key)

    def list_folders(self, prefix: str) -> list[str]:
        full = (self.prefix + "/" if self.prefix else "") + prefix.lstrip("/")
        try:
            pages = self._client.list_blobs(self._bucket, prefix=full, delimiter="/", retry=self._retry)  # type: ignore[attr-defined]  # fmt: skip
            list(pages)  # the prefixes fill in as the pages are read
        except self._errors as err:
            raise self._wrap(prefix or ".", err) from None
        return sorted(self._key(p) for p in pages.prefixes)

    def exists(self, key: str) -> bool:
        try:
            return bool(self._bucket.blob(self._name(key)).exists(retry=self._retry))
        except self._errors as err:
            raise self._wrap(key, err) from None

    def delete(self, key: str) -> None:
        try:
            self._bucket.blob(self._name(key)).delete(retry=self._retry)
        except self._gexc.NotFound:
            return
        except self._errors as err:
            raise self._wrap(key, err) from None

    def open_input(self, key: str) -> pa.NativeFile:
        return pa.BufferReader(self.read_bytes(key))

    def arrow_filesystem(self) -> tuple[pafs.FileSystem, str]:
        host = os.environ.get("STORAGE_EMULATOR_HOST")
        if host:
            parsed = urlparse(host if "://" in host else f"http://{host}")
            fs = pafs.GcsFileSystem(
                anonymous=True, scheme=parsed.scheme or "http", endpoint_override=parsed.netloc
            )
        else:
            fs = pafs.GcsFileSystem()
        base = f"{self.bucket_name}/{self.prefix}".rstrip("/")
        return fs, base


def open_store(uri: str) -> ObjectStore:
    """Open the store rooted at `uri` (file:// or gs://)."""
    uri = normalize_uri(uri)
    if uri.startswith("gs://"):
        return GcsStore(uri)
    return LocalStore(uri)
