"""`tunix_train`: one asynchronous RL training run, triggered by hand with params.

```
prepare (setup) ─┬─> actor [0..N) (mapped, pool cpu) ──────────────┐
                 └─> learner (pool tpu, retries resume) ─> stop_fleet ─> report
                                                           (teardown)    (teardown)
```

- `prepare` checks that the pools `cpu` and `tpu` exist (else it fails naming the
  `airflow pools set` commands) and that the trigger conf has no unknown key (a typo),
  validates the form through `tunix_tasks.frontdoor.entrypoints.prepare_run` (a bad
  value fails the task without retrying, naming the field), writes the run's config,
  clears a previous DONE marker and returns the run URI and the actor ids. The run is keyed by
  the `run_name` param, else by the Airflow `run_id` (never by `logical_date`, which is
  None for runs triggered from the UI or REST).
- The actors and the learner run *concurrently*; the object store is the buffer.
- While the learner runs, its task posts a `tunix_weights` asset event (REST) for each
  new weight snapshot it sees in the run's store; the events schedule `tunix_eval`.
- `stop_fleet` marks the run DONE as soon as the learner ends, even when it failed, so
  no actor outlives it; `report` writes the HTML report. Both are teardowns: the run's
  state is the state of the actors and the learner.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from airflow.sdk import dag, task
from tunix_fleet import fleet, preflight, publish_run_info
from tunix_launchers import entrypoints
from tunix_params import (
    run_config_from_params,
    sanitize_run_name,
    training_params,
)


@task(retries=1, retry_delay=timedelta(seconds=5))
def prepare(params: dict | None = None, run_id: str | None = None) -> list[dict]:
    """Validate the params, write the run's config; return the actors' kwargs."""
    from airflow.sdk.exceptions import AirflowFailException

    params = dict(params or {})
    preflight()
    ep = entrypoints()
    from tunix_tasks.config import ConfigError, config_from_dict

    run_name = params.get("run_name") or sanitize_run_name(run_id or "run")
    try:
        cfg = config_from_dict(
            run_config_from_params(params, run_name), params.get("overrides") or []
        )
        run_uri = ep.prepare_run(cfg)
    except (ConfigError, ValueError) as err:
        raise AirflowFailException(f"invalid run configuration: {err}") from err  # no retry
    return publish_run_info(run_uri, ep.launched_actors(cfg), deadline_s=cfg.deadline_s)


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
