"""`LowRank`: a LoRA adapter on one projection of the decoder.

The projection computes `W x`; with an adapter it computes `W x + scale * b(a(x))`, where
`a` maps the projection's input dims to `rank` and `b` maps `rank` to its output dims, so
the update `scale * a @ b` has the shape of W. `a` starts at random and `b` at zero: a new
adapter changes nothing. Both are `nnx.LoRAParam`, which is how the learner trains only
them (`wrt=nnx.LoRAParam`) and how snapshots carry only them (`policy/params.py`).

    lora = LowRank((d, r), (r, h, hd), "btd,dr->btr", "btr,rhk->bhtk", scale, rngs=rngs,
                   a_spec=(FSDP, None), b_spec=(None, None, None))
    y = jnp.einsum("btd,dhk->bhtk", x, w) + lora(x, dtype)
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

__all__ = ["LowRank", "initial_adapter"]


def _a_init(shape: tuple[int, ...]):
    return nnx.initializers.normal(math.prod(shape[:-1]) ** -0.5)


def initial_adapter(name: str, shape: tuple[int, ...], key: jax.Array) -> jax.Array:
    """A fresh adapter tensor by its param name (`.../a` random, `.../b` zero), as
    `LowRank.__init__` makes it: for models whose base is loaded, not initialised."""
    if name.endswith("/a"):
        return _a_init(shape)(key, shape, jnp.float32)
    if name.endswith("/b"):
        return jnp.zeros(shape, jnp.float32)
    raise KeyError(f"{name} is not an adapter tensor")


def _lora_param(value_init, rngs: nnx.Rngs, shape, spec) -> nnx.LoRAParam:
    # As `model._param`: shard at creation only under a mesh, keep the spec as metadata.
    eager = not jax.sharding.get_abstract_mesh().empty
    value = nnx.with_partitioning(value_init, spec)(rngs.params(), shape, jnp.float32)
    return nnx.LoRAParam(value, eager_sharding=eager)


class LowRank(nnx.Module):
    def __init__(
        self,
        a_shape: tuple[int, ...],
        b_shape: tuple[int, ...],
        eq_a: str,
        eq_b: str,
        scale: float,
        *,
        rngs: nnx.Rngs,
        a_spec: tuple[str | None, ...],
        b_spec: tuple[str | None, ...],
    ) -> None:
        self.a = _lora_param(_a_init(a_shape), rngs, a_shape, a_spec)
        self.b = _lora_param(nnx.initializers.zeros, rngs, b_shape, b_spec)
        self.eq_a, self.eq_b, self.scale = eq_a, eq_b, scale

    def __call__(self, x: jax.Array, dtype: jnp.dtype) -> jax.Array:
        low = jnp.einsum(self.eq_a, x, self.a[...].astype(dtype))
        return self.scale * jnp.einsum(self.eq_b, low, self.b[...].astype(dtype))

    def merged_delta(self) -> jax.Array:
        """scale * a @ b in W's shape (contracting `rank`): for tests and merging."""
        a, b = self.a[...], self.b[...]
        return self.scale * jnp.tensordot(a, b, axes=([a.ndim - 1], [0]))
