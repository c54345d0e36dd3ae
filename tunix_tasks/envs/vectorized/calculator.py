"""``calculator`` as a pure JAX environment: the same task and reward as `envs/calculator.py`.

Task ``23+45=?`` (operands of ``difficulty`` digits, an operator from ``ops``); a tool call
``TOOL 23+45`` is answered with the result (or ``error: ...``), an answer ``ANSWER 68``
earns 1.0 when right and ends the episode, anything else is ``invalid: ...``; done after an
answer or ``max_turns``. Questions are drawn with `jax.random` (same distribution as the
asynchronous env, not the same question per seed).

The tool evaluates ``[+-]* int ((+|-|*|//) [+-]* int)*`` with Python's precedence and floor
division, whitespace between tokens, an optional ``=?`` / ``=`` suffix, and Python's rule
against leading zeros; that is what `safe_eval` accepts minus parentheses and non-decimal
literals (which this one calls ``cannot parse expression``). Values beyond 10**9 are
``number too large`` (the asynchronous env allows 10**18: int32 here).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from tunix_tasks.envs.vectorized.base import (
    Chars,
    concat,
    fit,
    int_to_chars,
    literal,
    parse_action,
    parse_int,
    pick,
    strip,
)

__all__ = ["VecCalculator", "evaluate"]

LIMIT = 10**9
MAX_EXPR_CHARS = 64
ERRORS = (
    "",
    "error: empty or too long expression",
    "error: cannot parse expression",
    "error: division by zero",
    "error: number too large",
)
_EMPTY, _PARSE, _DIVZERO, _LARGE = 1, 2, 3, 4
INVALID = "invalid: call calculate or answer with an integer"
_OPS = {"+": 43, "-": 45, "*": 42}


class _Scan(NamedTuple):
    total: jax.Array  # the finished terms' sum
    term: jax.Array  # the current term's product so far
    num: jax.Array  # the literal being read
    add_sign: jax.Array  # +1 / -1 of the current term
    unary: jax.Array  # product of the current factor's unary signs
    term_op: jax.Array  # 0: the next factor starts a term, 1: multiplies, 2: floor-divides
    expect: jax.Array  # an operand must come next
    in_num: jax.Array  # inside a literal
    lead_zero: jax.Array  # the literal started with 0
    slash: jax.Array  # read one '/', the next must be '/'
    bad: jax.Array  # a syntax error (wins over evaluation errors, as in ast.parse)
    err: jax.Array  # the first evaluation error, in Python's evaluation order


def _first(err: jax.Array, cond: jax.Array, code: int) -> jax.Array:
    return jnp.where((err == 0) & cond, code, err)


def _factor_done(s: _Scan, live: jax.Array) -> _Scan:
    """Apply the finished factor (unary sign times literal) to the current term."""
    value = s.unary * s.num
    big = (value != 0) & (jnp.abs(s.term) > LIMIT // jnp.maximum(jnp.abs(value), 1))
    zero = value == 0
    term = jnp.where(
        s.term_op == 0,
        value,
        jnp.where(
            s.term_op == 1,
            jnp.where(big, LIMIT, s.term * value),
            jnp.floor_divide(s.term, jnp.where(zero, 1, value)),
        ),
    )
    err = _first(s.err, live & (s.term_op == 1) & big, _LARGE)
    err = _first(err, live & (s.term_op == 2) & zero, _DIVZERO)
    return s._replace(
        term=jnp.where(live, term, s.term),
        err=err,
        unary=jnp.where(live, 1, s.unary),
        in_num=jnp.where(live, False, s.in_num),
    )


def _term_done(s: _Scan, live: jax.Array) -> _Scan:
    total = s.total + s.add_sign * s.term
    err = _first(s.err, live & (jnp.abs(total) > LIMIT), _LARGE)
    return s._replace(total=jnp.where(live, jnp.clip(total, -LIMIT, LIMIT), s.total), err=err)


def _read(s: _Scan, item: tuple[jax.Array, jax.Array]) -> tuple[_Scan, None]:
    c, live = item
    digit = (c >= 48) & (c <= 57)
    d = c - 48
    space = (c == 32) | (c == 10)
    sign = (c == 43) | (c == 45)
    star, slash = c == 42, c == 47
    second_slash = s.slash & slash
    bad = s.slash & ~slash
    bad |= ~(digit | space | sign | star | slash)
    bad |= digit & ~s.expect & ~s.in_num  # "1 2"
    bad |= (star | slash) & s.expect & ~s.slash
    bad |= digit & s.in_num & s.lead_zero & (d != 0)  # "01": Python refuses leading zeros
    bad &= live

    start = live & digit & s.expect
    extend = live & digit & s.in_num & ~s.expect
    too_big = extend & (s.num > (LIMIT - d) // 10)
    s = s._replace(
        num=jnp.where(
            start, d, jnp.where(extend, jnp.where(too_big, LIMIT, s.num * 10 + d), s.num)
        ),
        err=_first(s.err, too_big, _LARGE),
        lead_zero=jnp.where(start, d == 0, s.lead_zero),
        in_num=jnp.where(start, True, s.in_num & ~(live & space)),
        expect=jnp.where(start, False, s.expect),
    )
    binop = live & (sign | star | slash) & ~s.expect & ~s.slash
    unary = live & sign & s.expect & ~s.slash
    s = _factor_done(s, binop)
    s = _term_done(s, binop & sign)
    minus = c == 45
    return s._replace(
        add_sign=jnp.where(binop & sign, jnp.where(minus, -1, 1), s.add_sign),
        unary=jnp.where(unary & minus, -s.unary, s.unary),
        term_op=jnp.where(
            binop & sign,
            0,
            jnp.where(binop & star, 1, jnp.where(live & second_slash, 2, s.term_op)),
        ),
        expect=jnp.where(binop & (sign | star) | live & second_slash, True, s.expect),
        slash=jnp.where(binop & slash, True, jnp.where(live & second_slash, False, s.slash)),
        bad=s.bad | bad,
    ), None


def evaluate(codes: jax.Array, first: jax.Array, end: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(error index into `ERRORS`, value) of the expression `codes[first:end]` (stripped)."""
    n = codes.shape[-1]
    at = lambda i: codes[jnp.clip(i, 0, n - 1)]  # noqa: E731
    # safe_eval: .removesuffix("=?").removesuffix("=").strip()
    end = jnp.where((end - first >= 2) & (at(end - 2) == 61) & (at(end - 1) == 63), end - 2, end)
    end = jnp.where((end > first) & (at(end - 1) == 61), end - 1, end)
    first, end = strip(Chars(codes, end), first)
    idx = jnp.arange(n)
    i32 = lambda v: jnp.int32(v)  # noqa: E731
    init = _Scan(
        *(i32(v) for v in (0, 0, 0, 1, 1, 0)),
        *(jnp.bool_(v) for v in (True, False, False, False, False)),
        i32(0),
    )
    s, _ = jax.lax.scan(_read, init, (codes, (idx >= first) & (idx < end)))
    bad = s.bad | s.expect | s.slash
    s = _term_done(_factor_done(s, ~bad), ~bad)
    length = end - first
    err = jnp.where((length == 0) | (length > MAX_EXPR_CHARS), 1, jnp.where(bad, _PARSE, s.err))
    return err.astype(jnp.int32), s.total


class _State(NamedTuple):
    answer: jax.Array
    turns: jax.Array


class VecCalculator:
    """The calculator task (module docstring) as a `VecEnv`."""

    name = "calculator"

    def __init__(self, difficulty: int = 2, ops: str = "+-*", max_turns: int = 3) -> None:
        if not 1 <= difficulty <= 4 or not ops or set(ops) - set(_OPS) or max_turns < 1:
            raise ValueError(
                "need 1 <= difficulty <= 4 (answers stay in int32), ops a non-empty subset "
                "of '+-*', max_turns >= 1"
            )
        self.difficulty, self.ops, self.max_turns = difficulty, ops, max_turns
        width = len(INVALID)
        texts = [literal(m, width) for m in (*ERRORS, INVALID)]
        self._messages = jax.tree.map(lambda *m: jnp.stack(m), *texts)  # [6, width]
        self.obs_len = len(INVALID)  # the longest observation

    def reset(self, key: jax.Array) -> tuple[_State, Chars]:
        ka, kb, ko = jax.random.split(key, 3)
        hi = 10**self.difficulty
        a = jax.random.randint(ka, (), 0, hi, jnp.int32)
        b = jax.random.randint(kb, (), 0, hi, jnp.int32)
        op = jnp.asarray([_OPS[o] for o in self.ops], jnp.int32)[
            jax.random.randint(ko, (), 0, len(self.ops))
        ]
        answer = jnp.where(op == 43, a + b, jnp.where(op == 45, a - b, a * b))
        width = self.difficulty
        text = concat(
            int_to_chars(a, width),
            Chars(op[None], jnp.int32(1)),
            int_to_chars(b, width),
            literal("=?"),
        )
        return _State(answer, jnp.int32(0)), fit(text, self.obs_len)

    def step(self, state: _State, action: Chars) -> tuple[_State, Chars, jax.Array, jax.Array]:
        turns = state.turns + 1
        is_tool, first, end = parse_action(action)
        is_int, value = parse_int(action.codes, first, end)
        answered = ~is_tool & is_int
        reward = jnp.where(answered & (value == state.answer), 1.0, 0.0).astype(jnp.float32)
        err, result = evaluate(action.codes, first, end)
        which = jnp.where(is_tool, err, len(ERRORS))  # an error, or INVALID
        message = jax.tree.map(lambda m: m[which], self._messages)
        tool_result = fit(int_to_chars(result), self.obs_len)
        obs = pick(is_tool & (err == 0), tool_result, message)
        done = answered | (turns >= self.max_turns)
        return _State(state.answer, turns), obs, reward, done
