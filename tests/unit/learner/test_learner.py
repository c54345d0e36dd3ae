"""The learner process end to end, on real shards in a real store (no mocks).

Shards are written directly with `ShardWriter` (actors are not needed to test the
learner): exactly-once accounting across SIGKILLs of a learner subprocess, the lease
(second learner refused, stolen lease stops publishing) on file:// and gs://, quarantine
of bad shards, the compile-count bound, staleness drops, the bfloat16 option and exact
importance weights on fresh data.
"""

from __future__ import annotations

import dataclasses
import json
import math
import threading
import time

import jax.numpy as jnp
import numpy as np
import pytest

from tests.runs import (
    EP_LEN,
    PER_STEP,
    learner_of,
    make_episodes,
    prepare_tiny_run,
    prepublish,
    read_ledger_ids,
    step_records,
    write_shards,
)
from tunix_tasks.episode import Episode
from tunix_tasks.frontdoor.entrypoints import run_learner
from tunix_tasks.learner import drop_bias
from tunix_tasks.learner.learner import Learner
from tunix_tasks.policy.build import build_policy
from tunix_tasks.policy.distribution import token_logprobs
from tunix_tasks.storage.layout import RunLayout
from tunix_tasks.storage.lease import LeaseHeldError, LeaseLost
from tunix_tasks.storage.metrics import read_metrics
from tunix_tasks.storage.runs import read_config, run_id
from tunix_tasks.storage.shards import RUN_ID_KEY, episodes_to_table, table_to_parquet_bytes
from tunix_tasks.storage.store import NotFound, ObjectStore, PreconditionFailed, open_store
from tunix_tasks.storage.weights import PublishConflict, WeightsPublisher, read_latest
from tunix_tasks.testing.shard_factory import make_episode

# ------------------------------------------------------------------- exactly once


# ------------------------------------------------------------------------ lease


def _run_in_thread(learner: Learner) -> tuple[threading.Thread, dict]:
    box: dict = {}

    def target() -> None:
        try:
            box["summary"] = learner.run()
        except BaseException as err:  # handed to the test thread
            box["error"] = err

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, box


def _wait_for(cond, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def test_second_learner_refused_and_stolen_lease_stops_publishing(store_uri):
    """A second learner on a run is refused (LeaseHeldError naming the holder); when the
    lease is then taken by someone else, the first learner stops and never overwrites the
    new owner's weights pointer."""
    # A lease of 6 s: renewed every 2 s, it outlives a loaded host's stalls (at 1.5 s, a
    # missed renewal let the second learner in).
    uri = prepare_tiny_run(store_uri, max_steps=10_000, lease_ttl_s=6.0, max_staleness=10_000)
    store = open_store(uri)
    rng = np.random.default_rng(0)
    write_shards(store, [make_episodes(rng, 64) for _ in range(8)])

    first = learner_of(uri)
    thread, box = _run_in_thread(first)
    _wait_for(lambda: (read_latest(store) or (-1,))[0] >= 2, 60, "the first learner to publish")

    with pytest.raises(LeaseHeldError) as info:
        run_learner(uri, handle_signals=False)
    msg = str(info.value)
    assert "refusing to start a second learner" in msg and first.parts.lease.owner in msg
    assert "learner/LEASE" in msg

    # Steal: another owner replaces the lease (compare-and-swap on its generation), then
    # publishes its own weights as a real successor would.
    for _ in range(20):  # the holder renews concurrently: retry the CAS as a thief would
        data, generation = store.read_versioned(RunLayout.LEASE)
        thief = {**json.loads(data), "owner": "other-host:1:thief", "host": "other-host", "pid": 1}
        thief["expires_at"] = time.time() + 3600
        try:
            store.write_if_generation(RunLayout.LEASE, json.dumps(thief).encode(), generation)
            break
        except PreconditionFailed:
            continue
    deadline = time.monotonic() + 30  # the old learner publishes until it notices (ttl/3)
    while True:
        try:
            WeightsPublisher(store).publish(
                {"w": np.zeros(1, np.float32)}, version=9999, step=0, model={}
            )
            break
        except PublishConflict:
            assert time.monotonic() < deadline, "the stolen learner kept publishing"
            time.sleep(0.05)

    thread.join(timeout=60)
    assert not thread.is_alive()
    assert isinstance(box.get("error"), (LeaseLost, PublishConflict)), box
    assert first.parts.lease.lost or isinstance(box["error"], PublishConflict)
    assert read_latest(store)[0] == 9999  # never overwritten by the stolen learner
    assert json.loads(store.read_bytes(RunLayout.LEASE))["owner"] == "other-host:1:thief"
    assert not store.exists(RunLayout.DONE)


# ------------------------------------------------------------------- quarantine


def _bad_shards(store: ObjectStore, rng) -> dict[str, str]:
    """key -> expected quarantine reason."""
    bad: dict[str, str] = {}
    key = "shards/actor-9/0000000000001-corrupt.parquet"
    store.write_bytes(key, b"PAR1 this is not parquet at all" * 10)
    bad[key] = "corrupt"

    table = episodes_to_table(make_episodes(rng, 4)).drop_columns(["reward"])
    key = "shards/actor-9/0000000000002-noreward.parquet"
    store.write_bytes(key, table_to_parquet_bytes(table))
    bad[key] = "missing_columns"

    eps = make_episodes(rng, 4)
    eps[2] = dataclasses.replace(eps[2], reward=math.nan)
    key = "shards/actor-9/0000000000003-nanreward.parquet"
    store.write_bytes(key, table_to_parquet_bytes(episodes_to_table(eps)))
    bad[key] = "non_finite"

    eps = make_episodes(rng, 4)
    eps[1].tokens[5] = 500  # vocabulary is 103
    key = "shards/actor-9/0000000000004-oov.parquet"
    store.write_bytes(key, table_to_parquet_bytes(episodes_to_table(eps)))
    bad[key] = "token_out_of_range"
    return bad


def test_bad_shards_are_quarantined_good_ones_trained(tmp_path):
    uri = prepare_tiny_run(str(tmp_path), max_steps=2)
    store = open_store(uri)
    rng = np.random.default_rng(1)
    bad = _bad_shards(store, rng)  # their names sort before the good shards
    good = make_episodes(rng, 2 * PER_STEP)
    write_shards(store, [good[:PER_STEP], good[PER_STEP:]])

    learner = learner_of(uri)
    summary = learner.run()
    assert summary["steps"] == 2 and summary["trained_episodes"] == 2 * PER_STEP
    trained, dropped = read_ledger_ids(store)
    assert set(trained) == {e.episode_id for e in good} and not dropped

    got = {q["shard"]: q["reason"] for q in summary["quarantined"]}
    assert got == bad
    for key, reason in bad.items():
        assert not store.exists(key)
        assert store.exists(f"quarantine/{key}")
        record = json.loads(store.read_bytes(f"quarantine/{key}.reason.json"))
        assert record["shard"] == key and record["reason"] == reason and record["detail"]
    steps = [r for r in read_metrics(store, "learner") if "step" in r]
    assert steps[-1]["quarantined"] == len(bad)


# ----------------------------------------------------------------- compile count


def test_compile_count_bounded_by_buckets_and_truncation_counted(tmp_path):
    """Lengths 5..192 (some > the 128 bucket; 192 = actor.max_episode_tokens, longer ones
    are quarantined): at most one RL compilation per bucket, and each truncated episode
    that was trained is counted once."""
    uri = prepare_tiny_run(
        str(tmp_path), max_steps=6, max_staleness=10_000, min_episodes_per_step=8
    )
    store = open_store(uri)
    rng = np.random.default_rng(2)
    lengths = np.concatenate([rng.integers(5, 128, 150), rng.integers(129, 193, 20)])
    rng.shuffle(lengths)
    eps = [make_episode(rng, length=int(n), group_id=f"g{i // 4}") for i, n in enumerate(lengths)]
    write_shards(store, [eps[i : i + 34] for i in range(0, len(eps), 34)])

    learner = learner_of(uri)
    summary = learner.run()
    assert summary["steps"] == 6
    assert 1 <= summary["compile_count"] <= 2
    assert learner.parts.trainer.total_compiles == summary["compile_count"]  # no supervised step
    records = read_metrics(store, "learner")
    buckets = {r["bucket"] for r in records if "bucket" in r}
    assert buckets <= {64, 128}
    # The live display's phases (issue #31.5): waiting, then one record per compilation.
    phases = [r["phase"] for r in records if "phase" in r]
    first_seen = list(dict.fromkeys(r["bucket"] for r in records if "bucket" in r))
    assert phases == [
        "waiting for the first shard",
        *(
            f"compiling the train step for bucket {b} ({i} of 2)"
            for i, b in enumerate(first_seen, 1)
        ),
    ]
    assert len(phases) - 1 == summary["compile_count"]
    trained, _ = read_ledger_ids(store)
    by_id = {e.episode_id: e for e in eps}
    long_trained = sum(by_id[i].length > 128 for i in trained)
    assert learner.acct.counters["truncated_sequences"] == long_trained
    assert summary["truncated_sequences"] == long_trained
    # No stale drop: the trained side is kept, no step record carries the comparison.
    assert learner.acct.counters["drop_bias"]["trained"]["n"] == len(trained)
    assert not any("drop_bias" in r for r in records)


# --------------------------------------------------------------------- staleness


def test_stale_data_dropped_and_counted(tmp_path):
    """max_staleness=1: data more than one policy version old is dropped (not trained)."""
    uri = prepare_tiny_run(str(tmp_path), max_steps=2, max_staleness=1, publish_every=100)
    store = open_store(uri)
    prepublish(store, 3)  # the learner runs at version 4
    rng = np.random.default_rng(3)
    old = make_episodes(rng, 12, version=2)
    older = make_episodes(rng, 4, version=1)
    new = make_episodes(rng, 2 * PER_STEP, version=4)
    write_shards(store, [old + older, new[:PER_STEP], new[PER_STEP:]])

    summary = learner_of(uri).run()
    assert summary["steps"] == 2 and summary["trained_episodes"] == 2 * PER_STEP
    assert summary["dropped"] == {"stale": 16}
    trained, dropped = read_ledger_ids(store)
    assert set(trained) == {e.episode_id for e in new}
    assert set(dropped["stale"]) == {e.episode_id for e in old + older}
    for r in (r for r in read_metrics(store, "learner") if "step" in r):
        assert r["version"] == 4 and r["staleness"] == {"0": PER_STEP}
        assert r["dropped"] == {"stale": 16}
        # The stale-drop bias, cumulative: the 16 stale episodes against those trained.
        bias = {side: drop_bias.describe(d) for side, d in r["drop_bias"].items()}
        assert bias["stale"]["episodes"] == 16 and bias["stale"]["length_mean"] == EP_LEN
        assert bias["trained"]["episodes"] == r["step"] * PER_STEP
        stale_rewards = [e.reward for e in old + older]
        assert bias["stale"]["reward_mean"] == pytest.approx(np.mean(stale_rewards), rel=1e-5)


# ------------------------------------------------- issue #11: bad input, retention


def test_future_replayed_and_too_long_shards_never_trained(tmp_path):
    """#11.4: a shard from the future (policy_version latest + 1,000,000) was trained
    (staleness -999996 in metrics); #11.5: a shard copied under a new name was accounted
    twice; #11.6: an episode over actor.max_episode_tokens (192) was truncated and
    trained. Now: quarantined as `future_version` / `too_long`, the replay dropped as
    `duplicate`; a shard an actor of another incarnation of the run wrote (the run deleted
    and created again under its URI while it ran) as `other_run`. #11.11: old snapshots
    are pruned (keep the newest 2) and, with `delete_consumed_shards`, the consumed
    shards are deleted after the final checkpoint."""
    uri = prepare_tiny_run(
        str(tmp_path),
        max_steps=2,
        max_staleness=10,
        keep_snapshots=2,
        keep_every=0,
        delete_consumed_shards=True,
    )
    store = open_store(uri)
    prepublish(store, 3)  # the learner runs at versions 4..6
    rng = np.random.default_rng(11)
    bad = {
        "shards/actor-9/0000000000001-future.parquet": (
            "future_version",
            make_episodes(rng, 4, version=1_000_004),
        ),
        "shards/actor-9/0000000000002-long.parquet": (
            "too_long",
            make_episodes(rng, 4, length=193, version=4),
        ),
        # an actor of the run deleted and created again under this URI while it ran
        "shards/actor-9/0000000000003-other.parquet": (
            "other_run",
            make_episodes(rng, 4, version=4),
        ),
    }
    for key, (reason, eps) in bad.items():
        writer = "f" * 32 if reason == "other_run" else run_id(store)  # else: this run's
        table = episodes_to_table(eps)
        store.write_bytes(key, table_to_parquet_bytes(table, extra_metadata={RUN_ID_KEY: writer}))
    good = [make_episodes(rng, PER_STEP, version=4) for _ in range(2)]
    keys = write_shards(store, good)
    replay = "shards/actor-0/9999999999999-replay.parquet"
    store.write_bytes(replay, store.read_bytes(keys[0]))

    summary = learner_of(uri).run()
    assert summary["steps"] == 2 and summary["trained_episodes"] == 2 * PER_STEP
    assert summary["dropped"] == {"duplicate": PER_STEP}
    assert {q["shard"]: q["reason"] for q in summary["quarantined"]} == {
        k: reason for k, (reason, _) in bad.items()
    }
    trained, dropped = read_ledger_ids(store)
    assert sorted(trained) == sorted(e.episode_id for eps in good for e in eps)  # once each
    assert set(dropped) == {"duplicate"}
    assert set(dropped["duplicate"]) == {e.episode_id for e in good[0]}
    for r in step_records(store):
        assert all(int(s) >= 0 for s in r["staleness"]), r["staleness"]
    # Retention: v3..v6 were published, the newest two are kept (LATEST is v6).
    assert read_latest(store)[0] == 6
    assert sorted({i.key.split("/")[1] for i in store.list("weights/v")}) == [
        "v00000005",
        "v00000006",
    ]
    # The consumed shards (the replay too) are gone; the quarantined ones were moved.
    assert store.list("shards/") == []


# --------------------------------------------------------------------- bfloat16


def test_bfloat16_compute_trains_with_finite_loss(tmp_path):
    uri = prepare_tiny_run(
        str(tmp_path), max_steps=3, compute_dtype="bfloat16", max_staleness=10_000
    )
    store = open_store(uri)
    rng = np.random.default_rng(4)
    write_shards(store, [make_episodes(rng, PER_STEP) for _ in range(3)])
    learner = learner_of(uri)
    summary = learner.run()
    records = step_records(store)
    assert summary["steps"] == 3 and len(records) == 3
    assert learner.parts.trainer.model.compute_dtype == jnp.bfloat16
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in records)
    assert all(r["grad_norm"] > 0 for r in records)
    # Params stay float32 (only the matmuls run in bfloat16).
    assert all(v.dtype == np.float32 for v in learner.parts.trainer.flat_params().values())


# ------------------------------------------------------------- on-policy weights


def _on_policy_episodes(uri: str, rng, n: int) -> list[Episode]:
    """Episodes whose behaviour log-probs come from the initial policy itself (the
    learner's model at step 0: same config, same seed), by a full forward pass."""
    cfg, _ = read_config(uri)
    _, model = build_policy(cfg.model, seed=cfg.seed)
    eps = make_episodes(rng, n)
    tokens = jnp.asarray(np.stack([e.tokens for e in eps]))
    pos = jnp.broadcast_to(jnp.arange(EP_LEN, dtype=jnp.int32), tokens.shape)
    logits = model(tokens, pos, jnp.ones_like(tokens))
    lp = np.asarray(token_logprobs(logits, tokens, cfg.actor.temperature))
    for e, row in zip(eps, lp, strict=True):
        e.loss_mask[0] = 0  # nothing predicts the first token
        e.behavior_logprobs[:] = 0.0
        e.behavior_logprobs[1:] = np.where(e.loss_mask[1:] == 1, row, 0.0)
    return eps


def test_fresh_data_has_unit_importance_weights(tmp_path):
    """Data from the current policy (staleness 0): pi/mu is 1 on every token. With
    `publish_every: 2` the second step trains data of the same version one update after
    its weights: that is not the sampler-vs-learner bucket s0 any more."""
    uri = prepare_tiny_run(str(tmp_path), max_steps=2, max_staleness=1, publish_every=2)
    store = open_store(uri)
    write_shards(store, [_on_policy_episodes(uri, np.random.default_rng(5), 2 * PER_STEP)])
    summary = learner_of(uri).run()
    records = step_records(store)
    assert summary["steps"] == 2 and summary["dropped"] == {}
    r, second = records
    assert r["staleness"] == second["staleness"] == {"0": PER_STEP}
    assert r["is_clipped_frac"] == 0.0
    # The learner's log-probs come from a differently shaped XLA program (a packed,
    # sharded [8, 64] batch inside the gradient computation) than the behaviour ones, so
    # single tokens may differ in the last float32 bits: |w - 1| < 1e-5 per token.
    assert r["is_weight_mean"] == pytest.approx(1.0, abs=1e-6)
    assert r["is_weight_max"] == pytest.approx(1.0, abs=1e-5)
    # The mismatch metrics are in the step record (so in TensorBoard): ratio statistics,
    # the sampler-vs-learner KL overall and per bucket (only buckets with data).
    assert r["ratio_mean"] == pytest.approx(1.0, abs=1e-6) and r["ppo_clip_frac"] == 0.0
    assert abs(r["approx_kl"]) < 1e-6 and abs(r["approx_kl_s0"]) < 1e-6
    assert 0 <= r["max_abs_logprob_diff_s0"] < 1e-5  # the worst token: float noise too
    assert r["tokens_s0"] > 0 and "tokens_s1_2" not in r and "kl_ref" not in r
    # Step 2: version 0 still, but one update after its weights: bucket s1_2.
    assert "tokens_s0" not in second and second["tokens_s1_2"] > 0
    assert second["max_abs_logprob_diff_s1_2"] > 1e-4  # the update moved the policy


def test_a_failed_checkpoint_stops_the_learner_without_training_a_step_twice(tmp_path, monkeypatch):
    """The checkpoint after step 2 fails (as a store outage made it in CI): the learner
    stops with that error. Before, the loop's cleanup completed the same update a second
    time: a step 3 record of the step-2 batch and its episodes acknowledged twice."""
    uri = prepare_tiny_run(str(tmp_path), max_steps=4, checkpoint_every=2, max_staleness=10_000)
    store = open_store(uri)
    rng = np.random.default_rng(7)
    write_shards(store, [make_episodes(rng, PER_STEP) for _ in range(4)])

    def failing(self, *, final: bool = False) -> None:
        raise FileNotFoundError("checkpoints/2/meta/metadata")

    monkeypatch.setattr(Learner, "_checkpoint", failing)
    learner = learner_of(uri)
    with pytest.raises(FileNotFoundError, match="checkpoints/2"):
        learner.run()
    assert learner.step == 2
    assert [r["step"] for r in step_records(store)] == [1, 2]


def test_a_learner_waiting_with_every_shard_read_tells_the_actors_what_it_needs(tmp_path):
    """The actors pause on episodes the learner has read but not trained; a learner that
    holds fewer than a step's worth and has read every shard says how many it lacks
    (`needs` in learner/flow.json), which the actors admit whatever the backlog: else
    each would wait for the other (seen after a resume: 50 s without a step)."""
    uri = prepare_tiny_run(str(tmp_path), max_steps=2, data_timeout_s=30)
    store = open_store(uri)
    rng = np.random.default_rng(5)
    write_shards(store, [make_episodes(rng, PER_STEP + 5)])
    thread, box = _run_in_thread(learner_of(uri))

    def flow() -> dict:
        try:
            return json.loads(store.read_bytes(RunLayout.FLOW))
        except NotFound:  # not written yet
            return {}

    _wait_for(lambda: flow().get("needs") == PER_STEP - 5, 60, "the learner's needs")
    assert flow()["consumed_total"] == PER_STEP  # after the first step
    write_shards(store, [make_episodes(rng, PER_STEP - 5)])
    thread.join(60)
    assert "error" not in box and box["summary"]["steps"] == 2, box
