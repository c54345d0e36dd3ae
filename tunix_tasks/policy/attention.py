"""Memory-efficient attention for the packed training forward (flash-style, in pure JAX).

This module owns `blockwise_attention`: the learner's attention over packed rows (causal,
never across a segment, segment 0 = padding) computed a [block, block] tile at a time with
an online softmax, forward and backward, so neither pass holds [.., T, T] scores: the
working set is one tile per (batch, head) plus O(T x head_dim) per layer kept for the
backward pass (q, k, v, the output and its log-sum-exp). Tiles no query of the block
needs are never computed: a query block reads the key blocks from the earliest start of
its queries' segments (over the batch) to its own, a key block is read by the query
blocks from its own to the latest end of its keys' segments. Loop bounds are traced
values, so shapes stay static. The sampler's KV-cache path keeps `model._attend`.

A layer with a sliding `window` (Gemma 3's local layers) also drops the keys a window or
more behind its query (`within_window`, shared with the model's other attention paths):
tiles wholly outside the window are skipped too, the others masked further.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

__all__ = ["ATTENTION", "Window", "blockwise_attention", "within_window"]

#: `checkpoint_name` of what a layer's attention keeps for its backward pass.
ATTENTION = "attention"

#: A layer's sliding window: an int where the layer is known when tracing, an int32
#: scalar inside a scan over layers; 0 is full (causal) attention.
Window = int | jax.Array


def within_window(mask: jax.Array, q_pos: jax.Array, k_pos: jax.Array, window: Window) -> jax.Array:
    """`mask` where the key is less than `window` positions behind the query (transformers'
    sliding-window overlay: key > query - window); `window` 0 leaves it as it is."""
    if isinstance(window, int):
        return mask if window == 0 else mask & (q_pos - k_pos < window)
    return mask & ((window == 0) | (q_pos - k_pos < window))


def _tile(x: jax.Array, i: jax.Array, block: int, axis: int) -> jax.Array:
    return jax.lax.dynamic_slice_in_dim(x, i * block, block, axis=axis)


def _block_bounds(segment_ids: jax.Array, block: int) -> tuple[jax.Array, jax.Array]:
    """Per block of indices: the first key block its queries read and the last query
    block that reads its keys, over the whole batch ([n] int32 each). Each segment must be
    one contiguous run of its row, as packing lays them out."""
    t = segment_ids.shape[1]
    idx = jnp.arange(t)
    new = jnp.concatenate(
        [jnp.ones_like(segment_ids[:, :1], bool), segment_ids[:, 1:] != segment_ids[:, :-1]], 1
    )
    last = jnp.concatenate(
        [segment_ids[:, 1:] != segment_ids[:, :-1], jnp.ones_like(segment_ids[:, :1], bool)], 1
    )
    start = jax.lax.cummax(jnp.where(new, idx, 0), axis=1)
    end = jax.lax.cummin(jnp.where(last, idx, t - 1), axis=1, reverse=True)
    pad = segment_ids == 0  # attends nothing, attended by nothing: bounded by itself
    start, end = jnp.where(pad, idx, start), jnp.where(pad, idx, end)
    first = jnp.min(start.reshape(-1, t // block, block), axis=(0, 2)) // block
    final = jnp.max(end.reshape(-1, t // block, block), axis=(0, 2)) // block
    return first.astype(jnp.int32), final.astype(jnp.int32)


def _tile_mask(
    seg: jax.Array, window: jax.Array, i: jax.Array, j: jax.Array, block: int
) -> jax.Array:
    """[B, 1, 1, block(q), block(k)]: causal, same segment, query not padding, within the
    window (a segment's indices advance with its positions)."""
    sq, sk = _tile(seg, i, block, 1), _tile(seg, j, block, 1)
    q_idx = i * block + jnp.arange(block)[:, None]
    k_idx = j * block + jnp.arange(block)[None, :]
    causal = within_window(q_idx >= k_idx, q_idx, k_idx, window)
    mask = causal[None] & (sq[:, :, None] == sk[:, None, :]) & (sq != 0)[:, :, None]
    return mask[:, None, None]


def _scores(q_tile: jax.Array, k_tile: jax.Array) -> jax.Array:
    scale = q_tile.shape[-1] ** -0.5
    s = jnp.einsum("bkgqd,bksd->bkgqs", q_tile, k_tile, preferred_element_type=jnp.float32)
    return s * scale


def _forward(q, k, v, seg, window, block):
    """q [B,KV,G,T,hd] (T a multiple of block) -> (out [B,KV,G,T,hd], lse [B,KV,G,T])."""
    first, _ = _block_bounds(seg, block)

    def query_block(i):
        q_i = _tile(q, i, block, 3)

        def step(j, carry):
            m, total, acc = carry
            mask = _tile_mask(seg, window, i, j, block)
            s = jnp.where(mask, _scores(q_i, _tile(k, j, block, 2)), -jnp.inf)
            m_new = jnp.maximum(m, jnp.max(s, axis=-1))
            m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)  # no valid key yet
            p = jnp.exp(s - m_safe[..., None])  # exactly 0 where masked
            rescale = jnp.exp(m - m_safe)
            pv = jnp.einsum(
                "bkgqs,bksd->bkgqd",
                p.astype(v.dtype),
                _tile(v, j, block, 2),
                preferred_element_type=jnp.float32,
            )
            return m_new, total * rescale + p.sum(-1), acc * rescale[..., None] + pv

        init = (
            jnp.full(q_i.shape[:-1], -jnp.inf, jnp.float32),
            jnp.zeros(q_i.shape[:-1], jnp.float32),
            jnp.zeros(q_i.shape, jnp.float32),
        )
        # A sliding window's queries read no key block wholly behind it either.
        behind = jnp.maximum(first[i], (i * block - window + 1) // block)
        start = jnp.where(window > 0, behind, first[i])
        m, total, acc = jax.lax.fori_loop(start, i + 1, step, init)
        seen = total > 0  # padding queries see no key: output 0
        out = jnp.where(seen[..., None], acc / jnp.where(seen, total, 1.0)[..., None], 0.0)
        return out.astype(q.dtype), jnp.where(seen, m + jnp.log(jnp.where(seen, total, 1.0)), 0.0)

    n = q.shape[3] // block
    out, lse = jax.lax.map(query_block, jnp.arange(n))  # [n, B,KV,G,block,(hd)]
    return jnp.moveaxis(out, 0, 3).reshape(q.shape), jnp.moveaxis(lse, 0, 3).reshape(q.shape[:4])


def _backward(q, k, v, seg, window, out, lse, d_out, block):
    """Gradients wrt q, k, v: key block by key block, each over the query blocks that
    read it; dq accumulates in float32 across key blocks."""
    _, final = _block_bounds(seg, block)
    delta = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)
    scale = q.shape[-1] ** -0.5

    def key_block(dq, j):
        k_j, v_j = _tile(k, j, block, 2), _tile(v, j, block, 2)

        def step(i, carry):
            dk, dv, dq = carry
            q_i, do_i = _tile(q, i, block, 3), _tile(d_out, i, block, 3)
            lse_i, delta_i = _tile(lse, i, block, 3), _tile(delta, i, block, 3)
            mask = _tile_mask(seg, window, i, j, block)
            p = jnp.where(mask, jnp.exp(_scores(q_i, k_j) - lse_i[..., None]), 0.0)
            f32 = partial(jnp.einsum, preferred_element_type=jnp.float32)
            dv = dv + f32("bkgqs,bkgqd->bksd", p.astype(do_i.dtype), do_i)
            dp = f32("bkgqd,bksd->bkgqs", do_i, v_j)
            ds = (p * (dp - delta_i[..., None]) * scale).astype(q.dtype)
            dk = dk + f32("bkgqs,bkgqd->bksd", ds, q_i)
            dq_i = _tile(dq, i, block, 3) + f32("bkgqs,bksd->bkgqd", ds, k_j)
            return dk, dv, jax.lax.dynamic_update_slice_in_dim(dq, dq_i, i * block, axis=3)

        zeros = jnp.zeros(k_j.shape, jnp.float32)
        # ... nor is a key block read by a query block wholly past its window.
        ahead = jnp.minimum(final[j], ((j + 1) * block + window - 2) // block)
        stop = jnp.where(window > 0, ahead, final[j]) + 1
        dk, dv, dq = jax.lax.fori_loop(j, stop, step, (zeros, zeros, dq))
        return dq, (dk, dv)

    n = k.shape[2] // block
    dq, (dk, dv) = jax.lax.scan(key_block, jnp.zeros(q.shape, jnp.float32), jnp.arange(n))
    dk, dv = (jnp.moveaxis(x, 0, 2).reshape(k.shape) for x in (dk, dv))
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


@partial(jax.custom_vjp, nondiff_argnums=(7,))
def _with_grads(q, k, v, seg, window, out, lse, block):
    """`out` (computed without gradients) given the attention's gradients wrt q, k, v.

    The forward runs outside this rule so that a checkpoint policy can keep its results
    (`ATTENTION`): a custom_vjp's own residuals would be recomputed under `jax.checkpoint`.
    """
    return out


def _with_grads_fwd(q, k, v, seg, window, out, lse, block):
    return out, (q, k, v, seg, window, out, lse)


def _with_grads_bwd(block, residuals, d_out):
    return (*_backward(*residuals, d_out, block), None, None, None, None)


_with_grads.defvjp(_with_grads_fwd, _with_grads_bwd)


def blockwise_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    window: Window = 0,
    *,
    segment_ids: jax.Array,
    block: int,
) -> jax.Array:
    """q [B,H,T,hd], k/v [B,KV,T,hd], segment_ids [B,T] int -> [B,H,T,hd].

    Query i attends key j <= i (and i - j < window, unless window is 0) of the same
    non-zero segment; query head h reads key/value
    head h // (H // KV). Softmax in float32; a padding query (segment 0) gives 0. Each
    segment is one contiguous run of its row. T need not be a multiple of `block`: the rows
    are padded with segment 0 and cut back.
    """
    b, h, t, hd = q.shape
    kv = k.shape[1]
    block = min(block, t)
    pad = -t % block
    qg = q.reshape(b, kv, h // kv, t, hd)
    if pad:
        qg = jnp.pad(qg, [(0, 0)] * 3 + [(0, pad), (0, 0)])
        k, v = (jnp.pad(x, [(0, 0), (0, 0), (0, pad), (0, 0)]) for x in (k, v))
        segment_ids = jnp.pad(segment_ids, [(0, 0), (0, pad)])
    window = jnp.asarray(window, jnp.int32)  # traced: one program for every layer
    out, lse = _forward(*map(jax.lax.stop_gradient, (qg, k, v)), segment_ids, window, block)
    out, lse = checkpoint_name(out, ATTENTION), checkpoint_name(lse, ATTENTION)
    out = _with_grads(qg, k, v, segment_ids, window, out, lse, block)
    return out[:, :, :, :t].reshape(b, h, t, hd)
