"""`tracker: mlflow`: the learner's metrics records go to MLflow (its local file store
here, the real client), one MLflow run per tunix run, found again on a restart; an
unknown or uninstalled tracker is refused in one line when the config loads."""

from __future__ import annotations

import pytest

from tunix_tasks.config import ConfigError, config_from_dict
from tunix_tasks.storage.metrics import MetricsWriter, read_metrics
from tunix_tasks.storage.store import open_store
from tunix_tasks.storage.trackers import TRACKERS, check_tracker, open_tracker

mlflow = pytest.importorskip("mlflow")  # the `test` extra installs mlflow-skinny


@pytest.fixture
def tracking(tmp_path, monkeypatch):
    """MLflow's local file store, as a user's MLFLOW_TRACKING_URI would name a server."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"file://{tmp_path}/mlruns")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # deprecated by MLflow 3, works
    return mlflow.MlflowClient(f"file://{tmp_path}/mlruns")


def _learner(tmp_path, run_uri: str) -> MetricsWriter:
    sink = open_tracker(
        "mlflow", run_name="demo", run_uri=run_uri, params={"learner.learning_rate": 0.001}
    )
    return MetricsWriter(open_store(str(tmp_path / "run")), "learner", tracker=sink)


def test_learner_records_reach_mlflow_and_a_restart_continues_the_run(tmp_path, tracking):
    metrics = _learner(tmp_path, "file:///runs/demo")
    metrics.log(warm_start_step=1, nll=3.5, step_s=0.1)
    metrics.log(step=1, loss=0.25, reward_mean=0.5, staleness={"0": 8}, dropped={})
    metrics.close()
    again = _learner(tmp_path, "file:///runs/demo")  # the learner restarted
    again.log(step=2, loss=0.125, reward_mean=0.75)
    again.close()
    (run,) = tracking.search_runs([tracking.get_experiment_by_name("Default").experiment_id])
    assert run.info.run_name == "demo" and run.info.status == "FINISHED"
    assert run.data.params == {"learner.learning_rate": "0.001"}
    history = {
        key: [(m.step, m.value) for m in tracking.get_metric_history(run.info.run_id, key)]
        for key in ("loss", "reward_mean", "warm_start/nll")
    }
    assert history == {
        "loss": [(1, 0.25), (2, 0.125)],
        "reward_mean": [(1, 0.5), (2, 0.75)],
        "warm_start/nll": [(1, 3.5)],
    }
    assert "staleness" not in run.data.metrics  # scalars only, as TensorBoard gets them


def test_the_first_records_of_many_runs_all_reach_mlflow(tmp_path, tracking):
    # MLflow's async logging sends a run's batches concurrently; its file store then lost
    # one to a race creating the run's metrics folder (a nested name, `warm_start/nll`,
    # beside a flat one): CI lost step 1's `loss` this way.
    for n in range(12):
        metrics = _learner(tmp_path, f"file:///runs/r{n}")
        metrics.log(warm_start_step=1, nll=3.5)
        metrics.log(step=1, loss=0.25)
        metrics.log(step=2, loss=0.125)
        metrics.close()
    runs = tracking.search_runs([tracking.get_experiment_by_name("Default").experiment_id])
    assert len(runs) == 12
    for run in runs:
        history = tracking.get_metric_history(run.info.run_id, "loss")
        assert [(m.step, m.value) for m in history] == [(1, 0.25), (2, 0.125)], run.info
        assert len(tracking.get_metric_history(run.info.run_id, "warm_start/nll")) == 1


def test_a_failing_tracker_never_breaks_the_metrics(tmp_path, caplog):
    class Down:
        def log(self, scalars, step):
            raise ConnectionError("tracking server unreachable")

        def close(self):
            raise ConnectionError("tracking server unreachable")

    store = open_store(str(tmp_path))
    metrics = MetricsWriter(store, "learner", tracker=Down(), tensorboard=False)
    metrics.log(step=1, loss=0.5)
    metrics.log(step=2, loss=0.25)
    metrics.close()
    assert [r["loss"] for r in read_metrics(store, "learner")] == [0.5, 0.25]
    assert caplog.text.count("metrics not sent") == 1  # logged once, not per record


def test_the_config_refuses_an_unknown_tracker_in_one_line():
    assert config_from_dict({}).tracker is None  # off by default
    assert config_from_dict({"tracker": "mlflow"}).tracker == "mlflow"
    with pytest.raises(ConfigError, match=r"tracker 'wandb': expected one of \['mlflow'\]"):
        config_from_dict({"tracker": "wandb"})


def test_a_tracker_whose_client_is_missing_is_refused(monkeypatch):
    registry = TRACKERS.copy()

    class Elsewhere:
        client = "no_such_tracker_client"

    registry.register("elsewhere")(Elsewhere)
    monkeypatch.setattr("tunix_tasks.storage.trackers.TRACKERS", registry)
    with pytest.raises(ValueError, match="needs the 'no_such_tracker_client' package"):
        check_tracker("elsewhere")
