"""Layers as one `lax.scan` in the sampler's programs: the same numbers as the unrolled
loop (forward_with_cache over a stacked cache, and the whole engine: prefill, decode
segments, lane refresh and write-back, multi-turn reuse, a weight update), on the tiny
Hugging Face fixtures."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.paths import HF_FIXTURES
from tunix_tasks.policy.hf_checkpoint import HFCheckpoint
from tunix_tasks.policy.model import Transformer, stack_layers
from tunix_tasks.policy.params import flat_params
from tunix_tasks.policy.sampling import Sampler

ATOL = 2e-5  # float32, summation order only


def _load(name: str) -> Transformer:
    ckpt = HFCheckpoint(str(HF_FIXTURES / name))
    return ckpt.load_model(ckpt.spec(max_seq_len=64))


@pytest.mark.parametrize(
    "name", ["tiny-llama3", "tiny-qwen2", "tiny-qwen3", "tiny-gemma3", "tiny-mistral"]
)
def test_scanned_cache_forward_equals_unrolled(name: str) -> None:
    model = _load(name)
    layers = stack_layers(model.blocks)
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(3, model.vocab_size, (2, 8)), jnp.int32)
    starts = jnp.asarray([0, 3], jnp.int32)

    @nnx.jit(static_argnames="stacked")
    def run(model, layers, stacked: bool):
        cache = model.init_cache(2, 32, stacked=stacked)
        pos = starts[:, None] + jnp.arange(8)[None]
        kw = {"layers": layers} if stacked else {}
        first, cache = model.forward_with_cache(tokens, pos, cache, **kw)
        step, cache = model.forward_with_cache(tokens[:, :1], pos[:, -1:] + 1, cache, **kw)
        return first, step, jnp.stack(cache.k).reshape(-1), jnp.stack(cache.v).reshape(-1)

    loop, scan = run(model, layers, False), run(model, layers, True)
    for a, b in zip(loop, scan, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=ATOL, rtol=0)
    assert float(jnp.abs(loop[2]).max()) > 0  # the cache was written


def _episodes(sampler: Sampler, rng: np.random.Generator) -> list[tuple]:
    """Three rows of two turns (sessions: the second turn reuses the first's cache), the
    second turn decoding in the lanes of rows admitted earlier); tokens and log-probs."""
    vocab = sampler.model.vocab_size
    ctxs = [rng.integers(3, vocab, n).tolist() for n in (3, 6, 9)]
    out = []
    for turn in range(2):
        done: dict[int, object] = {}
        for i, ctx in enumerate(ctxs):
            sampler.submit(
                ctx,
                max_new_tokens=4 + 6 * turn,
                session=f"s{i}",
                seed=i,
                stop_ids=(),
                on_done=lambda s, i=i, done=done: done.__setitem__(i, s),
            )
        while sampler.busy:
            sampler.step()
        for i in range(len(ctxs)):
            out.append((done[i].tokens, done[i].logprobs))
            ctxs[i] = ctxs[i] + done[i].tokens + rng.integers(3, vocab, 3).tolist()
    return out


def test_scanned_sampler_equals_unrolled() -> None:
    def make(scan: bool) -> Sampler:
        return Sampler(
            _load("tiny-qwen3"),
            pad_id=0,
            stop_ids=[1],
            max_seq_len=32,
            max_sequences=4,
            batch_buckets=(4,),
            prompt_buckets=(32,),
            segment_steps=4,
            scan_layers=scan,
        )

    loop, scan = make(False), make(True)
    assert scan.compiles["decode"] == 0 and not loop.scan_layers and scan.scan_layers
    for sampler in (loop, scan):
        sampler.seed(jax.random.key(3))
    new = {k: v + 0.01 for k, v in flat_params(loop.model).items()}
    for version in range(2):  # the second round on updated weights (re-stacked)
        a, b = (
            _episodes(loop, np.random.default_rng(version)),
            _episodes(scan, np.random.default_rng(version)),
        )
        for (ta, la), (tb, lb) in zip(a, b, strict=True):
            assert ta == tb
            np.testing.assert_allclose(la, lb, atol=1e-4, rtol=0)
        loop.update_params(new, version=1)
        scan.update_params(new, version=1)
    assert scan.compiles["decode"] >= 1 and scan.compiles["prefill"] >= 1
    assert sum(scan.compiles.values()) == scan.compile_count
