"""Static checks of the tunix DAGs: import, structure, params, parse time, helpers."""

from __future__ import annotations

import http.server
import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from .conftest import DAGS

DAG_FILES = ["tunix_train.py", "tunix_recurring.py", "tunix_eval.py"]


def test_no_import_errors(dagbag):
    assert dagbag.import_errors == {}
    assert set(dagbag.dag_ids) == {"tunix_train", "tunix_recurring", "tunix_eval"}


def test_helper_modules_are_not_parsed_as_dags():
    ignored = (DAGS / ".airflowignore").read_text().split()
    assert {"tunix_common.py", "tunix_launchers.py"} <= set(ignored)


@pytest.mark.parametrize("dag_id", ["tunix_train", "tunix_recurring"])
def test_training_dag_shape(dagbag, dag_id):
    dag = dagbag.dags[dag_id]
    assert "tunix" in dag.tags and "training" in dag.tags
    tasks = {t.task_id: t for t in dag.tasks}
    setup = "prepare" if dag_id == "tunix_train" else "resume"
    assert set(tasks) == {setup, "actor", "learner", "stop_fleet", "report"}

    actor, learner = tasks["actor"], tasks["learner"]
    assert actor.is_mapped and actor.map_index_template == "{{ tunix_label }}"
    assert (actor.pool, actor.queue) == ("cpu", "cpu")
    assert (learner.pool, learner.queue) == ("tpu", "tpu")
    assert learner.retries >= 1 and learner.execution_timeout is not None
    assert actor.retries >= 1 and actor.execution_timeout is not None
    # actors and learner both hang off the setup only: they run concurrently
    assert actor.upstream_task_ids == {setup} and learner.upstream_task_ids == {setup}
    assert tasks[setup].is_setup
    # stop_fleet follows the learner (not the actors), and always runs
    assert tasks["stop_fleet"].is_teardown and "learner" in tasks["stop_fleet"].upstream_task_ids
    assert "actor" not in tasks["stop_fleet"].upstream_task_ids
    assert tasks["report"].is_teardown
    assert {"actor", "stop_fleet"} <= tasks["report"].upstream_task_ids
    for t in ("stop_fleet", "report"):
        assert tasks[t].trigger_rule == "all_done_setup_success"


def test_recurring_schedule(dagbag):
    dag = dagbag.dags["tunix_recurring"]
    assert dag.catchup is False and dag.max_active_runs == 1
    assert dag.timetable.expression == "0 0 * * *"  # @daily (TUNIX_RECURRING_SCHEDULE)
    assert "steps_per_interval" in dag.params


def test_eval_is_scheduled_on_weights_asset(dagbag):
    from tunix_common import WEIGHTS_ASSET

    dag = dagbag.dags["tunix_eval"]
    assert [a.name for a in dag.timetable.asset_condition.objects] == [WEIGHTS_ASSET.name]
    assert dag.get_task("evaluate").pool == "cpu"


def test_params_defaults_are_valid(dagbag):
    for dag_id in dagbag.dag_ids:
        dagbag.dags[dag_id].params.validate()


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("num_actors", -1),
        ("num_actors", 0),
        ("env", "nope"),
        ("model_preset", "huge"),
        ("max_staleness", -1),
        ("publish_every", 0),
        ("deadline_s", -5),
        ("env_latency_s", -0.1),
        ("run_name", "bad name!"),
        ("store", "s3://bucket"),
        ("overrides", ["no-equals-sign"]),
    ],
)
def test_params_reject_bad_values(dagbag, name, value):
    import copy

    from airflow.sdk.exceptions import ParamValidationError

    params = copy.deepcopy(dagbag.dags["tunix_train"].params)
    with pytest.raises(ParamValidationError, match=name):
        params[name] = value


def test_params_describe_the_form(dagbag):
    params = dagbag.dags["tunix_train"].params
    for name in (
        "store",
        "run_name",
        "env",
        "model_preset",
        "num_actors",
        "envs_per_actor",
        "max_steps",
        "max_staleness",
        "publish_every",
        "deadline_s",
        "env_latency_s",
    ):
        assert params.get_param(name).description, name
    assert params.get_param("env").schema["enum"] == ["calculator", "guess_number", "python_exec"]
    assert params.get_param("num_actors").schema["minimum"] == 1


def test_run_config_from_params_matches_run_config(dagbag):
    from tunix_common import run_config_from_params

    from tunix_tasks.config import config_from_dict

    params = dagbag.dags["tunix_train"].params.validate()
    cfg = config_from_dict(run_config_from_params(params, "x1"))
    assert cfg.run_name == "x1" and cfg.actor.num_actors == params["num_actors"]
    assert cfg.learner.publish_every == params["publish_every"]
    assert cfg.env.name == params["env"] and cfg.model.preset == params["model_preset"]


def test_sanitize_run_name():
    from tunix_common import sanitize_run_name

    assert sanitize_run_name("manual__2025-01-01T00:00:00.123+00:00") == (
        "manual__2025-01-01T00-00-00.123-00-00"
    )
    assert sanitize_run_name("::") == "run"


_PARSE_PROBE = r"""
import importlib.util, json, sys, time
sys.path.insert(0, sys.argv[1])
import airflow.sdk  # the DAG processor has Airflow loaded already
out = {}
for path in sys.argv[2:]:
    t0 = time.perf_counter()
    spec = importlib.util.spec_from_file_location("probe_" + path.rsplit("/", 1)[-1][:-3], path)
    spec.loader.exec_module(importlib.util.module_from_spec(spec))
    out[path] = time.perf_counter() - t0
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("jax", "jaxlib", "flax", "optax",
        "tunix_tasks", "pyarrow", "orbax"))
print(json.dumps({"times": out, "heavy": heavy}))
"""


def test_parse_time_and_no_heavy_imports():
    files = [str(DAGS / f) for f in DAG_FILES]
    proc = subprocess.run(
        [sys.executable, "-c", _PARSE_PROBE, str(DAGS), *files],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["heavy"] == [], "DAG files must not import heavy modules at parse time"
    for path, seconds in result["times"].items():
        assert seconds < 1.0, f"{Path(path).name} took {seconds:.2f}s to parse"


# --------------------------------------------------------------------------- helpers


def test_latest_per_run():
    from tunix_eval import latest_per_run

    extras = [
        {"run_uri": "a", "version": 2},
        {"run_uri": "a", "version": 4},
        {"run_uri": "a", "version": 3},
        {"run_uri": "b", "version": None},
        {"from_rest_api": True},
    ]
    assert latest_per_run(extras) == {"a": 4, "b": None}


class _FakeApi(http.server.BaseHTTPRequestHandler):
    calls: list = []

    def log_message(self, *args):
        pass

    def _reply(self, code, body):
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self.calls.append(("GET", self.path, self.headers.get("Authorization"), None))
        if self.path.startswith("/api/v2/assets?"):
            self._reply(
                200, {"assets": [{"id": 7, "name": "tunix_weights"}, {"id": 8, "name": "x"}]}
            )
        else:
            self._reply(404, {"detail": "nope"})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.calls.append(("POST", self.path, self.headers.get("Authorization"), body))
        if self.path == "/auth/token":
            ok = body == {"username": "u", "password": "p"}
            self._reply(201 if ok else 401, {"access_token": "tok"} if ok else {"detail": "bad"})
        elif self.path == "/api/v2/assets/events":
            self._reply(200, {"id": 1, **body})
        else:
            self._reply(404, {"detail": "nope"})


@pytest.fixture
def fake_api():
    _FakeApi.calls = []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _FakeApi)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", _FakeApi.calls
    server.shutdown()


def test_rest_client_posts_asset_event_with_password_login(fake_api, monkeypatch):
    from tunix_common import WeightsEventPublisher

    url, calls = fake_api
    monkeypatch.setenv("TUNIX_AIRFLOW_ASSET_EVENTS", "1")
    monkeypatch.setenv("TUNIX_AIRFLOW_API_URL", url)
    monkeypatch.setenv("TUNIX_AIRFLOW_API_USER", "u")
    monkeypatch.setenv("TUNIX_AIRFLOW_API_PASSWORD", "p")
    pub = WeightsEventPublisher("file:///r/run1")
    pub(3, "file:///r/run1/weights/v00000003")
    pub(4, "file:///r/run1/weights/v00000004")
    assert pub.posted == [3, 4] and pub.failed == []
    posts = [c for c in calls if c[1] == "/api/v2/assets/events"]
    assert posts[0][2] == "Bearer tok"
    assert posts[0][3] == {
        "asset_id": 7,
        "extra": {
            "run_uri": "file:///r/run1",
            "version": 3,
            "path": "file:///r/run1/weights/v00000003",
        },
    }
    # one login and one asset lookup, then cached
    assert sum(c[1] == "/auth/token" for c in calls) == 1
    assert sum(c[1].startswith("/api/v2/assets?") for c in calls) == 1


def test_rest_failures_never_raise(monkeypatch):
    from tunix_common import AirflowApiClient, WeightsEventPublisher

    monkeypatch.setenv("TUNIX_AIRFLOW_ASSET_EVENTS", "1")
    monkeypatch.setattr("time.sleep", lambda s: None)
    pub = WeightsEventPublisher(
        "file:///r", client=AirflowApiClient("http://127.0.0.1:9", timeout_s=1)
    )
    pub(1, "file:///r/weights/v00000001")
    assert pub.failed == [1]


# --------------------------------------------------------------------------- launchers


def test_pod_specs(monkeypatch):
    import tunix_launchers as L

    monkeypatch.setenv("TUNIX_IMAGE", "gcr.io/p/tunix:1")
    monkeypatch.setenv("TUNIX_CPU_NODE_POOL", "actors")
    actor = L.actor_pod_spec("gs://b/runs/My_Run", 3, deadline_s=60.0)
    learner = L.learner_pod_spec("gs://b/runs/My_Run", max_steps=100)
    assert actor["metadata"]["name"] == "tunix-my-run-actor-3"
    assert actor["spec"]["nodeSelector"] == {"cloud.google.com/gke-nodepool": "actors"}
    assert actor["spec"]["containers"][0]["image"] == "gcr.io/p/tunix:1"
    assert learner["spec"]["containers"][0]["resources"]["limits"]["google.com/tpu"] == "4"
    assert "cloud.google.com/gke-tpu-accelerator" in learner["spec"]["nodeSelector"]
    for pod in (actor, learner):
        cmd = pod["spec"]["containers"][0]["command"]
        assert cmd[:2] == ["python", "-c"]
        compile(cmd[2], "<pod>", "exec")
    assert "run_actor" in actor["spec"]["containers"][0]["command"][2]


def test_launcher_selection(monkeypatch):
    import tunix_launchers as L

    monkeypatch.delenv("TUNIX_LAUNCHER", raising=False)
    assert L.launcher_kind() == "local"
    monkeypatch.setenv("TUNIX_LAUNCHER", "slurm")
    with pytest.raises(ValueError, match="TUNIX_LAUNCHER"):
        L.launcher_kind()
    monkeypatch.setenv("TUNIX_LAUNCHER", "kubernetes")
    try:
        import airflow.providers.cncf.kubernetes  # noqa: F401
    except ImportError:
        with pytest.raises(RuntimeError, match="cncf-kubernetes"):
            L.launch_actor("file:///tmp/x", 0)
