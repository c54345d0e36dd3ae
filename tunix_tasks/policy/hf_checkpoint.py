"""Import a Hugging Face checkpoint directory (local or gs://) into a `Transformer`.

A checkpoint is `config.json`, `model.safetensors` (or `model-0000N-of-0000M.safetensors`
plus `model.safetensors.index.json`) and the tokenizer files. This module owns reading the
weights: the files and safetensors headers are read and checked by `CheckpointFiles`
(policy/hf_headers.py, without JAX; a corrupt header is reported with its file name);
`HFCheckpoint` adds the tensors, read one at a time by byte range from a random-access file (a memory
map locally, ranged reads on GCS), converted to the model's layout and placed straight into
their final sharding: host memory holds one tensor at a time, never a second model.

    ckpt = HFCheckpoint("gs://team/models/qwen3-1.7b")
    spec = ckpt.spec(max_seq_len=4096)               # DecoderSpec from config.json
    model = ckpt.load_model(spec, mesh=mesh)         # params sharded over mesh's "fsdp"
    for name, param in ckpt.tensors(spec): ...       # or one param at a time, unplaced
    flat = params_from_hf(load_file(path), spec)     # a state dict already in memory
    hf = params_to_hf(flat, spec)                    # and back: HF names and layouts
    for name, w in hf_tensors(pairs, spec): ...      # the same, one tensor at a time

Errors (`CheckpointError`) name the file and the tensor: a missing tensor, a shape that does
not match config.json, an unknown dtype, a corrupt header, a truncated file.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from tunix_tasks.policy.hf_headers import (
    CheckpointError,
    CheckpointFiles,
    HeaderEntry,
    Target,
    expected_tensors,
    hf_tensor_shapes,
)
from tunix_tasks.policy.lora import initial_adapter
from tunix_tasks.policy.model import Transformer
from tunix_tasks.policy.spec import DecoderSpec, LoraSpec

__all__ = [
    "CheckpointError",
    "HFCheckpoint",
    "hf_tensor_shapes",
    "hf_tensors",
    "params_from_hf",
    "params_to_hf",
]


@functools.partial(jax.jit, static_argnames=("layout", "dims"))
def _to_ours(w: jax.Array, *, layout: str, dims: tuple[int, ...]) -> jax.Array:
    """A Hugging Face tensor in our layout, float32, on the device (XLA transposes ~5x
    faster than numpy's strided copy; compiled once per distinct shape)."""
    w = w.astype(jnp.float32)
    if layout == "transpose":  # [out, in] -> [in, out]
        return w.T
    if layout == "heads_in":  # [n*hd, d] -> [d, n, hd]
        return w.T.reshape(dims)
    if layout == "heads_out":  # [d, h*hd] -> [h, hd, d]
        return w.T.reshape(dims)
    if layout == "bias":  # [n*hd] -> [n, hd]
        return w.reshape(dims)
    return w


def _convert(target: Target, stored: np.ndarray) -> jax.Array:
    return _to_ours(jnp.asarray(stored), layout=target.layout, dims=target.dims)


def params_from_hf(tensors: Mapping[str, np.ndarray], spec: DecoderSpec) -> dict[str, jax.Array]:
    """A Hugging Face state dict already in memory (HF name -> array, as
    `safetensors.numpy.load_file` returns) as our flat params (`flat_params` names, float32,
    our layout, on the default device); `Sampler.update_params` / `load_flat_params` take
    it. Unlike `HFCheckpoint.tensors` it holds every tensor at once. A tensor missing or
    of the wrong shape: `CheckpointError` naming it."""
    targets = expected_tensors(spec)
    missing = [t.hf_name for t in targets.values() if t.hf_name not in tensors]
    if missing:
        raise CheckpointError(f"missing tensor(s) {', '.join(missing)}")
    for t in targets.values():
        if tuple(tensors[t.hf_name].shape) != t.hf_shape:
            raise CheckpointError(
                f"tensor {t.hf_name} has shape {list(tensors[t.hf_name].shape)}, the spec "
                f"implies {list(t.hf_shape)}"
            )
    return {ours: _convert(t, tensors[t.hf_name]) for ours, t in targets.items()}


def _to_hf(w: np.ndarray, layout: str) -> np.ndarray:
    """`_to_ours` undone: our layout back to the Hugging Face tensor's (dtype kept)."""
    if layout == "transpose":  # [in, out] -> [out, in]
        return w.T
    if layout == "heads_in":  # [d, n, hd] -> [n*hd, d]
        return w.reshape(w.shape[0], -1).T
    if layout == "heads_out":  # [h, hd, d] -> [d, h*hd]
        return w.reshape(-1, w.shape[-1]).T
    if layout == "bias":  # [n, hd] -> [n*hd]
        return w.reshape(-1)
    return w


def hf_tensors(
    params: Iterable[tuple[str, np.ndarray]], spec: DecoderSpec
) -> Iterator[tuple[str, np.ndarray]]:
    """Our params, (`flat_params` name, array) pairs as they come (a snapshot's, or a
    checkpoint's streamed), as Hugging Face tensors one at a time: (HF name, the array in
    HF layout, contiguous, dtype kept). A param of the wrong shape or not of this model,
    or one missing at the end: `CheckpointError` naming it."""
    targets, seen = expected_tensors(spec), set()
    for ours, value in params:
        t = targets.get(ours)
        if t is None:
            raise CheckpointError(f"param {ours} is not one of this model's")
        w = np.asarray(value)
        if t.layout in ("heads_in", "heads_out", "bias") and w.shape != t.dims:
            raise CheckpointError(
                f"param {ours} has shape {list(w.shape)}, expected {list(t.dims)}"
            )
        hf = np.ascontiguousarray(_to_hf(w, t.layout))
        if hf.shape != t.hf_shape:
            raise CheckpointError(
                f"param {ours} has shape {list(w.shape)}, the spec implies {list(t.hf_shape)} "
                f"as {t.hf_name}"
            )
        seen.add(ours)
        yield t.hf_name, hf
    missing = sorted(set(targets) - seen)
    if missing:
        raise CheckpointError(f"missing param(s) {', '.join(missing[:5])}")


def params_to_hf(flat: Mapping[str, np.ndarray], spec: DecoderSpec) -> dict[str, np.ndarray]:
    """Our flat params (`flat_params` names, as a snapshot holds them; others, such as
    adapters, are left out) as a Hugging Face state dict (`hf_tensors`), so a server that
    loads Hugging Face checkpoints (vLLM, SGLang, `tunix-tasks serve`) can load them; the
    inverse of `params_from_hf`."""
    targets = expected_tensors(spec)
    missing = sorted(set(targets) - set(flat))
    if missing:  # before converting anything
        raise CheckpointError(f"missing param(s) {', '.join(missing[:5])}")
    return dict(hf_tensors(((ours, flat[ours]) for ours in targets), spec))


class HFCheckpoint(CheckpointFiles):
    """A Hugging Face checkpoint directory: its files (`CheckpointFiles`) and its weights."""

    def tensors(self, spec: DecoderSpec) -> Iterator[tuple[str, jax.Array]]:
        """Every param of `spec` (`flat_params` names; no LoRA adapters): (name, the
        tensor read and converted to float32 in our layout on the default device), one at
        a time, file by file in offset order, so host memory holds one tensor at a time.
        `load_model` places each into its sharding; alone it streams the weights (e.g. to
        time the read + convert apart from placement). Checked first as `verify` does."""
        return self._read(self._plan(spec))

    def _read(
        self, by_file: dict[str, list[tuple[str, Target, HeaderEntry]]]
    ) -> Iterator[tuple[str, jax.Array]]:
        for file in sorted(by_file):
            with self._open(file.rsplit("/", 1)[-1]) as f:
                for ours, target, e in sorted(by_file[file], key=lambda x: x[2].begin):
                    f.seek(e.begin)
                    raw = f.read(e.end - e.begin)
                    if len(raw) != e.end - e.begin:
                        raise CheckpointError(f"{file}: tensor {target.hf_name}: file truncated")
                    yield ours, _convert(target, np.frombuffer(raw, e.dtype).reshape(e.shape))

    def load_model(
        self,
        spec: DecoderSpec,
        *,
        mesh: Mesh | None = None,
        compute_dtype: Any = np.float32,
        lora: LoraSpec | None = None,
        seed: int = 0,
    ) -> Transformer:
        """A `Transformer` holding this checkpoint's weights, each param device_put straight
        into its sharding over `mesh` (its "fsdp" annotations) or onto the default device.
        With `lora`, fresh adapters (from `seed`) sit on the frozen base."""
        by_file = self._plan(spec)  # the headers checked before the model is built
        abstract = nnx.eval_shape(
            lambda: Transformer(spec, rngs=nnx.Rngs(0), compute_dtype=compute_dtype, lora=lora)
        )
        graphdef, state = nnx.split(abstract)
        specs = nnx.get_partition_spec(state)
        flat_specs = {"/".join(map(str, p)): s for p, s in nnx.to_flat_state(specs)}
        values = {}
        for name, ours in self._read(by_file):
            spec_ = flat_specs[name]
            pspec = spec_.get_value() if hasattr(spec_, "get_value") else spec_
            values[name] = (
                ours if mesh is None else jax.device_put(ours, NamedSharding(mesh, pspec))
            )
        key = jax.random.key(seed)
        for i, (path, var) in enumerate(nnx.to_flat_state(state)):
            name = "/".join(map(str, path))
            if name not in values:  # an adapter: not in the checkpoint
                values[name] = initial_adapter(name, var.shape, jax.random.fold_in(key, i))
            var.set_value(values[name])
        return nnx.merge(graphdef, state)
