"""A real Celery deployment: Redis broker, PostgreSQL metadata DB, three Celery workers.

The fixtures start Redis and PostgreSQL (`conftest.celery_services`, the Debian servers
`make services` installs) and `infra/airflow/celery_cluster.py` (what `make
airflow-cluster` runs): scheduler, dag-processor and api-server with the CeleryExecutor,
and the workers `cpu-a`, `cpu-b` (queue `cpu`) and `tpu-a` (queue `tpu`), each in its own
directory as if on its own host; the object store is the only state they share.

One `tunix_train` run goes through the REST API. While its actors run, the cpu worker
that holds an actor is SIGKILLed with everything it started, as a dying host would be.
The test checks from the REST API's task instances (and their tries) that the actors ran
on cpu workers, the learner on `tpu-a`, and the dead worker's actors were retried on the
other cpu worker; that the run succeeded; and, from the store, that nothing was lost:
the dead actor's shards are intact and accounted for in the learner's ledger, and every
accounted episode comes from a shard, once. Then it stops everything and checks that no
process is left.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from datetime import datetime
from typing import TYPE_CHECKING, Any

import pyarrow.parquet as pq
import pytest

from tunix_tasks.learner.checkpoint import read_ledger
from tunix_tasks.storage.layout import RunLayout
from tunix_tasks.storage.metrics import read_metrics
from tunix_tasks.storage.store import ObjectStore, open_store

from .conftest import SMALL_RUN_OVERRIDES, running, small_train_conf

if TYPE_CHECKING:
    from celery_cluster import CeleryAirflow

pytestmark = [pytest.mark.airflow, pytest.mark.slow, pytest.mark.timeout(600)]

RUN = "celery-e2e"
CONF = small_train_conf(
    RUN,
    max_steps=12,
    deadline_s=300,
    overrides=[*SMALL_RUN_OVERRIDES, "learner.checkpoint_every=4"],
)
#: How long a dead worker's task keeps "running" before the scheduler fails it (then
#: retries it on a live worker). Task runners heartbeat every 5 s.
HEARTBEAT_TIMEOUT_S = 30


@pytest.fixture(scope="module")
def cluster(celery_services, tmp_path_factory):
    from celery_cluster import CeleryAirflow

    redis, postgres = celery_services
    store = f"file://{tmp_path_factory.mktemp('runs')}"
    af = CeleryAirflow.on(
        redis,
        postgres,
        tmp_path_factory.mktemp("cluster"),
        parallelism=8,
        cpu_slots=6,
        tpu_slots=1,
        triggerer=False,
        heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S,
    )
    af.env["TUNIX_STORE"] = store
    af.env["TUNIX_LEARNER_RETRY_DELAY_S"] = "35"
    af.env["TUNIX_AIRFLOW_ASSET_EVENTS"] = "0"  # tunix_eval stays paused: spare the 2 cores
    af.env["TUNIX_CHECK_POOLS"] = "1"
    af.store = store
    with running(af, ["tunix_train"], ["tunix_train"]):
        yield af


def _task_instances(af: CeleryAirflow, run_id: str) -> list[dict]:
    path = f"/api/v2/dags/tunix_train/dagRuns/{run_id}/taskInstances?limit=100"
    return af.request("GET", path)["task_instances"]


def _tries(af: CeleryAirflow, run_id: str, task_id: str, map_index: int = -1) -> list[dict]:
    path = f"/api/v2/dags/tunix_train/dagRuns/{run_id}/taskInstances/{task_id}/{map_index}/tries"
    return sorted(af.request("GET", path)["task_instances"], key=lambda t: t["try_number"])


def _wait(what: str, check: Callable[[], Any], timeout: float, af: CeleryAirflow) -> Any:
    """Poll `check` every 2 s until it returns something true; fail if a component died."""
    deadline = time.monotonic() + timeout
    while True:
        af.check_alive()
        if result := check():
            return result
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not after {timeout:.0f}s")
        time.sleep(2)


def _ts(value: str) -> float:
    return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()


def _episode_ids(store: ObjectStore, key: str) -> list[str]:
    """The episode ids of one shard (its `episode_id` column only)."""
    with store.open_input(key) as f:
        return pq.read_table(f, columns=["episode_id"]).column("episode_id").to_pylist()


def _shards(store: ObjectStore, prefix: str) -> list[str]:
    return [i.key for i in store.list(prefix) if i.key.endswith(".parquet")]


def test_fleet_on_celery_workers_survives_a_dead_cpu_worker(cluster):
    af = cluster
    t0 = time.monotonic()
    run = af.request(
        "POST",
        "/api/v2/dags/tunix_train/dagRuns",
        {"logical_date": None, "conf": {**CONF, "store": af.store}},
    )
    run_id = run["dag_run_id"]
    store = open_store(f"{af.store}/{RUN}")

    # Both actors running, the learner training: pick the cpu worker holding an actor.
    def running_actors() -> list[dict] | None:
        actors = [t for t in _task_instances(af, run_id) if t["task_id"] == "actor"]
        ok = len(actors) == 2 and all(t["state"] == "running" and t["hostname"] for t in actors)
        return actors if ok else None

    actors = _wait("both actors running", running_actors, 240, af)
    hosts = {t["map_index"]: t["hostname"] for t in actors}
    assert set(hosts.values()) <= {"cpu-a", "cpu-b"}, hosts
    victim = max(set(hosts.values()), key=list(hosts.values()).count)
    survivor = ({"cpu-a", "cpu-b"} - {victim}).pop()
    doomed = sorted(i for i, h in hosts.items() if h == victim)
    folders = [f"{RunLayout.SHARDS}actor-{i:04d}/" for i in doomed]

    def written() -> bool:
        if not store.exists(RunLayout.CONFIG):
            return False
        steps = [r for r in read_metrics(store, "learner") if "loss" in r]
        return bool(steps) and all(_shards(store, f) for f in folders)

    _wait("the victim's actors wrote shards and the learner trained", written, 240, af)
    before = {k for f in folders for k in _shards(store, f)}
    t_kill, t_kill_wall = time.monotonic(), time.time()
    killed = af.kill_worker(victim)
    print(
        f"{t_kill - t0:.0f}s: killed {victim} ({len(killed)} processes) running actors "
        f"{doomed} after {len(before)} of their shards; placement {hosts}"
    )

    def finished() -> dict | None:
        run = af.request("GET", f"/api/v2/dags/tunix_train/dagRuns/{run_id}")
        return run if run["state"] in ("success", "failed") else None

    run = _wait("the DAG run finished", finished, 360, af)
    tis = _task_instances(af, run_id)
    summary = {
        f"{t['task_id']}[{t['map_index']}]": (t["state"], t["hostname"], t["try_number"])
        for t in tis
    }
    print(f"run {run['state']} {time.monotonic() - t0:.0f}s after the trigger: {summary}")
    assert run["state"] == "success", json.dumps(summary)
    assert all(t["state"] == "success" for t in tis), summary

    # Placement: actors (and the cpu-queue control tasks) on cpu workers, learner on tpu-a.
    for t in tis:
        want = {"tpu-a"} if t["task_id"] == "learner" else {"cpu-a", "cpu-b"}
        assert t["hostname"] in want, (t["task_id"], t["map_index"], t["hostname"])
    (learner,) = [t for t in tis if t["task_id"] == "learner"]
    assert learner["try_number"] == 1, "the learner's worker was not touched"
    # The dead worker's actors: attempt 1 failed there (no heartbeat), the retry ran on
    # the survivor and succeeded; the other actor was not disturbed.
    retried_after = []
    for i in (0, 1):
        tries = _tries(af, run_id, "actor", i)
        seen = [(t["try_number"], t["hostname"], t["state"]) for t in tries]
        if i in doomed:
            assert seen[0][1:] == (victim, "failed"), seen
            assert seen[-1][1:] == (survivor, "success") and seen[-1][0] >= 2, seen
            failed_s = _ts(tries[0]["end_date"]) - t_kill_wall
            restarted_s = _ts(tries[-1]["start_date"]) - t_kill_wall
            retried_after.append(
                f"actor {i}: {seen}; attempt 1 failed {failed_s:.0f}s after the kill, "
                f"attempt {seen[-1][0]} started after {restarted_s:.0f}s"
            )
        else:
            assert seen == [(1, survivor, "success")], seen
    print("retries:", retried_after)

    # Nothing lost. Every episode the learner accounted for (trained or dropped) comes
    # from a shard in the store, and is accounted once ...
    ledger = read_ledger(store)
    accounted = [i for e in ledger for i in e["trained"]]
    accounted += [i for e in ledger for ids in e["dropped"].values() for i in ids]
    assert len(accounted) == len(set(accounted)) > 0
    shards = _shards(store, RunLayout.SHARDS)
    quarantined = _shards(store, RunLayout.QUARANTINE)
    written_ids = {i for k in shards + quarantined for i in _episode_ids(store, k)}
    assert set(accounted) <= written_ids, set(accounted) - written_ids
    # ... no shard was torn by the kill ...
    originals = [k[len(RunLayout.QUARANTINE) :] for k in quarantined]
    reasons = [
        json.loads(store.read_bytes(RunLayout.quarantine_reason(k)))["reason"] for k in originals
    ]
    assert "corrupt" not in reasons, reasons
    # ... and every shard the dead worker's actors wrote is intact and fully accounted.
    assert before <= set(shards), before - set(shards)
    unaccounted = {k: n for k in before if (n := set(_episode_ids(store, k)) - set(accounted))}
    assert not unaccounted, unaccounted
    after = {k for f in folders for k in _shards(store, f)} - before
    steps = max(r["step"] for r in read_metrics(store, "learner") if "loss" in r)
    assert steps == CONF["max_steps"]
    print(
        f"{len(shards)} shards ({len(before)} by the dead attempt, {len(after)} by the "
        f"retries), {len(quarantined)} quarantined {reasons}, {len(set(accounted))} episodes "
        f"accounted; run took {time.monotonic() - t0:.0f}s, {time.monotonic() - t_kill:.0f}s "
        "after the kill"
    )


def test_stop_leaves_no_process(cluster, celery_services):
    redis, postgres = celery_services
    assert cluster.pids(), "the cluster should be running before stop()"
    t0 = time.monotonic()
    assert cluster.stop() == []
    assert postgres.stop() == [] and redis.stop() == []
    print(f"stopped cluster, PostgreSQL and Redis in {time.monotonic() - t0:.0f}s")
