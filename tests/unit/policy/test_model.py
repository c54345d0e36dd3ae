"""Tests for tunix_tasks.policy.model: packing, KV cache, logprobs, weight I/O, sharding."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from tunix_tasks.config import ModelConfig
from tunix_tasks.policy.distribution import sampling_log_probs, token_logprobs
from tunix_tasks.policy.model import Transformer
from tunix_tasks.policy.params import flat_params, load_flat_params, param_count
from tunix_tasks.policy.precision import cast_params
from tunix_tasks.policy.spec import LoraSpec, spec_from_preset

VOCAB = 103
CFG = ModelConfig(preset="custom", d_model=32, n_layers=2, n_heads=4, d_ff=64, max_seq_len=64)
SPEC = spec_from_preset(CFG, vocab_size=VOCAB)
ATOL = 1e-5  # float32: packed vs alone, cached vs full forward


def _model(seed: int = 0, dtype=jnp.float32) -> Transformer:
    return Transformer(SPEC, rngs=nnx.Rngs(seed), compute_dtype=dtype)


def _seqs(seed: int, lengths: list[int]) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(1, VOCAB, size=n).astype(np.int32) for n in lengths]


@nnx.jit
def _forward(model: Transformer, tokens, positions, segments) -> jax.Array:
    return model(tokens, positions, segments)


@nnx.jit
def _forward_cached(model: Transformer, tokens, positions, cache):
    return model.forward_with_cache(tokens, positions, cache)


def _alone(model: Transformer, seq: np.ndarray, width: int = 24) -> jax.Array:
    """Logits of one sequence in its own row, right-padded (segment 0) to a fixed width."""
    tokens, pos, seg = _pack([seq], width)
    return _forward(model, tokens, pos, seg)[0, : len(seq)]


def _pack(seqs: list[np.ndarray], width: int) -> tuple[np.ndarray, ...]:
    tokens, pos, seg = (np.zeros((1, width), np.int32) for _ in range(3))
    at = 0
    for i, s in enumerate(seqs):
        tokens[0, at : at + len(s)] = s
        pos[0, at : at + len(s)] = np.arange(len(s))
        seg[0, at : at + len(s)] = i + 1
        at += len(s)
    return tokens, pos, seg


@pytest.mark.parametrize("dtype,atol", [(jnp.float32, ATOL), (jnp.bfloat16, 5e-2)])
def test_packed_forward_equals_each_sequence_alone(dtype, atol):
    model = _model(dtype=dtype)
    seqs = _seqs(0, [5, 9, 3])
    tokens, pos, seg = _pack(seqs, width=24)  # 7 trailing padding tokens
    logits = _forward(model, tokens, pos, seg)
    assert logits.dtype == jnp.float32 and logits.shape == (1, 24, VOCAB)
    assert bool(jnp.isfinite(logits).all()), "padding rows must not produce NaN"
    at = 0
    for s in seqs:
        np.testing.assert_allclose(logits[0, at : at + len(s)], _alone(model, s), atol=atol, rtol=0)
        at += len(s)


def test_all_padding_row_is_finite():
    model = _model()
    z = jnp.zeros((2, 8), jnp.int32)
    assert bool(jnp.isfinite(model(z, z, z)).all())


def test_kv_cache_matches_full_forward_and_greedy_decoding():
    model = _model()
    prompt = _seqs(1, [6])[0]
    steps = 10
    # No cache: greedy by re-running the full forward each step.
    seq = list(prompt)
    full_logits = []
    for _ in range(steps):
        lg = _alone(model, np.asarray(seq, np.int32))[-1]
        full_logits.append(lg)
        seq.append(int(jnp.argmax(lg)))
    # Cache: prefill the prompt in two chunks (right-padded second chunk), then decode.
    cache = model.init_cache(1, CFG.max_seq_len)
    _, cache = _forward_cached(model, prompt[None, :4], jnp.arange(4)[None], cache)
    chunk = np.zeros((1, 8), np.int32)
    chunk[0, :2] = prompt[4:]
    lg, cache = _forward_cached(model, chunk, 4 + jnp.arange(8)[None], cache)
    last = lg[0, 1]
    cached_seq = list(prompt)
    for i in range(steps):
        np.testing.assert_allclose(last, full_logits[i], atol=1e-4, rtol=0)
        nxt = int(jnp.argmax(last))
        cached_seq.append(nxt)
        p = len(cached_seq) - 1
        tok, pos = np.array([[nxt]], np.int32), np.array([[p]], np.int32)
        lg, cache = _forward_cached(model, tok, pos, cache)
        last = lg[0, 0]
    assert cached_seq == seq


def test_token_logprobs_alignment_and_topk():
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(size=(2, 5, 7)), jnp.float32)
    tokens = jnp.asarray(rng.integers(0, 7, size=(2, 5)), jnp.int32)
    lp = token_logprobs(logits, tokens, temperature=0.5)
    assert lp.shape == (2, 4) and lp.dtype == jnp.float32
    ref = jax.nn.log_softmax(logits / 0.5, axis=-1)
    np.testing.assert_allclose(lp[1, 2], ref[1, 2, tokens[1, 3]], rtol=1e-6)
    topk = jnp.exp(sampling_log_probs(logits, 1.0, top_k=3))
    assert int((topk > 0).sum(-1).max()) == 3
    np.testing.assert_allclose(topk.sum(-1), 1.0, rtol=1e-5)
    # top_k=0 disables filtering, top_k >= V keeps everything.
    np.testing.assert_allclose(
        sampling_log_probs(logits, 1.0, 0), sampling_log_probs(logits, 1.0, 99)
    )


def test_flat_params_round_trip_via_safetensors(tmp_path):
    from safetensors.numpy import load_file, save_file

    a, b = _model(0), _model(1)
    flat = flat_params(a)
    assert list(flat) == sorted(flat) and "blocks/0/attn/wq" in flat
    assert all(v.dtype == np.float32 for v in flat.values())
    assert param_count(a) == sum(v.size for v in flat.values())
    save_file(flat, str(tmp_path / "w.safetensors"))
    load_flat_params(b, load_file(str(tmp_path / "w.safetensors")))
    seq = _seqs(2, [7])[0]
    np.testing.assert_array_equal(_alone(a, seq), _alone(b, seq))


def test_load_flat_params_errors_name_the_keys():
    model = _model()
    flat = flat_params(model)
    before = flat_params(model)["embed"].copy()
    bad = dict(flat)
    bad.pop("final_norm/scale")
    bad["blocks/9/extra"] = np.zeros(3, np.float32)
    bad["embed"] = np.zeros((5, 5), np.float32)
    with pytest.raises(ValueError) as err:
        load_flat_params(model, bad)
    msg = str(err.value)
    assert "missing keys ['final_norm/scale']" in msg
    assert "unexpected keys ['blocks/9/extra']" in msg
    assert "embed: expected (103, 32), got (5, 5)" in msg
    np.testing.assert_array_equal(flat_params(model)["embed"], before)  # untouched


def test_small_preset_size():
    spec = spec_from_preset(ModelConfig(preset="small"), vocab_size=VOCAB)
    model = Transformer(spec, rngs=nnx.Rngs(0))
    assert 0.9e6 < param_count(model) < 1.2e6


def test_sharded_forward_matches_single_device():
    devices = np.array(jax.devices()[:8]).reshape(2, 4)
    mesh = Mesh(devices, ("data", "fsdp"))
    ref = _model(0)
    tokens, pos, seg = (jnp.asarray(np.tile(x, (4, 1))) for x in _pack(_seqs(3, [6, 10]), 16))
    expected = ref(tokens, pos, seg)

    model = _model(0)
    state = nnx.state(model)
    specs = nnx.get_partition_spec(state)
    assert specs["blocks"][0]["attn"]["wq"].get_value() == P("fsdp", None, None)
    assert specs["embed"].get_value() == P(None, "fsdp")
    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs)
    nnx.update(model, jax.device_put(state, shardings))
    assert model.blocks[0].mlp.gate[...].sharding.spec == P("fsdp", None)
    batch = NamedSharding(mesh, P("data", None))
    args = (jax.device_put(x, batch) for x in (tokens, pos, seg))
    got = nnx.jit(lambda m, t, p, s: m(t, p, s))(model, *args)
    np.testing.assert_allclose(got, expected, atol=ATOL, rtol=0)

    # Created directly under the mesh: params are sharded eagerly, values identical.
    with jax.set_mesh(mesh):
        eager = _model(0)
    assert eager.blocks[0].attn.wq[...].sharding.spec == P("fsdp", None, None)
    for name, value in flat_params(eager).items():
        np.testing.assert_array_equal(value, flat_params(ref)[name])


def test_cast_params_keeps_shardings_and_loading_keeps_the_held_dtype():
    """`cast_params` (a bfloat16 sampler's params) keeps every param's sharding, adapters
    included; a float32 snapshot then loads rounded to bfloat16, still sharded."""
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "fsdp"))
    with jax.set_mesh(mesh):
        model = Transformer(SPEC, rngs=nnx.Rngs(0), lora=LoraSpec(rank=4, alpha=8.0))

    def held() -> dict:
        return {path: var[...] for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param))}

    shardings = {path: x.sharding for path, x in held().items()}
    assert model.blocks[0].attn.lora_q.a[...].sharding.spec == P("fsdp", None)
    cast_params(model, jnp.bfloat16)
    assert {path: x.sharding for path, x in held().items()} == shardings
    assert {x.dtype for x in held().values()} == {jnp.dtype(jnp.bfloat16)}
    snapshot = flat_params(Transformer(SPEC, rngs=nnx.Rngs(1), lora=LoraSpec(4, 8.0)))
    load_flat_params(model, snapshot)
    assert {path: x.sharding for path, x in held().items()} == shardings
    assert {x.dtype for x in held().values()} == {jnp.dtype(jnp.bfloat16)}
    name = "blocks/0/attn/lora_q/a"
    np.testing.assert_array_equal(
        flat_params(model)[name], snapshot[name].astype(jnp.bfloat16).astype(np.float32)
    )


def test_a_norm_stored_less_one_adds_the_one_in_float32():
    """Gemma's RMSNorm scales are stored as w, applied as 1 + w, which transformers adds in
    float32. A sampler holding bfloat16 params (`model.dtype`) must too: 1 + 2**-9 is 1.0
    in bfloat16, a 0.2% error in every norm of every layer."""
    from tunix_tasks.policy.model import RMSNorm

    norm = RMSNorm(4, rngs=nnx.Rngs(0), offset=1.0)
    norm.scale.set_value(jnp.full((4,), 2.0**-9, jnp.bfloat16))  # exact in bfloat16
    out = norm(jnp.ones((1, 4), jnp.float32))
    np.testing.assert_allclose(np.asarray(out), 1 + 2.0**-9, rtol=1e-6)  # rms: eps aside
