"""The learner's memory: chunked log-probs and rematerialised layers change nothing but memory.

Equality with the unchunked / non-remat computation (values and gradients), and XLA's own
memory analysis of the compiled loss + gradient at a 2,048-token row with a 32k
vocabulary: chunking keeps the temporaries far below one [rows, T, V] float32 logits tensor.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tunix_tasks.config import ModelConfig
from tunix_tasks.policy.distribution import chunked_target_logprobs, token_logprobs
from tunix_tasks.policy.model import Transformer
from tunix_tasks.policy.spec import spec_from_preset


def _inputs(seed: int, b: int, t: int, d: int, v: int):
    rng = np.random.default_rng(seed)
    hidden = jnp.asarray(rng.normal(size=(b, t, d)), jnp.float32)
    w_out = jnp.asarray(rng.normal(size=(d, v)) / np.sqrt(d) * 4, jnp.float32)
    targets = jnp.asarray(rng.integers(0, v, size=(b, t)), jnp.int32)
    return hidden, w_out, targets


def _reference(hidden, w_out, targets, temperature, top_k):
    # token_logprobs scores tokens[:, t+1] with logits[:, t]: shift the targets in by one.
    logits = jnp.einsum("btd,dv->btv", hidden, w_out)
    tokens = jnp.concatenate([targets[:, :1], targets], axis=1)
    logits = jnp.concatenate([logits, logits[:, -1:]], axis=1)
    return token_logprobs(logits, tokens, temperature, top_k)


@pytest.mark.parametrize("chunk,top_k", [(7, 0), (16, 3), (0, 0), (1000, 2)])
def test_chunked_logprobs_and_grads_equal_unchunked(chunk, top_k):
    hidden, w_out, targets = _inputs(0, 2, 37, 8, 50)  # 37: not a multiple of the chunk

    def loss(fn, h, w):
        return jnp.sum(jnp.sin(fn(h, w)))

    chunked = lambda h, w: chunked_target_logprobs(h, w, targets, 0.7, top_k, chunk=chunk)  # noqa: E731
    full = lambda h, w: _reference(h, w, targets, 0.7, top_k)  # noqa: E731
    np.testing.assert_allclose(chunked(hidden, w_out), full(hidden, w_out), atol=1e-5)
    g1 = jax.grad(lambda h, w: loss(chunked, h, w), argnums=(0, 1))(hidden, w_out)
    g2 = jax.grad(lambda h, w: loss(full, h, w), argnums=(0, 1))(hidden, w_out)
    for a, b in zip(g1, g2, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-4)


def test_remat_changes_nothing_but_memory():
    cfg = ModelConfig(preset="custom", d_model=32, n_layers=3, n_heads=4, d_ff=64, max_seq_len=64)
    model = Transformer(spec_from_preset(cfg, vocab_size=40), rngs=nnx.Rngs(0))
    rng = np.random.default_rng(1)
    tokens = jnp.asarray(rng.integers(1, 40, size=(2, 24)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(24), (2, 24))
    segments = jnp.ones_like(tokens)

    def loss(m, remat):
        return jnp.sum(m.final_hidden(tokens, positions, segments, remat=remat) ** 2)

    (l1, g1), (l2, g2) = (nnx.value_and_grad(loss)(model, r) for r in (False, True))
    np.testing.assert_allclose(l1, l2, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)


def _temp_bytes(chunk: int, rows: int, t: int, d: int, v: int) -> int:
    hidden = jax.ShapeDtypeStruct((rows, t, d), jnp.float32)
    w_out = jax.ShapeDtypeStruct((d, v), jnp.float32)
    targets = jax.ShapeDtypeStruct((rows, t), jnp.int32)

    def loss(h, w, y):
        return -jnp.mean(chunked_target_logprobs(h, w, y, 1.0, 0, chunk=chunk))

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
    stats = step.lower(hidden, w_out, targets).compile().memory_analysis()
    if stats is None:
        pytest.skip("this backend gives no memory analysis")
    return int(stats.temp_size_in_bytes)


def test_a_2048_token_row_at_32k_vocab_never_holds_full_logits():
    rows, t, d, v = 2, 2048, 64, 32768
    full_logits = rows * t * v * 4  # 537 MB of float32
    chunk_logits = rows * 128 * v * 4
    chunked = _temp_bytes(128, rows, t, d, v)
    unchunked = _temp_bytes(0, rows, t, d, v)
    assert unchunked >= full_logits  # the measure sees the [rows, T, V] tensor...
    # ...and chunking leaves the working set of one chunk (logits, log-probs, their
    # gradients): 136 MB here against 1,074 MB unchunked.
    assert chunked <= 5 * chunk_logits and chunked < full_logits / 3
