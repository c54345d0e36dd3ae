"""The functional environment contract: `VecEnv`, `Chars`, and the pure text helpers envs use.

A vectorized environment is pure and fixed-shape, so E of them are one `jax.vmap` and a
whole episode can run inside a jitted loop on the accelerator, beside the policy:

    env = make_vec_env("calculator", max_turns=3)
    state, obs = env.reset(key)                         # obs: Chars [env.obs_len]
    state, obs, reward, done = env.step(state, action)  # action: Chars [any width]

    states, obs = jax.vmap(env.reset)(keys)             # E environments at once

Environments see text as `Chars`: character codes (ASCII for printable text) with a
length, plus three negative codes for the chat format's markers: `TOOL` before a tool
call's argument, `ANSWER` before an answer, `SPECIAL` for any other special token. The
actor translates token ids to codes and back (`actor/vectorized/ondevice.py`), so an environment never
sees a tokenizer and the same task runs under any character-level chat format.

`parse_action` reads a sampled turn exactly as `CharChat.parse` does (strip, then a leading
`TOOL` or `ANSWER` marker; unmarked text is an answer), and `parse_int` accepts what
`envs.guess_number.parse_int` accepts (`[+-]?\\d{1,9}` after stripping), so a vectorized
task rewards the same turns as its asynchronous twin (tests/unit/envs/test_vec_envs.py).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "ANSWER",
    "SPECIAL",
    "TOOL",
    "Chars",
    "VecEnv",
    "concat",
    "fit",
    "int_to_chars",
    "literal",
    "parse_action",
    "parse_int",
    "pick",
    "strip",
]

TOOL, ANSWER, SPECIAL = -2, -3, -1
_SPACE, _NEWLINE, _PLUS, _MINUS, _ZERO = 32, 10, 43, 45, 48
MAX_INT_DIGITS = 9  # parse_int's bound: keeps every accepted answer inside int32


class Chars(NamedTuple):
    """Text as character codes `codes [N]` (int32), of which the first `length` count."""

    codes: jax.Array
    length: jax.Array


State = Any  # an environment's state: any pytree of fixed-shape arrays


@runtime_checkable
class VecEnv(Protocol):
    """A pure, fixed-shape environment (module docstring: the loop).

    `obs_len` is the static width of every observation. `reset(key)` starts an episode
    (the same key gives the same task: an actor gives a GRPO group one key); `step` takes
    the policy's turn and returns the next observation, the reward of this step and
    whether the episode ended. Both must be traceable by `jax.jit` / `jax.vmap`.
    """

    name: str
    obs_len: int

    def reset(self, key: jax.Array) -> tuple[State, Chars]: ...

    def step(self, state: State, action: Chars) -> tuple[State, Chars, jax.Array, jax.Array]: ...


def literal(text: str, width: int | None = None) -> Chars:
    """A constant string as `Chars`, padded with spaces to `width`."""
    codes = [ord(c) for c in text]
    width = len(codes) if width is None else width
    if len(codes) > width or any(c > 126 for c in codes):
        raise ValueError(f"{text!r} is not printable ASCII of at most {width} characters")
    padded = np.full(width, _SPACE, np.int32)
    padded[: len(codes)] = codes
    return Chars(jnp.asarray(padded), jnp.int32(len(codes)))


def pick(cond: jax.Array, a: Chars, b: Chars) -> Chars:
    """`a` where `cond`, else `b` (same widths)."""
    return Chars(jnp.where(cond, a.codes, b.codes), jnp.where(cond, a.length, b.length))


def concat(*parts: Chars) -> Chars:
    """The parts one after another; width = the sum of the parts' widths."""
    width = sum(p.codes.shape[-1] for p in parts)
    out = jnp.full((width,), _SPACE, jnp.int32)
    offset = jnp.int32(0)
    for p in parts:  # a later part overwrites what lies past an earlier one's length
        out = jax.lax.dynamic_update_slice(out, p.codes.astype(jnp.int32), (offset,))
        offset = offset + p.length
    return Chars(out, offset)


def _is_space(codes: jax.Array) -> jax.Array:
    # str.strip() over this alphabet: space and newline (the only whitespace it has).
    return (codes == _SPACE) | (codes == _NEWLINE)


def strip(text: Chars, start: jax.Array | int = 0) -> tuple[jax.Array, jax.Array]:
    """`[first, end)` of `text.codes[start:length]` without surrounding whitespace
    (first == end when nothing is left)."""
    idx = jnp.arange(text.codes.shape[-1])
    inside = (idx >= start) & (idx < text.length)
    solid = inside & ~_is_space(text.codes)
    any_solid = jnp.any(solid)
    first = jnp.where(any_solid, jnp.argmax(solid), text.length)
    last = jnp.where(any_solid, idx.shape[0] - 1 - jnp.argmax(solid[::-1]), text.length - 1)
    return first.astype(jnp.int32), (last + 1).astype(jnp.int32)


def parse_action(text: Chars) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(is_tool_call, first, end): a sampled turn read as `CharChat.parse` reads it. The
    argument (tool call) or answer is `codes[first:end]`, already stripped."""
    first, end = strip(text)
    lead = text.codes[jnp.minimum(first, text.codes.shape[-1] - 1)]
    marked = (first < end) & ((lead == TOOL) | (lead == ANSWER))
    inner_first, inner_end = strip(Chars(text.codes, end), first + 1)
    is_tool = marked & (lead == TOOL)
    return is_tool, jnp.where(marked, inner_first, first), jnp.where(marked, inner_end, end)


def parse_int(codes: jax.Array, first: jax.Array, end: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(ok, value) of `codes[first:end]` read as `[+-]?\\d{1,9}`."""
    idx = jnp.arange(codes.shape[-1])
    lead = codes[jnp.minimum(first, codes.shape[-1] - 1)]
    signed = (first < end) & ((lead == _PLUS) | (lead == _MINUS))
    digits_from = first + signed.astype(jnp.int32)
    span = (idx >= digits_from) & (idx < end)
    digit = (codes >= _ZERO) & (codes <= _ZERO + 9)
    n = end - digits_from
    ok = (n >= 1) & (n <= MAX_INT_DIGITS) & jnp.all(~span | digit)
    # Horner's rule over the span only; at most 9 digits, so int32 never overflows.
    power = jnp.where(span, end - 1 - idx, 0)
    value = jnp.sum(jnp.where(span & ok, (codes - _ZERO) * 10**power, 0))
    return ok, jnp.where(signed & (lead == _MINUS), -value, value)


def int_to_chars(value: jax.Array, width: int = 11) -> Chars:
    """Decimal text of an int32 `value` (sign included), left-aligned in `width`."""
    magnitude = jnp.abs(value)
    digits = 1 + sum((magnitude >= 10**k).astype(jnp.int32) for k in range(1, 10))
    neg = (value < 0).astype(jnp.int32)
    idx = jnp.arange(width)
    power = digits - 1 - (idx - neg)  # the power of ten written at each index
    digit = (magnitude // (10 ** jnp.clip(power, 0, 9))) % 10
    codes = jnp.where(power >= 0, _ZERO + digit, _SPACE)
    codes = jnp.where((idx == 0) & (neg == 1), _MINUS, codes)
    return Chars(codes.astype(jnp.int32), digits + neg)


def fit(text: Chars, width: int) -> Chars:
    """`text` padded with spaces or cut to `width` (its length clipped to match)."""
    n = text.codes.shape[-1]
    codes = (
        text.codes[:width]
        if n >= width
        else jnp.pad(text.codes, (0, width - n), constant_values=_SPACE)
    )
    return Chars(codes, jnp.minimum(text.length, width))
