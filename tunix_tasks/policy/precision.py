"""The dtype a model holds its params in: float32 by default, bfloat16 for bf16 sampling.

The `Transformer` casts each param to its compute dtype at every use. A bfloat16
sampler therefore loses nothing by holding its params in bfloat16 outright (the matmul
inputs are the same values; only the RMSNorm scales, applied in float32, are rounded),
and gains a lot: a decode step is memory-bound, reading every weight once per token, so
half the bytes is close to half the time on an accelerator, and half the memory.
Snapshots stay float32 (`policy/params.py` checks it); `load_flat_params` casts each
incoming tensor to the dtype the model holds, so a bf16-held model stays bf16.

    cast_params(model, model.compute_dtype)   # a sampler's or an on-device actor's copy
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

__all__ = ["cast_params"]


def cast_params(model: nnx.Module, dtype: jnp.dtype | str) -> None:
    """Store `model`'s floating `nnx.Param` leaves (LoRA adapters included) in `dtype`,
    in place, one tensor at a time, each keeping its sharding. A no-op for leaves already
    in `dtype` (float32 -> float32 costs nothing)."""
    dtype = jnp.dtype(dtype)
    state = nnx.state(model, nnx.Param)
    for _, var in nnx.to_flat_state(state):
        old = var[...]
        if jnp.issubdtype(old.dtype, jnp.floating) and old.dtype != dtype:
            var.set_value(jax.device_put(old.astype(dtype), old.sharding))
    nnx.update(model, state)
