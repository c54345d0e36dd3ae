"""`tunix-tasks export`: a run's weight snapshot as a Hugging Face folder that
`transformers`, PEFT, vLLM and SGLang load (docs/models.md, "Export").

    export_snapshot("gs://team/runs/smol", "/models/smol-rl")     # the latest snapshot
    export_snapshot(run_uri, dest, version=12, merge=True, dtype="bfloat16")

- **A full snapshot** (full fine-tuning): `model.safetensors` in Hugging Face names and
  layouts (`policy/hf_checkpoint.py: hf_tensors`), with the base checkpoint's
  `config.json` (its dtype set to the export's), tokenizer and generation files.
- **An adapter snapshot** (a `model.lora_rank` run): a PEFT folder, `adapter_config.json`
  and `adapter_model.safetensors` (policy/hf_adapters.py), for PEFT or a server's
  `--enable-lora`. With `merge`, the base with the adapters merged in, as a full folder.

Only runs of a Hugging Face checkpoint (`model.checkpoint`) export: a preset's
architecture is the project's own. The snapshot is checksum-verified as actors verify it;
an adapter snapshot must be of the base the run's config names. The files go into a
temporary sibling folder renamed to `dest` at the end, so `dest` is complete or absent.
`model.safetensors` is written a tensor at a time into its place in the file: beside the
snapshot (or, merging, the base streamed from its checkpoint), memory holds one tensor.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import save_file

from tunix_tasks.config import RunConfig
from tunix_tasks.policy.build import base_fingerprint, lora_spec
from tunix_tasks.policy.hf_adapters import adapters_to_peft, merged, peft_config
from tunix_tasks.policy.hf_checkpoint import CheckpointError, HFCheckpoint, hf_tensors
from tunix_tasks.policy.hf_headers import expected_tensors
from tunix_tasks.policy.packaged_models import resolve_checkpoint
from tunix_tasks.policy.spec import DecoderSpec
from tunix_tasks.storage.local_folder import check_free, folder_in_place
from tunix_tasks.storage.runs import read_config
from tunix_tasks.storage.snapshot_format import DTYPES
from tunix_tasks.storage.weights import load_snapshot, published_version

__all__ = ["DTYPE_NAMES", "ExportError", "export_snapshot"]

#: `--dtype` choices: the Hugging Face name -> numpy dtype of the exported tensors.
DTYPE_NAMES = {
    "float32": DTYPES["F32"],
    "bfloat16": DTYPES["BF16"],
    "float16": DTYPES["F16"],
}
_CODES = {dtype: code for code, dtype in DTYPES.items()}
# A base checkpoint's files that go with exported weights, where it has them.
_BASE_FILES = (
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
)
Progress = Callable[[int, int, str], None]  # (done, total, tensor name)
_WRITE_CHUNK = 8 << 20


class ExportError(RuntimeError):
    """A run or snapshot that cannot be exported; the message says why."""


class _SafetensorsFile:
    """A safetensors file laid out from every tensor's name, shape and dtype up front,
    then filled a tensor at a time, in any order, each written into its place."""

    def __init__(self, path: Path, layout: dict[str, tuple[tuple[int, ...], np.dtype]]) -> None:
        self._path = path
        header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        self._places: dict[str, tuple[int, tuple[int, ...], np.dtype]] = {}
        offset = 0
        for name in sorted(layout):
            shape, dtype = layout[name]
            size = math.prod(shape) * dtype.itemsize
            header[name] = {
                "dtype": _CODES[dtype],
                "shape": list(shape),
                "data_offsets": [offset, offset + size],
            }
            self._places[name] = (offset, shape, dtype)
            offset += size
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
        self._start = 8 + len(raw)
        self._file = path.open("wb")
        self._file.write(struct.pack("<Q", len(raw)) + raw)
        self._file.truncate(self._start + offset)

    def put(self, name: str, array: np.ndarray) -> None:
        offset, shape, dtype = self._places.pop(name)
        with np.errstate(over="ignore"):  # an overflow is refused below, by name
            cast = np.ascontiguousarray(array, dtype=dtype)
        if cast.shape != shape:
            raise CheckpointError(f"{name}: shape {list(cast.shape)}, laid out {list(shape)}")
        if cast.dtype != array.dtype and not np.isfinite(cast).all():
            raise ExportError(f"{name}: values beyond {dtype}'s range (pick a wider --dtype)")
        data = memoryview(cast.reshape(-1).view(np.uint8))
        try:
            self._file.seek(self._start + offset)
            for start in range(0, len(data), _WRITE_CHUNK):  # one 131 MB write() took 0.8 s
                self._file.write(data[start : start + _WRITE_CHUNK])  # here, 8 MB ones 0.12 s
        except OSError as err:  # a full disk says no file name: name it
            raise OSError(err.errno, err.strerror, str(self._path)) from None

    def close(self, *, complete: bool = True) -> None:
        """Close the file; `complete`: every tensor laid out must have been written."""
        self._file.close()
        if complete and self._places:
            raise CheckpointError(f"tensors never written: {sorted(self._places)[:5]}")


def _write_weights(
    path: Path,
    spec: DecoderSpec,
    params: Iterable[tuple[str, np.ndarray]],
    dtype: np.dtype,
    progress: Progress,
) -> None:
    targets = expected_tensors(spec)
    out = _SafetensorsFile(path, {t.hf_name: (t.hf_shape, dtype) for t in targets.values()})
    try:
        for done, (name, tensor) in enumerate(hf_tensors(params, spec), 1):
            out.put(name, tensor)
            progress(done, len(targets), name)
    except BaseException:
        out.close(complete=False)  # the export's folder goes; the first error is the one
        raise
    out.close()


def _base_dtype(config: dict[str, Any]) -> str:
    """The base checkpoint's dtype name (config.json's `dtype` or `torch_dtype`)."""
    name = config.get("dtype", config.get("torch_dtype"))
    return name if name in DTYPE_NAMES else "float32"


def _no_progress(done: int, total: int, name: str) -> None:
    pass


def export_snapshot(
    run_uri: str,
    dest: str | Path,
    *,
    version: int | None = None,
    merge: bool = False,
    dtype: str | None = None,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """Write snapshot `version` of the run at `run_uri` (None: the latest) to the local
    folder `dest` (absent or empty) as a Hugging Face folder (module docstring); returns
    what was written: {"dest", "version", "kind" (full, adapter, merged), "dtype",
    "bytes"}. `dtype` (a `DTYPE_NAMES` key; None: the base checkpoint's) applies to full
    and merged folders; an adapter keeps the snapshot's."""
    dest = Path(dest).absolute()  # "." has no name to put a sibling beside
    check_free(dest, error=ExportError)
    if dtype is not None and dtype not in DTYPE_NAMES:
        raise ExportError(f"dtype {dtype!r}: one of {', '.join(DTYPE_NAMES)}")
    if version is not None and version < 0:  # else "weights/v-0000001 is incomplete"
        raise ExportError(f"version must be >= 0, got {version}")
    cfg, store = read_config(run_uri)
    root = store.local_path()
    if root is not None and dest.resolve().is_relative_to(root.resolve()):
        # Under the run's root the files would be the run's own: listed, pruned, copied.
        raise ExportError(f"{dest} is inside the run {run_uri}: export to a folder outside it")
    if cfg.model.checkpoint is None:
        raise ExportError(
            f"{run_uri}: model.preset {cfg.model.preset!r} is this project's own architecture, "
            "which transformers has no class for; export needs a run of a Hugging Face "
            "checkpoint (model.checkpoint)"
        )
    version = published_version(store, version)
    flat, manifest = load_snapshot(store, version)
    base = HFCheckpoint(resolve_checkpoint(cfg.model.checkpoint))
    spec = base.spec(max_seq_len=cfg.model.max_seq_len)
    config = base.read_json("config.json")
    dtype_name = dtype or _base_dtype(config)
    kind = manifest.kind if manifest.kind != "delta" else "full"
    if kind == "adapter":
        trained_on = (manifest.base or {}).get("fingerprint")
        if trained_on != base_fingerprint(cfg.model, cfg.seed):
            raise ExportError(
                f"v{version} holds adapters for base {str(trained_on)[:12]}..., but "
                f"{cfg.model.checkpoint} is not that base now: export needs the base it was "
                "trained on"
            )
        kind = "merged" if merge else "adapter"
        if kind == "adapter" and dtype is not None:
            raise ExportError(
                "--dtype applies to full and merged folders; an adapter keeps the snapshot's "
                "(add --merge for a full folder)"
            )
    elif merge:
        raise ExportError(f"v{version} is a full snapshot: nothing to merge (drop --merge)")
    with folder_in_place(dest) as tmp:
        _write(tmp, cfg, base, spec, config, flat, kind, dtype_name, progress)
    size = sum(p.stat().st_size for p in dest.iterdir())
    if kind == "adapter":  # kept as the snapshot holds it
        dtype_name = str(next(iter(flat.values())).dtype)
    return {
        "dest": str(dest),
        "version": version,
        "kind": kind,
        "dtype": dtype_name,
        "bytes": size,
    }


def _write(
    out: Path,
    cfg: RunConfig,
    base: HFCheckpoint,
    spec: DecoderSpec,
    config: dict[str, Any],
    flat: dict[str, np.ndarray],
    kind: str,
    dtype: str,
    progress: Progress | None,
) -> None:
    """The folder's files into `out` (export_snapshot's)."""
    progress = progress or _no_progress
    if kind == "adapter":
        lora = lora_spec(cfg.model)
        assert lora is not None  # an adapter run has model.lora_rank
        save_file(adapters_to_peft(flat, spec, lora), str(out / "adapter_model.safetensors"))
        where = base.uri  # PEFT reads a local path, not a file:// URI
        body = peft_config(lora, base=where.removeprefix("file://"))
        (out / "adapter_config.json").write_text(json.dumps(body, indent=2) + "\n")
        return
    if kind == "merged":
        lora = lora_spec(cfg.model)
        assert lora is not None
        params = ((n, merged(np.asarray(w), flat, n, lora)) for n, w in base.tensors(spec))
    else:
        params = iter(flat.items())
    _write_weights(out / "model.safetensors", spec, params, DTYPE_NAMES[dtype], progress)
    config = dict(config)
    for key in [k for k in ("dtype", "torch_dtype") if k in config] or ["dtype"]:
        config[key] = dtype
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for file in _BASE_FILES:
        data = base.read(file)
        if data is not None:
            (out / file).write_bytes(data)
