"""The DAG helper modules without a scheduler: REST client, weights watcher, launchers."""

from __future__ import annotations

import contextlib
import http.server
import json
import threading
import time

import numpy as np
import pytest

ASSET = {
    "aliases": [],
    "consuming_tasks": [],
    "created_at": "2025-01-01T00:00:00Z",
    "extra": {},
    "group": "tunix",
    "producing_tasks": [],
    "scheduled_dags": [],
    "updated_at": "2025-01-01T00:00:00Z",
    "watchers": [],
}


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


# --------------------------------------------------------------------------- fake API


class _FakeApi(http.server.BaseHTTPRequestHandler):
    """Answers like Airflow 3.3's API server (bodies the typed client can parse)."""

    calls: list = []
    fail_next: list = []  # status codes to answer asset-event posts with first
    valid_tokens: set = {"tok"}

    def log_message(self, *args):
        pass

    def _reply(self, code, body):
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _authorized(self) -> bool:
        auth = self.headers.get("Authorization") or ""
        if auth.removeprefix("Bearer ") in self.valid_tokens:
            return True
        self._reply(401, {"detail": "Not authenticated"})
        return False

    def do_GET(self):
        self.calls.append(("GET", self.path, self.headers.get("Authorization"), None))
        if not self._authorized():
            return
        if self.path.startswith("/api/v2/assets?"):
            assets = [
                {**ASSET, "id": 8, "name": "tunix_weights_old", "uri": "x://y"},
                {**ASSET, "id": 7, "name": "tunix_weights", "uri": "tunix://weights/"},
            ]
            self._reply(200, {"assets": assets, "total_entries": 2})
        elif self.path.startswith("/api/v2/pools"):  # a fresh `airflow standalone`
            slots = dict.fromkeys(["deferred", "occupied", "open", "queued", "running"], 0)
            pool = {f"{k}_slots": v for k, v in slots.items()}
            pool.update(scheduled_slots=0, include_deferred=False, name="default_pool", slots=128)
            self._reply(200, {"pools": [pool], "total_entries": 1})
        else:
            self._reply(404, {"detail": "nope"})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.calls.append(("POST", self.path, self.headers.get("Authorization"), body))
        if self.path == "/auth/token":
            ok = body == {"username": "u", "password": "p"}
            token = sorted(self.valid_tokens)[0]  # what the server issues now
            self._reply(201 if ok else 401, {"access_token": token} if ok else {"detail": "bad"})
        elif self.path == "/api/v2/assets/events":
            if not self._authorized():
                return
            if self.fail_next:
                self._reply(self.fail_next.pop(0), {"detail": "try later"})
                return
            event = {
                "id": len(self.calls),
                "created_dagruns": [],
                "source_map_index": -1,
                "timestamp": "2025-01-01T00:00:00Z",
                **body,
            }
            self._reply(200, event)
        else:
            self._reply(404, {"detail": "nope"})


@pytest.fixture
def fake_api(monkeypatch):
    _FakeApi.calls, _FakeApi.fail_next, _FakeApi.valid_tokens = [], [], {"tok"}
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _FakeApi)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    monkeypatch.setenv("TUNIX_AIRFLOW_ASSET_EVENTS", "1")
    monkeypatch.setenv("TUNIX_AIRFLOW_API_URL", url)
    monkeypatch.setenv("TUNIX_AIRFLOW_API_USER", "u")
    monkeypatch.setenv("TUNIX_AIRFLOW_API_PASSWORD", "p")
    yield url, _FakeApi
    server.shutdown()


def test_pool_check_logs_in_as_a_plain_airflow_standalone(fake_api, monkeypatch, tmp_path):
    """No tunix credentials configured, Airflow's own SimpleAuthManager: the check reads the
    password Airflow generated and fails fast naming the missing pools (no endless wait)."""
    from airflow.sdk.exceptions import AirflowFailException
    from tunix_fleet import check_pools

    url, api = fake_api
    for name in ("TUNIX_AIRFLOW_API_URL", "TUNIX_AIRFLOW_API_USER", "TUNIX_AIRFLOW_API_PASSWORD"):
        monkeypatch.delenv(name)
    (tmp_path / "passwords.json").write_text(json.dumps({"u": "p"}))
    monkeypatch.setenv("AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE", str(tmp_path / "passwords.json"))  # fmt: skip
    monkeypatch.setenv("AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS", "u:admin")
    monkeypatch.setenv("AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS", "False")
    monkeypatch.setenv("AIRFLOW__API__BASE_URL", url)
    monkeypatch.setenv("TUNIX_CHECK_POOLS", "1")
    with pytest.raises(AirflowFailException, match=r"'cpu', 'tpu'.*airflow pools set cpu"):
        check_pools(("cpu", "tpu"))
    assert ("POST", "/auth/token") in [c[:2] for c in api.calls]


def _events(calls) -> list:
    return [c for c in calls if c[1] == "/api/v2/assets/events"]


def test_rest_client_posts_asset_event_with_password_login(fake_api):
    from tunix_weights import WeightsEventPublisher

    _, api = fake_api
    pub = WeightsEventPublisher("file:///r/run1")
    pub(3, "file:///r/run1/weights/v00000003")
    pub(4, "file:///r/run1/weights/v00000004")
    assert pub.posted == [3, 4] and pub.failed == []
    posts = _events(api.calls)
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
    assert sum(c[1] == "/auth/token" for c in api.calls) == 1
    lookups = [c for c in api.calls if c[1].startswith("/api/v2/assets?")]
    assert len(lookups) == 1 and "name_pattern=tunix_weights" in lookups[0][1]


def test_rest_client_retries_server_errors_and_expired_tokens(fake_api):
    from tunix_api import AirflowApiClient

    url, api = fake_api
    client = AirflowApiClient(url, username="u", password="p", wait_s=0)
    api.fail_next = [503, 500]
    out = client.post_asset_event("tunix_weights", {"version": 1})
    assert out["asset_id"] == 7 and out["extra"] == {"version": 1}
    assert len(_events(api.calls)) == 3
    # the JWT expires: the 401 makes the client log in again, then the post goes through
    api.valid_tokens = {"tok2"}
    api.calls.clear()
    assert client.post_asset_event("tunix_weights", {"version": 2})["extra"] == {"version": 2}
    assert [c[1] for c in api.calls] == [
        "/api/v2/assets/events",
        "/auth/token",
        "/api/v2/assets/events",
    ]
    assert api.calls[-1][2] == "Bearer tok2"


def test_rest_client_does_not_retry_client_errors(fake_api):
    from tunix_api import AirflowApiClient, AirflowApiError

    url, api = fake_api
    client = AirflowApiClient(url, token="tok", wait_s=0)
    api.fail_next = [422]
    with pytest.raises(AirflowApiError, match="HTTP 422"):
        client.post_asset_event("tunix_weights", {"version": 1})
    assert len(_events(api.calls)) == 1
    with pytest.raises(AirflowApiError, match="not registered"):
        client.asset_id("no_such_asset")


def test_rest_failures_never_raise(monkeypatch):
    from tunix_api import AirflowApiClient
    from tunix_weights import WeightsEventPublisher

    monkeypatch.setenv("TUNIX_AIRFLOW_ASSET_EVENTS", "1")
    client = AirflowApiClient("http://127.0.0.1:9", timeout_s=1, wait_s=0)
    pub = WeightsEventPublisher("file:///r", client=client)
    pub(1, "file:///r/weights/v00000001")
    assert pub.failed == [1] and pub.posted == []


def test_api_url_from_airflow_config(monkeypatch):
    from tunix_api import AirflowApiClient

    monkeypatch.delenv("TUNIX_AIRFLOW_API_URL", raising=False)
    monkeypatch.setenv("AIRFLOW__API__BASE_URL", "")
    monkeypatch.setenv("AIRFLOW__CORE__EXECUTION_API_SERVER_URL", "http://h:9091/execution/")
    client = AirflowApiClient.from_environment()
    assert client.base_url == "http://h:9091" and client.token is None


def test_events_disabled(monkeypatch):
    from tunix_weights import WeightsEventPublisher

    monkeypatch.setenv("TUNIX_AIRFLOW_ASSET_EVENTS", "0")
    pub = WeightsEventPublisher("file:///r", client=object())  # never used
    pub(1, "file:///r/weights/v00000001")
    assert pub.posted == [] and pub.failed == []


# --------------------------------------------------------------------------- weights watcher


def _publish(run_uri: str, version: int) -> None:
    from tunix_tasks.storage.store import open_store
    from tunix_tasks.storage.weights import WeightsPublisher

    publisher = WeightsPublisher(open_store(run_uri))
    publisher.publish(
        {"w": np.full(2, version, np.float32)}, version=version, step=version, model={}
    )


def test_watcher_announces_each_new_latest(tmp_path):
    from tunix_weights import WeightsWatcher

    from tunix_tasks.storage.layout import RunLayout

    run_uri = f"file://{tmp_path}/run"
    _publish(run_uri, 0)  # published before: by a previous attempt, not announced again
    seen: list = []
    with WeightsWatcher(run_uri, lambda v, p: seen.append((v, p)), poll_s=0.05) as watcher:
        assert watcher.seen == 0
        _publish(run_uri, 1)
        deadline = time.monotonic() + 10
        while not seen and time.monotonic() < deadline:
            time.sleep(0.02)
        _publish(run_uri, 2)  # the last one is announced when the watch ends at the latest
    assert seen[0] == (1, f"{run_uri}/{RunLayout.snapshot(1)}")
    assert seen[-1] == (2, f"{run_uri}/{RunLayout.snapshot(2)}")
    assert [v for v, _ in seen] == sorted({v for v, _ in seen})


def test_watcher_survives_store_and_callback_errors(tmp_path):
    from tunix_weights import WeightsWatcher

    run_uri = f"file://{tmp_path}/run"

    def boom(version, path):
        raise RuntimeError("no API")

    watcher = WeightsWatcher(run_uri, boom, poll_s=3600)
    watcher.start()
    assert watcher.seen is None  # no LATEST yet
    (tmp_path / "run" / "weights").mkdir(parents=True)
    (tmp_path / "run" / "weights" / "LATEST").write_text("not json")
    watcher.check()  # logged, not raised
    _publish(run_uri, 0)
    watcher.stop()  # boom is logged, not raised
    assert watcher.seen == 0


# --------------------------------------------------------------------------- learner task


class _FakeEntrypoints:
    def __init__(self, run_uri: str):
        self.run_uri = run_uri
        self.calls: list = []

    def run_learner(self, run_uri, **kwargs):
        self.calls.append((run_uri, kwargs))
        for version in range(3):
            _publish(run_uri, version)
            time.sleep(0.15)
        return {"steps": 4}

    def run_actor(self, run_uri, actor_id, **kwargs):
        self.calls.append((run_uri, actor_id, kwargs))
        return {"episodes": 0}

    def fleet_autopilot(self, run_uri, *, launched=None, run_id=None):
        return contextlib.nullcontext()  # the autopilot off, as in the run's config


def test_learner_task_announces_weights_locally(fake_api, tmp_path, monkeypatch):
    """The local launcher: no callback into the learner, the watcher posts the events."""
    import tunix_fleet
    import tunix_launchers

    _, api = fake_api
    run_uri = f"file://{tmp_path}/run"
    fake = _FakeEntrypoints(run_uri)
    monkeypatch.delenv("TUNIX_LAUNCHER", raising=False)
    monkeypatch.setenv("TUNIX_WEIGHTS_POLL_S", "0.05")
    monkeypatch.setattr(tunix_launchers, "entrypoints", lambda: fake)
    summary = tunix_fleet.learner.function(run_uri, max_steps=4, deadline_s=0)
    assert fake.calls == [(run_uri, {"max_steps": 4, "deadline_s": None, "run_id": None})]
    assert summary["steps"] == 4 and summary["asset_events_failed"] == []
    assert summary["asset_events_posted"][-1] == 2
    posted = [c[3]["extra"]["version"] for c in _events(api.calls)]
    assert posted == summary["asset_events_posted"]


def test_a_dag_run_whose_run_was_created_again_fails_without_touching_it(
    fake_api, tmp_path, monkeypatch
):
    """Run `r` deleted and created again by another DAG run while this one is active:
    this one's actor and learner tasks (a retry, here) fail without another retry, and
    its `stop_fleet` teardown leaves the other run's actors running (no DONE)."""
    import shutil
    from types import SimpleNamespace

    import airflow.sdk
    import tunix_fleet
    from airflow.sdk.exceptions import AirflowFailException

    from tunix_tasks.frontdoor.entrypoints import prepare_run, prepared_run_id
    from tunix_tasks.storage.runs import is_done
    from tunix_tasks.storage.store import open_store

    monkeypatch.delenv("TUNIX_LAUNCHER", raising=False)
    uri = prepare_run({"store": str(tmp_path)}, run_name="r")
    ours = prepared_run_id(uri)
    shutil.rmtree(tmp_path / "r")
    uri = prepare_run({"store": str(tmp_path)}, run_name="r")  # the autopilot on (default)
    before = sorted(p.relative_to(tmp_path) for p in (tmp_path / "r").rglob("*"))
    pushed = {"prepare": ours}  # the setup task's `run_incarnation` XCom

    def xcom_pull(task_ids, key, default):
        assert key == "run_incarnation"
        return pushed.get(task_ids, default)

    ti = SimpleNamespace(xcom_pull=xcom_pull)
    ctx = {"dag": SimpleNamespace(dag_id="tunix_train"), "run_id": "manual__1", "ti": ti}
    monkeypatch.setattr(airflow.sdk, "get_current_context", lambda: ctx)
    monkeypatch.setattr(tunix_fleet, "_label_map_index", lambda label: None)
    with pytest.raises(AirflowFailException, match=f"created again .*{ours}"):
        tunix_fleet.actor.function(uri, 0, 0, run_incarnation=ours)
    with pytest.raises(AirflowFailException, match=f"created again .*{ours}"):
        tunix_fleet.learner.function(uri, setup_task="prepare")
    assert sorted(p.relative_to(tmp_path) for p in (tmp_path / "r").rglob("*")) == before
    not_marked = tunix_fleet.stop_fleet.function(uri, "prepare")
    assert not_marked.startswith(f"not marked DONE: {uri} was created again")
    assert is_done(open_store(uri)) is None
    pushed["prepare"] = prepared_run_id(uri)  # the new run's own DAG run
    assert tunix_fleet.stop_fleet.function(uri, "prepare").startswith("airflow")
    assert is_done(open_store(uri)) is not None
    # A setup task of the code before run ids pushed none: the run as it is (as before).
    assert tunix_fleet.stop_fleet.function(uri, "resume").startswith("airflow")


# --------------------------------------------------------------------------- launchers


def test_launcher_selection(monkeypatch, tmp_path):
    import tunix_launchers as L

    monkeypatch.delenv("TUNIX_LAUNCHER", raising=False)
    assert L.launcher_kind() == "local"
    fake = _FakeEntrypoints("x")
    monkeypatch.setattr(L, "entrypoints", lambda: fake)
    L.launch_actor("file:///tmp/x", 1, deadline_s=5.0, run_id="")
    assert fake.calls == [("file:///tmp/x", 1, {"deadline_s": 5.0, "run_id": ""})]
    monkeypatch.setenv("TUNIX_LAUNCHER", "slurm")
    with pytest.raises(ValueError, match="TUNIX_LAUNCHER"):
        L.launcher_kind()
    monkeypatch.setenv("TUNIX_LAUNCHER", "kubernetes")
    try:
        import airflow.providers.cncf.kubernetes  # noqa: F401
    except ImportError:
        with pytest.raises(RuntimeError, match="cncf-kubernetes"):
            L.launch_actor("file:///tmp/x", 0)


def test_entrypoints_are_the_library():
    import tunix_launchers

    ep = tunix_launchers.entrypoints()
    assert ep.__name__ == "tunix_tasks.frontdoor.entrypoints"
    for name in ("prepare_run", "run_actor", "run_learner", "learner_progress", "mark_done"):
        assert callable(getattr(ep, name)), name
