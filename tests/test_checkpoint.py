"""Learner checkpoints: resume equals an uninterrupted run; the ledger stays exact.

Real orbax checkpoints in a file:// run; the learner runs in-process on shards written
with `ShardWriter`. With equal-length episodes and one 16-episode shard per step, step k
trains exactly shard k, whatever the timing of the background reader, so two runs can be
compared step for step.
"""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

from tests.test_learner import PER_STEP, _episodes, _learner, _ledger, _prepare, _write
from tunix_tasks.learner.checkpoint import Checkpointer, ledger_key, read_ledger
from tunix_tasks.learner.train_step import Trainer
from tunix_tasks.policy.build import build_policy
from tunix_tasks.storage.runs import read_config
from tunix_tasks.storage.store import open_store

STEPS = 4


def _shards(seed: int = 0):
    rng = np.random.default_rng(seed)
    return [_episodes(rng, PER_STEP) for _ in range(STEPS)]


def _run(uri: str, max_steps: int) -> tuple[dict, dict[int, dict], object]:
    """Run a learner to `max_steps`; returns (summary, {step: (loss, params)}, learner)."""
    seen: dict[int, dict] = {}
    learner = None

    def progress(record: dict) -> None:
        seen[record["step"]] = {"loss": record["loss"], "params": learner.trainer.flat_params()}

    learner = _learner(uri, max_steps=max_steps, progress=progress)
    return learner.run(), seen, learner


def test_resume_matches_an_uninterrupted_run(tmp_path):
    """Run A: 4 steps straight. Run B: 2 steps (checkpoint), then a new Learner resumes
    and runs steps 3..4. B's steps after the restart equal A's (loss and params)."""
    shards = _shards()
    common = {"checkpoint_every": 2, "max_staleness": 10_000, "max_steps": STEPS}
    uri_a = _prepare(str(tmp_path / "a"), **common)
    uri_b = _prepare(str(tmp_path / "b"), **common)
    _write(open_store(uri_a), shards)
    _write(open_store(uri_b), shards)

    _, steps_a, _ = _run(uri_a, STEPS)
    first, _, learner1 = _run(uri_b, 2)
    assert first["steps"] == 2 and first["stop_reason"] == "max_steps"
    saved_stream = learner1.input.get_state()
    saved_opt = jax.tree.map(np.asarray, learner1.trainer.state()["opt"])
    assert len(saved_stream["done"]) == 2  # shards 1 and 2 fully acknowledged

    # Resume: restore step, version, stream position and optimizer state.
    learner2 = _learner(uri_b, max_steps=STEPS)
    learner2._setup()
    try:
        assert learner2.step == 2
        assert learner2.version == first["version"] + 1  # publishes a newer version
        assert learner2.input.get_state() == saved_stream
        assert learner2.counters["trained_episodes"] == 2 * PER_STEP
        restored_opt = jax.tree.map(np.asarray, learner2.trainer.state()["opt"])
        jax.tree.map(np.testing.assert_array_equal, restored_opt, saved_opt)
        assert int(np.asarray(restored_opt["step"])) == 2
        np.testing.assert_array_equal(
            learner2.trainer.flat_params()["embed"], learner1.trainer.flat_params()["embed"]
        )
    finally:
        learner2._teardown()

    second, steps_b, _ = _run(uri_b, STEPS)
    assert second["steps"] == STEPS and second["trained_episodes"] == STEPS * PER_STEP
    assert sorted(steps_b) == [3, 4]
    for step in (3, 4):
        assert steps_b[step]["loss"] == pytest.approx(steps_a[step]["loss"], rel=1e-5, abs=1e-7)
        for name, value in steps_a[step]["params"].items():
            np.testing.assert_allclose(
                steps_b[step]["params"][name], value, rtol=1e-5, atol=1e-7, err_msg=name
            )
    trained, dropped = _ledger(open_store(uri_b))
    assert sorted(trained) == sorted(e.episode_id for s in shards for e in s)
    assert not dropped


def test_ledger_of_a_crash_before_the_first_checkpoint_is_discarded(tmp_path):
    """A learner killed between writing ledger S and committing checkpoint S leaves a
    ledger file with no checkpoint; when no checkpoint exists at all, the restart must
    drop it (its episodes are about to be trained again), or they would count twice."""
    uri = _prepare(str(tmp_path), max_steps=1, max_staleness=10_000)
    store = open_store(uri)
    eps = _shards()[0]
    _write(store, [eps])
    ghost = {"trained": [e.episode_id for e in eps[:5]], "dropped": {"stale": ["x"]}}
    store.write_bytes(ledger_key(3), json.dumps(ghost).encode())

    summary = _learner(uri).run()
    assert summary["steps"] == 1
    trained, dropped = _ledger(store)
    assert sorted(trained) == sorted(e.episode_id for e in eps)  # each once
    assert not dropped
    assert len(read_ledger(store)) == 1


def test_checkpointer_round_trip_keeps_values_and_shardings(tmp_path):
    uri = _prepare(str(tmp_path))
    cfg, store = read_config(uri)
    _, model = build_policy(cfg.model, seed=1)
    trainer = Trainer(cfg, model)
    ckpt = Checkpointer(store)
    try:
        assert ckpt.restore(trainer.state()) is None
        meta = {"step": 5, "version": 2, "counters": {"x": 1}, "stream": {"version": 1}}
        ckpt.save(5, trainer.state(), meta, {"trained": ["a"], "dropped": {}})
        assert ckpt.latest_step() == 5
        _, fresh = build_policy(cfg.model, seed=2)
        other = Trainer(cfg, fresh)
        state, got_meta = ckpt.restore(other.state())
    finally:
        ckpt.close()
    assert got_meta == meta
    want = trainer.flat_params()
    got = np.asarray(state["model"]["embed"])
    np.testing.assert_array_equal(got, want["embed"])
    assert state["model"]["embed"].sharding == trainer.model.embed[...].sharding
    assert read_ledger(store) == [{"trained": ["a"], "dropped": {}}]
