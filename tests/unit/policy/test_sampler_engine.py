"""The sampler as an engine: multi-turn prefix reuse, continuous batching, reloads in flight.

Every check that matters is against a full forward pass of the same weights: a reused
cache, a row that joined a running batch, or a row re-admitted after a weights change
must produce the log-probs the learner would compute (fp32, atol 1e-4).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tunix_tasks.config import ModelConfig
from tunix_tasks.policy.distribution import token_logprobs
from tunix_tasks.policy.model import Transformer
from tunix_tasks.policy.params import flat_params
from tunix_tasks.policy.sampling import Sampler
from tunix_tasks.policy.spec import spec_from_preset

VOCAB = 64
CFG = ModelConfig(preset="custom", d_model=32, n_layers=2, n_heads=4, d_ff=64, max_seq_len=96)
SPEC = spec_from_preset(CFG, vocab_size=VOCAB)
STOP = VOCAB - 1
ATOL = 1e-4


def _model(seed: int = 0, scale: float = 30.0) -> Transformer:
    model = Transformer(SPEC, rngs=nnx.Rngs(seed))
    # A peaked output layer: distributions far from uniform, so wrong caches show.
    model.unembed.set_value(model.unembed[...] * scale)
    return model


def _sampler(model: Transformer, **kw) -> Sampler:
    kw = {"batch_buckets": (1, 2, 4), "prompt_buckets": (16, 32), "segment_steps": 4, **kw}
    return Sampler(model, pad_id=0, stop_ids=(STOP,), **kw)


@nnx.jit
def _forward(model, tokens):
    t = tokens.shape[1]
    return model(tokens, jnp.broadcast_to(jnp.arange(t), tokens.shape), jnp.ones_like(tokens))


def _full_logprobs(model, context, generated, temperature=1.0) -> np.ndarray:
    seq = np.zeros((1, CFG.max_seq_len), np.int32)
    seq[0, : len(context) + len(generated)] = [*context, *generated]
    lp = token_logprobs(_forward(model, jnp.asarray(seq)), jnp.asarray(seq), temperature)
    return np.asarray(lp[0, len(context) - 1 : len(context) - 1 + len(generated)])


def _run(sampler: Sampler, context, *, session=None, max_new=10, seed=0, temperature=1.0):
    got = []
    sampler.submit(
        context,
        max_new_tokens=max_new,
        session=session,
        seed=seed,
        temperature=temperature,
        on_done=got.append,
    )
    while sampler.busy:
        sampler.step()
    return got[0]


def test_turn_three_prefills_only_the_new_tokens():
    model = _model()
    s = _sampler(model)
    s.seed(jax.random.key(7))
    context = [1, *range(5, 17)]  # the first prompt: 13 tokens
    reply: list[int] = []
    for turn in range(3):
        before = s.stats.prefill_tokens
        out = _run(s, context, session="episode-1", seed=turn)
        new_tokens = s.stats.prefill_tokens - before
        if turn == 0:
            assert new_tokens == len(context)
        else:  # the last sampled token and the environment's reply: nothing else
            assert new_tokens == 1 + len(reply)
        np.testing.assert_allclose(
            out.logprobs, _full_logprobs(model, context, out.tokens), atol=ATOL, rtol=0
        )
        reply = [2, 30 + turn, 31 + turn]  # the env's answer, as the chat format lays it out
        context = [*context, *out.tokens, *reply]
    assert s.stats.reused_tokens > 0


def test_a_session_that_lost_its_slot_is_prefilled_again_correctly():
    model = _model(1)
    s = _sampler(model, max_sequences=1)
    first = _run(s, [1, 5, 6, 7], session="a")
    _run(s, [1, 9, 9, 9, 9], session="b")  # takes the only slot: "a"'s cache is gone
    context = [1, 5, 6, 7, *first.tokens, 2, 40]
    before = s.stats.prefill_tokens
    out = _run(s, context, session="a")
    assert s.stats.prefill_tokens - before == len(context)
    np.testing.assert_allclose(
        out.logprobs, _full_logprobs(model, context, out.tokens), atol=ATOL, rtol=0
    )


def test_continuous_batching_refills_finished_rows_without_waiting():
    model = _model(2)
    s = _sampler(model)
    s.seed(jax.random.key(3))
    done: dict[str, object] = {}
    order: list[str] = []

    def submit(name, context, max_new, seed):
        def on_done(sample):
            done[name] = sample
            order.append(name)

        s.submit(context, max_new_tokens=max_new, seed=seed, stop_ids=(), on_done=on_done)

    submit("long", [1, 5, 6], 40, 0)
    submit("short", [1, 7, 8, 9], 3, 1)
    s.step()
    s.step()  # "short" finished inside the second segment; "long" still decoding
    assert order == ["short"] and s.active_rows == 1
    submit("late", [1, 11, 12], 12, 2)  # joins the running batch at the next step
    s.step()
    assert s.active_rows == 2
    while s.busy:
        s.step()
    assert order == ["short", "late", "long"]
    # Each row equals its run alone (the same seed: the same random stream).
    for name, context, max_new, seed in (
        ("long", [1, 5, 6], 40, 0),
        ("short", [1, 7, 8, 9], 3, 1),
        ("late", [1, 11, 12], 12, 2),
    ):
        alone = _sampler(model)
        alone.seed(jax.random.key(3))
        got = []
        alone.submit(context, max_new_tokens=max_new, seed=seed, stop_ids=(), on_done=got.append)
        while alone.busy:
            alone.step()
        assert done[name].tokens == got[0].tokens
        np.testing.assert_allclose(done[name].logprobs, got[0].logprobs, atol=ATOL, rtol=0)


def test_rows_in_flight_are_readmitted_under_new_weights():
    old, new = _model(3), _model(4)
    s = _sampler(old)
    s.update_params(flat_params(old), version=5)
    got = []
    context = [1, 5, 6, 7]
    s.submit(context, max_new_tokens=20, stop_ids=(), on_done=got.append)
    s.step()  # prefill + one segment under v5
    s.update_params(flat_params(new), version=6)
    while s.busy:
        s.step()
    sample = got[0]
    assert sample.version == 5 and len(sample.tokens) == 20
    k = 1 + s.segment_steps  # tokens drawn under v5: the prefill's and one segment's
    np.testing.assert_allclose(
        sample.logprobs[:k],
        _full_logprobs(_model(3), context, sample.tokens)[:k],
        atol=ATOL,
        rtol=0,
    )  # a fresh copy of the old weights: the sampler's model now holds the new ones
    np.testing.assert_allclose(
        sample.logprobs[k:], _full_logprobs(new, context, sample.tokens)[k:], atol=ATOL, rtol=0
    )


@pytest.mark.parametrize("top_k", [0, 3])
def test_per_row_settings_in_one_batch(top_k):
    model = _model(5)
    s = _sampler(model)
    got: dict[float, object] = {}
    for temperature in (0.5, 1.5):
        s.submit(
            [1, 5, 6],
            max_new_tokens=8,
            temperature=temperature,
            top_k=top_k,
            stop_ids=(),
            on_done=lambda x, t=temperature: got.__setitem__(t, x),
        )
    while s.busy:
        s.step()
    for temperature, sample in got.items():
        seq = np.zeros((1, CFG.max_seq_len), np.int32)
        seq[0, : 3 + len(sample.tokens)] = [1, 5, 6, *sample.tokens]
        lp = token_logprobs(_forward(model, jnp.asarray(seq)), jnp.asarray(seq), temperature, top_k)
        np.testing.assert_allclose(sample.logprobs, np.asarray(lp[0, 2 : 2 + 8]), atol=ATOL)


def test_admit_is_the_prefill_of_step_and_decode_window_follows_the_live_rows():
    """`admit()` alone prefills (and draws the first token) without decoding; then `step()`
    decodes over `decode_window`, the bucket of the furthest row + a segment; the sample
    equals the one `step()` alone gives."""
    model = _model(4)
    s = _sampler(model)  # segment_steps 4, prompt buckets (16, 32, 96)
    s.seed(jax.random.key(2))
    got = []
    s.submit([1, 5, 6], max_new_tokens=1, stop_ids=(), on_done=got.append)
    s.submit([1, 7, 8], max_new_tokens=30, stop_ids=(), on_done=got.append)
    assert s.decode_window == 0
    assert s.admit() == 2
    # The 1-token request finished at its prefill; the other decodes from position 3.
    assert len(got) == 1 and s.active_rows == 1 and s.stats.segments == 0
    assert s.stats.prefill_tokens == 6
    windows = []
    while s.busy:
        windows.append(s.decode_window)
        s.step()
    # Positions 3, 7, 11 (+ 4 + 1) fit 16; 15 .. 27 fit 32; then the 96-position cache.
    assert windows == [16, 16, 16, 32, 32, 32, 32, 96]
    assert s.admit() == 0 and s.decode_window == 0
    alone = _sampler(model)
    alone.seed(jax.random.key(2))
    want = []
    alone.submit([1, 7, 8], max_new_tokens=30, stop_ids=(), on_done=want.append)
    while alone.busy:
        alone.step()
    assert want[0].tokens == got[1].tokens


def test_decode_working_set_copies_only_new_rows_and_stays_exact():
    """Rows keep their lane between segments (nothing copied), while rows that join,
    leave, return for a second turn or outgrow the window are copied in; every sample's
    log-probs still equal a full forward pass."""
    model = _model(5)
    s = _sampler(model, max_sequences=4)
    s.seed(jax.random.key(1))
    samples: dict[str, object] = {}

    def submit(name, context, max_new, session=None):
        s.submit(
            context,
            max_new_tokens=max_new,
            session=session,
            seed=len(samples) + len(name),
            stop_ids=(),
            on_done=lambda sample: samples.__setitem__(name, (context, sample)),
        )

    for i in range(4):
        submit(f"steady{i}", [1, 2 + i, 3], 4 * 3 + 2)  # 4 segments, the first 3 in window 16
    s.step()
    assert s.stats.lane_copies == 4
    s.step()
    s.step()  # the same four rows at the same window: nothing copied
    assert s.stats.lane_copies == 4 and s.active_rows == 4
    s.step()
    assert not s.busy
    # Churn: different budgets (rows leave mid-batch), late joiners, second turns that
    # reuse their slot, and a window growing from 16 to 32 positions.
    for i in range(3):
        submit(f"a{i}", [1, 9, 10 + i], 3 + 5 * i, session=f"ep{i}")
    s.step()
    submit("late", [1, 20, 21, 22], 9)
    while s.busy:
        s.step()
    for i in range(3):
        context, first = samples[f"a{i}"]
        submit(f"b{i}", [*context, *first.tokens, 30 + i], 6 + 4 * i, session=f"ep{i}")
    while s.busy:
        s.step()
    assert s.stats.reused_tokens > 0
    for context, sample in samples.values():
        want = _full_logprobs(model, context, sample.tokens)
        np.testing.assert_allclose(sample.logprobs, want, atol=ATOL, rtol=0)
