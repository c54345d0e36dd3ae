"""``sorting`` as a pure JAX environment: the same task and reward as `envs/sorting.py`.

A row of ``length`` distinct shuffled digits; ``TOOL 03`` swaps positions 0 and 3 and shows
the row, anything else unmarked or after ``ANSWER`` ends the episode with 1.0 if the row is
sorted. Rows are drawn with `jax.random` (same distribution, not the same row per seed).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from tunix_tasks.envs.sorting import swap_error
from tunix_tasks.envs.vectorized.base import Chars, fit, literal, parse_action, pick

__all__ = ["VecSorting"]


class _State(NamedTuple):
    row: jax.Array  # [length] digits
    turns: jax.Array


class VecSorting:
    """The sorting task (module docstring) as a `VecEnv`."""

    name = "sorting"

    def __init__(self, length: int = 4, max_turns: int = 8) -> None:
        if not 2 <= length <= 10 or max_turns < 1:
            raise ValueError("need 2 <= length <= 10 and max_turns >= 1")
        self.length, self.max_turns = length, max_turns
        self._error = literal(swap_error(length))
        self.obs_len = self._error.codes.shape[0]

    def _text(self, row: jax.Array) -> Chars:
        return fit(Chars(48 + row, jnp.int32(self.length)), self.obs_len)

    def reset(self, key: jax.Array) -> tuple[_State, Chars]:
        row = jax.random.permutation(key, 10)[: self.length].astype(jnp.int32)
        return _State(row, jnp.int32(0)), self._text(row)

    def step(self, state: _State, action: Chars) -> tuple[_State, Chars, jax.Array, jax.Array]:
        turns = state.turns + 1
        is_tool, first, end = parse_action(action)
        n = action.codes.shape[-1]
        i = action.codes[jnp.minimum(first, n - 1)] - 48
        j = action.codes[jnp.minimum(first + 1, n - 1)] - 48
        valid = (end - first == 2) & (i != j) & (i >= 0) & (j >= 0)
        valid &= (i < self.length) & (j < self.length) & is_tool
        swapped = state.row.at[i].set(state.row[j]).at[j].set(state.row[i])
        row = jnp.where(valid, swapped, state.row)
        sorted_ = jnp.all(row[1:] >= row[:-1])
        reward = jnp.where(~is_tool & sorted_, 1.0, 0.0).astype(jnp.float32)
        obs = pick(valid, self._text(row), fit(self._error, self.obs_len))
        done = ~is_tool | (turns >= self.max_turns)
        return _State(row, turns), obs, reward, done
