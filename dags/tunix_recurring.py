"""`tunix_recurring`: continue a named run for K more learner steps on a schedule.

Each interval (daily by default, `TUNIX_RECURRING_SCHEDULE` to change it):

```
resume (setup) ─┬─> actor [0..N) (pool cpu) ─────────────────────────────┐
                └─> learner(max_steps = current + K) ─> stop_fleet ─> report
```

`resume` reads the run's frozen config with `tunix_tasks.storage.runs.read_config` (the
first time, it creates the run from the params), clears the previous DONE marker through
`prepare_run`, and reads the learner's current step with `learner_progress`. The learner resumes from its latest
checkpoint and marks the run DONE at `current + K` steps, which stops the actors.
`catchup=False` and `max_active_runs=1`: a missed interval is not replayed, and two
intervals never train the same run at once.
"""

from __future__ import annotations

import os
from datetime import datetime, timedelta

from airflow.sdk import Param, dag, task
from tunix_fleet import fleet, preflight, publish_run_info
from tunix_launchers import entrypoints
from tunix_params import run_config_from_params, training_params

SCHEDULE = os.environ.get("TUNIX_RECURRING_SCHEDULE", "@daily")


def _params() -> dict[str, Param]:
    base = training_params(
        run_name="nightly",
        num_actors=1,
        max_steps=1_000_000,
        deadline_s=6 * 3600,
        require_run_name=True,
        titles={
            "run_name": "Run to continue (created with the params below if it does not exist)",
            # the learner gets current + K; max_steps only matters when the run is created
            "max_steps": "Max learner steps (only used when this DAG creates the run)",
        },
    )
    base["steps_per_interval"] = Param(
        50,
        type="integer",
        minimum=1,
        maximum=1_000_000,
        title="Steps per interval",
        description="Learner steps to add to the run each time this DAG runs.",
    )
    return base


@task(retries=1, retry_delay=timedelta(seconds=5))
def resume(params: dict | None = None) -> list[dict]:
    """Reopen (or create) the run; return run_uri, actor ids and the learner's target step."""
    from airflow.sdk.exceptions import AirflowFailException

    preflight()
    ep = entrypoints()
    from tunix_tasks.config import ConfigError, config_from_dict
    from tunix_tasks.storage.layout import RunLayout
    from tunix_tasks.storage.runs import read_config
    from tunix_tasks.storage.store import open_store
    from tunix_tasks.storage.uri import join_uri, normalize_uri

    params = dict(params or {})
    run_name = params["run_name"]
    try:
        run_uri = join_uri(normalize_uri(params["store"]), run_name)
        if open_store(run_uri).exists(RunLayout.CONFIG):
            cfg, _ = read_config(run_uri)  # the run's frozen config
            num_actors = int(params["num_actors"])  # the fleet may change between intervals
        else:
            cfg = config_from_dict(
                run_config_from_params(params, run_name), params.get("overrides") or []
            )
            num_actors = cfg.actor.num_actors
        run_uri = ep.prepare_run(cfg)  # clears the previous DONE marker
    except (ConfigError, ValueError) as err:
        raise AirflowFailException(f"invalid run configuration: {err}") from err
    current = int(ep.learner_progress(run_uri).get("step") or 0)
    target = current + int(params["steps_per_interval"])
    return publish_run_info(
        run_uri,
        ep.launched_actors(cfg, num_actors),
        max_steps=target,
        deadline_s=params.get("deadline_s") or 0,
    )


@dag(
    dag_id="tunix_recurring",
    schedule=SCHEDULE,
    start_date=datetime(2025, 1, 1),
    catchup=False,
    max_active_runs=1,
    tags=["tunix", "rl", "training", "recurring"],
    params=_params(),
    doc_md=__doc__,
    default_args={"owner": "tunix"},
)
def tunix_recurring():
    fleet(resume())


tunix_recurring()
