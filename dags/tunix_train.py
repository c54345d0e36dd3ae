"""`tunix_train`: one asynchronous RL training run, triggered by hand with params.

```
prepare (setup) ─┬─> actor [0..N) (mapped, pool cpu) ──────────────┐
                 └─> learner (pool tpu, retries resume) ─> stop_fleet ─> report
                                                           (teardown)    (teardown)
```

- `prepare` validates the form through `tunix_tasks.frontdoor.entrypoints.prepare_run` (a bad
  value fails the task without retrying, naming the field), writes `config.json`, clears
  a previous DONE marker and returns the run URI and the actor ids. The run is keyed by
  the `run_name` param, else by the Airflow `run_id` (never by `logical_date`, which is
  None for runs triggered from the UI or REST).
- The actors and the learner run *concurrently*; the object store is the buffer.
- The learner posts a `tunix_weights` asset event per weight snapshot (REST), which
  schedules `tunix_eval`.
- `stop_fleet` marks the run DONE as soon as the learner ends, even when it failed, so
  no actor outlives it; `report` writes the HTML report. Both are teardowns: the run's
  state is the state of the actors and the learner.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from airflow.sdk import dag, task
from tunix_common import (
    fleet,
    publish_run_info,
    run_config_from_params,
    sanitize_run_name,
    training_params,
)


@task(retries=1, retry_delay=timedelta(seconds=5))
def prepare(params: dict | None = None, run_id: str | None = None) -> list[dict]:
    """Validate the params, write the run's config.json; return the actors' kwargs."""
    from airflow.sdk.exceptions import AirflowFailException
    from tunix_common import entrypoints

    ep = entrypoints()
    from tunix_tasks.config import ConfigError, apply_overrides

    params = dict(params or {})
    run_name = params.get("run_name") or sanitize_run_name(run_id or "run")
    try:
        config = apply_overrides(
            run_config_from_params(params, run_name), params.get("overrides") or []
        )
        run_uri = ep.prepare_run(config, run_name=run_name)
    except (ConfigError, ValueError) as err:
        raise AirflowFailException(f"invalid run configuration: {err}") from err  # no retry
    return publish_run_info(
        run_uri, int(config["actor"]["num_actors"]), deadline_s=config.get("deadline_s") or 0
    )


@dag(
    dag_id="tunix_train",
    schedule=None,
    start_date=datetime(2025, 1, 1),
    catchup=False,
    tags=["tunix", "rl", "training"],
    params=training_params(),
    doc_md=__doc__,
    default_args={"owner": "tunix"},
    render_template_as_native_obj=True,
)
def tunix_train():
    fleet(prepare())


tunix_train()
