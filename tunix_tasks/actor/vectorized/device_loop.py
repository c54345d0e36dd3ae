"""The on-device actor's program: E environments and the policy, one token per row per step.

Every row is one episode laid out in a token buffer `[E, T]` exactly as the asynchronous
rollout lays it out (`actor/asynchronous/rollout.py`: start prompt, sampled turn, close, reply, ...,
end). Per row, `fed` tokens have been through the model (their keys and values are
cached) and `filled` are written; tokens in between are forced (template pieces and the
environment's observation). One step, for all rows at once:

    feed tokens[fed] at position fed                 -> logits, KV cache written at fed
    nothing forced left (fed == filled): draw a token, write it (mask 1, its log-prob)
    a turn ended (stop id or budget): env.step on the turn's text (jax.vmap), then write
        close + reply (prefix, observation, suffix), or close + end when the episode ends
    an episode ended: copy it into the segment's `Finished` buffer, reset the row
        (auto-reset: a fresh ticket, a new env state, the start prompt) while the
        segment's budget of new episodes lasts (flow control), else leave it idle

A segment starts with `Sampling.budget` new episodes it may start (flow control's room;
effectively unlimited without it): first in idle rows (`wake`), then as rows finish.
Beyond the budget, rows still reset to complete the GRPO group that is open (its other
members already play), so no group waits out a pause half started. Idle rows are carried
through the step with nothing fed, drawn or written, and a segment ends early once no
row is live.

So prefill and decode are the same step (an observation is fed one token per step while
other rows sample), no row waits for another, and the shapes never change: one compile
per (E, T, ...) for the whole run. A segment runs `steps` steps or until its `Finished`
buffer could overflow, then hands the finished episodes to the host.

Tickets number the episodes an actor starts; GRPO groups are `ticket // group_size`, and a
group's members get the same env seed (the same task), `group_seed(env_key, group)`: an int
< 2**31, each row's env reset with `jax.random.key(seed)`, so the seed an `Episode` stores
reproduces its task (`vec_env.reset(jax.random.key(episode.seed))`). Tokens are
drawn with `decoding.draw`, keyed by (ticket, position): unique per token, independent of E.
A row's `version` is the weights version current when its episode started (the oldest it
was sampled with: weights only change between segments).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from tunix_tasks.actor.vectorized.token_layout import TokenLayout
from tunix_tasks.envs.vectorized.base import Chars, VecEnv, concat, fit, pick
from tunix_tasks.policy.decoding import RowParams, draw
from tunix_tasks.policy.model import KVCache, Transformer

__all__ = [
    "Finished",
    "Loop",
    "Shape",
    "advance",
    "empty_finished",
    "group_seed",
    "refill",
    "start",
    "wake",
]


class Shape(NamedTuple):
    """Static sizes (hashable: part of the compiled program's key)."""

    envs: int  # E
    tokens: int  # T: max_episode_tokens, also the KV cache length
    max_new: int  # tokens a turn may sample
    max_turns: int
    group_size: int
    capacity: int  # finished episodes one segment can hold


class Rows(NamedTuple):
    tokens: jax.Array  # [E, T] int32
    mask: jax.Array  # [E, T] int8
    logprobs: jax.Array  # [E, T] float32
    fed: jax.Array  # [E] tokens the model has consumed
    filled: jax.Array  # [E] tokens written
    turn_start: jax.Array  # [E] where the current turn's sampled tokens begin
    budget: jax.Array  # [E] tokens the current turn may sample
    gen: jax.Array  # [E] tokens sampled in the current turn
    turns: jax.Array  # [E]
    reward: jax.Array  # [E] float32
    ticket: jax.Array  # [E] the episode's number in this actor
    seed: jax.Array  # [E] its group's env seed
    version: jax.Array  # [E] weights version when it started
    live: jax.Array  # [E] bool: playing an episode (False: idle, flow control paused it)
    env: Any  # the environments' states, [E, ...] leaves


class Loop(NamedTuple):
    rows: Rows
    cache: KVCache
    next_ticket: jax.Array
    budget: jax.Array  # new episodes this segment may still start


class Finished(NamedTuple):
    """Episodes a segment finished, [capacity, ...]; the first `count` are real."""

    tokens: jax.Array
    mask: jax.Array
    logprobs: jax.Array
    length: jax.Array
    reward: jax.Array
    turns: jax.Array
    truncated: jax.Array
    ticket: jax.Array
    seed: jax.Array
    version: jax.Array
    count: jax.Array


class Sampling(NamedTuple):
    """Traced per-call settings: changing them never recompiles."""

    key: jax.Array  # the actor's token key
    env_key: jax.Array  # groups' env keys fold from it
    temperature: jax.Array
    top_k: jax.Array
    version: jax.Array
    budget: jax.Array  # int32: new episodes the segment may start (flow control)


def group_seed(env_key: jax.Array, group: jax.Array) -> jax.Array:
    """The env seed of GRPO group `group`: an int32 in [0, 2**31), drawn from the actor's
    env key, so groups get distinct tasks and the seed alone reproduces one."""
    bits = jax.random.bits(jax.random.fold_in(env_key, group), dtype=jnp.uint32)
    return (bits >> 1).astype(jnp.int32)


def _ids(layout_piece: tuple[int, ...]) -> Chars:
    return Chars(jnp.asarray(layout_piece, jnp.int32).reshape(-1), jnp.int32(len(layout_piece)))


def _obs_ids(layout: TokenLayout, obs: Chars) -> Chars:
    return Chars(jnp.asarray(layout.code_to_id)[jnp.clip(obs.codes, 0, 127)], obs.length)


def _reserve(layout: TokenLayout) -> int:
    # As the asynchronous rollout: room for closing the turn and the episode's end ids.
    return len(layout.end) + 1


def _write(rows: Rows, at: jax.Array, seq: Chars, where: jax.Array) -> Rows:
    """Forced tokens `seq` [E, S] at each row's `at` (mask 0, log-prob 0) where `where`."""
    width = seq.codes.shape[1]
    j = jnp.arange(width)[None]
    pos = jnp.where(
        where[:, None] & (j < seq.length[:, None]), at[:, None] + j, rows.tokens.shape[1]
    )
    e = jnp.arange(rows.tokens.shape[0])[:, None]
    return rows._replace(
        tokens=rows.tokens.at[e, pos].set(seq.codes, mode="drop"),
        mask=rows.mask.at[e, pos].set(0, mode="drop"),
        logprobs=rows.logprobs.at[e, pos].set(0.0, mode="drop"),
    )


def _select(cond: jax.Array, new: Any, old: Any) -> Any:
    def one(n, o):
        return jnp.where(cond.reshape(cond.shape + (1,) * (n.ndim - 1)), n, o)

    return jax.tree.map(one, new, old)


def _reset(
    rows: Rows,
    which: jax.Array,
    next_ticket: jax.Array,
    env: VecEnv,
    layout: TokenLayout,
    shape: Shape,
    s: Sampling,
) -> tuple[Rows, jax.Array]:
    """Start a new episode in every row of `which`: the next tickets, in row order."""
    rank = jnp.cumsum(which) - 1
    ticket = jnp.where(which, next_ticket + rank, rows.ticket).astype(jnp.int32)
    seed = jax.vmap(lambda t: group_seed(s.env_key, t // shape.group_size))(ticket)
    env_state, obs = jax.vmap(lambda x: env.reset(jax.random.key(x)))(seed)
    prompt = jax.vmap(
        lambda o: concat(_ids(layout.start_prefix), _obs_ids(layout, o), _ids(layout.start_suffix))
    )(obs)
    zero = jnp.zeros_like(rows.fed)
    fresh = rows._replace(
        fed=zero,
        filled=prompt.length,
        turn_start=prompt.length,
        budget=jnp.minimum(shape.tokens - prompt.length - _reserve(layout), shape.max_new),
        gen=zero,
        turns=zero,
        reward=jnp.zeros_like(rows.reward),
        ticket=ticket,
        seed=seed,
        version=jnp.full_like(rows.version, s.version),
        live=jnp.ones_like(rows.live),
        env=env_state,
    )
    rows = _select(which, fresh, rows)
    rows = _write(rows, zero, prompt, which)
    return rows, next_ticket + jnp.sum(which).astype(jnp.int32)


def start(
    model: Transformer,
    env: VecEnv,
    layout: TokenLayout,
    shape: Shape,
    s: Sampling,
    first_ticket: jax.Array | int = 0,
) -> Loop:
    """Every row idle (the first segment's `wake` starts them), tickets from `first_ticket`."""
    e, t = shape.envs, shape.tokens
    key = jax.random.key(0)  # only gives the env state its shapes; every row is reset
    env_state, _ = jax.vmap(env.reset)(jax.random.split(key, e))
    z = jnp.zeros((e,), jnp.int32)
    rows = Rows(
        jnp.zeros((e, t), jnp.int32),
        jnp.zeros((e, t), jnp.int8),
        jnp.zeros((e, t), jnp.float32),
        z,
        z,
        z,
        z,
        z,
        z,
        jnp.zeros((e,), jnp.float32),
        z,
        z,
        z,
        jnp.zeros((e,), bool),
        env_state,
    )
    first = jnp.asarray(first_ticket, jnp.int32)
    return Loop(rows, model.init_cache(e, t), first, jnp.int32(0))


def empty_finished(shape: Shape) -> Finished:
    c, t = shape.capacity, shape.tokens
    z = jnp.zeros((c,), jnp.int32)
    return Finished(
        jnp.zeros((c, t), jnp.int32),
        jnp.zeros((c, t), jnp.int8),
        jnp.zeros((c, t), jnp.float32),
        z,
        jnp.zeros((c,), jnp.float32),
        z,
        jnp.zeros((c,), bool),
        z,
        z,
        z,
        jnp.int32(0),
    )


def _emit(out: Finished, rows: Rows, which: jax.Array, truncated: jax.Array) -> Finished:
    slot = jnp.where(which, out.count + jnp.cumsum(which) - 1, out.tokens.shape[0])
    put = lambda buf, v: buf.at[slot].set(v, mode="drop")  # noqa: E731
    return Finished(
        put(out.tokens, rows.tokens),
        put(out.mask, rows.mask),
        put(out.logprobs, rows.logprobs),
        put(out.length, rows.filled),
        put(out.reward, rows.reward),
        put(out.turns, rows.turns),
        put(out.truncated, truncated),
        put(out.ticket, rows.ticket),
        put(out.seed, rows.seed),
        put(out.version, rows.version),
        out.count + jnp.sum(which).astype(jnp.int32),
    )


def _end_turns(
    loop: Loop,
    out: Finished,
    ended: jax.Array,
    stopped: jax.Array,
    env: VecEnv,
    layout: TokenLayout,
    shape: Shape,
    s: Sampling,
) -> tuple[Loop, Finished]:
    """Rows whose turn `ended`: step their env, write what follows, finish and reset."""
    r = loop.rows
    t = shape.tokens
    idx = jnp.clip(r.turn_start[:, None] + jnp.arange(shape.max_new)[None], 0, t - 1)
    codes = jnp.asarray(layout.id_to_code)[jnp.take_along_axis(r.tokens, idx, axis=1)]
    action = Chars(codes, r.gen - stopped.astype(jnp.int32))  # a stop id is not text
    env_state, obs, reward, done = jax.vmap(env.step)(r.env, action)
    turns = r.turns + ended
    close = jnp.where(stopped, 0, len(layout.close)).astype(jnp.int32)

    def tail(o: Chars, cont: jax.Array, close_n: jax.Array) -> Chars:
        reply = concat(_ids(layout.reply_prefix), _obs_ids(layout, o), _ids(layout.reply_suffix))
        end = fit(_ids(layout.end), reply.codes.shape[0])
        return concat(Chars(_ids(layout.close).codes, close_n), pick(cont, reply, end))

    reply_len = len(layout.reply_prefix) + obs.length + len(layout.reply_suffix)
    room = t - (r.filled + close) - reply_len - _reserve(layout)
    out_of_turns = ended & ~done & (turns >= shape.max_turns)
    no_room = ended & ~done & ~out_of_turns & (room < 2)
    finished = ended & (done | out_of_turns | no_room)
    cont = ended & ~finished
    seq = jax.vmap(tail)(obs, cont, close)
    rows = _write(r, r.filled, seq, ended)
    filled = jnp.where(ended, r.filled + seq.length, r.filled)
    rows = rows._replace(
        filled=filled,
        turn_start=jnp.where(cont, filled, r.turn_start),
        budget=jnp.where(cont, jnp.minimum(room, shape.max_new), r.budget),
        gen=jnp.where(cont, 0, r.gen),
        turns=turns,
        reward=r.reward + jnp.where(ended, reward, 0.0),
        env=_select(ended, env_state, r.env),
    )

    def finish(rows: Rows, out: Finished, next_ticket: jax.Array, budget: jax.Array):
        out = _emit(out, rows, finished, out_of_turns | no_room)
        # The budget, or at least the tickets that complete the open group.
        allowed = jnp.maximum(budget, (-next_ticket) % shape.group_size)
        again = finished & (jnp.cumsum(finished) <= allowed)
        rows, next_ticket = _reset(rows, again, next_ticket, env, layout, shape, s)
        rows = rows._replace(live=rows.live & ~(finished & ~again))
        return rows, out, next_ticket, jnp.maximum(budget - jnp.sum(again), 0).astype(jnp.int32)

    rows, out, next_ticket, budget = jax.lax.cond(
        jnp.any(finished), finish, lambda *a: a, rows, out, loop.next_ticket, loop.budget
    )
    return Loop(rows, loop.cache, next_ticket, budget), out


def advance(
    model: Transformer,
    loop: Loop,
    out: Finished,
    env: VecEnv,
    layout: TokenLayout,
    shape: Shape,
    s: Sampling,
) -> tuple[Loop, Finished]:
    """One step of every row (module docstring)."""
    r = loop.rows
    e = jnp.arange(shape.envs)
    x = r.tokens[e, r.fed]
    logits, cache = model.forward_with_cache(x[:, None], r.fed[:, None], loop.cache)
    fed = r.fed + r.live.astype(jnp.int32)  # an idle row's forward is discarded
    need = r.live & (fed == r.filled)
    stop_ids = jnp.asarray(layout.stop_ids, jnp.int32)
    params = RowParams(
        seed=r.ticket,
        temperature=jnp.broadcast_to(s.temperature, (shape.envs,)),
        top_k=jnp.broadcast_to(s.top_k, (shape.envs,)),
        max_new=r.budget,
        stop_ids=jnp.broadcast_to(stop_ids, (shape.envs, stop_ids.size)),
    )
    tok, lp, _, _ = draw(logits[:, 0], s.key, params, fed)
    at = jnp.where(need, r.filled, shape.tokens)
    gen = r.gen + need
    stopped = need & jnp.any(tok[:, None] == stop_ids[None], axis=-1)
    ended = need & (stopped | (gen >= r.budget))
    rows = r._replace(
        tokens=r.tokens.at[e, at].set(tok, mode="drop"),
        mask=r.mask.at[e, at].set(1, mode="drop"),
        logprobs=r.logprobs.at[e, at].set(lp, mode="drop"),
        fed=fed,
        filled=r.filled + need,
        gen=gen,
    )
    loop = loop._replace(rows=rows, cache=cache)
    return jax.lax.cond(
        jnp.any(ended),
        lambda lo, o: _end_turns(lo, o, ended, stopped, env, layout, shape, s),
        lambda lo, o: (lo, o),
        loop,
        out,
    )


def wake(loop: Loop, env: VecEnv, layout: TokenLayout, shape: Shape, s: Sampling) -> Loop:
    """A segment's first act: take its budget, and start new episodes in idle rows
    while it lasts."""
    idle = ~loop.rows.live
    which = idle & (jnp.cumsum(idle) <= s.budget)
    rows, next_ticket = _reset(loop.rows, which, loop.next_ticket, env, layout, shape, s)
    budget = jnp.maximum(s.budget - jnp.sum(which), 0).astype(jnp.int32)
    return Loop(rows, loop.cache, next_ticket, budget)


def refill(model: Transformer, loop: Loop, block: int) -> Loop:
    """Recompute every row's cached keys and values under the current weights (after a
    reload, so new tokens are conditioned on the new policy, as the async sampler does),
    `block` rows at a time (the prefill's attention is [block, heads, T, T])."""
    e, t = loop.rows.tokens.shape
    tokens = loop.rows.tokens.reshape(e // block, block, t)
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (block, t))

    def one(tok: jax.Array) -> KVCache:
        fresh = model.init_cache(block, t, loop.cache.k[0].dtype)
        _, cache = model.forward_with_cache(tok, positions, fresh, last=jnp.zeros(block, jnp.int32))
        return cache

    caches = jax.lax.map(one, tokens)
    return loop._replace(cache=jax.tree.map(lambda c: c.reshape(e, *c.shape[2:]), caches))


def block_rows(envs: int, most: int = 128) -> int:
    """The largest power of two <= `most` dividing `envs`: `refill`'s block."""
    return int(np.gcd(envs, most))
