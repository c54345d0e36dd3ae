"""How many rows a sampler decodes at once: its slots, not a fixed 64 (issue #29.2).

The batch buckets follow the slot count (`row_buckets`), so every slot can decode in one
batch while the compiled programs stay a few per window; `build_sampler` holds the slots
against the device's memory (`costs.sampler_slots`).
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

from tunix_tasks.config import ConfigError, ModelConfig, config_from_dict
from tunix_tasks.policy import build, costs
from tunix_tasks.policy.model import Transformer
from tunix_tasks.policy.sampling import Sampler, row_buckets
from tunix_tasks.policy.spec import spec_from_preset

VOCAB = 64
CFG = ModelConfig(preset="custom", d_model=32, n_layers=2, n_heads=4, d_ff=64, max_seq_len=64)
SPEC = spec_from_preset(CFG, vocab_size=VOCAB)


def test_row_buckets_are_powers_of_two_up_to_the_cap():
    assert row_buckets(1) == (1,)
    assert row_buckets(64) == (1, 2, 4, 8, 16, 32, 64)
    assert row_buckets(384) == (1, 2, 4, 8, 16, 32, 64, 128, 256, 384)
    for cap in range(1, 5000, 7):  # every count has a bucket; programs ~ log2(cap)
        buckets = row_buckets(cap)
        assert buckets[-1] == cap and list(buckets) == sorted(set(buckets))
        assert len(buckets) <= cap.bit_length() + 1
    with pytest.raises(ValueError, match="max_rows must be >= 1"):
        row_buckets(0)


def test_a_sampler_decodes_as_many_rows_as_it_has_slots():
    model = Transformer(SPEC, rngs=nnx.Rngs(0))
    assert Sampler(model, pad_id=0, stop_ids=(1,)).batch_buckets[-1] == 64  # the default
    s = Sampler(model, pad_id=0, stop_ids=(1,), max_sequences=300)
    assert s.batch_buckets == row_buckets(300) and s.max_batch == 300
    pinned = Sampler(model, pad_id=0, stop_ids=(1,), max_sequences=300, batch_buckets=(8,))
    assert pinned.max_batch == 8  # explicit buckets still cap the batch


def test_256_concurrent_requests_decode_in_one_batch_with_two_programs():
    model = Transformer(SPEC, rngs=nnx.Rngs(0))
    s = Sampler(
        model, pad_id=0, stop_ids=(1,), max_sequences=256, prompt_buckets=(32,), segment_steps=4
    )
    s.seed(jax.random.key(0))
    rng = np.random.default_rng(0)
    got = []
    for i in range(256):
        context = rng.integers(2, VOCAB, 8).tolist()
        s.submit(context, max_new_tokens=12, stop_ids=(), seed=i, on_done=got.append)
    assert s.step() == 256 and s.active_rows == 256  # one prefill, one segment, all rows
    while s.busy:
        assert s.step() == 256  # nobody queues behind a 64-row cap
    assert len(got) == 256 and all(len(g.tokens) == 12 for g in got)
    # One batch bucket (256) and one window (32): one prefill and one decode program.
    assert dict(s.compiles) == {"prefill": 1, "decode": 1}
    assert s.stats.segments == 3  # 1 token at the prefill + 3 segments of 4 > 12


def test_sampler_memory_hand_example():
    # 2 (K,V) * 2 layers * 4 kv heads * 8 head_dim * 4 bytes = 512 bytes a position.
    per_pos = costs.kv_bytes(SPEC, 1, itemsize=4)
    assert per_pos == 512
    weights = costs.weight_bytes(SPEC, itemsize=4)
    assert costs.sampler_bytes(SPEC, slots=10, max_seq_len=64, itemsize=4) == (
        weights + 21 * 64 * 512
    )
    for budget in (weights + 21 * 64 * 512, weights + 22 * 64 * 512 - 1):
        assert costs.sampler_slots(SPEC, budget_bytes=budget, max_seq_len=64, itemsize=4) == 10
    assert costs.sampler_slots(SPEC, budget_bytes=weights, max_seq_len=64, itemsize=4) == 0
    # Decoding at most 4 rows: 4 lanes of working set, whatever the slots.
    four = {"max_seq_len": 64, "itemsize": 4, "rows": 4}
    assert costs.sampler_bytes(SPEC, slots=10, **four) == weights + 15 * 64 * 512
    assert costs.sampler_bytes(SPEC, slots=2, **four) == weights + 5 * 64 * 512
    assert costs.sampler_slots(SPEC, budget_bytes=weights + 15 * 64 * 512, **four) == 10
    assert costs.sampler_slots(SPEC, budget_bytes=weights + 6 * 64 * 512, **four) == 2


def test_build_sampler_names_the_slots_that_fit_or_shrinks_to_them(monkeypatch):
    cfg = ModelConfig(preset="tiny")
    with pytest.raises(ConfigError, match=r"actor\.kv_cache_slots: 100000000 KV-cache slots"):
        build.build_sampler(cfg, max_sequences=10**8)  # ~26 TB of cache: refused up front
    # A device of 64 MiB: 80% of it, less the weights, over 2 x 256 positions a slot.
    monkeypatch.setattr(build, "device_memory_bytes", lambda device: 64 * 2**20)
    _, model = build.build_policy(cfg)
    fit = costs.sampler_slots(
        model.spec, budget_bytes=0.8 * 64 * 2**20, max_seq_len=cfg.max_seq_len, itemsize=4
    )
    assert 0 < fit < 384
    with pytest.raises(ConfigError, match=f"at most {fit} fit"):
        build.build_sampler(cfg, max_sequences=384)
    _, sampler = build.build_sampler(cfg, max_sequences=384, shrink_to_fit=True)
    assert sampler.max_sequences == fit and sampler.batch_buckets[-1] == fit
    # Decoding at most 64 rows: less working set, so more slots fit.
    _, sampler = build.build_sampler(cfg, max_sequences=384, max_rows=64, shrink_to_fit=True)
    more = costs.sampler_slots(
        model.spec, budget_bytes=0.8 * 64 * 2**20, max_seq_len=256, itemsize=4, rows=64
    )
    assert fit < more == sampler.max_sequences and sampler.batch_buckets == row_buckets(64)


def test_the_actor_default_is_one_slot_per_environment():
    cfg = config_from_dict({"env": {"name": "calculator"}, "actor": {"envs_per_actor": 384}})
    assert cfg.actor.cache_slots == 384  # was capped at 256, decoding at most 64 at once
    pinned = {"envs_per_actor": 384, "kv_cache_slots": 100}
    assert (
        config_from_dict({"env": {"name": "calculator"}, "actor": pinned}).actor.cache_slots == 100
    )
