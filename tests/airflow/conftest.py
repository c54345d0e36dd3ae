"""Airflow test setup: a throwaway AIRFLOW_HOME, the repo's `dags/` folder, SQLite.

Airflow reads its configuration when it is first imported, so the environment is set
here, at collection time, before any test module imports `airflow`.
"""

from __future__ import annotations

import atexit
import os
import shutil
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
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
