"""Flat, named weights of a model: what snapshots store and what loads back into a model.

Names are the model's NNX paths joined by "/" (`blocks/0/attn/wq`), stable across runs;
values are float32 numpy arrays, ready for safetensors. Loading checks every name, shape
and dtype before it swaps anything, and keeps each param's sharding and held dtype (a
bfloat16-held sampler, `policy/precision.py`, stays bfloat16).

    flat = flat_params(model)             # {"embed": ndarray, "blocks/0/attn/wq": ...}
    host = host_params(model)             # the same, copying to host memory: returns at once
    load_flat_params(model, flat)         # ValueError naming every mismatch; model unchanged
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

__all__ = [
    "BASE",
    "check_flat_params",
    "flat_params",
    "host_params",
    "load_flat_params",
    "param_count",
]


Only = Any  # an NNX filter: a Variable type, or e.g. `BASE`
_PINNED = "pinned_host"  # the host memory a device can copy to without a bounce buffer
#: The base model's params, without LoRA adapters.
BASE = nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam))


def _flat_vars(model: nnx.Module, only: Only = nnx.Param) -> dict[str, nnx.Variable]:
    flat = nnx.to_flat_state(nnx.state(model, only))
    return {"/".join(str(p) for p in path): var for path, var in flat}


def param_count(model: nnx.Module) -> int:
    """Number of scalar parameters."""
    return sum(int(np.prod(v.shape)) for v in _flat_vars(model).values())


def flat_params(model: nnx.Module, only: Only = nnx.Param) -> dict[str, np.ndarray]:
    """{'blocks/0/attn/wq': float32 ndarray, ...}: stable names, ready for safetensors.
    `only=nnx.LoRAParam`: the adapters alone."""
    # One device_get of them all: it starts every device -> host copy before it waits on
    # any (one at a time, a snapshot's transfer was as many round trips as tensors).
    arrays = jax.device_get({name: var[...] for name, var in _flat_vars(model, only).items()})
    return {name: np.asarray(arrays[name], dtype=np.float32) for name in sorted(arrays)}


def host_params(model: nnx.Module, only: Only = nnx.Param) -> dict[str, jax.Array | np.ndarray]:
    """`flat_params` without waiting: each tensor's copy to (pinned) host memory is
    queued and the arrays returned at once, in the params' dtype; `np.asarray(v,
    np.float32)` on one waits for its copy and gives `flat_params`' value. The copies are
    buffers of their own, so the next update still donates the params' device buffers (for
    an array on one CPU device `flat_params` returns views of them, which an update cannot
    donate); the update's device work waits for the copies to read them. A backend without
    a pinned host memory gets `flat_params`."""
    arrays = {name: var[...] for name, var in sorted(_flat_vars(model, only).items())}
    devices = {d for a in arrays.values() for d in a.devices()}
    if not all(_PINNED in {m.kind for m in d.addressable_memories()} for d in devices):
        return flat_params(model, only)
    return jax.device_put(
        arrays, {n: a.sharding.with_memory_kind(_PINNED) for n, a in arrays.items()}
    )


def check_flat_params(
    model: nnx.Module, flat: Mapping[str, np.ndarray], only: Only = nnx.Param
) -> None:
    """Raise ValueError unless `flat` has exactly `model`'s tensors (of kind `only`), each
    of its shape and float32 (the snapshot format); the message names every missing /
    unexpected key and every shape or dtype mismatch. Reads only shapes and dtypes."""
    current = _flat_vars(model, only)
    missing = sorted(set(current) - set(flat))
    unexpected = sorted(set(flat) - set(current))
    common = sorted(set(current) & set(flat))
    bad_shape = [
        f"{n}: expected {tuple(current[n].shape)}, got {tuple(np.shape(flat[n]))}"
        for n in common
        if tuple(np.shape(flat[n])) != tuple(current[n].shape)
    ]
    bad_dtype = [
        f"{n}: expected float32, got {np.asarray(flat[n]).dtype}"
        for n in common
        if np.asarray(flat[n]).dtype != np.float32
    ]
    if missing or unexpected or bad_shape or bad_dtype:
        parts = []
        if missing:
            parts.append(f"missing keys {missing}")
        if unexpected:
            parts.append(f"unexpected keys {unexpected}")
        if bad_shape:
            parts.append(f"shape mismatches [{'; '.join(bad_shape)}]")
        if bad_dtype:
            parts.append(f"dtype mismatches [{'; '.join(bad_dtype)}]")
        raise ValueError("load_flat_params: " + ", ".join(parts))


def load_flat_params(
    model: nnx.Module, flat: Mapping[str, np.ndarray], only: Only = nnx.Param
) -> None:
    """Load `flat_params`-style arrays into `model` in place, each param keeping its
    sharding and the dtype it is held in (float32 snapshots into a bfloat16-held model are
    rounded to bfloat16); `only=nnx.LoRAParam` loads adapters and leaves the base as it is.

    Checks first (`check_flat_params`: names, shapes, float32) and raises ValueError naming
    every problem; nothing is modified when it raises. Then swaps one tensor at a time, so
    memory holds the old weights plus one new tensor, not two models.
    """
    check_flat_params(model, flat, only)
    state = nnx.state(model, only)
    for path, var in nnx.to_flat_state(state):
        old = var[...]
        value = np.asarray(flat["/".join(str(p) for p in path)], dtype=np.float32)
        # Rounded on the host (ml_dtypes, round-to-nearest-even like XLA): a bfloat16-held
        # model never holds a float32 copy of a tensor on its device.
        value = jnp.asarray(value.astype(old.dtype, copy=False))
        if isinstance(getattr(old, "sharding", None), jax.sharding.NamedSharding):
            value = jax.device_put(value, old.sharding)
        var.set_value(value)
    nnx.update(model, state)
