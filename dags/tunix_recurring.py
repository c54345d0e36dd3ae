"""`tunix_recurring`: continue a named run for K more learner steps on a schedule.

Each interval (daily by default, `TUNIX_RECURRING_SCHEDULE` to change it):

```
resume (setup) ─┬─> actor [0..N) (pool cpu) ─────────────────────────────┐
                └─> learner(max_steps = current + K) ─> stop_fleet ─> report
```

`resume` reads the run's frozen `config.json` (or, the first time, creates the run
from the params), clears the previous DONE marker through `prepare_run`, and reads the
learner's current step with `learner_progress`. The learner resumes from its latest
checkpoint and marks the run DONE at `current + K` steps, which stops the actors.
`catchup=False` and `max_active_runs=1`: a missed interval is not replayed, and two
intervals never train the same run at once.
"""

from __future__ import annotations

import os
from datetime import datetime, timedelta

from airflow.sdk import Param, dag, task
from tunix_common import fleet, publish_run_info, run_config_from_params, training_params

SCHEDULE = os.environ.get("TUNIX_RECURRING_SCHEDULE", "@daily")


def _params() -> dict[str, Param]:
    base = training_params(
        run_name="nightly", num_actors=1, max_steps=1_000_000, deadline_s=6 * 3600
    )
    base["run_name"] = Param(
        "nightly",
        type="string",
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$",
        title="Run name",
        description="The run to continue (created with the params below if it does not exist).",
    )
    base["steps_per_interval"] = Param(
        50,
        type="integer",
        minimum=1,
        maximum=1_000_000,
        title="Steps per interval",
        description="Learner steps to add to the run each time this DAG runs.",
    )
    # max_steps only matters when the run is created here: the learner gets current + K.
    base["max_steps"].description = "Only used when the run is created by this DAG."
    return base


@task(retries=1, retry_delay=timedelta(seconds=5))
def resume(params: dict | None = None) -> list[dict]:
    """Reopen (or create) the run; return run_uri, actor ids and the learner's target step."""
    import json

    from airflow.sdk.exceptions import AirflowFailException
    from tunix_common import entrypoints

    ep = entrypoints()
    from tunix_tasks.config import ConfigError, apply_overrides
    from tunix_tasks.storage.store import join_uri, normalize_uri, open_store

    params = dict(params or {})
    run_name = params["run_name"]
    run_uri = join_uri(normalize_uri(params["store"]), run_name)
    store = open_store(run_uri)
    if store.exists("config.json"):
        config = json.loads(store.read_bytes("config.json"))
        num_actors = int(params["num_actors"])  # the fleet size may change between intervals
    else:
        config = apply_overrides(
            run_config_from_params(params, run_name), params.get("overrides") or []
        )
        num_actors = int(config["actor"]["num_actors"])
    try:
        run_uri = ep.prepare_run(config, run_name=run_name)  # clears the previous DONE marker
    except (ConfigError, ValueError) as err:
        raise AirflowFailException(f"invalid run configuration: {err}") from err
    current = int(ep.learner_progress(run_uri).get("step") or 0)
    target = current + int(params["steps_per_interval"])
    return publish_run_info(
        run_uri, num_actors, max_steps=target, deadline_s=params.get("deadline_s") or 0
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
