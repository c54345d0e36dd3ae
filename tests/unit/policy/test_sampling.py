"""Tests for tunix_tasks.policy.sampling: logprob agreement, greedy == no-cache, stops, compiles."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tunix_tasks.config import ModelConfig
from tunix_tasks.policy.distribution import sampling_log_probs, token_logprobs
from tunix_tasks.policy.model import Transformer
from tunix_tasks.policy.params import flat_params, load_flat_params
from tunix_tasks.policy.sampling import Sampler
from tunix_tasks.policy.spec import LoraSpec, spec_from_preset
from tunix_tasks.policy.tokenizer import Tokenizer

TOK = Tokenizer()
CFG = ModelConfig(preset="custom", d_model=32, n_layers=2, n_heads=4, d_ff=64, max_seq_len=48)
SPEC = spec_from_preset(CFG, vocab_size=TOK.vocab_size)
LOGPROB_ATOL = 1e-4  # float32: sampler's logprobs vs token_logprobs of a full forward


def _peaky(flat: dict[str, np.ndarray], scale: float) -> dict[str, np.ndarray]:
    """Scale the output projection so logits are far from ties (greedy is well defined)."""
    return {k: v * scale if k == "unembed" else v for k, v in flat.items()}


@pytest.fixture(scope="module")
def sampler() -> Sampler:
    model = Transformer(SPEC, rngs=nnx.Rngs(0))
    s = Sampler(
        model,
        pad_id=TOK.pad_id,
        stop_ids=(TOK.end_id, TOK.eos_id),
        batch_buckets=(1, 2, 4),
        prompt_buckets=(16, 32),
    )
    s.update_params(_peaky(flat_params(model), 300.0))
    return s


@nnx.jit
def _forward(model: Transformer, tokens: jax.Array) -> jax.Array:
    t = tokens.shape[1]
    return model(tokens, jnp.broadcast_to(jnp.arange(t), tokens.shape), jnp.ones_like(tokens))


def _contexts(seed: int, lengths: list[int]) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[TOK.bos_id, *rng.integers(8, TOK.vocab_size, size=n - 1).tolist()] for n in lengths]


def _full_logprobs(model, ctx, gen, temperature, top_k) -> np.ndarray:
    seq = np.zeros((1, CFG.max_seq_len), np.int32)  # fixed width: one compile
    seq[0, : len(ctx) + len(gen)] = ctx + gen
    lp = token_logprobs(_forward(model, jnp.asarray(seq)), jnp.asarray(seq), temperature, top_k)
    return np.asarray(lp[0, len(ctx) - 1 : len(ctx) - 1 + len(gen)])


@pytest.mark.parametrize("temperature,top_k", [(1.0, 0), (0.7, 5)])
def test_logprobs_match_full_forward(sampler, temperature, top_k):
    contexts = _contexts(0, [3, 11, 7])
    out = sampler.sample(
        contexts, max_new_tokens=12, temperature=temperature, top_k=top_k, rng=jax.random.key(1)
    )
    assert [len(s.tokens) for s in out] == [len(s.logprobs) for s in out]
    for ctx, s in zip(contexts, out, strict=True):
        assert s.tokens
        ref = _full_logprobs(sampler.model, ctx, s.tokens, temperature, top_k)
        np.testing.assert_allclose(s.logprobs, ref, atol=LOGPROB_ATOL, rtol=0)


def test_greedy_equals_no_cache_decoding(sampler):
    contexts = _contexts(1, [4, 9])
    out = sampler.sample(contexts, max_new_tokens=8, top_k=1, stop_ids=(), rng=jax.random.key(0))
    for ctx, s in zip(contexts, out, strict=True):
        seq = list(ctx)
        for _ in range(8):  # no cache: full forward over the whole sequence every step
            padded = np.zeros((1, CFG.max_seq_len), np.int32)
            padded[0, : len(seq)] = seq
            seq.append(
                int(jnp.argmax(_forward(sampler.model, jnp.asarray(padded))[0, len(seq) - 1]))
            )
        assert s.tokens == seq[len(ctx) :]
        assert s.finish_reason == "length"
        np.testing.assert_allclose(s.logprobs, 0.0)  # top_k=1 is a point mass
    # A longer generation runs with a longer KV cache bucket: same greedy prefix.
    longer = sampler.sample(
        contexts, max_new_tokens=30, top_k=1, stop_ids=(), rng=jax.random.key(0)
    )
    for s, s_long in zip(out, longer, strict=True):
        assert s_long.tokens[:8] == s.tokens


def test_batching_is_invisible_to_each_row(sampler):
    contexts = _contexts(2, [5, 2, 14, 8, 3, 6])  # 6 rows > largest batch bucket (4)
    together = sampler.sample(contexts, max_new_tokens=6, top_k=1, rng=jax.random.key(0))
    for ctx, s in zip(contexts, together, strict=True):
        alone = sampler.sample([ctx], max_new_tokens=6, top_k=1, rng=jax.random.key(0))[0]
        assert alone.tokens == s.tokens


def test_stop_conditions(sampler):
    ctx = _contexts(3, [5])[0]
    out = sampler.sample([ctx], max_new_tokens=30, top_k=1, stop_ids=(), rng=jax.random.key(0))[0]
    first = out.tokens[0]
    stopped = sampler.sample(
        [ctx], max_new_tokens=30, top_k=1, stop_ids=(first, TOK.eos_id), rng=jax.random.key(0)
    )[0]
    assert stopped.tokens == [first] and stopped.finish_reason == "stop"

    assert len(out.tokens) == 30 and out.finish_reason == "length"
    near_full = _contexts(4, [CFG.max_seq_len - 3])[0]
    s = sampler.sample([near_full], max_new_tokens=10, stop_ids=(), rng=jax.random.key(0))[0]
    assert len(s.tokens) == 3 and s.finish_reason == "max_seq_len"
    full = _contexts(4, [CFG.max_seq_len])[0]
    s = sampler.sample([full], max_new_tokens=10, rng=jax.random.key(0))[0]
    assert s.tokens == [] and s.finish_reason == "max_seq_len"
    with pytest.raises(ValueError, match="max_seq_len"):
        sampler.sample([[*full, 1]], max_new_tokens=1, rng=jax.random.key(0))
    with pytest.raises(ValueError, match="temperature"):
        sampler.sample([ctx], max_new_tokens=1, temperature=0.0, rng=jax.random.key(0))


def test_compile_count_bounded_and_reload_does_not_recompile():
    model = Transformer(SPEC, rngs=nnx.Rngs(5))
    s = Sampler(
        model,
        pad_id=TOK.pad_id,
        stop_ids=(TOK.end_id, TOK.eos_id),
        batch_buckets=(2, 4),
        prompt_buckets=(16,),
    )
    rng = np.random.default_rng(0)
    for i in range(16):
        n = int(rng.integers(1, 5))
        lengths = rng.integers(1, CFG.max_seq_len - 2, size=n).tolist()
        s.sample(
            _contexts(i, lengths),
            max_new_tokens=int(rng.integers(1, 40)),
            temperature=float(rng.uniform(0.5, 1.5)),
            top_k=int(rng.integers(0, 4)),
            rng=jax.random.key(i),
        )
    # Buckets (16, 48): prefill (batch 2|4) x (chunk, window) in {(16,16), (16,48), (48,48)},
    # decode (batch 2|4) x window 16|48: at most 10 programs, whatever the requests.
    assert 1 <= s.compile_count <= 10
    traced = s._prefill._cache_size() + s._decode._cache_size()
    assert traced == s.compile_count  # traces == XLA executables
    before = s.compile_count
    ctx = _contexts(99, [6])
    old = s.sample(ctx, max_new_tokens=5, top_k=1, stop_ids=(), rng=jax.random.key(0))[0]
    for scale in (200.0, -200.0):
        s.update_params(_peaky(flat_params(model), scale))
        new = s.sample(ctx, max_new_tokens=5, top_k=1, stop_ids=(), rng=jax.random.key(0))[0]
    assert new.tokens != old.tokens  # the new weights are in use...
    assert s.compile_count == before  # ...without a recompilation


# ------------------------------------------------------------------ bfloat16 sampling
BF16 = jnp.dtype(jnp.bfloat16)


def _held_dtypes(model: Transformer) -> set:
    return {var[...].dtype for _, var in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def test_bf16_sampler_holds_bf16_params_through_updates():
    """A bfloat16 sampler holds every param (adapters too) and its KV cache in bfloat16:
    after construction, after a float32 snapshot (rounded as it loads) and after an
    adapters-only update (the base untouched); it still exports float32."""
    lora = LoraSpec(rank=4, alpha=8.0)
    trained = Transformer(SPEC, rngs=nnx.Rngs(3), lora=lora)  # the learner's float32 params
    s = Sampler(
        Transformer(SPEC, rngs=nnx.Rngs(0), compute_dtype=BF16, lora=lora),
        pad_id=TOK.pad_id,
        stop_ids=(TOK.end_id,),
        batch_buckets=(2,),
        prompt_buckets=(16,),
    )
    assert _held_dtypes(s.model) == {BF16}
    assert {c.dtype for c in (*s._cache.k, *s._cache.v)} == {BF16}
    flat = flat_params(trained)
    s.update_params(flat, version=1)
    assert _held_dtypes(s.model) == {BF16}
    held = flat_params(s.model)  # float32 again, the bf16 rounding of the snapshot
    assert {v.dtype for v in held.values()} == {np.dtype(np.float32)}
    for name, value in flat.items():
        np.testing.assert_array_equal(held[name], value.astype(BF16).astype(np.float32))
    adapters = {k: v + 0.25 for k, v in flat_params(trained, nnx.LoRAParam).items()}
    s.update_params(adapters, version=2, only=nnx.LoRAParam)
    assert _held_dtypes(s.model) == {BF16}
    after = flat_params(s.model)
    for name, value in held.items():
        if "lora_" not in name:
            np.testing.assert_array_equal(after[name], value)  # the base stays as it was
        else:
            np.testing.assert_array_equal(
                after[name], adapters[name].astype(BF16).astype(np.float32)
            )
    out = s.sample(_contexts(5, [4, 7]), max_new_tokens=5, rng=jax.random.key(0))
    assert all(np.isfinite(o.logprobs).all() and o.version == 2 for o in out)


def test_bf16_logprobs_differ_from_a_float32_learner_by_rounding_only():
    """The same tokens scored by a float32 learner (`_full_logprobs`): a float32 sampler
    agrees to float noise, a bfloat16 one by a small but nonzero gap (the tiny preset,
    logits scaled x30 so the distribution is not near-uniform). Measured: float32 max
    ~1e-6; bfloat16 mean ~3e-3, max ~1e-2."""
    tiny = spec_from_preset(ModelConfig(preset="tiny"), vocab_size=TOK.vocab_size)
    learner = Transformer(tiny, rngs=nnx.Rngs(0))
    flat = _peaky(flat_params(learner), 30.0)
    load_flat_params(learner, flat)
    contexts = _contexts(6, [3, 11, 7, 5])
    gaps = {}
    for dtype in (jnp.float32, BF16):
        s = Sampler(
            Transformer(tiny, rngs=nnx.Rngs(1), compute_dtype=dtype),
            pad_id=TOK.pad_id,
            stop_ids=(TOK.end_id,),
            max_seq_len=CFG.max_seq_len,
            batch_buckets=(4,),
            prompt_buckets=(16, 32),
        )
        s.update_params(flat)
        out = s.sample(contexts, max_new_tokens=30, stop_ids=(), rng=jax.random.key(1))
        gaps[dtype] = np.concatenate(
            [
                np.abs(np.asarray(o.logprobs) - _full_logprobs(learner, c, o.tokens, 1.0, 0))
                for c, o in zip(contexts, out, strict=True)
            ]
        )
    assert gaps[jnp.float32].max() < 1e-5
    assert 1e-4 < gaps[BF16].mean() < 0.05 and gaps[BF16].max() < 0.2


def test_top_logprobs_are_the_distributions_best_and_change_nothing_sampled(sampler):
    """A row asking for `top_logprobs` gets, per token, the most likely ids of the
    distribution it was drawn from (the learner's, over a full forward) with their
    log-probs, most likely first, filtered ids left out; the batch draws the same tokens
    as without it, and a row that did not ask gets none."""
    contexts = _contexts(3, [5, 9])
    temperature, top_k, want = 0.7, 6, 8

    def run(top: int):
        sampler.seed(jax.random.key(4))
        out = [None, None]
        for i, ctx in enumerate(contexts):
            sampler.submit(
                ctx,
                max_new_tokens=20,
                temperature=temperature,
                top_k=top_k,
                seed=i,
                top_logprobs=top if i == 0 else 0,
                on_done=lambda s, i=i: out.__setitem__(i, s),
            )
        while sampler.busy:
            sampler.step()
        return out

    plain, asked = run(0), run(want)
    assert [s.tokens for s in plain] == [s.tokens for s in asked]
    np.testing.assert_array_equal(plain[0].logprobs, asked[0].logprobs)
    assert plain[0].top_logprobs is None and asked[1].top_logprobs is None
    s, ctx = asked[0], contexts[0]
    assert len(s.top_logprobs) == len(s.tokens) > 1  # the prefill's token and decoded ones
    seq = np.zeros((1, CFG.max_seq_len), np.int32)
    seq[0, : len(ctx) + len(s.tokens)] = ctx + s.tokens
    ref = np.asarray(
        sampling_log_probs(_forward(sampler.model, jnp.asarray(seq)), temperature, top_k)
    )[0]
    for i, (token, logprob, alternatives) in enumerate(
        zip(s.tokens, s.logprobs, s.top_logprobs, strict=True)
    ):
        row = ref[len(ctx) - 1 + i]
        best = np.argsort(-row, kind="stable")[:top_k]  # top_k: only 6 ids have mass
        assert [t for t, _ in alternatives] == best.tolist()
        np.testing.assert_allclose([lp for _, lp in alternatives], row[best], rtol=1e-4, atol=1e-3)
        np.testing.assert_allclose(dict(alternatives)[token], logprob, atol=1e-6)
