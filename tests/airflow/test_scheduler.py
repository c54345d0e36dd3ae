"""A real Airflow: scheduler + dag-processor + api-server (LocalExecutor, SQLite).

The fixture starts the components with `infra/airflow/local_airflow.py` (what
`make airflow` runs) in a temporary AIRFLOW_HOME on a free loopback port, and stops
them at the end, checking that no process of theirs (tasks included) is left.

One training run goes through the REST API exactly as a user's would: trigger
`tunix_train` with `conf`, poll, then check that it succeeded, that the actors ran at
the same time as the learner, that weight snapshots were published, that the learner
task's asset events (its watcher of `weights/LATEST`) scheduled `tunix_eval`, and that
the run is DONE.
"""

from __future__ import annotations

import json
import time
import urllib.error
from datetime import datetime

import pytest

from tunix_tasks.storage.layout import RunLayout

from .conftest import running, small_train_conf

pytestmark = [pytest.mark.airflow, pytest.mark.slow, pytest.mark.timeout(600)]

RUN = "sched-e2e"
CONF = small_train_conf(RUN)


@pytest.fixture(scope="module")
def airflow(tmp_path_factory):
    from local_airflow import LocalAirflow

    home = tmp_path_factory.mktemp("airflow_home")
    store = f"file://{tmp_path_factory.mktemp('runs')}"
    af = LocalAirflow(home, parallelism=8, cpu_slots=6, tpu_slots=1, triggerer=False)
    af.env["TUNIX_STORE"] = store
    af.env["TUNIX_LEARNER_RETRY_DELAY_S"] = "35"
    af.env["TUNIX_AIRFLOW_ASSET_EVENTS"] = "1"  # conftest turns them off for dag.test()
    af.env["TUNIX_CHECK_POOLS"] = "1"  # conftest turns it off for dag.test(); check for real
    af.store = store
    with running(
        af, ["tunix_train", "tunix_eval", "tunix_recurring"], ["tunix_train", "tunix_eval"]
    ):
        yield af


def _post_error(af, path: str, body: dict) -> tuple[int, str]:
    try:
        af.request("POST", path, body)
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()
    return 200, ""


@pytest.mark.parametrize(
    ("param", "value"), [("num_actors", -1), ("env_max_turns", 65), ("max_staleness", "x")]
)
def test_trigger_with_invalid_params_is_rejected(airflow, param, value):
    code, detail = _post_error(
        airflow,
        "/api/v2/dags/tunix_train/dagRuns",
        {"logical_date": None, "conf": {**CONF, param: value}},
    )
    print(f"{param}={value!r}: HTTP {code} {detail}")
    assert code == 400, detail
    assert param in detail, detail


def _ts(value: str) -> datetime:
    return datetime.fromisoformat(value.replace("Z", "+00:00"))


def _wait_run(af, dag_id: str, run_id: str, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        af.check_alive()
        run = af.request("GET", f"/api/v2/dags/{dag_id}/dagRuns/{run_id}")
        if run["state"] in ("success", "failed"):
            return run
        if time.monotonic() > deadline:
            raise TimeoutError(f"{dag_id}/{run_id} still {run['state']} after {timeout:.0f}s")
        time.sleep(3)


def test_train_run_end_to_end(airflow):
    from tunix_tasks.storage.store import open_store
    from tunix_tasks.storage.weights import read_latest

    af = airflow
    t0 = time.monotonic()
    conf = {**CONF, "store": af.store}
    run = af.request(
        "POST", "/api/v2/dags/tunix_train/dagRuns", {"logical_date": None, "conf": conf}
    )
    run_id = run["dag_run_id"]
    run = _wait_run(af, "tunix_train", run_id, timeout=360)
    tis = af.request("GET", f"/api/v2/dags/tunix_train/dagRuns/{run_id}/taskInstances?limit=100")
    tis = tis["task_instances"]
    summary = {
        (t["task_id"], t["map_index"]): (t["state"], t.get("rendered_map_index")) for t in tis
    }
    print(f"tunix_train finished in {time.monotonic() - t0:.0f}s: {summary}")
    assert run["state"] == "success", json.dumps(summary, default=str)
    assert all(t["state"] == "success" for t in tis), summary

    # actors ran concurrently with the learner
    actors = [t for t in tis if t["task_id"] == "actor"]
    (learner,) = [t for t in tis if t["task_id"] == "learner"]
    assert sorted(t["map_index"] for t in actors) == [0, 1]
    assert sorted(t["rendered_map_index"] for t in actors) == ["actor 0", "actor 1"]
    for a in actors:
        assert _ts(a["start_date"]) < _ts(learner["end_date"]), (a, learner)
        assert _ts(learner["start_date"]) < _ts(a["end_date"]), (a, learner)

    # snapshots were published, the run is DONE (so no actor outlives it), report written
    run_uri = f"{af.store}/{RUN}"
    store = open_store(run_uri)
    assert store.exists(RunLayout.LATEST)
    assert store.exists(RunLayout.DONE)
    xcom = af.request(
        "GET",
        f"/api/v2/dags/tunix_train/dagRuns/{run_id}/taskInstances/learner/xcomEntries/return_value",
    )
    learned = xcom["value"]
    if isinstance(learned, str):  # older API versions return XCom values as repr strings
        import ast

        learned = ast.literal_eval(learned)
    assert learned["steps"] >= CONF["max_steps"]
    assert learned["asset_events_posted"] and not learned["asset_events_failed"], learned
    # the learner task's watcher announced the final weights/LATEST
    assert max(learned["asset_events_posted"]) == read_latest(store)[0]

    # the learner's asset events (posted through REST) carry the run and version ...
    events = af.request("GET", "/api/v2/assets/events?limit=100")["asset_events"]
    ours = [e["extra"] for e in events if e["extra"].get("run_uri") == run_uri]
    assert sorted(e["version"] for e in ours) == sorted(learned["asset_events_posted"])
    assert all(e["path"].startswith(run_uri) for e in ours)

    # ... and scheduled tunix_eval, which evaluated a snapshot
    deadline = time.monotonic() + 180
    while True:
        evals = af.request("GET", "/api/v2/dags/tunix_eval/dagRuns?limit=50")["dag_runs"]
        if any(r["state"] == "success" for r in evals) and not any(
            r["state"] in ("queued", "running") for r in evals
        ):
            break
        assert not any(r["state"] == "failed" for r in evals), evals
        assert time.monotonic() < deadline, f"tunix_eval did not succeed: {evals}"
        time.sleep(3)
    assert all(r["run_type"] == "asset_triggered" for r in evals)
    assert [o for o in store.list(RunLayout.EVAL)], "evaluate_snapshot wrote no eval/v*.json"
    print(f"end to end (train + eval) in {time.monotonic() - t0:.0f}s")


def test_stop_leaves_no_process(airflow):
    assert airflow.pids(), "components should be running before stop()"
    assert airflow.stop() == []
