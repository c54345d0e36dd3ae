"""`dag.test()` of each DAG, in-process, with the real library (tiny model, seconds).

`dag.test()` runs tasks one after another, so the actors (which run until the run is
DONE) are marked successful instead of run (`mark_success_pattern`): this checks the
wiring prepare/resume -> learner -> stop_fleet -> report and the eval DAG's params path.
Actors and learner running *concurrently* are checked by `test_cluster.py`.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip(
    "tunix_tasks.frontdoor.entrypoints", reason="tunix_tasks.frontdoor.entrypoints not written yet"
)
pytest.importorskip(
    "tunix_tasks.frontdoor.report", reason="tunix_tasks.frontdoor.report not written yet"
)
pytest.importorskip(
    "tunix_tasks.frontdoor.evaluate", reason="tunix_tasks.frontdoor.evaluate not written yet"
)

pytestmark = [pytest.mark.airflow, pytest.mark.slow]

FAST = [
    "learner.data_timeout_s=60",
    "learner.batch_rows=8",  # divisible by the 8 test devices (tests/conftest.py)
    "learner.min_episodes_per_step=8",
    "actor.episodes_per_shard=8",
    "actor.shard_interval_s=3",
]


AUTOPILOT = [
    "actor.flow_control=true",
    "actor.autopilot.enabled=true",
    "actor.autopilot.max_actors=2",
]


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return f"file://{tmp_path_factory.mktemp('runs')}"


def _states(dag_run) -> dict[str, str]:
    return {ti.task_id: str(ti.state) for ti in dag_run.get_task_instances()}


def test_train_dag_in_process(airflow_db, dagbag, store):
    from tunix_tasks.storage.layout import RunLayout
    from tunix_tasks.storage.store import open_store

    dag = dagbag.dags["tunix_train"]
    conf = {
        "store": store,
        "run_name": "dagtest",
        "num_actors": 1,
        "envs_per_actor": 2,
        "max_steps": 2,
        "deadline_s": 20,
        "warm_start_steps": 0,  # the form's default is the demo's recipe: 140
        "env_latency_s": None,  # empty: the config's default, no latency
        # the autopilot on: the DAG maps max_actors actors, the learner task parks the surplus
        "overrides": [*FAST, *AUTOPILOT],
    }
    dr = dag.test(run_conf=conf, mark_success_pattern=r"^actor$")
    states = _states(dr)
    assert dr.state == "success", states
    assert states["prepare"] == states["learner"] == states["report"] == "success"
    assert states["stop_fleet"] == "success"
    mapped = sorted(ti.map_index for ti in dr.get_task_instances() if ti.task_id == "actor")
    assert mapped == [0, 1]
    run = open_store(f"{store}/dagtest")
    assert run.exists(RunLayout.CONFIG) and run.exists(RunLayout.LATEST)
    assert run.exists(RunLayout.DONE)
    fleet = json.loads(run.read_bytes(RunLayout.FLEET))  # the autopilot ran beside the learner
    assert fleet["active"] == 1 and fleet["reason"] == "the run's first fleet"


def test_eval_dag_manual_params(airflow_db, dagbag, store):
    """The run is finished and this is its last snapshot: the report (written by the
    fleet's `report` task before any evaluation) is rewritten with the result."""
    import json

    from tunix_tasks.storage.layout import RunLayout
    from tunix_tasks.storage.store import open_store

    run = open_store(f"{store}/dagtest")
    assert json.loads(run.read_bytes(RunLayout.SUMMARY))["evaluations"] == []
    dag = dagbag.dags["tunix_eval"]
    dr = dag.test(run_conf={"run_uri": f"{store}/dagtest"})
    assert dr.state == "success", _states(dr)
    evaluations = json.loads(run.read_bytes(RunLayout.SUMMARY))["evaluations"]
    latest = json.loads(run.read_bytes(RunLayout.LATEST))["version"]
    assert [e["version"] for e in evaluations] == [latest]


def test_recurring_dag_continues_the_run(airflow_db, dagbag, store):
    from tunix_tasks.frontdoor.entrypoints import learner_progress

    before = learner_progress(f"{store}/dagtest")
    dag = dagbag.dags["tunix_recurring"]
    conf = {"store": store, "run_name": "dagtest", "steps_per_interval": 1, "deadline_s": 20}
    dr = dag.test(run_conf=conf, mark_success_pattern=r"^actor$")
    assert dr.state == "success", _states(dr)
    after = learner_progress(f"{store}/dagtest")
    assert after["step"] >= before["step"]


def test_recurring_dag_refuses_a_bad_config(airflow_db, dagbag, store):
    """A run that does not exist yet is created from the params: bad ones fail `resume`."""
    dag = dagbag.dags["tunix_recurring"]
    conf = {"store": store, "run_name": "badrec", "overrides": ["learner.buckets=[7]"]}
    dr = dag.test(run_conf=conf, mark_success_pattern=r"^actor$")
    states = _states(dr)
    assert dr.state == "failed" and states["resume"] == "failed", states
