"""End-to-end: `tunix-tasks train` with a learner and actor processes (marked slow).

Each test runs the real command in a subprocess, as a user would, on the tiny preset.
The async run on file:// with the live display, the report and the ledger checks is the
learning test's (tests/e2e/test_learning.py: `_check_the_run`); here the sync mode on delta
snapshots and a gs:// run through a store outage.
"""

from __future__ import annotations

import collections
import itertools
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from tunix_tasks.learner.accounting import read_ledger
from tunix_tasks.storage.layout import RunLayout
from tunix_tasks.storage.metrics import read_metrics
from tunix_tasks.storage.runs import is_done
from tunix_tasks.storage.store import open_store
from tunix_tasks.storage.weights import read_latest, read_manifest

pytestmark = pytest.mark.slow

SHORT = [
    "model.preset=tiny",
    "env.name=calculator",
    "env.kwargs.difficulty=1",
    "env.max_turns=3",
    "actor.num_actors=2",
    "actor.envs_per_actor=8",
    "actor.episodes_per_shard=8",
    "actor.shard_interval_s=2",
    "actor.max_new_tokens=8",
    "actor.max_episode_tokens=96",
    "learner.buckets=[64,128]",
    "learner.batch_rows=8",
    "learner.min_episodes_per_step=8",
    "learner.publish_every=1",
    "learner.checkpoint_every=4",
]


def _cmd(
    store: str, run_name: str, *extra: str, mode: str | None = None, quiet: bool = True
) -> list[str]:
    cmd = [sys.executable, "-m", "tunix_tasks.frontdoor.cli", "train", "--json"]
    cmd += ["--quiet"] if quiet else []
    cmd += ["--store", store, "--run-name", run_name]
    if mode:
        cmd += ["--mode", mode]
    for item in (*SHORT, *extra):
        cmd += ["--set", item]
    return cmd


def _run_out(cmd: list[str], cwd: Path, timeout: float = 600) -> tuple[dict, str]:
    out = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    i = out.stdout.index("\n{") + 1
    return json.loads(out.stdout[i:]), out.stdout[:i]


def _run(cmd: list[str], cwd: Path, timeout: float = 600) -> dict:
    return _run_out(cmd, cwd, timeout)[0]


def _train(tmp_path: Path, name: str, *extra: str, mode: str) -> tuple[list[str], dict, Any]:
    """A `train` run that ends cleanly: its command, its summary and its run's store."""
    cmd = _cmd(str(tmp_path / "runs"), name, *extra, mode=mode)
    summary = _run(cmd, tmp_path)
    assert summary["learner_exit_code"] == 0 and summary["actor_exit_codes"] == [0, 0]
    return cmd, summary, open_store(summary["run_uri"])


def test_sync_mode_runs_lockstep_on_delta_snapshots(tmp_path):
    """Sync mode, full fine-tuning publishing deltas between full snapshots (every 3
    versions): actors rebuild deltas and sample only with the newest weights. Issue #31.1:
    the same command again finds the run finished and leaves it alone; with max_steps
    raised it trains on from where it stopped."""
    cmd, summary, store = _train(
        tmp_path, "sync", "learner.max_steps=4", "learner.full_snapshot_every=3", mode="sync"
    )
    steps = [r for r in read_metrics(store, "learner") if "loss" in r]
    assert len(steps) == 4
    # Synchronous: every trained episode came from the newest weights.
    assert all(set(r["staleness"]) == {"0"} for r in steps)
    assert all(r["is_weight_mean"] == pytest.approx(1.0, abs=1e-6) for r in steps)
    kinds = {}
    for info in store.list("weights/"):
        if info.key.endswith("manifest.json"):
            m = read_manifest(store, int(info.key.split("/")[1][1:]))
            kinds[m.version] = m.kind
    assert "delta" in kinds.values() and "full" in kinds.values(), kinds
    versions = {r["weights_version"] for r in read_metrics(store, "actor/")}
    assert any(kinds.get(v) == "delta" for v in versions), (versions, kinds)  # rebuilt one

    kept = (RunLayout.CONFIG, RunLayout.DONE, RunLayout.REPORT, RunLayout.SUMMARY)
    files = {key: store.read_bytes(key) for key in kept}
    again = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stderr[-3000:]
    assert json.loads(again.stdout)["finished"] == (
        f"run {summary['run_uri']} is finished (step 4 of 4); "
        "raise learner.max_steps to continue or use --run-name"
    )
    assert {key: store.read_bytes(key) for key in kept} == files
    more = _run([*cmd, "--set", "learner.max_steps=5"], tmp_path, timeout=300)
    assert more["last_step"]["step"] == 5 and more["actor_exit_codes"] == [0, 0]
    assert [r["step"] for r in read_metrics(store, "learner") if "loss" in r] == [1, 2, 3, 4, 5]


def test_actors_that_reload_every_k_versions_train_stale_data_up_to_the_bound(tmp_path):
    """`actor.reload_every_versions=3` (the staleness study's lever, issue #27): actors
    load a new version only once the learner is 3 ahead, so the learner trains on episodes
    up to its bound old, not only on the newest weights'. Flow control is off: a paused
    actor loads any newer version (tests/unit/actor/test_actor.py), which made the
    versions loaded here depend on timing; without it every load is the lever's."""
    _, _, store = _train(
        tmp_path,
        "stale",
        "learner.max_steps=16",
        "learner.max_staleness=3",
        "actor.reload_every_versions=3",
        "actor.flow_control=false",
        mode="async",
    )
    lags = collections.Counter()
    for r in read_metrics(store, "learner"):
        lags.update({int(k): v for k, v in r.get("staleness", {}).items()})
    assert max(lags) <= 3 and sum(v for k, v in lags.items() if k >= 2) > 0, lags
    jumps = []  # versions between an actor's successive loads (not counting v0)
    for actor in ("actor-0000", "actor-0001"):
        # Versions it sampled with (its shards) or held at a metrics record: each was loaded.
        loaded = {r["weights_version"] for r in read_metrics(store, f"actor/{actor}")}
        for key in (i.key for i in store.list(f"{RunLayout.SHARDS}{actor}/")):
            table = pq.read_table(store.open_input(key), columns=["policy_version"])
            loaded.update(table.column("policy_version").to_pylist())
        jumps += [b - a for a, b in itertools.pairwise(sorted(v for v in loaded if v > 0))]
    assert jumps and min(jumps) >= 3, jumps  # held its weights while the learner moved on


@pytest.mark.gcs
def test_train_rides_out_a_store_outage(tmp_path, monkeypatch):
    """A run on gs:// (a real fake-gcs-server) writes its shards, checkpoints, snapshots
    and report there. Issue #11.8: the store is down for 20 s mid-run, four times the
    per-call retry deadline. Actors keep their episodes and retry with backoff (no actor
    dies or is restarted), the launcher does not hang, and the run finishes (if the
    learner stopped in the outage, the same command resumes it), every trained episode
    accounted once."""
    from tunix_tasks.storage.store import RETRY_DEADLINE_ENV
    from tunix_tasks.testing.gcs_outage import OutageGcs

    # Four times shorter than the outage; not shorter, so a slow answer on a loaded machine
    # is not taken for an outage (a failed ledger write would stop the learner).
    monkeypatch.setenv(RETRY_DEADLINE_ENV, "5")  # inherited by the launcher's children
    # A gs:// run's process logs go to $XDG_CACHE_HOME/tunix-tasks/logs/<run_name>/,
    # appended to: this test's own, not an earlier session's under ~/.cache.
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    with OutageGcs() as gcs:
        store_uri = gcs.new_bucket_uri("runs")
        run_uri = f"{store_uri}/out"
        cmd = _cmd(store_uri, "out", "learner.max_steps=12")
        proc = subprocess.Popen(
            cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        try:
            # Down right after the step-4 checkpoint is committed, so the outage hits
            # publishing, shard polling and the actors' commits (the learner's checkpoint
            # itself is covered by the SIGKILL tests).
            committed = f"{RunLayout.CHECKPOINTS}/4/commit_success.txt"
            deadline = time.monotonic() + 300
            while not open_store(run_uri).exists(committed):
                if proc.poll() is not None or time.monotonic() > deadline:
                    proc.kill()
                    out, err = proc.communicate()
                    pytest.fail(
                        f"no checkpoint 4 (exit {proc.returncode}):\n{out[-2000:]}{err[-3000:]}"
                    )
                time.sleep(0.5)
            gcs.down()
            time.sleep(20)
            gcs.up()
            t_up = time.monotonic()
            out, err = proc.communicate(timeout=300)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
        assert time.monotonic() - t_up < 240, "the launcher hung after the outage"
        assert "\n{" in out, f"no summary (exit {proc.returncode}):\n{err[-3000:]}"
        summary = json.loads(out[out.index("\n{") + 1 :])
        assert summary["actor_exit_codes"] == [0, 0], err[-3000:]
        assert summary["actor_restarts"] == {}
        logs = Path(summary["logs"])
        for name in ("actor-0000", "actor-0001"):
            text = (logs / f"{name}.log").read_text()
            assert "object store unreachable" in text and "reachable again" in text, text[-2000:]
        if proc.returncode != 0:  # the learner may stop in the outage: resume the run
            summary = _run(cmd, tmp_path)
        assert summary["run_uri"] == run_uri
        store = open_store(run_uri)
        assert max(r["step"] for r in _learner_steps(run_uri)) == 12
        assert is_done(store)["reason"].startswith("learner max_steps")
        trained = [i for e in read_ledger(store) for i in e["trained"]]
        assert len(trained) == len(set(trained)) > 0
        # everything of the run is in the bucket
        keys = [i.key for i in store.list()]
        assert any(k.startswith("shards/") for k in keys)
        assert any(k.startswith("learner/checkpoints/") for k in keys)
        assert read_latest(store)[0] >= 12
        assert json.loads(store.read_bytes("report/summary.json"))["steps"] == 12


def _learner_steps(run_uri: str) -> list[dict]:
    try:
        return [r for r in read_metrics(open_store(run_uri), "learner") if "loss" in r]
    except Exception:  # no metrics yet, or the store is down
        return []


#: One slow actor (0.3 s per env step) that cannot feed the learner, the autopilot on and
#: quick to decide.
TOO_SMALL_A_FLEET = [
    "actor.num_actors=1",
    "actor.envs_per_actor=4",
    "env.latency_s=0.3",
    "learner.max_steps=20",
    "actor.flow_control=true",
    "actor.autopilot.enabled=true",
    "actor.autopilot.cooldown_s=5",
    "actor.autopilot.interval_s=1",
]


def test_the_autopilot_grows_a_fleet_too_small_for_the_learner(tmp_path):
    """`train` with `actor.autopilot` on: one slow actor (0.3 s per env step) cannot feed
    the learner, so the launcher starts more, up to the ceiling; each decision is a
    metrics record, and the report's "Autopilot" section lists the changes."""
    store_uri = f"file://{tmp_path}/runs"
    cmd = _cmd(
        store_uri,
        "pilot",
        *TOO_SMALL_A_FLEET,
        "actor.autopilot.max_actors=3",
    )
    summary = _run(cmd, tmp_path, timeout=600)
    assert summary["learner_exit_code"] == 0 and summary["interrupted"] is None
    assert len(summary["actor_exit_codes"]) >= 2, summary  # the autopilot started one more
    assert summary["autopilot"]["changes"][0] == "1 -> 2"
    store = open_store(summary["run_uri"])
    decisions = read_metrics(store, "autopilot")
    grown = [r for r in decisions if r["autopilot"] == "grow"]
    assert grown and grown[0]["actors_before"] == 1, [r["reason"] for r in decisions]
    assert "capacity needs" in grown[0]["reason"]
    assert all(r["actors"] <= 3 for r in decisions)
    assert summary["report"] == f"{summary['run_uri']}/{RunLayout.REPORT}"
    page = store.read_bytes(RunLayout.REPORT).decode()
    assert "<h2>Autopilot</h2>" in page and "1 -&gt; 2" in page


def test_a_fleet_started_at_its_ceiling_parks_the_actors_it_does_not_need(tmp_path):
    """What the Airflow DAGs do with `actor.autopilot` on: every actor up to `max_actors`
    starts (`launched_actors`) and the learner runs beside a `FleetAutopilot`; the actors
    outside its fleet park. One slow actor cannot feed the learner, so the autopilot
    unparks the second, which only then makes episodes that the learner trains."""
    import os

    from tunix_tasks.config import config_from_dict
    from tunix_tasks.frontdoor.entrypoints import actor_name, launched_actors, prepare_run
    from tunix_tasks.frontdoor.fleet import FleetAutopilot
    from tunix_tasks.frontdoor.supervision import close_logs, spawn, stop

    cfg = config_from_dict(
        {"store": f"file://{tmp_path}/runs", "run_name": "parked"},
        [*SHORT, *TOO_SMALL_A_FLEET, "actor.autopilot.max_actors=2"],
    )
    run_uri = prepare_run(cfg)
    assert launched_actors(cfg) == 2
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "JAX_PLATFORMS": "cpu"}
    learner = spawn("learner", ["learner", "--run", run_uri], str(tmp_path), env)
    actors = [
        spawn(actor_name(i), ["actor", "--run", run_uri, "--actor-id", str(i)], str(tmp_path), env)
        for i in range(2)
    ]
    try:
        with FleetAutopilot(run_uri, poll_s=1.0) as pilot:
            assert learner.proc.wait(timeout=600) == 0, (tmp_path / "learner.log").read_text()
        for actor in actors:
            assert actor.proc.wait(timeout=60) == 0
    finally:
        stop([learner, *actors], 15, 10.0)
        close_logs([learner, *actors])
    assert pilot.fleet is not None and pilot.fleet.summary()["changes"][0] == "1 -> 2"
    store = open_store(run_uri)
    grown = [r for r in read_metrics(store, "autopilot") if r["autopilot"] == "grow"]
    assert grown[0]["actors_before"] == 1 and "capacity needs" in grown[0]["reason"]
    second = read_metrics(store, "actor/actor-0001")
    before = [r for r in second if r["time"] < grown[0]["time"]]
    assert before and all(r["parked"] and r["episodes"] == 0 for r in before), before
    assert max(r["reloads"] for r in before) <= 1  # parked: the first weights only
    assert "parked by the autopilot (1 active)" in {r.get("phase") for r in before}
    assert second[-1]["episodes"] > 0 and not second[-1]["parked"]
    made = set()
    for info in store.list(f"{RunLayout.SHARDS}actor-0001/"):
        with store.open_input(info.key) as f:
            made |= set(pq.read_table(f, columns=["episode_id"]).column(0).to_pylist())
    trained = {i for e in read_ledger(store) for i in e["trained"]}
    assert made & trained, "the unparked actor's episodes were trained"


def test_a_parked_actor_on_shifts_gives_its_process_back_and_returns_when_unparked(tmp_path):
    """What an actor's task does on the Kubernetes launcher (`run_actor_shifts`), with a
    real actor process as each shift's pod (`tunix-tasks actor --leave-when-parked`):
    parked at first, it starts nothing; grown over, its process makes episodes; parked
    again, the process commits them and exits while the run goes on; unparked, a new
    process serves. Nothing it made is lost across the shifts."""
    import os
    import threading

    from tunix_tasks.actor.admission import LEFT_PARKED
    from tunix_tasks.config import config_from_dict
    from tunix_tasks.frontdoor.entrypoints import prepare_run
    from tunix_tasks.frontdoor.fleet import run_actor_shifts
    from tunix_tasks.frontdoor.supervision import close_logs, spawn, stop
    from tunix_tasks.storage.runs import mark_done, write_fleet

    cfg = config_from_dict(
        {"store": f"file://{tmp_path}/runs", "run_name": "shifts"},
        [
            *SHORT,
            "actor.num_actors=1",
            "actor.flow_control=true",
            "actor.autopilot.enabled=true",
            "actor.autopilot.max_actors=2",
            "learner.max_steps=100000",
        ],
    )
    run_uri = prepare_run(cfg)
    store = open_store(run_uri)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "JAX_PLATFORMS": "cpu"}
    learner = spawn("learner", ["learner", "--run", run_uri], str(tmp_path), env)
    first = ["actor", "--run", run_uri, "--actor-id", "0"]
    actor0 = spawn("actor-0000", first, str(tmp_path), env)
    shifts: list[tuple[float, dict]] = []  # (when it ended, its summary)

    def pod(seconds_left: float | None) -> dict:
        cmd = [sys.executable, "-m", "tunix_tasks.frontdoor.cli", "actor", "--run", run_uri]
        cmd += ["--actor-id", "1", "--leave-when-parked"]
        with open(tmp_path / f"actor-0001.{len(shifts)}.log", "w") as log:
            done = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=log, text=True)
        assert done.returncode == 0, (tmp_path / f"actor-0001.{len(shifts)}.log").read_text()
        shifts.append((time.time(), json.loads(done.stdout)))
        return shifts[-1][1]

    out: dict = {}
    slot = threading.Thread(
        target=lambda: out.update(run_actor_shifts(run_uri, 1, pod, poll_s=0.2))
    )
    slot.start()

    def wait(what, timeout: float = 240.0):
        end = time.time() + timeout
        while not (got := what()):
            assert time.time() < end and learner.proc.poll() is None, "timed out"
            time.sleep(0.2)
        return got

    def made() -> int:
        return len(store.list(f"{RunLayout.SHARDS}actor-0001/"))

    try:
        wait(lambda: read_latest(store) is not None)
        time.sleep(1.0)
        assert made() == 0 and not shifts  # parked before any fleet file: no process
        write_fleet(store, 2, "grow")
        wait(lambda: made() >= 1)
        write_fleet(store, 1, "shrink")
        left_at, summary = wait(lambda: shifts and shifts[0])
        assert summary["stop_reason"] == LEFT_PARKED and summary["episodes"] > 0
        assert is_done(store) is None and learner.proc.poll() is None  # the run went on
        time.sleep(1.0)
        assert len(shifts) == 1 and slot.is_alive()  # parked: no process
        before = made()
        write_fleet(store, 2, "grow")
        wait(lambda: made() > before)
    finally:
        mark_done(store, "test over")
        slot.join(timeout=120)
        stop([learner, actor0], 15, 10.0)
        close_logs([learner, actor0])
    assert out["shifts"] == 2 and out["stop_reason"].startswith("run done")
    rows = 0
    for info in store.list(f"{RunLayout.SHARDS}actor-0001/"):
        with store.open_input(info.key) as f:
            rows += pq.read_metadata(f).num_rows
    assert rows == out["episodes"] == sum(s["episodes"] for _, s in shifts)
    assert left_at < json.loads(store.read_bytes(RunLayout.DONE))["time"]
