"""`learner.param_dtype: bfloat16`: bf16 params and grads, a float32 master copy in the
optimizer state; it trains like float32, keeps its layout across a checkpoint, and a
resume may not switch it.

Uses the 8 simulated CPU devices from conftest.py and the tiny preset.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from tests.runs import prepare_tiny_run
from tests.unit.learner.test_train_step import _batches, _cfg
from tunix_tasks.config import ConfigError, ConfigWarning, MeshConfig, config_from_dict
from tunix_tasks.config.resume import fixed_changes
from tunix_tasks.learner.checkpoint import Checkpointer
from tunix_tasks.learner.master_copy import master_params, with_master_copy
from tunix_tasks.learner.train_step import Trainer, make_mesh
from tunix_tasks.policy.build import build_policy
from tunix_tasks.policy.costs import STATE_BYTES_PER_PARAM
from tunix_tasks.storage.runs import read_config

STEPS = 24


def test_small_updates_accumulate_in_the_master_instead_of_rounding_away():
    # 1.0 - 1e-4 is 1.0 in bfloat16 (its spacing near 1 is 2^-8): plain SGD on a bf16
    # param never moves it; on a master copy 100 such steps move it by 0.01.
    params = {"w": jnp.ones((4,), jnp.bfloat16)}
    grads = {"w": jnp.ones((4,), jnp.bfloat16)}
    for tx, moved in ((optax.sgd(1e-4), False), (with_master_copy(optax.sgd(1e-4)), True)):
        p, state = params, tx.init(params)
        for _ in range(100):
            updates, state = tx.update(grads, state, p)
            p = optax.apply_updates(p, updates)
        assert p["w"].dtype == jnp.bfloat16
        if moved:
            master = master_params(state)["w"]
            assert master.dtype == jnp.float32
            np.testing.assert_allclose(np.asarray(master), 0.99, rtol=1e-5)
            np.testing.assert_array_equal(p["w"], master.astype(jnp.bfloat16))
        else:
            np.testing.assert_array_equal(p["w"], params["w"])


def _trainer(param_dtype: str, seed: int = 0, mesh=None) -> Trainer:
    cfg = _cfg(param_dtype=param_dtype)
    _, model = build_policy(cfg.model, seed=seed)
    return Trainer(cfg, model, mesh=mesh)


def _dtypes(state) -> set:
    return {leaf.dtype for leaf in jax.tree.leaves(nnx.to_pure_dict(state))}


def _master(trainer: Trainer) -> dict:
    return master_params(nnx.as_pure(trainer.optimizer.opt_state))


def test_bf16_params_with_a_master_train_like_float32():
    # Supervised steps cycling over two batches: a loss curve that goes down (memorizing).
    batches = _batches(0, 2, buckets=(64,)) * (STEPS // 2)
    mesh = make_mesh(MeshConfig(data=2, fsdp=4))
    fp32, bf16 = _trainer("float32", mesh=mesh), _trainer("bfloat16", mesh=mesh)
    losses = np.array([[t.step(b, supervised=True)["loss"] for t in (fp32, bf16)] for b in batches])
    assert losses[-2:, 0].max() < losses[:2, 0].min() - 0.3  # 4.64 -> 4.06 on this preset
    # Measured: the curves agree to 4.4e-4 (1e-4 relative) over the 24 steps.
    np.testing.assert_allclose(losses[:, 1], losses[:, 0], atol=5e-3)

    assert _dtypes(nnx.state(bf16.model, nnx.Param)) == {jnp.dtype(jnp.bfloat16)}
    assert _dtypes(nnx.state(fp32.model, nnx.Param)) == {jnp.dtype(jnp.float32)}
    master = _master(bf16)
    assert {leaf.dtype for leaf in jax.tree.leaves(master)} == {jnp.dtype(jnp.float32)}
    params = nnx.to_pure_dict(nnx.state(bf16.model, nnx.Param))
    for name in ("embed", "unembed"):
        # the params are the master rounded to bf16, each laid out like its param
        np.testing.assert_array_equal(params[name], master[name].astype(jnp.bfloat16))
        assert master[name].sharding == params[name].sharding
    # snapshots stay float32: the bf16 values the learner computes with, widened
    flat = bf16.flat_params()
    assert flat["embed"].dtype == np.float32
    np.testing.assert_array_equal(flat["embed"], np.asarray(params["embed"], np.float32))


def test_state_bytes_per_param_are_what_the_trainer_holds():
    """`STATE_BYTES_PER_PARAM` (benchmarks/model_memory.py's tables) against the arrays
    a Trainer holds: params and optimizer state, plus grads shaped and typed like the
    params (their dtype is the params': the gradient of a bf16 param is bf16)."""
    for regime, param_dtype in (("fp32", "float32"), ("bf16", "bfloat16")):
        trainer = _trainer(param_dtype)
        params = jax.tree.leaves(nnx.to_pure_dict(nnx.state(trainer.model, nnx.Param)))
        opt = jax.tree.leaves(nnx.to_pure_dict(nnx.state(trainer.optimizer)))
        count = sum(p.size for p in params)
        held = sum(p.nbytes for p in params) * 2 + sum(a.nbytes for a in opt if a.ndim)
        assert held == STATE_BYTES_PER_PARAM[regime] * count, regime


def test_checkpoint_round_trip_keeps_the_master_and_resumes_the_same_step(tmp_path):
    uri = prepare_tiny_run(str(tmp_path), param_dtype="bfloat16")
    cfg, store = read_config(uri)
    batch = _batches(1, 1, buckets=(64,))[0]
    _, model = build_policy(cfg.model, seed=1)
    trainer = Trainer(cfg, model)
    ckpt = Checkpointer(store)
    try:
        trainer.step(batch)
        ckpt.save(1, trainer.state(), {"step": 1}, None, wait=True)
        _, fresh = build_policy(cfg.model, seed=2)
        other = Trainer(cfg, fresh)
        state, _ = ckpt.restore(other.checkpoint_template())
        other.load_state(state)
    finally:
        ckpt.close()
    for got, want in ((_master(other), _master(trainer)), (other.flat_params(), None)):
        want = want if want is not None else trainer.flat_params()
        jax.tree.map(np.testing.assert_array_equal, got, want)
    assert _dtypes(nnx.state(other.model, nnx.Param)) == {jnp.dtype(jnp.bfloat16)}
    assert other.step(batch)["loss"] == trainer.step(batch)["loss"]


def test_a_resume_may_not_change_param_dtype():
    changes = fixed_changes(_cfg(), _cfg(param_dtype="bfloat16"))
    assert [c.field for c in changes] == ["learner.param_dtype"]


def test_a_checkpoint_of_the_other_param_dtype_is_refused_in_one_line(tmp_path):
    _, store = read_config(prepare_tiny_run(str(tmp_path)))
    ckpt = Checkpointer(store)
    try:
        ckpt.save(1, _trainer("float32").state(), {"step": 1}, None, wait=True)
        with pytest.raises(ConfigError, match=r"another state layout .* learner.param_dtype"):
            ckpt.restore(_trainer("bfloat16").checkpoint_template())
        # the same layout still restores (the check compares paths, not values)
        assert ckpt.restore(_trainer("float32", seed=3).checkpoint_template()) is not None
    finally:
        ckpt.close()


def test_lora_with_a_bf16_base_warns_against_float32_actors():
    def load(model_dtype: str, param_dtype: str) -> None:
        model = {"preset": "tiny", "lora_rank": 4, "dtype": model_dtype}
        learner = {"param_dtype": param_dtype, "compute_dtype": model_dtype}
        config_from_dict({"model": model, "learner": learner})

    with pytest.warns(ConfigWarning, match="frozen base in bfloat16"):
        load("float32", "bfloat16")
    # bf16 actors round the base as the learner does; a float32 learner base is cast per use
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load("bfloat16", "bfloat16")
        load("bfloat16", "float32")
