"""bf16 params with a float32 master copy: the optimizer transform behind
`learner.param_dtype: bfloat16`.

The model holds its params (and so receives its gradients) in bfloat16; the optimizer
state holds a float32 copy of every trained param (`MasterState.master`) and the inner
transform's state (AdamW's moments, built on that copy, so float32). Each update widens
the gradients to float32, steps the master, and moves the bf16 params to the master
rounded to bfloat16: small updates that a bf16 param cannot represent accumulate in the
master instead of being rounded away.

    tx = with_master_copy(optax.adamw(3e-4))     # a plain optax GradientTransformation
    nnx.Optimizer(model, tx, wrt=nnx.Param)      # model's params already bfloat16

Memory per trained param: 2 (params) + 2 (grads, transient) + 4 (master) + the inner
state (AdamW: 8) = 16 bytes, the same as float32 training (4 + 4 + 8): the win is the
bf16 matmul inputs without a cast per use and half the bytes an FSDP all-gather moves,
not memory (`benchmarks/model_memory.py`).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

__all__ = ["MasterState", "master_params", "with_master_copy"]


class MasterState(NamedTuple):
    """The float32 master params and the inner transform's state (built on them)."""

    master: optax.Params
    inner: optax.OptState


def _widen(tree: Any) -> Any:
    return jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), tree)


def with_master_copy(inner: optax.GradientTransformation) -> optax.GradientTransformation:
    """`inner` run on a float32 master copy of the params. The updates it returns take
    each param to its master rounded to the param's dtype: a bf16 param p moves to
    q = bf16(master) by the float32 update q - p, which `optax.apply_updates` adds back
    exactly (both are bf16 values; only a param shrinking 2^16-fold in one step, i.e. one
    crossing zero, is off, by float32 rounding of its old magnitude)."""

    def init(params: optax.Params) -> MasterState:
        master = _widen(params)
        return MasterState(master, inner.init(master))

    def update(
        grads: optax.Updates, state: MasterState, params: optax.Params | None = None
    ) -> tuple[optax.Updates, MasterState]:
        if params is None:
            raise ValueError("with_master_copy needs the params (to move them to the master)")
        steps, inner_state = inner.update(_widen(grads), state.inner, state.master)
        master = optax.apply_updates(state.master, steps)
        updates = jax.tree.map(
            lambda m, p: m.astype(p.dtype).astype(jnp.float32) - p.astype(jnp.float32),
            master,
            params,
        )
        return updates, MasterState(master, inner_state)

    return optax.GradientTransformation(init, update)


def master_params(opt_state: Any) -> Any:
    """The float32 master copy inside an optimizer state made by `with_master_copy`."""
    if not isinstance(opt_state, MasterState):
        raise TypeError(f"not a master-copy optimizer state: {type(opt_state).__name__}")
    return opt_state.master
