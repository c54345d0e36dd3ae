"""The fleet of a training DAG: actors ∥ learner, then the `stop_fleet` / `report` teardowns.

`fleet(setup)` wires, under a setup task that returned `publish_run_info(...)`:

```
setup ─┬─> actor [0..N) (mapped, pool cpu) ─────────────────┐
       └─> learner (pool tpu, retries resume) ─> stop_fleet ─> report
```

Used by `tunix_train` and `tunix_recurring`. The tasks call the library only through
`tunix_launchers` (in the task process or a pod) at run time.

Every task joins the run as the setup task prepared it (its `run_id`, passed on as
`run_incarnation`: Airflow's own `run_id` names the DAG run). Should the run be deleted,
or deleted and created again by another DAG run, while this one is active, its actors
and learner stop (or refuse to start, on a retry) and fail without another retry, and its
`stop_fleet` leaves the other run's actors running.
"""

from __future__ import annotations

import logging
import os
from datetime import timedelta
from typing import Any

from airflow.sdk import task
from tunix_launchers import (
    entrypoints,
    failing_when_fenced,
    launch_actor,
    launch_learner,
    prepared_incarnation,
)
from tunix_params import check_conf_keys
from tunix_weights import LearnerProgressLog, WeightsEventPublisher, WeightsWatcher

log = logging.getLogger(__name__)

#: Pools (and, for Celery/Kubernetes executors, queues) of the two kinds of worker.
CPU_POOL = os.environ.get("TUNIX_CPU_POOL", "cpu")
TPU_POOL = os.environ.get("TUNIX_TPU_POOL", "tpu")
#: Hard limits on the long tasks; the run's own `deadline_s` normally ends them first.
LEARNER_TIMEOUT = timedelta(hours=float(os.environ.get("TUNIX_LEARNER_TIMEOUT_H", "24")))
ACTOR_TIMEOUT = timedelta(hours=float(os.environ.get("TUNIX_ACTOR_TIMEOUT_H", "24")))


#: `airflow pools set` commands that create the pools (what `make airflow-init` does locally).
POOL_COMMANDS = {
    CPU_POOL: f'airflow pools set {CPU_POOL} 16 "tunix actors (one slot per actor)"',
    TPU_POOL: f'airflow pools set {TPU_POOL} 1 "tunix learners (one slot per accelerator slice)"',
}


def preflight() -> None:
    """What `prepare`/`resume` check before touching the run: every trigger-conf key is a
    declared param (a typo fails, no retry) and the fleet's pools exist."""
    from airflow.sdk import get_current_context
    from airflow.sdk.exceptions import AirflowFailException

    try:
        ctx = get_current_context()  # `params` has the conf merged in: use the DAG's
        check_conf_keys(getattr(ctx["dag_run"], "conf", None), ctx["dag"].params.keys())
    except ValueError as err:
        raise AirflowFailException(str(err)) from err  # no retry
    check_pools()


def check_pools(pools: tuple[str, ...] = (CPU_POOL, TPU_POOL), client: Any = None) -> None:
    """Fail fast when a pool the fleet uses does not exist (called by the setup task).

    A task in a missing pool stays "scheduled" forever with only a scheduler log line
    (plain `airflow standalone` creates no pools). Asks the REST API (`tunix_api`); when
    the API cannot answer (no server, no credentials) it logs a warning and goes on.
    `TUNIX_CHECK_POOLS=0` skips the check.
    """
    if os.environ.get("TUNIX_CHECK_POOLS", "1").strip().lower() in ("0", "false", "no"):
        return
    from airflow.sdk.exceptions import AirflowFailException

    wanted = list(dict.fromkeys(pools))
    commands = [POOL_COMMANDS.get(p, f'airflow pools set {p} 1 "tunix"') for p in wanted]
    try:
        if client is None:
            from tunix_api import AirflowApiClient

            client = AirflowApiClient.from_environment(attempts=1, timeout_s=5.0)
        existing = client.pool_names()
    except Exception as err:  # the check must not be what breaks a run
        log.warning(
            "could not check that the pools %s exist (%s); if the actors or the learner stay "
            "'scheduled', create them: %s",
            wanted,
            err,
            "; ".join(commands),
        )
        return
    missing = [c for p, c in zip(wanted, commands, strict=True) if p not in existing]
    if missing:
        names = [p for p in wanted if p not in existing]
        raise AirflowFailException(
            f"Airflow pool(s) {', '.join(map(repr, names))} do not exist: the actors/learner "
            f"would stay 'scheduled' forever. Create them, then clear this task: "
            + "; ".join(missing)
            + " (locally: make airflow-init)"
        )
    log.info("pools %s exist", wanted)


def optional_deadline(value: Any) -> float | None:
    value = float(value or 0)
    return value if value > 0 else None


def quiet_library_loggers() -> None:
    """Raise the chatty libraries' loggers (orbax's checkpoint INFO lines, absl) to WARNING
    in the task process, so the task log shows the learner's progress lines."""
    for name in ("absl", "orbax", "orbax.checkpoint", "jax._src.xla_bridge", "etils"):
        logging.getLogger(name).setLevel(logging.WARNING)


def _label_map_index(label: str) -> None:
    from airflow.sdk import get_current_context

    get_current_context()["tunix_label"] = label


@task(
    pool=CPU_POOL,
    queue=CPU_POOL,
    retries=2,
    retry_delay=timedelta(seconds=10),
    execution_timeout=ACTOR_TIMEOUT,
    map_index_template="{{ tunix_label }}",
)
def actor(
    run_uri: str,
    actor_id: int,
    deadline_s: float | None = None,
    run_incarnation: str | None = None,
) -> dict:
    """One CPU actor: steps its envs and writes shards until the run is DONE."""
    _label_map_index(f"actor {actor_id}")
    with failing_when_fenced():
        return launch_actor(
            run_uri,
            int(actor_id),
            deadline_s=optional_deadline(deadline_s),
            run_id=run_incarnation,
        )


@task(
    pool=TPU_POOL,
    queue=TPU_POOL,
    retries=2,
    # > learner.lease_ttl_s (30 s): a crashed learner's lease must expire before the retry
    # takes it over, else the retry fails with LeaseHeldError.
    retry_delay=timedelta(seconds=float(os.environ.get("TUNIX_LEARNER_RETRY_DELAY_S", "45"))),
    execution_timeout=LEARNER_TIMEOUT,
)
def learner(
    run_uri: str,
    max_steps: int | None = None,
    deadline_s: float | None = None,
    num_actors: int | None = None,
    setup_task: str | None = None,
) -> dict:
    """The learner: trains from the shards, publishes snapshots (+ asset events).

    A retry resumes from the latest checkpoint (`run_learner` does that), so `retries`
    turns a crashed or pre-empted learner into a pause rather than a lost run. Meanwhile
    a `WeightsWatcher` announces each new `weights/LATEST` as a `tunix_weights` event,
    and with `actor.autopilot` on, the fleet's autopilot parks the mapped actors it does
    not need (`launch_learner` runs it; the DAG mapped `num_actors` of them).
    """
    quiet_library_loggers()
    publisher = WeightsEventPublisher(run_uri)
    progress = LearnerProgressLog(run_uri)
    with failing_when_fenced(), WeightsWatcher(run_uri, publisher, on_poll=progress):
        summary = launch_learner(
            run_uri,
            max_steps=int(max_steps) if max_steps else None,
            deadline_s=optional_deadline(deadline_s),
            actors=int(num_actors) if num_actors else None,
            run_id=prepared_incarnation(setup_task),
        )
    progress.flush()
    summary = dict(summary or {})
    summary["asset_events_posted"] = publisher.posted
    summary["asset_events_failed"] = publisher.failed
    return summary


@task(pool=CPU_POOL, queue=CPU_POOL, retries=3, retry_delay=timedelta(seconds=5))
def stop_fleet(run_uri: str, setup_task: str | None = None) -> str:
    """Mark the run DONE once the learner has finished, whatever its outcome.

    Actors stop when they see the marker, so no actor outlives its learner. This is a
    teardown: it runs even when the learner failed, and does not change the run's state.
    A run created again under the URI since the setup task is another DAG run's: left
    running.
    """
    from airflow.sdk import get_current_context

    ctx = get_current_context()
    dag_id, run_id = ctx["dag"].dag_id, ctx["run_id"]
    try:  # for the DONE marker's reason only
        states = ctx["ti"].get_task_states(dag_id=dag_id, task_ids=["learner"], run_ids=[run_id])
        learner_state = states.get(run_id, {}).get("learner", "finished")
    except Exception:
        learner_state = "finished"
    reason = f"airflow {dag_id}/{run_id}: learner {learner_state}"
    why_not = entrypoints().mark_done(run_uri, reason, run_id=prepared_incarnation(setup_task))
    if why_not:
        return f"not marked DONE: {why_not}"
    log.info("marked %s DONE: %s", run_uri, reason)
    return reason


@task(pool=CPU_POOL, queue=CPU_POOL, retries=1, retry_delay=timedelta(seconds=5))
def report(run_uri: str) -> str:
    """Write the run's HTML report (works for crashed runs too); returns its URI."""
    uri = entrypoints().write_report(run_uri)
    log.info("report: %s", uri)
    return uri


def publish_run_info(
    run_uri: str, num_actors: int, *, max_steps: int | None = None, deadline_s: float = 0.0
) -> list[dict]:
    """Called by the setup task once it prepared the run: push the run's facts as
    XComs, return the actor kwargs.

    Airflow maps only over a task's `return_value`, so the setup task returns one kwargs
    dict per actor (`actor.expand_kwargs`) and pushes `run_uri`, `run_incarnation` (the
    run's id now), `max_steps`, `deadline_s` and `num_actors` under their own keys for
    the learner and the teardowns.
    """
    from airflow.sdk import get_current_context

    ti = get_current_context()["ti"]
    incarnation = entrypoints().prepared_run_id(run_uri)
    ti.xcom_push(key="run_uri", value=run_uri)
    ti.xcom_push(key="run_incarnation", value=incarnation)
    # 0 = "the config's max_steps": an XCom whose value is None reads back as missing
    # (XComNotFound when the learner's arguments are resolved).
    ti.xcom_push(key="max_steps", value=int(max_steps or 0))
    ti.xcom_push(key="deadline_s", value=float(deadline_s or 0))
    ti.xcom_push(key="num_actors", value=int(num_actors))  # the autopilot's ceiling
    return [
        {
            "run_uri": run_uri,
            "actor_id": i,
            "deadline_s": float(deadline_s or 0),
            "run_incarnation": incarnation,
        }
        for i in range(int(num_actors))
    ]


def fleet(setup: Any):
    """Wire actors ∥ learner → stop_fleet → report under the `setup` task.

    `setup` is the XComArg of a task that returned `publish_run_info(...)`. The setup
    task becomes an Airflow *setup*, `stop_fleet` and `report` its *teardowns*, so the
    DAG run's state is that of the actors and the learner. Returns the report XComArg.
    """
    from airflow.sdk import XComArg

    setup_op = setup.operator
    run_uri = XComArg(setup_op, key="run_uri")
    actors = actor.expand_kwargs(setup)
    learn = learner(
        run_uri=run_uri,
        max_steps=XComArg(setup_op, key="max_steps"),
        deadline_s=XComArg(setup_op, key="deadline_s"),
        num_actors=XComArg(setup_op, key="num_actors"),
        setup_task=setup_op.task_id,  # pulled in the task: absent from an older setup
    )
    stop = stop_fleet(run_uri, setup_op.task_id)
    rep = report(run_uri)
    learn >> stop
    [actors, stop] >> rep
    setup_op.as_setup()
    stop.operator.as_teardown(setups=setup_op)
    rep.operator.as_teardown(setups=setup_op)
    return rep
