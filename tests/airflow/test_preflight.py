"""What the setup task checks before the fleet starts, and what the learner task logs.

- missing pools (plain `airflow standalone` creates none): `prepare` fails at once naming
  the pools and the `airflow pools set` commands, instead of tasks "scheduled" forever;
- unknown keys in the trigger conf (a typo such as `max_step`): `prepare` fails naming
  the key, a close match and the valid params;
- the learner task logs one progress line per N steps, read from the run's metrics.
"""

from __future__ import annotations

import http.server
import json
import logging
import threading

import pytest

# --------------------------------------------------------------------------- pools


@pytest.fixture(autouse=True)
def _pool_check_on(monkeypatch):
    monkeypatch.setenv("TUNIX_CHECK_POOLS", "1")  # conftest turns it off for dag.test()


class _Pools:
    def __init__(self, names):
        self.names = set(names)

    def pool_names(self):
        return self.names


def test_check_pools_fails_naming_missing_pools_and_commands():
    from airflow.sdk.exceptions import AirflowFailException
    from tunix_fleet import check_pools

    with pytest.raises(AirflowFailException) as err:
        check_pools(("cpu", "tpu"), client=_Pools({"default_pool", "cpu"}))
    msg = str(err.value)
    assert "'tpu'" in msg and "'cpu'" not in msg, msg
    assert 'airflow pools set tpu 1 "tunix learners' in msg, msg
    assert "scheduled" in msg

    with pytest.raises(AirflowFailException) as err:
        check_pools(("cpu", "tpu"), client=_Pools({"default_pool"}))
    assert "airflow pools set cpu 16" in str(err.value) and "airflow pools set tpu" in str(
        err.value
    )


def test_check_pools_passes_or_warns(caplog, monkeypatch):
    from tunix_fleet import check_pools

    check_pools(("cpu", "tpu"), client=_Pools({"default_pool", "cpu", "tpu"}))

    class Down:
        def pool_names(self):
            raise RuntimeError("GET /api/v2/pools: HTTP 401: Not authenticated")

    with caplog.at_level(logging.WARNING, logger="tunix_fleet"):
        check_pools(("cpu", "tpu"), client=Down())  # cannot check: warn, go on
    assert "airflow pools set cpu" in caplog.text and "HTTP 401" in caplog.text

    monkeypatch.setenv("TUNIX_CHECK_POOLS", "0")
    check_pools(("cpu", "tpu"), client=_Pools(set()))  # disabled


class _PoolApi(http.server.BaseHTTPRequestHandler):
    pools = [f"p{i}" for i in range(150)] + ["cpu"]

    def log_message(self, *args):
        pass

    def do_GET(self):
        from urllib.parse import parse_qs, urlsplit

        url = urlsplit(self.path)
        q = {k: int(v[0]) for k, v in parse_qs(url.query).items()}
        assert url.path == "/api/v2/pools", url
        page = self.pools[q.get("offset", 0) : q.get("offset", 0) + q.get("limit", 100)]
        body = {
            "pools": [
                {
                    "name": n,
                    "slots": 1,
                    "description": None,
                    "include_deferred": False,
                    "occupied_slots": 0,
                    "running_slots": 0,
                    "queued_slots": 0,
                    "scheduled_slots": 0,
                    "open_slots": 1,
                    "deferred_slots": 0,
                }
                for n in page
            ],
            "total_entries": len(self.pools),
        }
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture
def pool_api():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _PoolApi)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_pool_names_through_the_rest_client(pool_api, monkeypatch):
    from airflow.sdk.exceptions import AirflowFailException
    from tunix_api import AirflowApiClient
    from tunix_fleet import check_pools

    assert AirflowApiClient(pool_api).pool_names() == set(_PoolApi.pools)  # 2 pages
    monkeypatch.setenv("TUNIX_AIRFLOW_API_URL", pool_api)
    with pytest.raises(AirflowFailException, match="'tpu'"):
        check_pools(("cpu", "tpu"))  # the client from the environment


# --------------------------------------------------------------------------- conf keys


def test_unknown_conf_keys_are_named_with_the_valid_ones():
    from tunix_params import check_conf_keys, training_params

    valid = training_params()
    check_conf_keys({"max_steps": 3, "overrides": []}, valid)
    check_conf_keys(None, valid)
    with pytest.raises(ValueError) as err:
        check_conf_keys({"max_step": 3, "zzz": 1, "seed": 1}, valid)
    msg = str(err.value)
    assert "'max_step' (did you mean 'max_steps'?)" in msg and "'zzz'" in msg, msg
    assert "valid params:" in msg and "num_actors" in msg and "'seed'" not in msg


@pytest.mark.slow
@pytest.mark.airflow
def test_prepare_fails_fast_in_dag_test(airflow_db, dagbag, pool_api, monkeypatch, tmp_path):
    """dag.test(): a typo in the conf, then missing pools, fail `prepare` with the reason."""
    dag = dagbag.dags["tunix_train"]
    conf = {"store": f"file://{tmp_path}", "run_name": "pre", "max_step": 2}
    monkeypatch.setenv("TUNIX_CHECK_POOLS", "0")
    dr = dag.test(run_conf=conf)
    states = {ti.task_id: str(ti.state) for ti in dr.get_task_instances()}
    assert dr.state == "failed" and states["prepare"] == "failed", states
    assert not (tmp_path / "pre").exists()  # nothing was written

    monkeypatch.setenv("TUNIX_CHECK_POOLS", "1")
    monkeypatch.setenv("TUNIX_AIRFLOW_API_URL", pool_api)  # has "cpu", not "tpu"
    del conf["max_step"]
    dr = dag.test(run_conf=conf)
    states = {ti.task_id: str(ti.state) for ti in dr.get_task_instances()}
    assert dr.state == "failed" and states["prepare"] == "failed", states
    assert not (tmp_path / "pre").exists()


# --------------------------------------------------------------------------- learner log


def test_learner_progress_log_every_n_steps(tmp_path, caplog):
    from tunix_fleet import quiet_library_loggers
    from tunix_weights import LearnerProgressLog

    from tunix_tasks.storage.metrics import MetricsWriter
    from tunix_tasks.storage.store import open_store

    run_uri = f"file://{tmp_path}/run"
    writer = MetricsWriter(open_store(run_uri), "learner", tensorboard=False)
    progress = LearnerProgressLog(run_uri, every=10)
    with caplog.at_level(logging.INFO, logger="tunix_weights"):
        for step in range(1, 26):
            writer.log(step=step, version=step // 2, loss=1.0 / step, reward_mean=step / 25)
            if step in (12, 20):
                writer.flush()
                progress()
        writer.flush()
        progress.flush()
    lines = [r.getMessage() for r in caplog.records if "learner step" in r.getMessage()]
    assert [int(line.split()[2].rstrip(":")) for line in lines] == [1, 11, 21, 25], lines
    assert "reward_mean=1.000" in lines[-1] and "loss=0.04" in lines[-1], lines

    quiet_library_loggers()
    assert logging.getLogger("orbax").getEffectiveLevel() == logging.WARNING
    assert logging.getLogger("absl").getEffectiveLevel() == logging.WARNING
