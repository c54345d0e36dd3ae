"""Store URIs: the scheme table (which backend opens a scheme's roots, how they are
written), normalising and joining. No third-party import, so the config imports it.

A run root is `<scheme>://...`; each scheme is registered once with the backend class
that opens it (as ``"module:Class"``, imported on the first `open_store`, so google-cloud-
storage loads only for gs://) and the rule that writes its roots in normal form:

- `local_root`: a path on this machine (`file://rel`, `/abs`, `rel` -> `file:///abs`);
- `bucket_root`: a bucket and a prefix (`gs://b/p/` -> `gs://b/p`), the default.

Another package adds a scheme with an entry point in the ``tunix_tasks.stores`` group
(name: the scheme, value: the backend class; its roots follow `bucket_root`), or in code
with `register_backend`:

    register_backend("s3", "tunix_tasks.storage.backends.s3:S3Store")
    normalize_uri("s3://bucket/runs/")        # "s3://bucket/runs"
    join_uri("s3://bucket/runs", "r1")        # "s3://bucket/runs/r1"
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import ParseResult, urlparse

from tunix_tasks.registry import Registry

__all__ = [
    "BACKENDS",
    "ENTRY_POINT_GROUP",
    "InvalidURI",
    "backend_for",
    "bucket_root",
    "join_uri",
    "local_root",
    "normalize_uri",
    "register_backend",
    "scheme_of",
]

ENTRY_POINT_GROUP = "tunix_tasks.stores"
# Scheme -> the backend class that opens a root of it (called with the normal URI).
BACKENDS = Registry(ENTRY_POINT_GROUP, "store scheme")
RootRule = Callable[[ParseResult, str], str]
_ROOTS: dict[str, RootRule] = {}


class InvalidURI(ValueError):
    """A store URI that is empty, lacks a bucket, or has an unsupported scheme."""


def local_root(parsed: ParseResult, uri: str) -> str:
    """`file://<path>` with the path made absolute (`file://./runs` is relative)."""
    path = (parsed.netloc + parsed.path) if parsed.netloc else parsed.path
    return f"{parsed.scheme}://{Path(path).expanduser().resolve()}"


def bucket_root(parsed: ParseResult, uri: str) -> str:
    """`<scheme>://bucket/prefix` without a trailing slash; a bucket is required."""
    if not parsed.netloc:
        raise InvalidURI(f"{parsed.scheme}:// URI needs a bucket: {uri!r}")
    return f"{parsed.scheme}://{parsed.netloc}/{parsed.path.strip('/')}".rstrip("/")


def register_backend(
    scheme: str, backend: str | Callable[..., Any], *, root: RootRule = bucket_root
) -> None:
    """Open `scheme://` roots with `backend` (a class, or ``"module:Class"`` imported on
    first use), whose roots `root` writes in normal form."""
    if isinstance(backend, str):
        BACKENDS.register_target(scheme, backend)
    else:
        BACKENDS.register(scheme)(backend)
    _ROOTS[scheme] = root


def scheme_of(uri: str) -> str:
    """The scheme of a normal URI (`normalize_uri`'s output)."""
    return uri.partition("://")[0]


def backend_for(uri: str) -> Callable[[str], Any]:
    """The backend class registered for the scheme of the normal URI `uri` (imported now
    if it was registered by name or entry point)."""
    return BACKENDS.factory(scheme_of(uri))


def normalize_uri(uri: str) -> str:
    """A root URI in its scheme's normal form (a bare path is a `file://` one); raises
    `InvalidURI` for an empty URI or a scheme no backend is registered for."""
    uri = uri.strip()
    if not uri:
        raise InvalidURI("store URI is empty; use file:///abs/dir or gs://bucket/prefix")
    # A bare path is taken whole (no URL parsing: '#' or '?' may be part of a file name).
    parsed = urlparse(uri) if "://" in uri else ParseResult("file", "", uri, "", "", "")
    if parsed.scheme not in BACKENDS:
        raise InvalidURI(
            f"unsupported store scheme {parsed.scheme!r} in {uri!r}; "
            f"valid: {', '.join(BACKENDS.names())}"
        )
    return _ROOTS.get(parsed.scheme, bucket_root)(parsed, uri)


def join_uri(root: str, key: str) -> str:
    return f"{root.rstrip('/')}/{key.lstrip('/')}"


register_backend("file", "tunix_tasks.storage.backends.local:LocalStore", root=local_root)
register_backend("gs", "tunix_tasks.storage.backends.gcs:GcsStore")
