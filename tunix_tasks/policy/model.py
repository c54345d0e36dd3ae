"""The policy network: one decoder-only transformer in Flax NNX for every family.

This module owns:

- `Transformer(spec)`: token embedding, pre-norm blocks (RMSNorm; causal grouped-query
  attention with RoPE, optional per-head q/k RMSNorm (Qwen3) and q/k/v bias (Qwen2);
  SwiGLU MLP), final norm, output projection (tied to the embedding or not). Gemma 3's
  options: per-layer sliding windows (static per layer in the loop, a traced value in a
  scan), its local layers' own rope, norms of each sublayer's output, scales stored less
  one, embeddings times sqrt(d_model), GeGLU. The
  `DecoderSpec` (`policy/spec.py`) says which options a family uses. Params are float32
  (a sampler holds them in its compute dtype: `policy/precision.py`); `compute_dtype`
  (float32 / bfloat16) is what matmuls run in; logits accumulate in float32.
- Packed training forward: `model(tokens, positions, segment_ids)`. Attention is causal and
  never crosses a segment; segment 0 is padding. Positions restart at 0 per segment. The
  learner's `final_hidden` can attend blockwise (`policy/attention.py`) and scan its layers.
- KV-cache decoding for the sampler: `init_cache` + `forward_with_cache` with static shapes;
  the cache holds the key/value heads only (n_kv_heads, not n_heads).
- Sharding annotations: every param carries a PartitionSpec over the mesh axis `"fsdp"` on
  its d_model dimension (None elsewhere), read with `nnx.get_partition_spec(nnx.state(m))`.

Param names follow the NNX paths (`embed`, `blocks/0/attn/wq`, ..., `unembed`), the names
snapshots store (`policy/params.py`); `policy/hf_checkpoint.py` maps Hugging Face names.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from tunix_tasks.policy.attention import ATTENTION, Window, blockwise_attention, within_window
from tunix_tasks.policy.distribution import output_logits
from tunix_tasks.policy.lora import LowRank
from tunix_tasks.policy.spec import (
    DecoderSpec,
    LoraSpec,
    rope_attention_factor,
    rope_inv_freq,
)

__all__ = ["FSDP", "KVCache", "Transformer", "merge_stacked", "split_stacked", "stack_layers"]

FSDP = "fsdp"  # mesh axis that shards the d_model dimension of every weight
# Finite (not -inf) so that a fully-masked attention row gives a uniform softmax, not NaN.
_MASK_VALUE = -1e30
#: q [B,H,T,hd], k/v [B,KV,T,hd], the layer's sliding window -> [B,H,T,hd]: the training
#: forward's attention.
Attend = Callable[[jax.Array, jax.Array, jax.Array, Window], jax.Array]
# Without remat a scanned layer keeps its weight matmuls' outputs and its attention's for
# the backward pass and recomputes the elementwise rest: residuals that cross the scan
# are materialised (a Python loop lets XLA fuse them away), and cost more than recomputing.
_KEEP = jax.checkpoint_policies.save_from_both_policies(
    jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    jax.checkpoint_policies.save_only_these_names(ATTENTION),
)


class KVCache(NamedTuple):
    """Keys/values, [batch, n_kv_heads, max_len, head_dim] per layer; slot == position.

    Either one array per layer, or (`init_cache(..., stacked=True)`, what a scan over the
    layers reads: `forward_with_cache(..., layers=...)`) a single array per side with the
    layers first, [n_layers, batch, n_kv_heads, max_len, head_dim]. Code that handles both
    indexes from the end (`x[..., slots, :, :window, :]`). Heads before slots: the
    attention matmuls read the cache in place (no per-step transpose).
    """

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]


def _param(rngs: nnx.Rngs, init, shape: tuple[int, ...], spec: tuple[str | None, ...]):
    # Shard at creation only under `jax.set_mesh(...)`; without a mesh (actors, tests) the
    # spec is kept as metadata for `nnx.get_partition_spec` and params stay unsharded.
    eager = not jax.sharding.get_abstract_mesh().empty
    value = nnx.with_partitioning(init, spec)(rngs.params(), shape, jnp.float32)
    return nnx.Param(value, eager_sharding=eager)


def _rope(
    x: jax.Array, positions: jax.Array, inv_freq: jax.Array, scale: float | jax.Array
) -> jax.Array:
    """Rotary embedding (rotate-half form) of x [B,H,T,hd] at integer positions [B,T], cos
    and sin multiplied by `scale` (yarn's attention factor; 1.0 otherwise; traced in a scan
    over layers of two kinds)."""
    half = x.shape[-1] // 2
    angle = positions.astype(jnp.float32)[..., None] * inv_freq  # [B,T,half]
    sin, cos = jnp.sin(angle)[:, None], jnp.cos(angle)[:, None]
    if not (isinstance(scale, float) and scale == 1.0):  # a plain rope traces as before
        sin, cos = sin * scale, cos * scale
    xf = x.astype(jnp.float32)
    x1, x2 = xf[..., :half], xf[..., half:]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


def _attend(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """q [B,H,T,hd], k/v [B,KV,S,hd], mask [B,T,S] bool -> [B,H,T,hd]. Softmax in float32.

    Query head h reads key/value head h // (H // KV), as Hugging Face's `repeat_kv` does.
    """
    b, h, t, hd = q.shape
    kv = k.shape[1]
    qg = q.reshape(b, kv, h // kv, t, hd)
    scores = jnp.einsum("bkgtd,bksd->bkgts", qg, k, preferred_element_type=jnp.float32)
    scores = jnp.where(mask[:, None, None], scores * hd**-0.5, _MASK_VALUE)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    return jnp.einsum("bkgts,bksd->bkgtd", probs, v).reshape(b, h, t, hd)


class RMSNorm(nnx.Module):
    """x / rms(x) * (offset + scale): Gemma stores its scales less one (`offset` 1)."""

    def __init__(self, dim: int, *, rngs: nnx.Rngs, eps: float = 1e-6, offset: float = 0.0):
        init = nnx.initializers.zeros if offset else nnx.initializers.ones  # the identity
        self.scale = _param(rngs, init, (dim,), (None,))
        self.eps = eps
        self.offset = offset

    def __call__(self, x: jax.Array) -> jax.Array:
        xf = x.astype(jnp.float32)  # statistics in float32 even under bfloat16 compute
        y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        scale = self.scale[...]
        if self.offset:  # in float32, as transformers: 1 + w in bfloat16 is off by up to 0.4%
            scale = scale.astype(jnp.float32) + self.offset
        return (y * scale).astype(x.dtype)


class Attention(nnx.Module):
    def __init__(
        self, spec: DecoderSpec, *, rngs: nnx.Rngs, dtype: jnp.dtype, lora: LoraSpec | None
    ):
        d, h, kv, hd = spec.d_model, spec.n_heads, spec.n_kv_heads, spec.head_dim
        init = nnx.initializers.variance_scaling(1.0, "fan_in", "normal", in_axis=0)
        out_init = nnx.initializers.variance_scaling(1.0, "fan_in", "normal", in_axis=(0, 1))
        self.wq = _param(rngs, init, (d, h, hd), (FSDP, None, None))
        self.wk = _param(rngs, init, (d, kv, hd), (FSDP, None, None))
        self.wv = _param(rngs, init, (d, kv, hd), (FSDP, None, None))
        self.wo = _param(rngs, out_init, (h, hd, d), (None, None, FSDP))
        zeros = nnx.initializers.zeros
        if spec.qkv_bias:
            self.bq = _param(rngs, zeros, (h, hd), (None, None))
            self.bk = _param(rngs, zeros, (kv, hd), (None, None))
            self.bv = _param(rngs, zeros, (kv, hd), (None, None))
        if spec.qk_norm:
            self.q_norm = RMSNorm(hd, rngs=rngs, eps=spec.norm_eps, offset=spec.norm_offset)
            self.k_norm = RMSNorm(hd, rngs=rngs, eps=spec.norm_eps, offset=spec.norm_offset)
        for name, n in (("q", h), ("k", kv), ("v", kv)):
            if lora is not None and name in lora.targets:
                adapter = LowRank(
                    (d, lora.rank),
                    (lora.rank, n, hd),
                    "btd,dr->btr",
                    "btr,rhk->bhtk",
                    lora.scale,
                    rngs=rngs,
                    a_spec=(FSDP, None),
                    b_spec=(None, None, None),
                )
                setattr(self, f"lora_{name}", adapter)
        if lora is not None and "o" in lora.targets:
            self.lora_o = LowRank(
                (h, hd, lora.rank),
                (lora.rank, d),
                "bhtk,hkr->btr",
                "btr,rd->btd",
                lora.scale,
                rngs=rngs,
                a_spec=(None, None, None),
                b_spec=(None, FSDP),
            )
        self.spec = spec
        self.dtype = dtype

    def _project(self, x: jax.Array, name: str) -> jax.Array:
        w = getattr(self, f"w{name}")[...].astype(self.dtype)
        d, h, hd = w.shape
        b, t, _ = x.shape
        # A 2-D matmul on the weight as stored: as an einsum to "bhtk", XLA on CPU copied
        # every projection weight into a transposed layout at each decode step.
        y = (x @ w.reshape(d, h * hd)).reshape(b, t, h, hd).transpose(0, 2, 1, 3)
        if (adapter := getattr(self, f"lora_{name}", None)) is not None:
            y = y + adapter(x, self.dtype)
        if self.spec.qkv_bias:
            y = y + getattr(self, f"b{name}")[...].astype(self.dtype)[None, :, None, :]
        return y

    def _rotation(self, window: Window) -> tuple[jax.Array, float | jax.Array]:
        """(inverse frequencies, cos/sin factor) of a layer: a sliding layer's own rope
        where the spec has one (Gemma 3's local theta), else the global rope."""
        spec = self.spec
        inv, scale = jnp.asarray(rope_inv_freq(spec)), rope_attention_factor(spec)
        if not spec.rope_local_theta or (isinstance(window, int) and window == 0):
            return inv, scale
        local = jnp.asarray(rope_inv_freq(spec, local=True))
        if isinstance(window, int):
            return local, rope_attention_factor(spec, local=True)
        sliding = window > 0  # traced: a scan over layers of both kinds
        return jnp.where(sliding, local, inv), jnp.where(sliding, 1.0, scale)

    def _qkv(self, x: jax.Array, positions: jax.Array, window: Window):
        q, k, v = self._project(x, "q"), self._project(x, "k"), self._project(x, "v")
        if self.spec.qk_norm:  # Qwen3, Gemma 3: per-head RMSNorm before the rotation
            q, k = self.q_norm(q), self.k_norm(k)
        inv_freq, scale = self._rotation(window)
        q, k = _rope(q, positions, inv_freq, scale), _rope(k, positions, inv_freq, scale)
        # Scores scaled by query_scale, not head_dim ** -0.5 (Gemma 3 27B's; in 270M and 1B
        # the two are equal, and q is left as it is).
        factor = self.spec.query_scale * self.spec.head_dim**0.5 if self.spec.query_scale else 1.0
        if abs(factor - 1.0) > 1e-12:
            q = q * jnp.asarray(factor, q.dtype)
        return q, k, v

    def _out(self, o: jax.Array) -> jax.Array:
        w = self.wo[...].astype(self.dtype)
        h, hd, d = w.shape
        b, _, t, _ = o.shape
        y = o.transpose(0, 2, 1, 3).reshape(b, t, h * hd) @ w.reshape(h * hd, d)  # see _project
        if (adapter := getattr(self, "lora_o", None)) is not None:
            y = y + adapter(o, self.dtype)
        return y

    def __call__(
        self, x: jax.Array, positions: jax.Array, attend: Attend, window: Window = 0
    ) -> jax.Array:
        o = attend(*self._qkv(x, positions, window), window)
        return self._out(checkpoint_name(o, ATTENTION))

    def cached(
        self,
        x: jax.Array,
        positions: jax.Array,
        k_cache: jax.Array,
        v_cache: jax.Array,
        layer: jax.Array | None = None,
        window: Window = 0,
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Write this chunk's k/v at slots positions[:, 0].. and attend over slots <= position
        (and, with a sliding `window`, > position - window).

        With `layer`, the caches are the stacked ones ([L, B, ...]) and this is layer
        `layer` of them: only the chunk is written (in place in a scan's carry)."""
        q, k, v = self._qkv(x, positions, window)
        start = positions[:, 0]
        if layer is None:
            write = jax.vmap(lambda c, u, s: jax.lax.dynamic_update_slice(c, u, (0, s, 0)))
            k_cache = write(k_cache, k.astype(k_cache.dtype), start)
            v_cache = write(v_cache, v.astype(v_cache.dtype), start)
            k_read, v_read = k_cache, v_cache
        else:
            write = jax.vmap(
                lambda c, u, s: jax.lax.dynamic_update_slice(c, u[None], (layer, 0, s, 0)),
                in_axes=(1, 0, 0),
                out_axes=1,
            )
            k_cache = write(k_cache, k.astype(k_cache.dtype), start)
            v_cache = write(v_cache, v.astype(v_cache.dtype), start)
            k_read = jax.lax.dynamic_index_in_dim(k_cache, layer, keepdims=False)
            v_read = jax.lax.dynamic_index_in_dim(v_cache, layer, keepdims=False)
        slots = jnp.arange(k_read.shape[2], dtype=positions.dtype)[None, None, :]
        mask = within_window(slots <= positions[:, :, None], positions[:, :, None], slots, window)
        return self._out(_attend(q, k_read, v_read, mask)), k_cache, v_cache


#: `DecoderSpec.activation` -> the gate's function (gelu_tanh: GeGLU, Gemma's).
_ACTIVATIONS = {"silu": jax.nn.silu, "gelu_tanh": partial(jax.nn.gelu, approximate=True)}


class MLP(nnx.Module):
    """Gated: down(act(gate(x)) * up(x)); act silu (SwiGLU) or tanh-approximated gelu."""

    def __init__(
        self,
        d_model: int,
        d_ff: int,
        *,
        rngs: nnx.Rngs,
        dtype: jnp.dtype,
        lora: LoraSpec | None,
        activation: str = "silu",
    ):
        init = nnx.initializers.variance_scaling(1.0, "fan_in", "normal")
        shapes = {"gate": (d_model, d_ff), "up": (d_model, d_ff), "down": (d_ff, d_model)}
        for name, (n_in, n_out) in shapes.items():
            spec = (None, FSDP) if name == "down" else (FSDP, None)
            setattr(self, name, _param(rngs, init, (n_in, n_out), spec))
            if lora is not None and name in lora.targets:
                adapter = LowRank(
                    (n_in, lora.rank),
                    (lora.rank, n_out),
                    "...i,ir->...r",
                    "...r,ro->...o",
                    lora.scale,
                    rngs=rngs,
                    a_spec=(spec[0], None),
                    b_spec=(None, spec[1]),
                )
                setattr(self, f"lora_{name}", adapter)
        self.dtype = dtype
        self.activation = activation

    def _project(self, x: jax.Array, name: str) -> jax.Array:
        y = x @ getattr(self, name)[...].astype(self.dtype)
        if (adapter := getattr(self, f"lora_{name}", None)) is not None:
            y = y + adapter(x, self.dtype)
        return y

    def __call__(self, x: jax.Array) -> jax.Array:
        h = _ACTIVATIONS[self.activation](self._project(x, "gate")) * self._project(x, "up")
        return self._project(h, "down")


class Block(nnx.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x)); with the spec's
    `sandwich_norms` (Gemma 3) each sublayer's output is normed too before it is added."""

    def __init__(
        self, spec: DecoderSpec, *, rngs: nnx.Rngs, dtype: jnp.dtype, lora: LoraSpec | None
    ):
        norm = partial(RMSNorm, spec.d_model, rngs=rngs, eps=spec.norm_eps, offset=spec.norm_offset)
        self.attn_norm = norm()
        self.attn = Attention(spec, rngs=rngs, dtype=dtype, lora=lora)
        self.mlp_norm = norm()
        self.mlp = MLP(
            spec.d_model, spec.d_ff, rngs=rngs, dtype=dtype, lora=lora, activation=spec.activation
        )
        self.sandwich = spec.sandwich_norms
        if self.sandwich:
            self.attn_out_norm, self.mlp_out_norm = norm(), norm()

    def _residual(self, x: jax.Array, a: jax.Array) -> jax.Array:
        x = x + (self.attn_out_norm(a) if self.sandwich else a)
        m = self.mlp(self.mlp_norm(x))
        return x + (self.mlp_out_norm(m) if self.sandwich else m)

    def __call__(
        self, x: jax.Array, positions: jax.Array, attend: Attend, window: Window = 0
    ) -> jax.Array:
        return self._residual(x, self.attn(self.attn_norm(x), positions, attend, window))

    def cached(self, x, positions, k_cache, v_cache, layer=None, window: Window = 0):
        a, k_cache, v_cache = self.attn.cached(
            self.attn_norm(x), positions, k_cache, v_cache, layer, window
        )
        return self._residual(x, a), k_cache, v_cache


def packed_attend(segment_ids: jax.Array, block: int = 0) -> Attend:
    """The training forward's attention over packed rows [B,T]: a query attends to
    earlier-or-same indices of the same non-zero segment. Rows longer than `block` use
    `blockwise_attention` in tiles of `block`; others (all rows with `block` 0) the dense
    `_attend` (a [B,T,T] mask and float32 scores), which one tile would equal."""
    if 0 < block < segment_ids.shape[1]:
        return partial(blockwise_attention, segment_ids=segment_ids, block=block)
    idx = jnp.arange(segment_ids.shape[1])
    causal = idx[None, :] <= idx[:, None]  # [T(query), T(key)]
    same = segment_ids[:, :, None] == segment_ids[:, None, :]
    mask = causal[None] & same & (segment_ids != 0)[:, :, None]

    def attend(q: jax.Array, k: jax.Array, v: jax.Array, window: Window = 0) -> jax.Array:
        # In one segment indices and positions advance together: index distance is position's.
        return _attend(q, k, v, within_window(mask, idx[None, :, None], idx[None, None, :], window))

    return attend


def _split_blocks(blocks: nnx.List) -> tuple[nnx.GraphDef, list[nnx.State]]:
    """The blocks' shared graphdef and each block's state (one body runs every layer).

    Split inside the traced step: the params keep their per-layer names and layout
    (snapshots, LoRA, FSDP), and gradients flow back to each layer's own.
    """
    splits = [nnx.split(block) for block in blocks]
    graphdef = splits[0][0]
    if any(g != graphdef for g, _ in splits[1:]):
        raise ValueError("the decoder blocks differ in structure: one body cannot run them")
    return graphdef, [state for _, state in splits]


def stack_layers(blocks: nnx.List) -> nnx.State:
    """One block's state with every leaf stacked over the layers ([L, ...]): what a scan
    over the layers reads (`final_hidden(scan_layers=True)` stacks inside its step; a
    sampler holds it stacked: `Transformer.forward_with_cache(..., layers=...)`)."""
    _, states = _split_blocks(blocks)
    return jax.tree.map(lambda *xs: jnp.stack(xs), *states)


def split_stacked(model: Transformer) -> tuple[nnx.GraphDef, nnx.State, nnx.State]:
    """(graphdef, every param outside the blocks, the blocks stacked): a scanning
    sampler's state, which holds no per-layer copy (`merge_stacked` rebuilds the model)."""
    graphdef, _, rest = nnx.split(model, nnx.PathContains("blocks"), ...)
    return graphdef, rest, stack_layers(model.blocks)


def merge_stacked(graphdef: nnx.GraphDef, rest: nnx.State, layers: nnx.State) -> Transformer:
    """`split_stacked`'s model, inside a traced program: its blocks are slices of `layers`
    that `forward_with_cache(..., layers=layers)` never reads (XLA drops them)."""
    n = jax.tree.leaves(layers)[0].shape[0]
    flat = layers.flat_state()
    views = [
        (("blocks", i, *p), jax.tree.map(lambda x, i=i: x[i], v)) for i in range(n) for p, v in flat
    ]
    return nnx.merge(graphdef, nnx.State.from_flat_path(views), rest)


class Transformer(nnx.Module):
    """Decoder-only LM. Params float32 (sharding-annotated); logits float32."""

    def __init__(
        self,
        spec: DecoderSpec,
        *,
        rngs: nnx.Rngs,
        compute_dtype: jnp.dtype = jnp.float32,
        lora: LoraSpec | None = None,
    ):
        self.spec = spec
        self.lora = lora
        self.vocab_size = spec.vocab_size
        self.compute_dtype = jnp.dtype(compute_dtype)
        d, v = spec.d_model, spec.vocab_size
        self.embed = _param(rngs, nnx.initializers.normal(1.0), (v, d), (None, FSDP))
        self.blocks = nnx.List(
            [
                Block(spec, rngs=rngs, dtype=self.compute_dtype, lora=lora)
                for _ in range(spec.n_layers)
            ]
        )
        self.final_norm = RMSNorm(d, rngs=rngs, eps=spec.norm_eps, offset=spec.norm_offset)
        if not spec.tie_embeddings:
            # Small init keeps the initial policy close to uniform (sane early exploration).
            init = nnx.initializers.normal(0.02 / d**0.5)
            self.unembed = _param(rngs, init, (d, v), (FSDP, None))

    @property
    def max_seq_len(self) -> int:
        return self.spec.max_seq_len

    def _embed(self, tokens: jax.Array) -> jax.Array:
        x = jnp.take(self.embed[...], tokens, axis=0).astype(self.compute_dtype)
        if self.spec.embed_scale:  # Gemma: sqrt(d_model), rounded to the compute dtype
            x = x * jnp.asarray(self.spec.d_model**0.5, self.compute_dtype)
        return x

    def _windows(self) -> tuple[int, ...]:
        return tuple(self.spec.window(i) for i in range(self.spec.n_layers))

    def output_matrix(self) -> jax.Array:
        """[d_model, V] in the compute dtype: the unembedding (the embedding's transpose
        when tied). Logits = final_hidden @ output_matrix, accumulated in float32."""
        if self.spec.tie_embeddings:
            return self.embed[...].astype(self.compute_dtype).T
        return self.unembed[...].astype(self.compute_dtype)

    def _logits(self, x: jax.Array) -> jax.Array:
        return output_logits(self.final_norm(x), self.output_matrix())

    def final_hidden(
        self,
        tokens: jax.Array,
        positions: jax.Array,
        segment_ids: jax.Array,
        *,
        remat: bool = False,
        attention_block: int = 0,
        scan_layers: bool = False,
    ) -> jax.Array:
        """The packed training forward up to the final norm: [B,T,d_model].

        A query attends to earlier-or-same indices of the same non-zero segment; padding
        (segment 0) attends nothing (finite, meaningless output). `attention_block`:
        `packed_attend`'s. With `remat`, each layer is rematerialised in the backward pass
        (activations of one layer at a time). `scan_layers`: one `lax.scan` over the
        stacked layer states, so the program holds one layer body whatever the depth.
        """
        attend = packed_attend(segment_ids, attention_block)
        graphdef, states = _split_blocks(self.blocks)

        def layer(x: jax.Array, state: nnx.State, window: Window) -> jax.Array:
            return nnx.merge(graphdef, state)(x, positions, attend, window)

        x = self._embed(tokens)
        if scan_layers:
            body = jax.checkpoint(layer, policy=None if remat else _KEEP)
            stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *states)  # = stack_layers
            windows = jnp.asarray(self._windows(), jnp.int32)
            x, _ = jax.lax.scan(lambda x, sw: (body(x, *sw), None), x, (stacked, windows))
        else:
            # A layer's window is static here: it picks the layer's program, traced apart.
            body = jax.checkpoint(layer, static_argnums=(2,)) if remat else layer
            for state, window in zip(states, self._windows(), strict=True):
                x = body(x, state, window)
        return self.final_norm(x)

    def __call__(
        self, tokens: jax.Array, positions: jax.Array, segment_ids: jax.Array
    ) -> jax.Array:
        """tokens/positions/segment_ids [B,T] int32 -> logits [B,T,V] float32."""
        return output_logits(
            self.final_hidden(tokens, positions, segment_ids), self.output_matrix()
        )

    def init_cache(
        self, batch: int, max_len: int, dtype: jnp.dtype | None = None, *, stacked: bool = False
    ) -> KVCache:
        """An empty cache of static shape; `max_len` bounds the positions that can be written.
        `stacked`: one [L, ...] array per side, for `forward_with_cache(..., layers=...)`."""
        shape = (batch, self.spec.n_kv_heads, max_len, self.spec.head_dim)
        dt = dtype or self.compute_dtype
        if stacked:
            shape = (len(self.blocks), *shape)
            return KVCache(k=(jnp.zeros(shape, dt),), v=(jnp.zeros(shape, dt),))
        zeros = tuple(jnp.zeros(shape, dt) for _ in self.blocks)
        return KVCache(k=zeros, v=tuple(jnp.zeros(shape, dt) for _ in self.blocks))

    def forward_with_cache(
        self,
        tokens: jax.Array,
        positions: jax.Array,
        cache: KVCache,
        last: jax.Array | None = None,
        *,
        layers: nnx.State | None = None,
    ) -> tuple[jax.Array, KVCache]:
        """Process a chunk tokens [B,C] at positions [B,C]; return (logits, cache).

        Each row's positions must be contiguous (`positions[b] = start_b + arange(C)`), and
        slots < start_b must already hold that row's earlier tokens. Prefill = a chunk of new
        tokens at each row's start; decode = C=1 at each row's own length. With right
        padding, the pad tokens' k/v land in slots beyond the row's length, which causality
        hides until a real token overwrites them. Positions must stay < the cache length.

        Logits are [B,C,V]; with `last` ([B] chunk indices) only row b's logits at
        `last[b]` are computed, [B,1,V]: a prefill never materialises [B,C,V].

        `layers`: the blocks' params stacked (`stack_layers`) and a stacked cache
        (`init_cache(stacked=True)`): the layers run as one `lax.scan` (the program holds
        one layer body, so it compiles in a time independent of depth), the same numbers.
        """
        x = self._embed(tokens)
        if layers is not None:
            graphdef = nnx.graphdef(self.blocks[0])

            def body(x, layer):
                state, k, v, window = layer
                x, k, v = nnx.merge(graphdef, state).cached(x, positions, k, v, window=window)
                return x, (k, v)

            windows = jnp.asarray(self._windows(), jnp.int32)
            x, (k, v) = jax.lax.scan(body, x, (layers, *cache.k, *cache.v, windows))
            cache = KVCache(k=(k,), v=(v,))
        else:
            ks, vs = [], []
            blocks = zip(self.blocks, cache.k, cache.v, self._windows(), strict=True)
            for block, kc, vc, window in blocks:
                x, kc, vc = block.cached(x, positions, kc, vc, window=window)
                ks.append(kc)
                vs.append(vc)
            cache = KVCache(k=tuple(ks), v=tuple(vs))
        if last is not None:
            x = jnp.take_along_axis(x, last[:, None, None], axis=1)
        return self._logits(x), cache
