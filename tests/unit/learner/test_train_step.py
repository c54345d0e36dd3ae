"""The sharded Trainer: same numbers on 1 and 8 devices, one compilation per bucket.

Uses the 8 simulated CPU devices from conftest.py. A Trainer is built on an explicit mesh
(`make_mesh(MeshConfig, devices=...)`), fed `PackedBatch`es from the real packer.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tunix_tasks.config import MeshConfig, config_from_dict
from tunix_tasks.episode import Episode
from tunix_tasks.learner.packing import pack
from tunix_tasks.learner.train_step import Trainer, make_mesh
from tunix_tasks.policy.build import build_policy
from tunix_tasks.policy.distribution import sampling_log_probs, token_logprobs
from tunix_tasks.testing.shard_factory import make_episode

BUCKETS = (64, 128)
ROWS = 8


def _cfg(actor: dict | None = None, **learner):
    return config_from_dict(
        {
            "model": {"preset": "tiny"},
            "actor": actor or {},
            "learner": {
                "buckets": list(BUCKETS),
                "batch_rows": ROWS,
                "learning_rate": 1e-3,
                **learner,
            },
        }
    )


def _examples(rng, n: int, lo: int, hi: int, tag: str) -> list[Episode]:
    out = []
    for i in range(n):
        e = make_episode(rng, length=int(rng.integers(lo, hi)))
        adv = float(rng.normal())
        out.append(Episode(f"{tag}{i}", e.tokens, e.loss_mask, e.behavior_logprobs, advantage=adv))
    return out


def _batches(seed: int, n: int, buckets: tuple[int, ...] = BUCKETS):
    """`n` full packed batches, cycling through `buckets`, deterministic."""
    rng = np.random.default_rng(seed)
    out = []
    for k in range(n):
        bucket = buckets[k % len(buckets)]
        lo, hi = (8, 60) if bucket == 64 else (70, 128)
        result = pack(_examples(rng, 40, lo, hi, f"b{k}-"), buckets=(bucket,), batch_rows=ROWS)
        out.append(result.batches[0])
    return out


def _train(mesh, batches):
    cfg = _cfg()
    _, model = build_policy(cfg.model, seed=cfg.seed)
    trainer = Trainer(cfg, model, mesh=mesh)
    metrics = [trainer.step(b) for b in batches]
    return trainer, metrics


def test_make_mesh_shapes():
    devices = jax.devices()
    assert len(devices) == 8
    assert make_mesh(MeshConfig(data=1, fsdp=1), devices[:1]).shape == {"data": 1, "fsdp": 1}
    assert make_mesh(MeshConfig(data=2, fsdp=4)).shape == {"data": 2, "fsdp": 4}
    assert make_mesh(MeshConfig(data=-1, fsdp=2)).shape == {"data": 4, "fsdp": 2}
    with pytest.raises(ValueError, match="does not fit 8 devices"):
        make_mesh(MeshConfig(data=3, fsdp=1))


def test_one_device_and_eight_devices_give_the_same_updates():
    """Same batches, same init: 1 device vs data=2 x fsdp=4 vs data=8.

    Tolerance: losses rtol 1e-5, params after 3 Adam steps rtol 1e-4 / atol 1e-6 (sharded
    reductions sum in a different order, so float32 results differ in the last bits).
    One bucket only: a compilation per mesh is what this test pays for.
    """
    batches = _batches(0, 3, buckets=(64,))
    devices = jax.devices()
    ref, ref_metrics = _train(make_mesh(MeshConfig(data=1, fsdp=1), devices[:1]), batches)
    ref_params = ref.flat_params()
    for data, fsdp in ((2, 4), (8, 1)):
        mesh = make_mesh(MeshConfig(data=data, fsdp=fsdp), devices)
        trainer, metrics = _train(mesh, batches)
        for a, b in zip(ref_metrics, metrics, strict=True):
            for key in ("loss", "nll", "grad_norm", "is_weight_mean"):
                assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), (data, fsdp, key)
        params = trainer.flat_params()
        assert params.keys() == ref_params.keys()
        moved = 0.0
        for name, value in ref_params.items():
            np.testing.assert_allclose(
                params[name], value, rtol=1e-4, atol=1e-6, err_msg=f"{name} {data}x{fsdp}"
            )
            moved = max(moved, float(np.abs(value).max()))
        assert moved > 0
        # The params really are laid out over the mesh (fsdp shards d_model).
        embed = trainer.model.embed[...]
        assert embed.sharding.mesh.shape == {"data": data, "fsdp": fsdp}
        assert len(embed.sharding.device_set) == 8


def test_compiles_once_per_bucket_shape():
    cfg = _cfg()
    _, model = build_policy(cfg.model, seed=cfg.seed)
    trainer = Trainer(cfg, model)
    batches = _batches(1, 4)
    assert len({b.shape for b in batches}) == 2
    for b in batches:
        trainer.step(b)
    assert trainer.compile_count == 2 == trainer.total_compiles
    trainer.step(batches[0], supervised=True)
    trainer.step(batches[2], supervised=True)  # same shape: no new compilation
    assert trainer.compile_count == 2  # the RL step was not recompiled
    assert trainer.total_compiles == 3


def test_device_time_leaves_out_the_host_work_a_step_overlaps():
    """`step_s` runs from dispatch to collect, so it holds whatever the host did meanwhile
    (packing the next batch); `device_s` is launch -> result ready, and two steps in flight
    at once are not counted twice."""
    cfg = _cfg()
    _, model = build_policy(cfg.model, seed=cfg.seed)
    trainer = Trainer(cfg, model)
    batch = _batches(2, 1)[0]
    trainer.step(batch)  # compiles
    alone = trainer.step(batch)
    assert 0 < alone["device_s"] <= alone["step_s"]
    pending = trainer.dispatch(batch)
    # the host busy with something else, long enough that the step's device time stays
    # under half of it even when a loaded host runs that step 10x slower than alone
    time.sleep(1.0 + 10 * alone["step_s"])
    m = trainer.collect(pending)
    assert m["step_s"] >= 1.0 and m["device_s"] < 0.5 * m["step_s"]
    first, second = trainer.dispatch(batch), trainer.dispatch(batch)  # queued back to back
    a, b = trainer.collect(first), trainer.collect(second)
    # Counted from each launch, the second step would hold the first's computation too
    # (~1.5x the wall time); the ready times come from waiter threads, so allow them the
    # scheduling delay of a loaded CI core.
    wall = time.perf_counter() - first.launched
    assert a["device_s"] + b["device_s"] <= 1.1 * wall + 2e-3


def test_lower_step_gives_xla_accounting_without_running_the_step():
    cfg = _cfg()
    _, model = build_policy(cfg.model, seed=cfg.seed)
    trainer = Trainer(cfg, model, mesh=make_mesh(MeshConfig(data=1, fsdp=1), jax.devices()[:1]))
    batch = _batches(2, 1, buckets=(64,))[0]
    before = trainer.flat_params()
    compiled = trainer.lower_step(batch).compile()
    assert trainer.traces == {"rl": 1} and trainer.steps == 0
    for name, value in trainer.flat_params().items():  # lowered and compiled, never run
        np.testing.assert_array_equal(value, before[name])
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    assert cost["flops"] > 2 * sum(v.size for v in before.values()) * batch.tokens.size
    memory = compiled.memory_analysis()
    assert memory.argument_size_in_bytes >= sum(v.nbytes for v in before.values())
    trainer.lower_step(batch, supervised=True)
    assert trainer.traces == {"rl": 1, "supervised": 1}


def test_batch_rows_must_divide_over_the_mesh():
    cfg = config_from_dict({"learner": {"batch_rows": 6, "buckets": [64]}})
    _, model = build_policy(cfg.model)
    with pytest.raises(ValueError, match="divisible by the 8 devices"):
        Trainer(cfg, model)


def _sampled_episodes(model, *, n: int, length: int, temperature: float, top_k: int, seed=0):
    """Episodes whose policy tokens are drawn from the actors' distribution (temperature,
    top-k) of `model`, with those behaviour log-probs: fresh, on-policy data."""
    rng = np.random.default_rng(seed)
    prompt = 4
    tokens = jnp.asarray(rng.integers(1, model.vocab_size, (n, length)), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(length), tokens.shape)
    forward = jax.jit(lambda t: model(t, pos, jnp.ones_like(t)))
    key = jax.random.key(seed)
    for t in range(prompt, length):  # causal: the logits at t - 1 see tokens < t only
        logp = sampling_log_probs(forward(tokens)[:, t - 1], temperature, top_k)
        key, sub = jax.random.split(key)
        tokens = tokens.at[:, t].set(jax.random.categorical(sub, logp).astype(jnp.int32))
    logits = forward(tokens)
    blp = np.asarray(token_logprobs(logits, tokens, temperature, top_k))
    mask = np.zeros(length, np.int8)
    mask[prompt:] = 1
    out = []
    for i in range(n):
        lp = np.concatenate([[0.0], np.where(mask[1:] == 1, blp[i], 0.0)])
        out.append(
            Episode(
                f"s{i}",
                np.asarray(tokens[i]),
                mask,
                lp,
                advantage=1.0 - 2 * (i % 2),
                policy_version=2 * (i % 2),
            )
        )
    # The learner's check below would notice a top-k it ignored: full-softmax log-probs differ.
    assert np.abs(np.asarray(token_logprobs(logits, tokens, temperature)) - blp).max() > 0.05
    return out


def test_topk_sampled_fresh_data_has_unit_ratios_and_staleness_split():
    """Actor-side top-k (k=5) at T=0.7: through the real loss path every ratio is 1 (the
    learner scores with the sampling distribution), and the mismatch metrics split the
    batch's tokens by learner steps since their behaviour weights (here 2 and 0)."""
    cfg = _cfg({"temperature": 0.7, "top_k": 5})
    _, model = build_policy(cfg.model, seed=cfg.seed)
    eps = _sampled_episodes(model, n=ROWS, length=24, temperature=0.7, top_k=5)
    (batch,) = pack(eps, buckets=(64,), batch_rows=ROWS, flush=True).batches
    trainer = Trainer(cfg, model, mesh=make_mesh(MeshConfig(data=1), jax.devices()[:1]))
    m = trainer.step(batch, lag=2 - batch.policy_versions)  # learner steps since mu
    for key in ("is_weight_max", "is_weight_mean", "ratio_max", "ratio_mean"):
        assert m[key] == pytest.approx(1.0, abs=1e-5), key
    assert m["is_clipped_frac"] == 0.0 and abs(m["approx_kl"]) < 1e-6
    assert m["tokens_s0"] == m["tokens_s1_2"] == ROWS // 2 * 20 and m["tokens_s3p"] == 0
    assert abs(m["approx_kl_s0"]) < 1e-6 and m["ratio_mean_s1_2"] == pytest.approx(1.0, abs=1e-5)


def test_decoupled_ppo_mini_epochs_kl_reference_and_entropy():
    """Several updates per batch make the decoupled clip bite; the KL reference is the
    params as RL starts (0 before any update, > 0 after), re-taken by freeze_reference."""
    cfg = _cfg(
        correction="decoupled_ppo",
        updates_per_batch=2,
        learning_rate=0.05,
        kl_coef=0.1,
        entropy_coef=0.01,
    )
    _, model = build_policy(cfg.model, seed=cfg.seed)
    trainer = Trainer(cfg, model, mesh=make_mesh(MeshConfig(data=1), jax.devices()[:1]))
    (batch,) = _batches(2, 1, buckets=(64,))
    first = trainer.step(batch)
    assert first["kl_ref"] == 0.0 and first["entropy"] > 0
    assert first["ppo_clip_frac"] > 0  # update 1 moved pi away from pi_prox: 2 is clipped
    second = trainer.step(batch)
    assert second["kl_ref"] > 0
    assert "reference" in trainer.state()  # checkpointed with the params
    trainer.freeze_reference()
    assert trainer.step(batch)["kl_ref"] == 0.0
