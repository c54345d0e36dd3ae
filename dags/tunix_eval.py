"""`tunix_eval`: evaluate each new weight snapshot, scheduled on the `tunix_weights` asset.

The learner task posts an asset event per new snapshot with `extra={"run_uri", "version", "path"}`.
Airflow may fold several queued events into one DAG run: the task evaluates the newest
version of every run among them (older ones are superseded and only logged).
`evaluate_snapshot` writes `<run_uri>/eval/v{version}.json`; the results are also
returned as XCom. When the evaluated snapshot is the last one of a finished run, the run's
report is written again so that it shows this result (the fleet's `report` task ran first). Trigger by hand with `run_uri` (and optionally `version`) to evaluate
any run's snapshot.
"""

from __future__ import annotations

import logging
from datetime import datetime, timedelta

from airflow.sdk import Param, dag, task
from tunix_fleet import CPU_POOL
from tunix_launchers import entrypoints
from tunix_weights import WEIGHTS_ASSET

log = logging.getLogger(__name__)


def latest_per_run(extras: list[dict]) -> dict[str, int | None]:
    """{run_uri: newest version} among asset-event extras (missing version = LATEST)."""
    newest: dict[str, int | None] = {}
    for extra in extras:
        run_uri = extra.get("run_uri")
        if not run_uri:
            continue
        version = extra.get("version")
        version = None if version is None else int(version)
        if run_uri not in newest or (
            version is not None and (newest[run_uri] is None or version > newest[run_uri])
        ):
            newest[run_uri] = version
    return newest


@task(pool=CPU_POOL, queue=CPU_POOL, retries=1, retry_delay=timedelta(seconds=10))
def evaluate(triggering_asset_events=None, params: dict | None = None) -> list[dict]:
    """Evaluate the snapshots named by the triggering events (or by the params)."""
    extras: list[dict] = []
    for events in (triggering_asset_events or {}).values():
        extras.extend(dict(e.extra or {}) for e in events)
    if not extras and params and params.get("run_uri"):
        extras = [{"run_uri": params["run_uri"], "version": params.get("version")}]
    if not extras:
        from airflow.sdk.exceptions import AirflowSkipException

        raise AirflowSkipException("no tunix_weights event and no run_uri param")
    todo = latest_per_run(extras)
    log.info("events: %s -> evaluating %s", extras, todo)

    lib = entrypoints()
    results = []
    for run_uri, version in todo.items():
        result = dict(lib.evaluate_snapshot(run_uri, version))
        result.setdefault("run_uri", run_uri)
        log.info("eval %s v%s: %s", run_uri, result.get("version"), result)
        report = lib.report_after_eval(run_uri, int(result["version"]))
        if report:
            log.info("the run is finished: report rewritten with this evaluation: %s", report)
        results.append(result)
    return results


@dag(
    dag_id="tunix_eval",
    schedule=[WEIGHTS_ASSET],
    start_date=datetime(2025, 1, 1),
    catchup=False,
    max_active_runs=1,
    tags=["tunix", "rl", "eval"],
    params={
        "run_uri": Param(
            None,
            type=["null", "string"],
            description="Manual runs only: the run to evaluate (asset events carry their own).",
        ),
        "version": Param(
            None,
            type=["null", "integer"],
            minimum=0,
            description="Manual runs only: snapshot version (empty: the LATEST one).",
        ),
    },
    doc_md=__doc__,
    default_args={"owner": "tunix"},
)
def tunix_eval():
    evaluate()


tunix_eval()
