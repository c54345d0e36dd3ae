"""Experiment trackers: the learner's metrics records, also sent to a tracker the user
already runs (`tracker: mlflow`), through its own client and the client's own settings
(`MLFLOW_TRACKING_URI`, `MLFLOW_EXPERIMENT_NAME`, credentials). Off by default and never
required: the JSON-lines records stay the source of truth, and a tracker that fails is
logged once, never raised (as TensorBoard's event files).

A tracker gets what TensorBoard gets (`storage/tensorboard.py`: `scalar_values` at
`scalar_step`); `MetricsWriter(store, "learner", tracker=sink)` feeds it every record:

    sink = open_tracker("mlflow", run_name="demo", run_uri=store.uri, params=flat_config)
    sink.log({"loss": 0.12}, step=3)
    sink.close()

Trackers are a registry (`TRACKERS`: built-ins, and the entry-point group
`tunix_tasks.trackers` for your own): a class taking `(run_name, run_uri, params)` with
`log(scalars, step)` and `close()` (`TrackerSink`), and a `client` attribute, the module
it needs (checked when the config loads; imported only when the learner opens it).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

from tunix_tasks.registry import Registry

__all__ = ["TRACKERS", "MlflowSink", "TrackerSink", "check_tracker", "open_tracker"]

TRACKERS = Registry("tunix_tasks.trackers", "tracker")
TRACKERS.register_target("mlflow", "tunix_tasks.storage.trackers:MlflowSink")


class TrackerSink(Protocol):
    def log(self, scalars: Mapping[str, float], step: int) -> None: ...

    def close(self) -> None: ...


def check_tracker(name: str) -> None:
    """Raise `ValueError` in one line if `name` is not a tracker, or its client is not
    installed; imports no client."""
    valid = sorted(TRACKERS.names())
    if name not in valid:
        raise ValueError(
            f"tracker {name!r}: expected one of {valid} (or your own, registered in the "
            "entry-point group tunix_tasks.trackers), or no tracker"
        )
    client = TRACKERS.factory(name).client
    if importlib.util.find_spec(client) is None:
        raise ValueError(
            f"tracker {name!r} needs the {client!r} package, which is not installed "
            f"(pip install {client}), or no tracker"
        )


def open_tracker(name: str, *, run_name: str, run_uri: str, params: Mapping[str, Any]) -> Any:
    """The `TrackerSink` registered as `name`, opened for this run."""
    return TRACKERS.factory(name)(run_name=run_name, run_uri=run_uri, params=params)


class MlflowSink:
    """MLflow through `mlflow` (or `mlflow-skinny`): one MLflow run per tunix run, found
    again by its tag `tunix.run_uri` when the learner restarts (the config is logged as
    params once, when it is created). Metrics go to that run by its id from one sender
    thread, in order, so logging never waits on the tracking server; `close` waits for
    them and marks the run finished. MLflow's own async logging is not used: it logs
    batches of one run concurrently, and its file store then loses a batch to a race
    creating the run's metrics folder (`FileExistsError` in a worker, never raised)."""

    client = "mlflow"
    TAG = "tunix.run_uri"

    def __init__(self, *, run_name: str, run_uri: str, params: Mapping[str, Any]) -> None:
        import mlflow

        self._mlflow = mlflow
        found = mlflow.search_runs(
            filter_string=f"tags.`{self.TAG}` = '{run_uri}'", output_format="list"
        )
        if found:
            run = mlflow.start_run(run_id=found[0].info.run_id)
        else:
            run = mlflow.start_run(run_name=run_name, tags={self.TAG: run_uri})
            mlflow.log_params(dict(params))
        self.run_id = run.info.run_id
        self._sender = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mlflow-sink")
        self._failure: Exception | None = None

    def log(self, scalars: Mapping[str, float], step: int) -> None:
        """Queue `scalars` at `step`; raises the first failure of an earlier send."""
        if self._failure is not None:
            raise self._failure
        self._sender.submit(self._send, dict(scalars), step)

    def _send(self, scalars: dict[str, float], step: int) -> None:
        try:  # MLflow metric names allow '/' (a warm start's series: `warm_start/nll`)
            self._mlflow.log_metrics(scalars, step=step, synchronous=True, run_id=self.run_id)
        except Exception as err:
            self._failure = self._failure or err

    def close(self) -> None:
        self._sender.shutdown(wait=True)
        mlflow = self._mlflow
        active = mlflow.active_run()
        if active is not None and active.info.run_id == self.run_id:
            mlflow.end_run()  # the thread that opened it: also leaves no run active
        else:
            mlflow.MlflowClient().set_terminated(self.run_id)
        if self._failure is not None:
            raise self._failure
