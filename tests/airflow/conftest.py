"""Airflow test setup: a throwaway AIRFLOW_HOME, the repo's `dags/` folder, SQLite.

Airflow reads its configuration when it is first imported, so the environment is set
here, at collection time, before any test module imports `airflow`.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.paths import REPO

DAGS = REPO / "dags"
INFRA = REPO / "infra" / "airflow"
VENV_BIN = Path(sys.executable).parent

_HOME = Path(tempfile.mkdtemp(prefix="tunix-airflow-test-"))
atexit.register(shutil.rmtree, _HOME, ignore_errors=True)

if "airflow" in sys.modules:  # pragma: no cover - another test imported Airflow first
    warnings.warn("airflow was imported before tests/airflow/conftest.py", stacklevel=1)
os.environ["AIRFLOW_HOME"] = str(_HOME)
os.environ["AIRFLOW__CORE__DAGS_FOLDER"] = str(DAGS)
os.environ["AIRFLOW__CORE__LOAD_EXAMPLES"] = "False"
os.environ["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"] = f"sqlite:///{_HOME / 'airflow.db'}"
os.environ["TUNIX_AIRFLOW_ASSET_EVENTS"] = "0"  # no API server for dag.test()
os.environ["TUNIX_CHECK_POOLS"] = "0"  # idem (test_preflight.py turns it on with a fake API)
for path in (str(DAGS), str(INFRA), str(REPO)):
    if path not in sys.path:
        sys.path.insert(0, path)


@pytest.fixture(scope="session")
def airflow_home() -> Path:
    return _HOME


@pytest.fixture(scope="session")
def airflow_db(airflow_home: Path) -> Path:
    """`airflow db migrate` once per session (needed by `dag.test()`)."""
    subprocess.run(
        [str(VENV_BIN / "airflow"), "db", "migrate"],
        env=os.environ.copy(),
        check=True,
        capture_output=True,
        timeout=300,
    )
    return airflow_home


@pytest.fixture(scope="session")
def dagbag():
    from airflow.dag_processing.dagbag import DagBag

    return DagBag(dag_folder=str(DAGS))


#: Overrides that keep a run triggered through a real Airflow small and quick.
SMALL_RUN_OVERRIDES = [
    "learner.batch_rows=8",
    "learner.min_episodes_per_step=8",
    "learner.data_timeout_s=120",
    "actor.episodes_per_shard=8",
    "actor.shard_interval_s=3",
]


def small_train_conf(run_name: str, **changes: Any) -> dict[str, Any]:
    """`tunix_train` trigger conf of a small, fast run (2 actors x 4 envs, tiny model)."""
    conf = {
        "run_name": run_name,
        "env": "calculator",
        "model_preset": "tiny",
        "num_actors": 2,
        "envs_per_actor": 4,
        "max_steps": 4,
        "publish_every": 2,
        "max_staleness": 4,
        "deadline_s": 240,
        "warm_start_steps": 0,  # the form's default is the demo's recipe: 140
        "env_latency_s": 0,
        "overrides": SMALL_RUN_OVERRIDES,
    }
    return {**conf, **changes}


@contextlib.contextmanager
def running(af: Any, dags: list[str], unpause: list[str]) -> Iterator[Any]:
    """Start a `LocalAirflow` (or `CeleryAirflow`), wait until `dags` are parsed, unpause
    `unpause`, yield it; stop it after and fail if any of its processes is left."""
    t0 = time.monotonic()
    af.init()
    af.start()
    try:
        af.startup_s = af.wait_ready() + (time.monotonic() - t0)
        af.wait_dags(dags)
        af.unpause(*unpause)
        if hasattr(af, "wait_workers"):
            af.wait_workers()
        print(f"Airflow ready after {time.monotonic() - t0:.0f}s at {af.url}")
        yield af
    finally:
        left = af.stop()
        if left:
            pytest.fail(f"Airflow processes still alive after stop(): {left}")


@pytest.fixture(scope="module")
def celery_services(tmp_path_factory):
    """A throwaway Redis broker and PostgreSQL metadata DB (`infra/airflow/services.py`),
    stopped at the end; skipped when `make services` has not installed them."""
    from services import Postgres, Redis, missing_services

    if missing := missing_services():
        pytest.skip(f"{' '.join(missing)} not installed (as root: make services)")
    logs = tmp_path_factory.mktemp("services")
    redis, postgres = Redis(logs), Postgres(logs)
    try:
        redis.start()
        postgres.start()
        yield redis, postgres
    finally:
        left = postgres.stop() + redis.stop()
        if left:
            pytest.fail(f"Redis/PostgreSQL processes still alive after stop(): {left}")
