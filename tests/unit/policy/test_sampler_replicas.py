"""Sampler replicas (policy/replicas.py): one sampler per CPU device, one answer.

A request's sample must not depend on the replica that serves it (per-row random streams),
a session must stay where its cache is, a new snapshot must reach every replica, and the
replicas must really run on their own devices. The test process has 8 CPU devices
(tests/conftest.py).
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from tests.unit.policy.test_sampler_engine import ATOL, STOP, _full_logprobs, _model
from tunix_tasks.config import ModelConfig, config_from_dict
from tunix_tasks.policy.build import build_sampler
from tunix_tasks.policy.params import flat_params
from tunix_tasks.policy.replicas import SamplerReplicas, sampler_devices
from tunix_tasks.policy.sampling import Sampler

KW = {"batch_buckets": (1, 2, 4), "prompt_buckets": (16, 32), "segment_steps": 4}


def _replicas(model, n: int = 2, slots: int = 4) -> SamplerReplicas:
    return SamplerReplicas(
        [
            Sampler(model, pad_id=0, stop_ids=(STOP,), max_sequences=slots, device=d, **KW)
            for d in sampler_devices(n)
        ]
    )


def _contexts(n: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[1, *rng.integers(5, 60, int(rng.integers(3, 20))).tolist()] for _ in range(n)]


def test_replicas_sample_what_one_sampler_samples_on_their_own_devices():
    model = _model(0)
    contexts = _contexts(7)
    one = Sampler(model, pad_id=0, stop_ids=(STOP,), max_sequences=8, **KW)
    ref = one.sample(contexts, max_new_tokens=12, rng=jax.random.key(3))
    reps = _replicas(model)
    got = reps.sample(contexts, max_new_tokens=12, rng=jax.random.key(3))
    assert [s.tokens for s in got] == [s.tokens for s in ref]
    for s, r in zip(got, ref, strict=True):
        np.testing.assert_allclose(s.logprobs, r.logprobs, atol=ATOL, rtol=0)
    # Both replicas served rows, each on its own device, and the counts add up.
    assert all(r.stats.decode_steps > 0 for r in reps.replicas)
    devices = [{a.device for a in jax.tree.leaves(r._cache)} for r in reps.replicas]
    assert devices == [{jax.devices()[0]}, {jax.devices()[1]}]
    assert reps.stats.prefill_tokens == one.stats.prefill_tokens
    assert reps.compile_count == sum(r.compile_count for r in reps.replicas) > 0


def test_a_session_stays_on_its_replica_and_reuses_its_cache():
    model = _model(1)
    reps = _replicas(model)
    reps.seed(jax.random.key(5))
    contexts = {f"ep-{i}": c for i, c in enumerate(_contexts(4, seed=1))}
    for turn in range(3):
        got: dict[str, object] = {}
        # Each turn in another order: a router without affinity would move sessions.
        for name, context in sorted(contexts.items(), reverse=turn % 2 == 1):
            reps.submit(
                context, max_new_tokens=5, session=name, seed=turn,
                on_done=lambda s, name=name, got=got: got.__setitem__(name, s),
            )  # fmt: skip
        before = reps.stats.prefill_tokens
        while reps.busy:
            reps.step()
        if turn:  # each turn after the first prefills its last token and the reply only
            assert reps.stats.prefill_tokens - before == len(contexts) * (1 + 2)
        for name, sample in got.items():
            np.testing.assert_allclose(
                sample.logprobs,
                _full_logprobs(model, contexts[name], sample.tokens),
                atol=ATOL,
                rtol=0,
            )
            contexts[name] = [*contexts[name], *sample.tokens, 2, 40 + turn]
    assert [r.load for r in reps.replicas] == [0, 0]
    assert [len(r._slots._sessions) for r in reps.replicas] == [2, 2]  # spread evenly


def test_new_weights_reach_every_replica_and_a_bad_snapshot_none():
    old, new = _model(3), _model(4)
    reps = _replicas(old)
    reps.update_params(flat_params(old), version=1)
    bad = {**flat_params(new)}
    name = next(iter(bad))
    bad[name] = bad[name][..., :1]
    with pytest.raises(ValueError, match=name):
        reps.update_params(bad, version=2)
    assert [r.version for r in reps.replicas] == [1, 1]
    contexts = _contexts(4, seed=2)
    got: list[object] = [None] * 4
    for i, c in enumerate(contexts):
        reps.submit(
            c, max_new_tokens=12, stop_ids=(), seed=i,
            on_done=lambda s, i=i: got.__setitem__(i, s),
        )  # fmt: skip
    reps.step()  # every row in flight on both replicas under v1
    reps.update_params(flat_params(new), version=2)
    assert [r.version for r in reps.replicas] == [2, 2]
    while reps.busy:
        reps.step()
    k = 1 + KW["segment_steps"]  # drawn under v1: the prefill's token and one segment
    for c, sample in zip(contexts, got, strict=True):
        assert sample.version == 1
        np.testing.assert_allclose(
            sample.logprobs[k:], _full_logprobs(new, c, sample.tokens)[k:], atol=ATOL, rtol=0
        )


def test_build_sampler_splits_the_slots_and_names_missing_devices():
    cfg = ModelConfig(preset="tiny")
    _, reps = build_sampler(cfg, max_sequences=6, replicas=3)
    assert isinstance(reps, SamplerReplicas)
    assert [r.max_sequences for r in reps.replicas] == [2, 2, 2]
    with pytest.raises(ValueError, match="64 sampler replicas need 64 local devices"):
        sampler_devices(64)
    with pytest.raises(ValueError, match="sampler_replicas > 1"):
        config_from_dict(
            {"actor": {"kind": "vectorized", "sampler_replicas": 2}, "env": {"name": "calculator"}}
        )
