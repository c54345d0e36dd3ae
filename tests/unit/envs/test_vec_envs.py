"""Vectorized (JAX) environments against their asynchronous twins, turn by turn.

The same question (or row) is put into both implementations, the same sampled turns are
fed to both (the async env through `CharChat.parse`, the JAX env through the character
codes the on-device actor hands it), and rewards, done flags and observations must agree;
the only differences allowed are the documented ones (envs/vectorized/calculator.py:
Python's "unsupported syntax: ..." is "cannot parse expression"; values beyond 10**9 are
"number too large"). Also: the pure text helpers, jit/vmap, and the registry.
"""

from __future__ import annotations

import asyncio
import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tunix_tasks.actor.vectorized.token_layout import TokenLayout
from tunix_tasks.envs import CalculatorEnv, SortingEnv
from tunix_tasks.envs.calculator import safe_eval
from tunix_tasks.envs.vectorized import available_vec_envs, make_vec_env, register_vec_env
from tunix_tasks.envs.vectorized.base import Chars, int_to_chars, literal, parse_int, strip
from tunix_tasks.policy.tokenizer import ANSWER, TOOL, CharChat

CHAT = CharChat()
LAYOUT = TokenLayout.from_chat(CHAT)
WIDTH = 24


def _text(chars: Chars) -> str:
    return "".join(chr(c) for c in np.asarray(chars.codes)[: int(chars.length)])


def _turn(text: str, stop: bool, width: int = WIDTH) -> tuple[list[int], Chars]:
    """Sampled ids of a turn, and the Chars the on-device actor gives the env for them."""
    ids = CHAT.tokenizer.encode(text)[: width - 1]
    codes = np.zeros(width, np.int32)
    codes[: len(ids)] = LAYOUT.id_to_code[ids]
    if stop:
        ids = [*ids, CHAT.tokenizer.end_id]
    return ids, Chars(jnp.asarray(codes), jnp.int32(len(ids) - stop))


def _random_turn(rng: random.Random, alphabet: str, answer: int) -> str:
    body = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 10)))
    return rng.choice(
        [
            f"{TOOL}{body}",
            f" {TOOL} {body} ",
            f"{ANSWER}{body}",
            body,
            f"{ANSWER} {answer} ",
            f"{ANSWER}{answer + rng.choice([0, 1])}",
            f"{TOOL}{rng.randint(0, 999)}{rng.choice('+-*')}{rng.randint(0, 99)}=?",
            f"{TOOL}{rng.randint(0, 99)}//{rng.choice([0, 3, -7])}",
        ]
    )


def _same_observation(python: str | tuple[str, ...], ours: str) -> bool:
    if isinstance(python, tuple):  # the one call a character-level turn can make
        (python,) = python
    if python.startswith("error: unsupported syntax"):
        return ours == "error: cannot parse expression"
    if python.lstrip("-").isdigit() and abs(int(python)) > 10**9:
        return ours == "error: number too large"
    return python == ours


_STEPS: dict[int, object] = {}


def _jit_step(vec_env):
    """One compiled step per env object (a fresh `jax.jit` per call would retrace)."""
    return _STEPS.setdefault(id(vec_env), jax.jit(vec_env.step))


def _play_both(async_env, vec_env, state, turns: list[tuple[str, bool]]) -> int:
    """Feed `turns` to both until one is done; returns how many steps were compared."""
    step = _jit_step(vec_env)
    tools = list(async_env.tools)
    for n, (text, stop) in enumerate(turns, 1):
        ids, chars = _turn(text, stop)
        result = asyncio.run(async_env.step(CHAT.parse(ids, tools)))
        state, obs, reward, done = step(state, chars)
        assert float(reward) == result.reward, (text, result)
        assert bool(done) == result.done, (text, result)
        if result.done:
            return n
        assert _same_observation(result.observation, _text(obs)), (text, result, _text(obs))
    return len(turns)


def test_calculator_twins_agree_turn_by_turn():
    rng = random.Random(0)
    vec = make_vec_env("calculator", difficulty=2, max_turns=3)
    compared = 0
    for seed in range(150):
        env = CalculatorEnv(difficulty=2, max_turns=3)
        question = asyncio.run(env.reset(seed))
        answer = safe_eval(question)
        state, _ = vec.reset(jax.random.key(seed))
        state = state._replace(answer=jnp.int32(answer))
        turns = [(_random_turn(rng, "0123456789+-*/ =?a", answer), rng.random() < 0.8)]
        turns += [(_random_turn(rng, "0123456789+-*/ =?", answer), True) for _ in range(2)]
        compared += _play_both(env, vec, state, turns)
    assert compared > 300


def test_calculator_tool_grammar():
    vec = make_vec_env("calculator")
    state, _ = vec.reset(jax.random.key(0))
    cases = {
        "12+7": "19", "3*4-5//2": "10", " 5 - -3 =?": "8", "7//-2": "-4", "--4": "4",
        "00": "0", "01": "error: cannot parse expression", "1 2": "error: cannot parse expression",
        "8/2": "error: cannot parse expression", "1///2": "error: cannot parse expression",
        "1//0": "error: division by zero", "99999*99999": "error: number too large",
        "": "error: empty or too long expression", "=?": "error: empty or too long expression",
        "1" * 65: "error: empty or too long expression",
    }  # fmt: skip
    step = _jit_step(vec)
    for expr, want in cases.items():
        _, chars = _turn(f"{TOOL}{expr}", stop=False, width=72)
        _, obs, _, done = step(state, chars)
        assert _text(obs) == want and not bool(done), expr


def test_sorting_twins_agree_and_demonstrations_solve_both():
    rng = random.Random(1)
    vec = make_vec_env("sorting", length=4, max_turns=6)
    solved = 0
    for seed in range(60):
        env = SortingEnv(length=4, max_turns=6)
        first = asyncio.run(env.reset(seed))
        state, _ = vec.reset(jax.random.key(seed))
        state = state._replace(row=jnp.asarray([int(c) for c in first], jnp.int32))
        if seed % 2:  # the expert's moves, as the char format renders them
            moves = [CHAT.tokenizer.decode(CHAT.render_action([], a, env.tools)[:-1])
                     for a in env.demonstration(seed)]  # fmt: skip
            turns = [(m, True) for m in moves]
        else:
            turns = [(f"{TOOL}{rng.choice('0123456789 ')}{rng.choice('0123456789x')}", True)
                     for _ in range(4)] + [(f"{ANSWER}done", True)]  # fmt: skip
        _play_both(env, vec, state, turns)
        solved += seed % 2 and env._row == sorted(env._row)
    assert solved == 30


def test_text_helpers():
    assert _text(int_to_chars(jnp.int32(-120), 6)) == "-120"
    assert _text(int_to_chars(jnp.int32(999_999_999))) == "999999999"
    assert _text(int_to_chars(jnp.int32(0), 3)) == "0"
    for text, want in {" 42 ": (True, 42), "-7": (True, -7), "+3": (True, 3), "1234567890": None,
                       "4 2": None, "": None, "-": None}.items():  # fmt: skip
        chars = literal(text, 12)
        ok, value = parse_int(chars.codes, *strip(chars))
        assert (bool(ok), int(value)) == want if want else not bool(ok), text


@pytest.mark.parametrize("name", ["calculator", "sorting"])
def test_vmapped_batch_is_the_single_env_batched(name):
    env = make_vec_env(name)
    keys = jax.random.split(jax.random.key(3), 16)
    states, obs = jax.jit(jax.vmap(env.reset))(keys)
    assert obs.codes.shape == (16, env.obs_len)
    one_state, one_obs = env.reset(keys[5])
    assert _text(jax.tree.map(lambda x: x[5], obs)) == _text(one_obs)
    _, action = _turn(f"{TOOL}01", True)
    batched = jax.vmap(env.step, in_axes=(0, None))(states, action)
    single = _jit_step(env)(one_state, action)
    jax.tree.map(lambda b, s: np.testing.assert_array_equal(b[5], s), batched, single)


def test_registry():
    assert {"calculator", "sorting"} <= set(available_vec_envs())
    with pytest.raises(KeyError, match=r"available: .*calculator"):
        make_vec_env("no-such-env")

    class Broken:
        name = "broken"

    register_vec_env("test_vec_broken")(Broken)
    with pytest.raises(TypeError, match="lacks obs_len, reset, step"):
        make_vec_env("test_vec_broken")
