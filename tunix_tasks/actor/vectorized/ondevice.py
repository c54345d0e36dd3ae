"""`OnDeviceRollout`: the device loop (device_loop.py) as the vectorized actor's `RolloutEngine`.

    engine = OnDeviceRollout(model, env, layout, shape, temperature=1.0, top_k=0,
                             token_seed=7, env_seed=8)
    engine.update_params(flat, version=3)    # between segments; rows in flight are re-cached
    finished, ran, live = engine.run_segment(192)   # numpy `Finished`: the episodes that ended
    handle = engine.launch(192, budget=20)    # or: queue the next segment, then
    finished, ran, live = engine.fetch(handle)      # read it (overlaps host work with the device)

`budget` is how many new episodes a segment may start (flow control's room; the open
GRPO group is completed beyond it); rows that finish past it go idle, and `live` is how
many rows still play at the segment's end. With `budget=0` they fall to 0 within about
one episode, and a segment with no live row and no budget runs no step.

It holds the model's params in the model's compute dtype (bf16 sampling: half the bytes a
decode step reads; log-probs stay float32) and compiles one segment program for the run:
weights, sampling settings and the version are traced arguments.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tunix_tasks.actor.vectorized import device_loop
from tunix_tasks.actor.vectorized.device_loop import Finished, Loop, Sampling, Shape
from tunix_tasks.actor.vectorized.token_layout import TokenLayout
from tunix_tasks.envs.vectorized.base import VecEnv
from tunix_tasks.policy.model import Transformer
from tunix_tasks.policy.params import load_flat_params
from tunix_tasks.policy.precision import cast_params

__all__ = ["UNLIMITED", "OnDeviceRollout"]

#: A segment's budget without flow control: more new episodes than any segment starts.
UNLIMITED = 2**30


class OnDeviceRollout:
    """E environments and the policy in one jitted loop (module docstring)."""

    def __init__(
        self,
        model: Transformer,
        env: VecEnv,
        layout: TokenLayout,
        shape: Shape,
        *,
        temperature: float,
        top_k: int,
        token_seed: int,
        env_seed: int,
    ) -> None:
        need = layout.prompt_len(env.obs_len) + len(layout.end) + 1 + 2
        if shape.tokens < need:
            raise ValueError(
                f"actor.max_episode_tokens={shape.tokens} cannot hold {env.name}'s first prompt "
                f"and a turn: need at least {need}"
            )
        if shape.tokens > model.max_seq_len:
            raise ValueError(f"{shape.tokens} tokens exceed the model's {model.max_seq_len}")
        self.env, self.layout, self.shape = env, layout, shape
        self.version = -1
        self._model = model
        cast_params(model, model.compute_dtype)
        self._graphdef, self._state = nnx.split(model)
        self._settings = (temperature, top_k, token_seed, env_seed)
        self._loop: Loop | None = None
        self._traces = 0
        self._segment = jax.jit(self._segment_impl, static_argnames="steps", donate_argnums=1)
        self._refill = jax.jit(self._refill_impl, donate_argnums=1)
        self._start = jax.jit(self._start_impl)

    @property
    def model(self) -> Transformer:
        return self._model

    @property
    def compile_count(self) -> int:
        """How many times a program was traced (== XLA compilations it caused)."""
        return self._traces

    def _sampling(self, budget: int = UNLIMITED) -> Sampling:
        temperature, top_k, token_seed, env_seed = self._settings
        return Sampling(
            key=jax.random.key(token_seed),
            env_key=jax.random.key(env_seed),
            temperature=jnp.float32(temperature),
            top_k=jnp.int32(top_k),
            version=jnp.int32(max(self.version, 0)),
            budget=jnp.int32(budget),
        )

    def update_params(
        self,
        flat: Mapping[str, np.ndarray],
        *,
        version: int,
        only: type = nnx.Param,
        digest: str = "",
        created_at: float = 0.0,
    ) -> None:
        """Load a snapshot (checked first: a ValueError leaves the old weights); rows in
        flight keep going with their keys and values recomputed under the new weights.
        `digest` and `created_at` are not needed: the weights stay on this device."""
        load_flat_params(self._model, flat, only)
        self._state = nnx.state(self._model)
        self.version = version
        if self._loop is not None:
            self._loop = self._refill(self._state, self._loop)

    def launch(
        self, steps: int, *, budget: int = UNLIMITED
    ) -> tuple[Finished, jax.Array, jax.Array]:
        """Queue a segment of up to `steps` steps of every row and return at once (its
        results are device arrays: the host can commit the previous segment meanwhile).
        It starts at most `budget` new episodes, plus those completing the open group."""
        if self._loop is None:
            self._loop = self._start(self._state, self._sampling(), jnp.int32(0))
        s = self._sampling(min(budget, UNLIMITED))
        self._loop, out, ran, live = self._segment(self._state, self._loop, s, steps=steps)
        return out, ran, live

    @staticmethod
    def fetch(launched: tuple[Finished, jax.Array, jax.Array]) -> tuple[Finished, int, int]:
        """A launched segment's finished episodes (numpy), how many steps it ran and how
        many rows were still live at its end."""
        out, ran, live = jax.device_get(launched)
        return out, int(ran), int(live)

    def run_segment(self, steps: int, *, budget: int = UNLIMITED) -> tuple[Finished, int, int]:
        """`fetch(launch(steps, budget=budget))`."""
        return self.fetch(self.launch(steps, budget=budget))

    # ------------------------------------------------------------------ jitted programs

    def _start_impl(self, state, s: Sampling, first_ticket: jax.Array) -> Loop:
        self._traces += 1  # runs only while tracing: counts compilations
        model = nnx.merge(self._graphdef, state)
        return device_loop.start(model, self.env, self.layout, self.shape, s, first_ticket)

    def _segment_impl(self, state, loop: Loop, s: Sampling, *, steps: int):
        self._traces += 1
        model = nnx.merge(self._graphdef, state)
        e = self.shape.envs

        def cond(carry):
            i, loop, out = carry
            room = out.count <= self.shape.capacity - e
            return (i < steps) & room & jnp.any(loop.rows.live)

        def body(carry):
            i, loop, out = carry
            loop, out = device_loop.advance(model, loop, out, self.env, self.layout, self.shape, s)
            return i + 1, loop, out

        loop = device_loop.wake(loop, self.env, self.layout, self.shape, s)
        init = (jnp.int32(0), loop, device_loop.empty_finished(self.shape))
        ran, loop, out = jax.lax.while_loop(cond, body, init)
        return loop, out, ran, jnp.sum(loop.rows.live, dtype=jnp.int32)

    def _refill_impl(self, state, loop: Loop) -> Loop:
        self._traces += 1
        model = nnx.merge(self._graphdef, state)
        return device_loop.refill(model, loop, device_loop.block_rows(self.shape.envs))
