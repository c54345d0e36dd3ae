"""Learner checkpoints: resume equals an uninterrupted run; the ledger stays exact.

Real orbax checkpoints in a file:// run; the learner runs in-process on shards written
with `ShardWriter`. With equal-length episodes and one 16-episode shard per step, step k
trains exactly shard k, whatever the timing of the background reader, so two runs can be
compared step for step.
"""

from __future__ import annotations

import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.runs import (
    PER_STEP,
    learner_of,
    make_episodes,
    prepare_tiny_run,
    read_ledger_ids,
    write_shards,
)
from tunix_tasks.learner.accounting import LedgerError, read_ledger
from tunix_tasks.learner.checkpoint import Checkpointer
from tunix_tasks.learner.learner import Learner
from tunix_tasks.learner.startup import start_learner
from tunix_tasks.learner.train_step import Trainer
from tunix_tasks.policy.build import build_policy
from tunix_tasks.storage.layout import RunLayout
from tunix_tasks.storage.runs import read_config
from tunix_tasks.storage.store import open_store

STEPS = 4


def _shards(seed: int = 0):
    rng = np.random.default_rng(seed)
    return [make_episodes(rng, PER_STEP) for _ in range(STEPS)]


class _Recording(Learner):
    """Keeps each step's loss and the params right after that step's update."""

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.seen: dict[int, dict] = {}

    def _record(self, m, batch, episodes):
        record = super()._record(m, batch, episodes)
        params = self.parts.trainer.flat_params()
        self.seen[record["step"]] = {"loss": record["loss"], "params": params}
        return record


def _run(uri: str, max_steps: int) -> tuple[dict, dict[int, dict], _Recording]:
    """Run a learner to `max_steps`; returns (summary, {step: (loss, params)}, learner)."""
    cfg, store = read_config(uri)
    learner = _Recording(cfg, store, max_steps=max_steps)
    return learner.run(), learner.seen, learner


def test_resume_matches_an_uninterrupted_run(tmp_path):
    """Run A: 4 steps straight. Run B: 2 steps (checkpoint), then a new Learner resumes
    and runs steps 3..4. B's steps after the restart equal A's (loss and params)."""
    shards = _shards()
    common = {"checkpoint_every": 2, "max_staleness": 10_000, "max_steps": STEPS}
    uri_a = prepare_tiny_run(str(tmp_path / "a"), **common)
    uri_b = prepare_tiny_run(str(tmp_path / "b"), **common)
    write_shards(open_store(uri_a), shards)
    keys = write_shards(open_store(uri_b), shards)

    _, steps_a, _ = _run(uri_a, STEPS)
    first, _, learner1 = _run(uri_b, 2)
    assert first["steps"] == 2 and first["stop_reason"] == "max_steps"
    saved_stream = learner1.parts.source.get_state()
    saved_opt = jax.tree.map(np.asarray, learner1.parts.trainer.state()["opt"])
    position = learner1.parts.source.source.position
    assert [position.is_done(k) for k in keys] == [True, True, False, False]

    # Resume: restore step, version, stream position and optimizer state.
    cfg, store = read_config(uri_b)
    parts = start_learner(cfg, store)
    try:
        assert parts.step == 2
        assert parts.version == first["version"] + 1  # publishes a newer version
        assert parts.source.get_state() == saved_stream
        assert parts.counters["trained_episodes"] == 2 * PER_STEP
        restored_opt = jax.tree.map(np.asarray, parts.trainer.state()["opt"])
        jax.tree.map(np.testing.assert_array_equal, restored_opt, saved_opt)
        assert int(np.asarray(restored_opt["step"])) == 2
        np.testing.assert_array_equal(
            parts.trainer.flat_params()["embed"], learner1.parts.trainer.flat_params()["embed"]
        )
    finally:
        parts.close()

    second, steps_b, _ = _run(uri_b, STEPS)
    assert second["steps"] == STEPS and second["trained_episodes"] == STEPS * PER_STEP
    assert sorted(steps_b) == [3, 4]
    for step in (3, 4):
        assert steps_b[step]["loss"] == pytest.approx(steps_a[step]["loss"], rel=1e-5, abs=1e-7)
        for name, value in steps_a[step]["params"].items():
            np.testing.assert_allclose(
                steps_b[step]["params"][name], value, rtol=1e-5, atol=1e-7, err_msg=name
            )
    trained, dropped = read_ledger_ids(open_store(uri_b))
    assert sorted(trained) == sorted(e.episode_id for s in shards for e in s)
    assert not dropped


def test_a_checkpoint_of_another_incarnation_of_the_run_is_never_resumed_from(tmp_path):
    """Each checkpoint names the run's id. A deleted run's learner whose save was in
    flight as the run was created again leaves a checkpoint there: the new run's learner
    refuses it, naming it, instead of resuming the deleted run's training."""
    from tunix_tasks.config import ConfigError
    from tunix_tasks.storage.runs import run_id

    uri = prepare_tiny_run(str(tmp_path), checkpoint_every=2, max_staleness=10_000)
    store = open_store(uri)
    write_shards(store, _shards()[:2])
    _run(uri, 2)
    ours = run_id(store)
    ckpt = Checkpointer(store)
    try:
        assert ckpt.read_meta()["run_id"] == ours != ""
    finally:
        ckpt.close()
    store.delete(RunLayout.RUN_ID)  # as if created again around the late checkpoint
    store.write_if_generation(RunLayout.RUN_ID, b"f" * 32, 0)
    cfg, store = read_config(uri)
    with pytest.raises(ConfigError, match=f"step 2 .* written by run_id '{ours}', not this"):
        start_learner(cfg, store).close()


def test_a_learner_whose_save_fails_as_its_run_is_created_again_is_fenced(tmp_path, monkeypatch):
    """A background save cut off because the run's folder was deleted under it is a
    storage error; with the run gone or created again the learner is fenced (exit 3),
    not a storage failure (exit 5: what CI saw). The same error on its own run stays."""
    import shutil

    from tunix_tasks.frontdoor.entrypoints import Fenced, run_learner
    from tunix_tasks.learner.checkpoint import CheckpointError
    from tunix_tasks.storage.runs import write_config

    uri = prepare_tiny_run(str(tmp_path / "runs"))
    cfg, _ = read_config(uri)

    def cut_off(self, *, again: bool) -> None:
        if again:
            shutil.rmtree(tmp_path / "runs" / cfg.run_name)
            write_config(cfg)
        raise CheckpointError("checkpoint 2 could not be saved: the folder is gone")

    monkeypatch.setattr(Learner, "run", lambda self: cut_off(self, again=False))
    with pytest.raises(CheckpointError):
        run_learner(uri, handle_signals=False)
    monkeypatch.setattr(Learner, "run", lambda self: cut_off(self, again=True))
    with pytest.raises(Fenced, match="created again") as fenced:
        run_learner(uri, handle_signals=False)
    assert fenced.value.code == 3


@pytest.mark.parametrize("found_by", ["a look", "the lease"])
def test_a_learner_whose_run_is_created_again_mid_run_stops_at_its_next_look(
    tmp_path, monkeypatch, found_by
):
    """The run deleted and created again between two steps, well inside the lease's
    renewal period: the learner's next look (at most a second apart, before a write, or
    before its checkpoint) fences it (exit 3). The new run holds no metrics, DONE,
    checkpoint, lease or `LATEST` of the old one; at most the files of a snapshot or a
    flow report written within that second (names the new run writes too). Where the
    lease's renewal finds it first (a lease lost), the reason named is still the run's."""
    import shutil

    from tunix_tasks.frontdoor.entrypoints import Fenced, run_learner
    from tunix_tasks.storage.lease import LeaseLost
    from tunix_tasks.storage.runs import write_config

    uri = prepare_tiny_run(str(tmp_path / "runs"), max_staleness=10_000)
    cfg, store = read_config(uri)
    write_shards(store, _shards())
    record = Learner._record

    def created_again_after_step_1(self, m, batch, episodes):
        if self.step == 1:
            shutil.rmtree(tmp_path / "runs" / cfg.run_name)
            write_config(cfg)
            if found_by == "the lease":
                raise LeaseLost("this learner does not hold its lease (the renewal's words)")
        return record(self, m, batch, episodes)

    monkeypatch.setattr(Learner, "_record", created_again_after_step_1)
    with pytest.raises(Fenced, match="created again") as fenced:
        run_learner(uri, max_steps=STEPS, handle_signals=False)
    assert fenced.value.code == 3
    left = {i.key for i in open_store(uri).list("")} - {RunLayout.CONFIG, RunLayout.RUN_ID}
    snapshot = re.compile(r"weights/v\d{8}/[^/]+")
    assert all(k == RunLayout.FLOW or snapshot.fullmatch(k) for k in left), left


def test_a_learner_whose_replaced_run_a_background_write_found_still_ends_fenced(
    tmp_path, monkeypatch
):
    """A resumed learner waiting for data (no step since its checkpoint, no flow report
    in sync mode) whose run is deleted and created again: the metrics timer's flush is
    the first write to find it, and only asks the learner to stop. It still ends fenced
    (exit 3), not as a learner that finished (exit 0: an Airflow task that succeeded)."""
    import shutil

    from tunix_tasks.frontdoor.entrypoints import Fenced, run_learner
    from tunix_tasks.storage.runs import write_config

    uri = prepare_tiny_run(str(tmp_path / "runs"), checkpoint_every=2, max_staleness=10_000)
    cfg, store = read_config(uri)
    write_shards(store, _shards()[:2])
    assert run_learner(uri, max_steps=2, handle_signals=False)["steps"] == 2
    phase = Learner._phase

    def created_again_while_waiting(self, text):
        phase(self, text)
        if (tmp_path / "runs" / cfg.run_name / "metrics").exists():
            shutil.rmtree(tmp_path / "runs" / cfg.run_name)
            write_config(cfg)
            self.parts.metrics.log(phase="a record the timer flushes")

    monkeypatch.setattr(Learner, "_phase", created_again_while_waiting)
    monkeypatch.setattr(Learner, "_report_flow", lambda self: None)  # as in sync mode
    with pytest.raises(Fenced, match="created again") as fenced:
        run_learner(uri, max_steps=STEPS, handle_signals=False)
    assert fenced.value.code == 3
    keys = sorted(i.key for i in open_store(uri).list(""))
    assert keys == [RunLayout.CONFIG, RunLayout.RUN_ID]


@pytest.mark.parametrize(("saved_kl", "resumed_kl"), [(0.0, 0.01), (0.01, 0.0)])
def test_resume_under_another_kl_coef(tmp_path, saved_kl, resumed_kl):
    """The KL reference is checkpointed only with kl_coef > 0. A resume that turns it on
    takes the reference from the restored params; one that turns it off ignores the
    saved reference. Either way the run resumes and trains on."""
    uri = prepare_tiny_run(
        str(tmp_path), checkpoint_every=2, max_staleness=10_000, kl_coef=saved_kl
    )
    store = open_store(uri)
    write_shards(store, _shards()[:3])
    _, _, learner1 = _run(uri, 2)
    saved = learner1.parts.trainer.flat_params()
    raw = json.loads(store.read_bytes(RunLayout.CONFIG))
    raw["learner"]["kl_coef"] = resumed_kl
    store.write_bytes(RunLayout.CONFIG, json.dumps(raw).encode())

    cfg, store = read_config(uri)
    parts = start_learner(cfg, store)
    try:
        trainer = parts.trainer
        assert parts.step == 2
        jax.tree.map(np.testing.assert_array_equal, trainer.flat_params(), saved)
        if resumed_kl:
            restored = nnx.to_pure_dict(nnx.state(trainer.model, trainer.trained))
            reference = nnx.to_pure_dict(trainer.reference)
            jax.tree.map(np.testing.assert_array_equal, reference, restored)
        else:
            assert trainer.reference is None and "reference" not in trainer.state()
    finally:
        parts.close()
    summary, steps, _ = _run(uri, 3)
    assert summary["steps"] == 3 and sorted(steps) == [3]
    assert np.isfinite(steps[3]["loss"])


def test_ledger_of_a_crash_before_the_first_checkpoint_is_discarded(tmp_path):
    """A learner killed between writing ledger S and committing checkpoint S leaves a
    ledger file with no checkpoint; when no checkpoint exists at all, the restart must
    drop it (its episodes are about to be trained again), or they would count twice."""
    uri = prepare_tiny_run(str(tmp_path), max_steps=1, max_staleness=10_000)
    store = open_store(uri)
    eps = _shards()[0]
    write_shards(store, [eps])
    ghost = {"trained": [e.episode_id for e in eps[:5]], "dropped": {"stale": ["x"]}}
    store.write_bytes(RunLayout.ledger(3), json.dumps(ghost).encode())

    summary = learner_of(uri).run()
    assert summary["steps"] == 1
    trained, dropped = read_ledger_ids(store)
    assert sorted(trained) == sorted(e.episode_id for e in eps)  # each once
    assert not dropped
    assert len(read_ledger(store)) == 1


def test_checkpointer_round_trip_keeps_values_and_shardings(tmp_path):
    uri = prepare_tiny_run(str(tmp_path))
    cfg, store = read_config(uri)
    _, model = build_policy(cfg.model, seed=1)
    trainer = Trainer(cfg, model)
    ckpt = Checkpointer(store)
    try:
        assert ckpt.restore(trainer.state()) is None and ckpt.read_meta() is None
        meta = {"step": 5, "version": 2, "counters": {"x": 1}, "stream": {"version": 1}}
        ckpt.save(5, trainer.state(), meta, {"trained": ["a"], "dropped": {}})
        assert ckpt.latest_step() == 5
        assert ckpt.read_meta() == meta  # without the state (no template needed)
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


def test_checkpoints_follow_the_current_gcs_emulator(monkeypatch):
    """Orbax writes gs:// through tensorstore, which reads TENSORSTORE_GCS_HTTP_URL. A value
    left by an earlier emulator in the same process sent every checkpoint write to a server
    without the bucket (404); the current STORAGE_EMULATOR_HOST must win."""
    from tunix_tasks.storage.store import open_store

    monkeypatch.setenv("TENSORSTORE_GCS_HTTP_URL", "http://127.0.0.1:1")  # a stale server
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", "http://127.0.0.1:2")
    store = open_store("gs://bucket/run")
    assert store.orbax_path(RunLayout.CHECKPOINTS) == "gs://bucket/run/learner/checkpoints"
    assert os.environ["TENSORSTORE_GCS_HTTP_URL"] == "http://127.0.0.1:2"


def test_a_store_outage_mid_save_is_one_clear_error_and_loses_nothing(caplog):
    """The store (a real fake-gcs-server) goes down once the ledger of checkpoint 2 is
    written, as orbax starts on its files: the save raises `CheckpointError` (a StoreError:
    the CLI prints its one line and exits 5) naming step 2 and checkpoint 1, the latest, and
    gcsfs's log lines carry no traceback. Before, orbax's own aiohttp error left the learner
    with a traceback. With the store back, a new Checkpointer (a resumed learner) restores
    checkpoint 1 and saves step 2 over what the cut-off save left."""
    from tunix_tasks.frontdoor.cli import EXIT_STORAGE, _known_error
    from tunix_tasks.learner.checkpoint import CheckpointError
    from tunix_tasks.testing.gcs_outage import OutageGcs

    state = {"w": jnp.arange(4096, dtype=jnp.float32).reshape(64, 64)}
    ledger = {"trained": ["a"], "dropped": {}}
    with OutageGcs() as gcs:
        store = open_store(gcs.new_bucket_uri("runs") + "/r")
        ckpt = Checkpointer(store)
        ckpt.save(1, state, {"step": 1}, ledger, wait=True)
        write = ckpt._write

        def down_then_write(*args) -> None:
            gcs.down()
            write(*args)

        ckpt._write = down_then_write
        with pytest.raises(CheckpointError) as info:
            ckpt.save(2, {"w": state["w"] + 1}, {"step": 2}, ledger, wait=True)
        message = str(info.value)
        assert message.startswith("checkpoint 2 could not be written"), message
        assert "the latest checkpoint is 1" in message
        assert _known_error(info.value) == (EXIT_STORAGE, message)
        gcsfs = [r for r in caplog.records if r.name.startswith("gcsfs")]
        assert gcsfs and not any(r.exc_info or r.exc_text for r in gcsfs)
        gcs.up()
        resumed = Checkpointer(store)
        try:
            got, meta = resumed.restore({"w": state["w"]})
            assert meta == {"step": 1}
            np.testing.assert_array_equal(np.asarray(got["w"]), np.asarray(state["w"]))
            resumed.save(2, {"w": state["w"] + 1}, {"step": 2}, ledger, wait=True)
            assert resumed.restore({"w": state["w"]})[1] == {"step": 2}
        finally:
            resumed.close()


def test_the_ledger_reads_back_without_orbax_and_names_an_entry_that_is_not_json(tmp_path):
    """`read_ledger` (the report's reader of the exactly-once account) imports neither
    orbax nor JAX, and a hand-broken entry (not JSON, nested past the recursion limit, not
    an object) is a `LedgerError` naming its file: one line from `tunix-tasks report`, where
    it was a RecursionError or an AttributeError traceback."""
    import subprocess
    import sys

    probe = (
        "import sys; import tunix_tasks.learner.accounting, tunix_tasks.frontdoor.report; "
        "print(sorted(m for m in ('jax', 'orbax.checkpoint', 'flax') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
    store = open_store(str(tmp_path))
    store.write_bytes(f"{RunLayout.LEDGER}00000002.json", b'{"trained": ["a"]}')
    assert read_ledger(store) == [{"trained": ["a"]}]
    store.write_bytes(f"{RunLayout.LEDGER}00000004.json", b"[" * 100_000)
    with pytest.raises(LedgerError, match=r"00000004\.json is not a ledger entry: nested too"):
        read_ledger(store)
    store.write_bytes(f"{RunLayout.LEDGER}00000004.json", b"[]")
    with pytest.raises(LedgerError, match=r"00000004\.json is not a ledger entry: not a JSON"):
        read_ledger(store)
    uri = prepare_tiny_run(str(tmp_path / "runs"))
    open_store(uri).write_bytes(f"{RunLayout.LEDGER}00000004.json", b"[]")
    cli = [sys.executable, "-m", "tunix_tasks.frontdoor.cli", "report", uri]
    out = subprocess.run(cli, capture_output=True, text=True, timeout=300)
    assert out.returncode != 0 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert "00000004.json is not a ledger entry: not a JSON object" in out.stderr
