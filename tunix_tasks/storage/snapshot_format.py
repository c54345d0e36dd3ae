"""What a weight snapshot is, as data (no I/O): its manifest, its params blob
(safetensors, decoded into zero-copy views), the delta codec between two blobs of the
same layout, and the `weights/LATEST` pointer. `weights.py` stores, reads and verifies
them.

A delta is `zstd(shuffle(new XOR base))`: XOR leaves only the bits a small update
changed, and the byte-plane shuffle (byte 0 of every 4-byte word, then byte 1, ...) puts
the mostly-zero high bytes of float32 words next to each other, where zstd squeezes them.

    blob, manifest = encode_snapshot(flat, version=3, step=60, model={...})
    flat = decode_safetensors(blob)           # {name: read-only ndarray viewing blob}
    encode_safetensors(flat)                  # == safetensors.numpy.save(flat), as uint8
    delta = encode_delta(new_blob, base_blob) # None when the layouts differ
    apply_delta(delta, base_blob)             # == new_blob (a read-only uint8 array)
    delta_base({"version": 3, "sha256": "…"}, version=5)   # -> (3, "…"), or ValueError
    parse_pointer(encode_pointer(3, step=60))  # -> 3; ValueError for a pointer elsewhere
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import struct
import time
from dataclasses import asdict, dataclass
from typing import Any

import ml_dtypes
import numpy as np
import pyarrow as pa

from tunix_tasks.storage.layout import RunLayout
from tunix_tasks.untrusted import json_loads

__all__ = [
    "DTYPES",
    "Blob",
    "BlobError",
    "FullBlob",
    "Manifest",
    "apply_delta",
    "decode_safetensors",
    "delta_base",
    "encode_delta",
    "encode_safetensors",
    "encode_snapshot",
    "non_finite",
]

Blob = bytes | np.ndarray  # a safetensors file in memory; arrays are 1-D uint8

#: What snapshots may hold (the model decides what fits), in safetensors' order of tensors
#: in a file: by dtype, widest alignment first (ties in its own enum order: F32 before I32),
#: then by name (`encode_safetensors`).
DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "I32": np.dtype(np.int32),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F16": np.dtype(np.float16),
}
_FLOATS = tuple(d for d in DTYPES.values() if d != np.int32)
_CODES = {dtype: code for code, dtype in DTYPES.items()}
_ORDER = {code: i for i, code in enumerate(DTYPES)}
_MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit
_FINITE_CHUNK = 1 << 20  # values checked at a time: the check's temporary memory is ~1 MB
_WORD = 4  # float32: the shuffle's word size
_SHA256 = re.compile(r"[0-9a-f]{64}")


class BlobError(ValueError):
    """Bytes that are not a valid safetensors file, or a delta that does not apply."""


@dataclass(frozen=True)
class Manifest:
    """What a snapshot holds. `sha256` is always of the full params blob (for a delta: of
    the blob it rebuilds), `num_bytes` the size of the stored file. `base`: for an
    adapter the frozen base model ({"fingerprint", "uri"}), for a delta the full snapshot
    it applies to ({"version", "sha256"}). `full_every` > 1: deltas against full snapshots
    follow, so readers keep the last full blob. Invalid combinations raise ValueError."""

    version: int
    step: int
    sha256: str
    created_at: float
    num_bytes: int
    model: dict[str, Any]
    kind: str = "full"  # the defaults read manifests written before these fields
    base: dict[str, Any] | None = None
    full_every: int = 0

    def __post_init__(self) -> None:
        if self.kind == "delta":
            delta_base(self.base, self.version)
        elif self.kind == "adapter":
            if not isinstance(self.base, dict) or not all(
                isinstance(self.base.get(k), str) for k in ("fingerprint", "uri")
            ):
                raise ValueError(f"adapter base {str(self.base)[:80]} lacks fingerprint/uri")
        elif self.kind != "full" or self.base is not None:
            raise ValueError(f"kind {str(self.kind)[:20]} with base {str(self.base)[:80]}")
        if type(self.full_every) is not int or self.full_every < 0:
            raise ValueError(f"full_every {str(self.full_every)[:20]} is not an int >= 0")
        if type(self.num_bytes) is not int or self.num_bytes < 0:  # readers size buffers by it
            raise ValueError(f"num_bytes {str(self.num_bytes)[:20]} is not an int >= 0")

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), indent=2, sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes) -> Manifest:
        raw = json_loads(data)
        return cls(**{k: raw[k] for k in cls.__dataclass_fields__ if k in raw})


@dataclass(frozen=True)
class FullBlob:
    """A checksum-verified full params blob: what deltas apply to."""

    version: int
    sha256: str
    data: Blob


def encode_snapshot(
    flat: dict[str, np.ndarray],
    *,
    version: int,
    step: int,
    model: dict[str, Any],
    kind: str = "full",
    base: dict[str, str] | None = None,
    full_every: int = 0,
) -> tuple[np.ndarray, Manifest]:
    """Serialize params (safetensors, `encode_safetensors`) and describe them (manifest
    with their sha256). Kind "full", or "adapter": `flat` holds only adapter tensors on top
    of the frozen base model `base` names ({"fingerprint", "uri"}). Deltas are made by
    `encode_delta` only."""
    if kind not in ("full", "adapter"):
        raise ValueError(f"cannot encode a snapshot of kind {kind!r}: 'full' or 'adapter'")
    blob = encode_safetensors(flat)
    manifest = Manifest(
        version=version,
        step=step,
        sha256=hashlib.sha256(blob).hexdigest(),
        created_at=time.time(),
        num_bytes=len(blob),
        model=model,
        kind=kind,
        base=None if base is None else dict(base),
        full_every=full_every,
    )
    return blob, manifest


def encode_safetensors(arrays: dict[str, np.ndarray]) -> np.ndarray:
    """`safetensors.numpy.save(arrays)` byte for byte, as one read-only uint8 array;
    ValueError for a tensor not of a snapshot dtype (`DTYPES`, little-endian). The tensors
    are copied in by numpy, which releases the GIL while it copies; safetensors' own
    encoder holds it throughout (~1 s of a 256 MB snapshot, measured in #29), and a
    publish in the background would stall the train loop's thread that long."""
    arrays = {k: np.asarray(v, order="C") for k, v in arrays.items()}  # 0-d stays 0-d
    bad = sorted(k for k, v in arrays.items() if v.dtype not in _CODES)
    if bad:
        raise ValueError(f"tensors {bad[:5]} are not of a snapshot dtype ({'/'.join(DTYPES)})")
    order = sorted(arrays, key=lambda name: (_ORDER[_CODES[arrays[name].dtype]], name))
    header: dict[str, Any] = {}
    size = 0
    for name in order:
        a = arrays[name]
        header[name] = {
            "dtype": _CODES[a.dtype],
            "shape": list(a.shape),
            "data_offsets": [size, size + a.nbytes],
        }
        size += a.nbytes
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)  # safetensors pads its header to 8 bytes
    start = 8 + len(text)
    out = np.empty(start + size, np.uint8)
    out[:start] = np.frombuffer(struct.pack("<Q", len(text)) + text, np.uint8)
    for name in order:
        begin, end = header[name]["data_offsets"]
        out[start + begin : start + end] = arrays[name].reshape(-1).view(np.uint8)
    out.flags.writeable = False  # like `apply_delta`'s: a blob is never changed in place
    return out


def non_finite(flat: dict[str, np.ndarray]) -> str | None:
    """None if every floating-point value in `flat` is finite, else which tensor is not
    and how many of its values are NaN/Inf. Snapshots must never carry them: an actor
    that loads NaN weights samples garbage until the next version. Checked in chunks, so
    the check needs ~1 MB besides the tensors, whatever their size."""
    for name, array in flat.items():
        if array.dtype not in _FLOATS:
            continue
        values = array.reshape(-1)
        bad = sum(
            int(np.count_nonzero(~np.isfinite(values[i : i + _FINITE_CHUNK])))
            for i in range(0, values.size, _FINITE_CHUNK)
        )
        if bad:
            return f"tensor {name!r} has {bad} NaN/Inf of {values.size} values"
    return None


def _header_end(blob: Blob) -> tuple[int, dict[str, Any]]:
    """(offset where the tensor data starts, the parsed JSON header)."""
    size = len(blob)
    if size < 8:
        raise BlobError(f"{size} bytes: too short for a safetensors header")
    (n,) = struct.unpack("<Q", bytes(blob[:8]))
    if n > _MAX_HEADER_BYTES or 8 + n > size:
        raise BlobError(f"header length {n} exceeds the blob ({size} bytes)")
    try:
        header = json_loads(bytes(blob[8 : 8 + n]))
    except ValueError as err:
        raise BlobError(f"header is not JSON: {err}") from None
    if not isinstance(header, dict):
        raise BlobError("header is not a JSON object")
    return 8 + n, header


def decode_safetensors(blob: Blob) -> dict[str, np.ndarray]:
    """Tensors as read-only views into `blob` (no copy: the blob is the only buffer).
    Every entry is checked: a known dtype, a shape of non-negative ints, offsets that fit
    the shape and lie inside the blob."""
    start, header = _header_end(blob)
    out: dict[str, np.ndarray] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            code, shape, (begin, end) = info["dtype"], info["shape"], info["data_offsets"]
        except (TypeError, KeyError, ValueError):
            raise BlobError(f"tensor {name!r}: malformed entry {str(info)[:80]}") from None
        dtype = DTYPES.get(code) if isinstance(code, str) else None
        if dtype is None:
            raise BlobError(f"tensor {name!r}: dtype {str(code)[:20]} is not {'/'.join(DTYPES)}")
        if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
            raise BlobError(f"tensor {name!r}: bad shape {str(shape)[:80]}")
        count = math.prod(shape)
        if type(begin) is not int or begin < 0 or end != begin + count * dtype.itemsize:
            raise BlobError(f"tensor {name!r}: offsets {[begin, end]} do not fit {shape}")
        if start + end > len(blob):
            raise BlobError(
                f"tensor {name!r}: data [{begin}, {end}) ends past the blob "
                f"({len(blob)} bytes: truncated)"
            )
        view = np.frombuffer(blob, dtype, count=count, offset=start + begin).reshape(shape)
        view.flags.writeable = False
        out[name] = view
    return out


def encode_delta(new: Blob, base: Blob) -> bytes | None:
    """The delta that rebuilds `new` from `base`, or None unless both have the same
    safetensors header (same names, shapes, dtypes: then the same layout)."""
    end = _header_end(new)[0]
    if len(new) != len(base) or bytes(new[:end]) != bytes(base[:end]):
        return None
    x = np.bitwise_xor(np.frombuffer(new, np.uint8), np.frombuffer(base, np.uint8))
    words = len(x) // _WORD * _WORD  # a tail of 2-byte tensors stays unshuffled
    planes = np.empty_like(x)
    for k, plane in enumerate(planes[:words].reshape(_WORD, -1)):
        plane[...] = x[k:words:_WORD]
    planes[words:] = x[words:]
    del x
    return pa.compress(planes, codec="zstd", asbytes=True)


def apply_delta(delta: bytes, base: bytes) -> np.ndarray:
    """`new` rebuilt from `base` and `encode_delta(new, base)`, as a read-only uint8 array.
    BlobError when the delta does not decompress to exactly the base's size (corrupt,
    truncated, or of another base); the caller checks the result's sha256."""
    try:
        planes = np.frombuffer(
            pa.decompress(delta, decompressed_size=len(base), codec="zstd"), np.uint8
        )
    except (OSError, pa.ArrowException) as err:
        raise BlobError(f"delta does not decompress: {err}") from None
    out = np.empty(len(base), np.uint8)
    words = len(base) // _WORD * _WORD
    for k, plane in enumerate(planes[:words].reshape(_WORD, -1)):
        out[k:words:_WORD] = plane  # one strided copy per plane: ~2x faster than .T
    out[words:] = planes[words:]
    del planes
    np.bitwise_xor(out, np.frombuffer(base, np.uint8), out=out)
    out.flags.writeable = False
    return out


def delta_base(base: Any, version: int) -> tuple[int, str]:
    """(version, sha256) of the full snapshot a delta of `version` applies to; ValueError
    unless `base` is exactly {"version": int in [0, version), "sha256": 64 hex digits}.
    Nothing else (no path) is accepted: the base is read from its version's folder."""
    if not isinstance(base, dict) or set(base) != {"version", "sha256"}:
        raise ValueError(f"delta base {str(base)[:80]} is not {{version, sha256}}")
    found, sha = base["version"], base["sha256"]
    if type(found) is not int or not 0 <= found < version:  # bool is refused too
        raise ValueError(f"delta base version {str(found)[:40]} is not an int in [0, {version})")
    if not isinstance(sha, str) or not _SHA256.fullmatch(sha):
        raise ValueError(f"delta base sha256 {str(sha)[:70]} is not 64 hex digits")
    return found, sha


def encode_pointer(version: int, step: int) -> bytes:
    """The `weights/LATEST` pointer to snapshot `version` (trained `step` steps)."""
    return json.dumps(
        {"version": version, "path": RunLayout.snapshot(version), "step": step}
    ).encode()


def short_repr(value: Any) -> str:
    """`repr(value)` cut to 80 characters, for messages quoting what a reader refused."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def parse_pointer(data: bytes) -> int:
    """The version a `LATEST` pointer names; ValueError unless `version` is a non-negative
    JSON integer and `path` is exactly that version's snapshot key (so no pointer can send
    a reader outside the run, or to another version's files)."""
    pointer = json_loads(data)
    if not isinstance(pointer, dict):
        raise ValueError(f"not a JSON object: {short_repr(pointer)}")
    version = pointer.get("version")
    if type(version) is not int or version < 0:  # bool is an int subclass: refused too
        raise ValueError(f"version {short_repr(version)} is not a non-negative integer")
    path = pointer.get("path")
    if path != RunLayout.snapshot(version):
        raise ValueError(
            f"path {short_repr(path)} is not {RunLayout.snapshot(version)!r}, the snapshot of v{version}"
        )
    return version
