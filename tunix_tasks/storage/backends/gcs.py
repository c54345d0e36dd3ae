"""`GcsStore`: the `gs://` backend, a bucket prefix through google-cloud-storage.

The only module that imports google-cloud-storage (on the first `open_store` of a gs://
root). Honours STORAGE_EMULATOR_HOST (fake-gcs-server in the tests), for orbax's
checkpoints and pyarrow's reads too. Without usable credentials (and without an emulator)
opening the store raises a one-line `StoreError` saying how to get them. Every call
retries what GCS calls transient for up to `retry_deadline_s()`, logging each retry, then
raises a `StoreError`.
"""

from __future__ import annotations

import io
import logging
import os
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pyarrow as pa
import pyarrow.fs as pafs
import requests
from google.api_core import exceptions as gexc
from google.api_core.retry import Retry
from google.auth import exceptions as auth_exc
from google.auth.credentials import AnonymousCredentials
from google.cloud import storage
from google.cloud.storage.retry import DEFAULT_RETRY

from tunix_tasks.storage.store import (
    ByteSink,
    Data,
    NotFound,
    ObjectInfo,
    PreconditionFailed,
    StoreError,
    check_head,
    check_key,
)
from tunix_tasks.storage.store import retry_deadline_s as _deadline
from tunix_tasks.storage.uri import join_uri, normalize_uri

__all__ = ["GcsStore"]

log = logging.getLogger(__name__)
# Errors that survive the retry policy; all become StoreError subclasses. Credentials
# that cannot be refreshed (revoked, expired) surface as GoogleAuthError on the first call.
_ERRORS = (
    gexc.GoogleAPICallError,
    gexc.RetryError,
    requests.RequestException,
    auth_exc.GoogleAuthError,
)
NO_CREDENTIALS_HINT = (
    "run `gcloud auth application-default login`, set GOOGLE_APPLICATION_CREDENTIALS to a "
    "service-account key file, or run where workload identity provides them "
    "(STORAGE_EMULATOR_HOST=host:port for an emulator, which needs none)"
)


#: Chunk of a resumable upload (the client's default). The client takes each chunk as
#: `bytes`, so one chunk is copied at a time while holding the GIL (~70 ms of 100 MiB on
#: a 2-core host); copying a whole 450 MB snapshot first held it ~0.5-1 s (#29).
UPLOAD_CHUNK_BYTES = 100 << 20
#: Up to this size the client uploads in one request (multipart); above, resumable.
MULTIPART_MAX_BYTES = 8 << 20


class _BufferReader(io.RawIOBase):
    """A seekable read-only file over `data`'s buffer, without copying it: what the
    client uploads from, a chunk at a time (and seeks back to resume one)."""

    def __init__(self, data: Data) -> None:
        self._view = memoryview(data).cast("B")
        self._pos = 0

    @property
    def size(self) -> int:
        return self._view.nbytes

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self.size}[whence]
        self._pos = min(max(base + offset, 0), self.size)
        return self._pos

    def readinto(self, buffer: Any) -> int:
        chunk = self._view[self._pos : self._pos + memoryview(buffer).nbytes]
        memoryview(buffer).cast("B")[: chunk.nbytes] = chunk
        self._pos += chunk.nbytes
        return chunk.nbytes

    def read(self, size: int | None = -1) -> bytes:
        end = self.size if size is None or size < 0 else self._pos + size
        chunk = self._view[self._pos : end].tobytes()
        self._pos += len(chunk)
        return chunk


class GcsStore:
    """A bucket prefix, through google-cloud-storage (honours STORAGE_EMULATOR_HOST)."""

    def __init__(
        self, uri: str, *, client: object | None = None, retry_deadline_s: float | None = None
    ) -> None:
        self.uri = normalize_uri(uri)
        parsed = urlparse(self.uri)
        self.bucket_name = parsed.netloc
        self.prefix = parsed.path.strip("/")
        if client is None:
            if os.environ.get("STORAGE_EMULATOR_HOST"):
                client = storage.Client(project="tunix-local", credentials=AnonymousCredentials())
            else:
                try:
                    client = storage.Client()
                except auth_exc.DefaultCredentialsError as err:
                    why = str(err).split(". ")[0].rstrip(".")  # the rest is a link
                    raise StoreError(
                        f"{self.uri}: no usable Google Cloud credentials ({why}); "
                        + NO_CREDENTIALS_HINT
                    ) from None
        self._client = client
        self._bucket = client.bucket(self.bucket_name)  # type: ignore[attr-defined]
        deadline = _deadline(retry_deadline_s)
        self._retry = Retry(
            predicate=DEFAULT_RETRY._predicate,
            timeout=deadline,
            on_error=lambda err: log.warning(
                "%s: %r; retrying for up to %.0f s", self.uri, err, deadline
            ),
        )

    def _name(self, key: str) -> str:
        key = check_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    def _key(self, name: str) -> str:
        return name[len(self.prefix) + 1 :] if self.prefix else name

    def _wrap(self, key: str, err: Exception, *, writing: bool = False) -> StoreError:
        where = self.uri if key == "." else join_uri(self.uri, key)  # "." : a listing
        if isinstance(err, gexc.NotFound) and writing:  # an upload finds no bucket
            return NotFound(
                f"{where}: bucket gs://{self.bucket_name} does not exist; create it "
                f"(gcloud storage buckets create gs://{self.bucket_name}) or fix the store URI"
            )
        if isinstance(err, gexc.NotFound):
            return NotFound(f"{where} does not exist")
        if isinstance(err, gexc.PreconditionFailed):
            return PreconditionFailed(f"{where}: generation changed concurrently")
        if isinstance(err, gexc.RetryError):  # .cause: the last transient error
            return StoreError(
                f"{where}: unreachable, gave up after retrying for "
                f"{self._retry.timeout:.0f} s (last error: {err.cause!r})"
            )
        return StoreError(f"{where}: {type(err).__name__}: {err}")

    def read_bytes(self, key: str) -> bytes:
        try:
            return self._bucket.blob(self._name(key)).download_as_bytes(retry=self._retry)
        except _ERRORS as err:
            raise self._wrap(key, err) from None

    def read_head(self, key: str, max_bytes: int) -> bytes:
        try:  # one ranged GET (the client checks no hash of a part of an object)
            data = self._bucket.blob(self._name(key)).download_as_bytes(
                start=0, end=check_head(max_bytes) - 1, retry=self._retry
            )
            return data[:max_bytes]  # a gzip-encoded object comes back whole, decoded
        except gexc.RequestRangeNotSatisfiable:  # GCS: any range of an empty object
            return b""
        except _ERRORS as err:
            raise self._wrap(key, err) from None

    def size(self, key: str) -> int:
        try:
            blob = self._bucket.get_blob(self._name(key), retry=self._retry)
        except _ERRORS as err:
            raise self._wrap(key, err) from None
        if blob is None:
            raise NotFound(f"{join_uri(self.uri, key)} does not exist")
        return int(blob.size or 0)

    def write_bytes(self, key: str, data: Data) -> None:
        # Keys written this way are write-once or last-writer-wins, so retrying is safe.
        reader = _BufferReader(data)
        blob = self._bucket.blob(self._name(key))
        blob.chunk_size = UPLOAD_CHUNK_BYTES  # above the client's 8 MiB: resumable
        try:
            try:
                blob.upload_from_file(reader, size=reader.size, retry=self._retry)
            except gexc.NotFound:
                if reader.size <= MULTIPART_MAX_BYTES:
                    raise  # one request: the bucket is missing
                # A resumable session the server lost (restarted, or expired) is a 404 like
                # a missing bucket: start over once; a missing bucket fails again.
                log.warning("%s: upload session lost; uploading again", join_uri(self.uri, key))
                reader.seek(0)
                blob.upload_from_file(reader, size=reader.size, retry=self._retry)
        except _ERRORS as err:
            raise self._wrap(key, err, writing=True) from None

    def read_versioned(self, key: str) -> tuple[bytes, int] | None:
        try:
            blob = self._bucket.get_blob(self._name(key), retry=self._retry)
            if blob is None:
                return None
            data = blob.download_as_bytes(if_generation_match=blob.generation, retry=self._retry)
            return data, int(blob.generation)
        except gexc.NotFound:
            return None
        except gexc.PreconditionFailed:
            return self.read_versioned(key)  # replaced between metadata and download
        except _ERRORS as err:
            raise self._wrap(key, err) from None

    def write_if_generation(self, key: str, data: bytes, generation: int) -> int:
        blob = self._bucket.blob(self._name(key))
        try:
            blob.upload_from_string(data, if_generation_match=generation, retry=self._retry)
        except _ERRORS as err:
            raise self._wrap(key, err, writing=True) from None
        return int(blob.generation)

    def list(self, prefix: str = "", *, start_after: str | None = None) -> list[ObjectInfo]:
        base = self.prefix + "/" if self.prefix else ""
        offset = base + start_after.lstrip("/") if start_after else None  # inclusive
        try:
            blobs = list(
                self._client.list_blobs(  # type: ignore[attr-defined]
                    self._bucket,
                    prefix=base + prefix.lstrip("/"),
                    start_offset=offset,
                    retry=self._retry,
                )
            )
        except _ERRORS as err:
            raise self._wrap(prefix or ".", err) from None
        out = [
            ObjectInfo(
                self._key(b.name), int(b.size or 0), b.updated.timestamp() if b.updated else 0.0
            )
            for b in blobs
            if offset is None or b.name > offset
        ]
        return sorted(out, key=lambda i: i.key)

    def list_folders(self, prefix: str) -> list[str]:
        full = (self.prefix + "/" if self.prefix else "") + prefix.lstrip("/")
        try:
            pages = self._client.list_blobs(  # type: ignore[attr-defined]
                self._bucket, prefix=full, delimiter="/", retry=self._retry
            )
            list(pages)  # the prefixes fill in as the pages are read
        except _ERRORS as err:
            raise self._wrap(prefix or ".", err) from None
        return sorted(self._key(p) for p in pages.prefixes)

    def exists(self, key: str) -> bool:
        try:
            return bool(self._bucket.blob(self._name(key)).exists(retry=self._retry))
        except _ERRORS as err:
            raise self._wrap(key, err) from None

    def delete(self, key: str) -> None:
        try:
            self._bucket.blob(self._name(key)).delete(retry=self._retry)
        except gexc.NotFound:
            return
        except _ERRORS as err:
            raise self._wrap(key, err) from None

    def open_input(self, key: str) -> pa.NativeFile:
        return pa.BufferReader(self.read_bytes(key))

    def read_to(self, key: str, sink: ByteSink) -> None:
        # The client writes each response chunk as it arrives and resumes an interrupted
        # download where it stopped, pinned to the generation it started on. The caller
        # checks what it read (a snapshot: its sha256), so no second (crc32c) hash.
        try:
            self._bucket.blob(self._name(key)).download_to_file(
                sink, retry=self._retry, checksum=None
            )
        except _ERRORS as err:
            raise self._wrap(key, err) from None

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

    def orbax_path(self, key: str) -> str:
        emulator = os.environ.get("STORAGE_EMULATOR_HOST")
        if emulator:
            # Orbax writes gs:// through tensorstore and gcsfs, which ignore
            # STORAGE_EMULATOR_HOST; point them at the same emulator (and skip gcsfs's
            # hierarchical-namespace probe, ~60 s of gRPC retries per bucket).
            # Always follow the emulator: a value left by an earlier one would send the
            # checkpoint to a server that does not have this bucket (404 on every write).
            os.environ["TENSORSTORE_GCS_HTTP_URL"] = (
                emulator if "://" in emulator else f"http://{emulator}"
            )
            os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
        return join_uri(self.uri, check_key(key))

    def local_path(self, key: str = "") -> Path | None:
        return None  # a bucket has no path on this machine
