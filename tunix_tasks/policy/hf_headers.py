"""A Hugging Face checkpoint's files and safetensors headers, read and checked without JAX.

What `prepare` checks before any process starts (policy/preflight.py) lives here, so the
check costs the reads, not a JAX import: `config.json` (its shape fields bounded, policy/
spec.py), the weight files named by `model.safetensors.index.json` (inside the checkpoint
directory), every safetensors header (dtypes, offsets inside the file, at most 100 MB), and
the tensors `config.json` implies against those headers: the layer count and embedding
first, then every name and shape. `HFCheckpoint` (policy/hf_checkpoint.py) reads the
weights on top of this.

    files = CheckpointFiles("gs://team/models/qwen3-1.7b")
    spec = files.verify(max_seq_len=4096)      # CheckpointError naming file and tensor

Errors (`CheckpointError`) name the file and the tensor.
"""

from __future__ import annotations

import dataclasses
import re
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np
import pyarrow as pa

from tunix_tasks.policy.spec import DecoderSpec, UnsupportedCheckpoint, spec_from_hf_config
from tunix_tasks.storage.store import NotFound, ObjectStore, StoreError, open_store
from tunix_tasks.untrusted import json_loads

__all__ = [
    "INDEX",
    "SINGLE",
    "CheckpointError",
    "CheckpointFiles",
    "HeaderEntry",
    "Target",
    "expected_tensors",
    "hf_tensor_shapes",
]

_DTYPES: dict[str, Any] = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
}
_MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


class CheckpointError(ValueError):
    """The checkpoint cannot be loaded; the message names the file (and tensor)."""


@dataclass(frozen=True)
class HeaderEntry:
    file: str
    dtype: Any
    shape: tuple[int, ...]
    begin: int  # absolute byte offsets in the file
    end: int


@dataclass(frozen=True)
class Target:
    """One of our params and the Hugging Face tensor it is made of: `layout` and `dims`
    say how to turn one into the other (`_to_ours`)."""

    hf_name: str
    hf_shape: tuple[int, ...]
    layout: str = "same"  # same | transpose | heads_in | heads_out | bias
    dims: tuple[int, ...] = ()


def expected_tensors(spec: DecoderSpec) -> dict[str, Target]:
    """Our param name -> the HF tensor, its expected shape and the layout transform."""
    d, h, kv, hd, ff = spec.d_model, spec.n_heads, spec.n_kv_heads, spec.head_dim, spec.d_ff
    out: dict[str, Target] = {"embed": Target("model.embed_tokens.weight", (spec.vocab_size, d))}
    for i in range(spec.n_layers):
        hf, ours = f"model.layers.{i}", f"blocks/{i}"
        layer = {
            "attn_norm/scale": Target("input_layernorm.weight", (d,)),
            "mlp_norm/scale": Target("post_attention_layernorm.weight", (d,)),
            "attn/wq": Target("self_attn.q_proj.weight", (h * hd, d), "heads_in", (d, h, hd)),
            "attn/wk": Target("self_attn.k_proj.weight", (kv * hd, d), "heads_in", (d, kv, hd)),
            "attn/wv": Target("self_attn.v_proj.weight", (kv * hd, d), "heads_in", (d, kv, hd)),
            "attn/wo": Target("self_attn.o_proj.weight", (d, h * hd), "heads_out", (h, hd, d)),
            "mlp/gate": Target("mlp.gate_proj.weight", (ff, d), "transpose"),
            "mlp/up": Target("mlp.up_proj.weight", (ff, d), "transpose"),
            "mlp/down": Target("mlp.down_proj.weight", (d, ff), "transpose"),
        }
        if spec.qkv_bias:
            for name, n in (("q", h), ("k", kv), ("v", kv)):
                layer[f"attn/b{name}"] = Target(
                    f"self_attn.{name}_proj.bias", (n * hd,), "bias", (n, hd)
                )
        if spec.qk_norm:
            layer["attn/q_norm/scale"] = Target("self_attn.q_norm.weight", (hd,))
            layer["attn/k_norm/scale"] = Target("self_attn.k_norm.weight", (hd,))
        if spec.sandwich_norms:  # Gemma 3: post_attention_layernorm norms the attention's output
            layer["attn_out_norm/scale"] = Target("post_attention_layernorm.weight", (d,))
            layer["mlp_norm/scale"] = Target("pre_feedforward_layernorm.weight", (d,))
            layer["mlp_out_norm/scale"] = Target("post_feedforward_layernorm.weight", (d,))
        for name, target in layer.items():
            out[f"{ours}/{name}"] = dataclasses.replace(target, hf_name=f"{hf}.{target.hf_name}")
    out["final_norm/scale"] = Target("model.norm.weight", (d,))
    if not spec.tie_embeddings:
        out["unembed"] = Target("lm_head.weight", (spec.vocab_size, d), "transpose")
    return out


def hf_tensor_shapes(spec: DecoderSpec) -> dict[str, tuple[int, ...]]:
    """The Hugging Face tensors (name -> shape) a checkpoint of this spec must hold."""
    return {t.hf_name: t.hf_shape for t in expected_tensors(spec).values()}


def _parse_header(raw: bytes, file: str, size: int) -> dict[str, HeaderEntry]:
    if len(raw) < 8:
        raise CheckpointError(f"{file}: corrupt safetensors header: file has {size} bytes")
    (n,) = struct.unpack("<Q", raw[:8])
    if n > _MAX_HEADER_BYTES or 8 + n > size:
        raise CheckpointError(
            f"{file}: corrupt safetensors header: header length {n} exceeds the file ({size} B)"
        )
    try:
        header = json_loads(raw[8 : 8 + n])
    except ValueError as err:
        raise CheckpointError(f"{file}: corrupt safetensors header: {err}") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{file}: corrupt safetensors header: not a JSON object")
    entries = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
        except (TypeError, KeyError, ValueError):
            raise CheckpointError(f"{file}: tensor {name}: malformed header entry") from None
        if dtype not in _DTYPES:
            raise CheckpointError(
                f"{file}: tensor {name}: dtype {dtype} not supported ({', '.join(_DTYPES)})"
            )
        nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(_DTYPES[dtype]).itemsize
        if end - begin != nbytes or begin < 0 or 8 + n + end > size:
            raise CheckpointError(
                f"{file}: tensor {name}: data offsets [{begin}, {end}) do not fit shape "
                f"{list(shape)} {dtype} in a file of {size} bytes (truncated or corrupt)"
            )
        entries[name] = HeaderEntry(file, _DTYPES[dtype], shape, 8 + n + begin, 8 + n + end)
    return entries


_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def _check_against_headers(
    spec: DecoderSpec, entries: Mapping[str, HeaderEntry], where: str
) -> None:
    """config.json's layer count and embedding shape against the safetensors headers."""
    layers = {int(m.group(1)) for name in entries if (m := _LAYER.match(name))}
    held = max(layers) + 1 if layers else 0
    if held != spec.n_layers:
        raise CheckpointError(
            f"{where}: config.json says num_hidden_layers={spec.n_layers}, the safetensors "
            f"headers hold {held} layers"
        )
    embed = entries.get("model.embed_tokens.weight")
    if embed is not None and embed.shape != (spec.vocab_size, spec.d_model):
        raise CheckpointError(
            f"{embed.file}: tensor model.embed_tokens.weight has shape {list(embed.shape)}, "
            f"config.json implies {[spec.vocab_size, spec.d_model]} (vocab_size, hidden_size)"
        )


class CheckpointFiles:
    """A Hugging Face checkpoint directory's files, read through the run's object stores:
    config.json, the tokenizer files and the safetensors headers (no tensor data)."""

    def __init__(self, uri: str) -> None:
        self.uri = uri.rstrip("/")
        self.store: ObjectStore = open_store(self.uri)

    def read(self, name: str) -> bytes | None:
        """A file of the checkpoint, or None when it does not exist."""
        try:
            return self.store.read_bytes(name)
        except NotFound:
            return None

    def read_json(self, name: str) -> dict[str, Any]:
        raw = self.read(name)
        if raw is None:
            raise CheckpointError(f"{self.uri}/{name}: missing")
        try:
            value = json_loads(raw)
        except ValueError as err:
            raise CheckpointError(f"{self.uri}/{name}: not valid JSON: {err}") from None
        if not isinstance(value, dict):
            raise CheckpointError(f"{self.uri}/{name}: expected a JSON object")
        return value

    def spec(self, *, max_seq_len: int) -> DecoderSpec:
        try:
            return spec_from_hf_config(self.read_json("config.json"), max_seq_len=max_seq_len)
        except UnsupportedCheckpoint as err:
            raise CheckpointError(f"{self.uri}/{err}") from None

    def _files(self) -> list[str]:
        index = self.read(INDEX)
        if index is None:
            if not self.store.exists(SINGLE):
                raise CheckpointError(f"{self.uri}: neither {SINGLE} nor {INDEX} exists")
            return [SINGLE]
        weight_map = self.read_json(INDEX).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{self.uri}/{INDEX}: no weight_map")
        files = sorted(set(weight_map.values()))
        for f in files:  # names from a manifest stay inside the checkpoint directory
            if (
                not isinstance(f, str)
                or "/" in f
                or f.startswith(".")
                or not f.endswith(".safetensors")
            ):
                raise CheckpointError(f"{self.uri}/{INDEX}: bad file name {f!r} in weight_map")
        return files

    def _open(self, file: str) -> pa.NativeFile:
        fs, base = self.store.arrow_filesystem()
        try:
            return fs.open_input_file(f"{base}/{file}")
        except (FileNotFoundError, OSError, StoreError) as err:
            raise CheckpointError(f"{self.uri}/{file}: cannot open: {err}") from None

    def _entries(self, files: list[str]) -> dict[str, HeaderEntry]:
        entries: dict[str, HeaderEntry] = {}
        for file in files:
            with self._open(file) as f:
                size = f.size()
                head = f.read(min(size, 8))
                if len(head) == 8:
                    (n,) = struct.unpack("<Q", head)
                    head += f.read(min(n, _MAX_HEADER_BYTES + 1, size - 8))
                entries.update(_parse_header(head, f"{self.uri}/{file}", size))
        return entries

    def _plan(self, spec: DecoderSpec) -> dict[str, list[tuple[str, Target, HeaderEntry]]]:
        """Every param's tensor, checked (present, shape) from the headers, by file. The
        layer count and the embedding are compared before the expected tensors are listed."""
        files = self._files()
        entries = self._entries(files)
        where = INDEX if files != [SINGLE] else SINGLE
        _check_against_headers(spec, entries, f"{self.uri}/{where}")
        targets = expected_tensors(spec)
        missing = [t.hf_name for t in targets.values() if t.hf_name not in entries]
        if missing:
            raise CheckpointError(f"{self.uri}/{where}: missing tensor(s) {', '.join(missing)}")
        by_file: dict[str, list[tuple[str, Target, HeaderEntry]]] = {}
        for ours, target in targets.items():
            e = entries[target.hf_name]
            if e.shape != target.hf_shape:
                raise CheckpointError(
                    f"{e.file}: tensor {target.hf_name} has shape {list(e.shape)}, config.json "
                    f"implies {list(target.hf_shape)}"
                )
            by_file.setdefault(e.file, []).append((ours, target, e))
        return by_file

    def fingerprint(self) -> bytes:
        """What identifies this base without reading its weights: config.json, and each
        weight file's name, size and safetensors header (names, dtypes, shapes, offsets)."""
        parts = [self.read("config.json") or b""]
        for file in self._files():
            with self._open(file) as f:
                size = f.size()
                (n,) = struct.unpack("<Q", f.read(8))
                parts += [file.encode(), str(size).encode(), f.read(min(n, _MAX_HEADER_BYTES))]
        return b"\0".join(parts)

    def verify(self, *, max_seq_len: int) -> DecoderSpec:
        """Check config.json, every safetensors header, tensor names and shapes (reads no
        tensor data); returns the spec. Raises `CheckpointError` naming file and tensor."""
        spec = self.spec(max_seq_len=max_seq_len)
        self._plan(spec)
        return spec
