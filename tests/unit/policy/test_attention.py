"""The learner's training forward at depth and length: blockwise attention and scanned layers.

Blockwise (flash-style) attention equals the dense one on packed rows (values and
gradients), and XLA's memory analysis of a 2 x 2,048-token loss + gradient shows it never
holds [T, T] scores. Scanned layers equal the Python loop (values and gradients, with and
without remat, with LoRA, in the sharded Trainer) and put one layer body in the program
whatever the depth.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tunix_tasks.config import ModelConfig, config_from_dict
from tunix_tasks.episode import Episode
from tunix_tasks.learner.packing import pack
from tunix_tasks.learner.train_step import Trainer
from tunix_tasks.policy.attention import blockwise_attention
from tunix_tasks.policy.model import Transformer, packed_attend
from tunix_tasks.policy.spec import LoraSpec, spec_from_preset


def _segments(rng, rows: int, t: int) -> np.ndarray:
    """Packed rows: contiguous segments 1..k of random lengths, the last 3 positions padding."""
    out = np.zeros((rows, t), np.int32)
    for r in range(rows):
        start, seg = 0, 1
        while start < t - 3:
            n = int(rng.integers(1, t // 3))
            out[r, start : min(start + n, t - 3)] = seg
            start, seg = start + n, seg + 1
    return out


@pytest.mark.parametrize("block,window", [(8, 0), (64, 0), (8, 5), (4, 9)])
def test_blockwise_equals_dense_values_and_gradients(block, window):
    """Windows 5 and 9: a sliding layer's (Gemma 3), keys up to 4 or 8 positions back:
    tiles wholly outside it are skipped (9 over tiles of 4: two behind). The dense mask
    is checked against transformers in test_hf_models.py (tiny-gemma3)."""
    rng = np.random.default_rng(block)
    b, h, kv, t, hd = 3, 6, 2, 37, 8  # GQA (3 query heads per kv head); 37: not a multiple
    q, k, v = (jnp.asarray(rng.normal(size=(b, n, t, hd)), jnp.float32) for n in (h, kv, kv))
    segments = jnp.asarray(_segments(rng, b, t))
    assert (segments.max(axis=1) >= 3).all()
    real = (segments != 0)[:, None, :, None]
    weights = jnp.asarray(rng.normal(size=(b, h, t, hd)), jnp.float32)
    dense = partial(packed_attend(segments), window=window)
    blockwise = partial(blockwise_attention, window=window, segment_ids=segments, block=block)

    def loss(attend, q, k, v):  # padding queries' outputs are meaningless: left out
        return jnp.sum(jnp.where(real, attend(q, k, v) * weights, 0.0))

    out = blockwise(q, k, v)
    np.testing.assert_allclose(jnp.where(real, out, 0.0), jnp.where(real, dense(q, k, v), 0.0), atol=1e-5)  # fmt: skip
    assert not np.asarray(jnp.where(real, 0.0, out)).any()  # padding queries give 0
    g_dense = jax.grad(lambda *a: loss(dense, *a), argnums=(0, 1, 2))(q, k, v)
    g_block = jax.jit(jax.grad(lambda *a: loss(blockwise, *a), argnums=(0, 1, 2)))(q, k, v)
    for a, b_ in zip(g_dense, g_block, strict=True):
        np.testing.assert_allclose(a, b_, atol=1e-5)


#: Gemma 3's options on a preset: sliding layers (window 5, their own rope theta) between
#: a global one, sandwich norms stored less one, scaled embeddings, GeGLU, q/k norms.
GEMMA_LIKE = {
    "layer_windows": (5, 0, 5),
    "rope_local_theta": 10_000.0,
    "rope_theta": 1e6,
    "sandwich_norms": True,
    "norm_offset": 1.0,
    "embed_scale": True,
    "activation": "gelu_tanh",
    "query_scale": 0.3,
    "qk_norm": True,
}


def _model(n_layers: int, lora: bool = False, t: int = 32, **spec_changes) -> Transformer:
    cfg = ModelConfig(
        preset="custom", d_model=32, n_layers=n_layers, n_heads=4, d_ff=64, max_seq_len=t
    )
    spec = dataclasses.replace(spec_from_preset(cfg, vocab_size=40), **spec_changes)
    model = Transformer(spec, rngs=nnx.Rngs(0), lora=LoraSpec(rank=4, alpha=8.0) if lora else None)
    rng = np.random.default_rng(1)
    for _, var in nnx.to_flat_state(nnx.state(model, nnx.LoRAParam)):  # adapters that act
        var.set_value(jnp.asarray(rng.normal(size=var.shape) * 0.3, jnp.float32))
    return model


def _rows(t: int = 32):
    rng = np.random.default_rng(2)
    segments = _segments(rng, 2, t)
    tokens = jnp.asarray(rng.integers(1, 40, size=(2, t)) * (segments != 0), jnp.int32)
    return tokens, jnp.asarray(np.tile(np.arange(t), (2, 1))), jnp.asarray(segments)


@pytest.mark.parametrize(
    "lora,remat,spec_changes", [(False, False, {}), (True, True, {}), (True, True, GEMMA_LIKE)]
)
def test_scanned_layers_equal_the_loop(lora, remat, spec_changes):
    """Loop and scan, dense and blockwise: the same loss and gradients; with Gemma's
    options each layer's window is static in the loop, traced in the scan."""
    model = _model(3, lora, **spec_changes)
    tokens, positions, segments = _rows()
    trained = nnx.LoRAParam if lora else nnx.Param

    def loss(m, scan, block):
        h = m.final_hidden(
            tokens, positions, segments, remat=remat, attention_block=block, scan_layers=scan
        )
        return jnp.sum(jnp.where(segments[..., None] != 0, jnp.sin(h), 0.0))

    @nnx.jit  # one program for the four variants: one compilation
    def variants(m):
        grad = nnx.value_and_grad(loss, argnums=nnx.DiffState(0, trained))
        # dense, then blockwise attention (rows of 32 in tiles of 8): loop, then scan
        return [[grad(m, scan, block) for scan in (False, True)] for block in (0, 8)]

    for (l1, g1), (l2, g2) in variants(model):
        np.testing.assert_allclose(l1, l2, rtol=1e-5)
        flat1, flat2 = nnx.to_flat_state(g1), nnx.to_flat_state(g2)
        assert [p for p, _ in flat1] == [p for p, _ in flat2]  # per-layer names kept
        assert all("lora_" in "/".join(map(str, p)) for p, _ in flat1) == lora
        # float32 rounding of sums whose terms are as large as the largest gradient entry
        # (~100 with these adapters), added in another order by the loop and the scan (and
        # by XLA's code generation level): a few ulps of it. 1e-5 absolute held at -O2 by
        # chance and failed at -O0 (3e-5 where the largest entry is 104).
        scale = max(1.0, *(float(np.abs(b[...]).max()) for _, b in flat2))
        for (_, a), (_, b) in zip(flat1, flat2, strict=True):
            np.testing.assert_allclose(a[...], b[...], atol=1e-6 * scale)


def _dots(n_layers: int, scan: bool) -> int:
    """dot_general ops in the lowered loss + gradient of an n-layer model."""
    graph, state = nnx.split(_model(n_layers))
    tokens, positions, segments = _rows()

    def loss(state):
        m = nnx.merge(graph, state)
        return jnp.sum(m.final_hidden(tokens, positions, segments, scan_layers=scan))

    return jax.jit(jax.grad(loss)).lower(state).as_text().count("dot_general")


def test_scanned_program_holds_one_layer_whatever_the_depth():
    assert _dots(8, scan=True) == _dots(2, scan=True)
    assert _dots(8, scan=False) > 3 * _dots(2, scan=False)  # the loop: a copy per layer


def _temp_bytes(block: int, rows: int, t: int) -> int:
    cfg = ModelConfig(preset="custom", d_model=64, n_layers=2, n_heads=4, d_ff=128, max_seq_len=t)
    graph, state = nnx.split(Transformer(spec_from_preset(cfg, vocab_size=64), rngs=nnx.Rngs(0)))
    ints = jax.ShapeDtypeStruct((rows, t), jnp.int32)

    def loss(state, tokens, positions, segments):
        m = nnx.merge(graph, state)
        return jnp.sum(m.final_hidden(tokens, positions, segments, attention_block=block) ** 2)

    compiled = jax.jit(jax.value_and_grad(loss)).lower(state, ints, ints, ints).compile()
    stats = compiled.memory_analysis()
    if stats is None:
        pytest.skip("this backend gives no memory analysis")
    return int(stats.temp_size_in_bytes)


def test_blockwise_attention_never_holds_t_by_t_scores():
    rows, t, heads = 2, 2048, 4
    scores = rows * heads * t * t * 4  # one layer's float32 [rows, H, T, T]: 134 MB
    dense, blockwise = _temp_bytes(0, rows, t), _temp_bytes(128, rows, t)
    assert dense >= 2 * scores  # the measure sees both layers' scores kept for backward...
    # ...blockwise keeps O(T x head_dim) per layer: 58 MB here against 855 MB dense.
    assert blockwise < scores and dense > 8 * blockwise


def _trainer(**learner) -> Trainer:
    model = {"preset": "custom", "d_model": 32, "n_layers": 2, "n_heads": 4, "d_ff": 64}
    cfg = config_from_dict(
        {
            "model": {**model, "max_seq_len": 256, "lora_rank": 4},
            "learner": {"buckets": [32], "batch_rows": 8, **learner},
        }
    )
    return Trainer(cfg, _model(2, lora=True, t=256))


def test_trainer_scanned_blockwise_sharded_equals_loop_dense():
    """learner.scan_layers / attention_block / remat reach the LoRA train step, on an FSDP
    mesh, and change nothing but how it runs."""
    rng = np.random.default_rng(3)
    episodes = []
    for i in range(40):
        n = int(rng.integers(4, 20))
        mask = (np.arange(n) >= n // 2).astype(np.int8)
        tokens = rng.integers(1, 40, n).astype(np.int32)
        episodes.append(Episode(f"e{i}", tokens, mask, np.full(n, -3.7, np.float32), advantage=float(rng.normal())))  # fmt: skip
    batch = pack(episodes, buckets=(32,), batch_rows=8).batches[0]
    plain = _trainer(attention_block=0)
    fast = _trainer(attention_block=8, scan_layers=True, remat=True, mesh={"data": 4, "fsdp": 2})
    m1, m2 = plain.step(batch), fast.step(batch)
    np.testing.assert_allclose(m1["loss"], m2["loss"], rtol=1e-5)
    p1, p2 = plain.flat_params(), fast.flat_params()
    assert p1.keys() == p2.keys() and all("lora_" in k for k in p1)
    for key in p1:
        np.testing.assert_allclose(p1[key], p2[key], atol=1e-6)
