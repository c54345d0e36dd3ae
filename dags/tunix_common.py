"""Shared pieces of the tunix DAGs: the weights asset, params, the REST client, the fleet.

Kept light on purpose: the DAG processor imports this module every time it parses a
tunix DAG, so it imports only the standard library and `airflow.sdk`. Anything heavy
(`tunix_tasks.*`, JAX) is imported inside task callables, at run time.

Pieces:

- `WEIGHTS_ASSET`: the asset the learner updates each time it publishes a weight
  snapshot. The learner is one long task, and Airflow only emits `outlets` events when a
  task *succeeds*, so the learner posts one event per snapshot through the REST API
  (`AirflowApiClient.post_asset_event`) with `extra={"run_uri", "version", "path"}`.
- `training_params()` / `run_config_from_params()`: the DAG-run form and its mapping onto
  `tunix_tasks.config.RunConfig`.
- `fleet()`: the actor fleet (mapped, pool `cpu`) + learner (pool `tpu`) running
  concurrently, then `stop_fleet` and `report` teardowns. Used by `tunix_train` and
  `tunix_recurring`.

REST configuration (first match wins), read in the task process:

1. an Airflow connection `tunix_airflow_api` (e.g. env
   `AIRFLOW_CONN_TUNIX_AIRFLOW_API='http://user:password@airflow-api:8080'`,
   or a connection whose `password` field holds a ready JWT and `extra` `{"token": true}`);
2. env `TUNIX_AIRFLOW_API_URL` (+ `TUNIX_AIRFLOW_API_TOKEN`, or
   `TUNIX_AIRFLOW_API_USER` / `TUNIX_AIRFLOW_API_PASSWORD` exchanged at `/auth/token`);
3. Airflow config `[api] base_url`, else `[core] execution_api_server_url` without its
   `/execution/` suffix, with no credentials (works when the API server runs with
   `AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS=True`, i.e. local development only).

`TUNIX_AIRFLOW_ASSET_EVENTS=0` turns the events off (e.g. for `dag.test()` without an API
server).
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from airflow.sdk import Asset, Param, task

log = logging.getLogger(__name__)

DAGS_DIR = Path(__file__).resolve().parent
REPO_ROOT = DAGS_DIR.parent

#: One asset for every run's weight snapshots; the event's extra says which run/version.
WEIGHTS_ASSET = Asset(name="tunix_weights", uri="tunix://weights", group="tunix")

ENVIRONMENTS = ["calculator", "guess_number", "python_exec"]
MODEL_PRESETS = ["tiny", "small", "base"]
RUN_NAME_PATTERN = r"^$|^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"

#: Pools (and, for Celery/Kubernetes executors, queues) of the two kinds of worker.
CPU_POOL = os.environ.get("TUNIX_CPU_POOL", "cpu")
TPU_POOL = os.environ.get("TUNIX_TPU_POOL", "tpu")
#: Hard limits on the long tasks; the run's own `deadline_s` normally ends them first.
LEARNER_TIMEOUT = timedelta(hours=float(os.environ.get("TUNIX_LEARNER_TIMEOUT_H", "24")))
ACTOR_TIMEOUT = timedelta(hours=float(os.environ.get("TUNIX_ACTOR_TIMEOUT_H", "24")))
API_CONN_ID = "tunix_airflow_api"


def default_store() -> str:
    """`TUNIX_STORE` or `file://<repo>/runs` (evaluated when the DAG file is parsed)."""
    return os.environ.get("TUNIX_STORE") or f"file://{REPO_ROOT / 'runs'}"


def ensure_library_importable() -> None:
    """Make `import tunix_tasks` work in a task process of a local checkout.

    Installed deployments (`pip install .` in the worker image) need nothing; a local
    checkout started without `PYTHONPATH=<repo>` gets the repo root appended here.
    """
    if (REPO_ROOT / "tunix_tasks").is_dir() and str(REPO_ROOT) not in sys.path:
        try:
            import tunix_tasks  # noqa: F401
        except ImportError:
            sys.path.append(str(REPO_ROOT))


def entrypoints():
    """`tunix_tasks.frontdoor.entrypoints`, imported at task run time (never at DAG parse time)."""
    ensure_library_importable()
    import importlib

    return importlib.import_module("tunix_tasks.frontdoor.entrypoints")


def sanitize_run_name(text: str) -> str:
    """Turn an Airflow run_id (``manual__2025-01-01T00:00:00+00:00``) into a run name."""
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-._")[:128]
    return name or "run"


# --------------------------------------------------------------------------- params


def training_params(**defaults: Any) -> dict[str, Param]:
    """The DAG-run form of a training run. `defaults` override the default values."""
    d: dict[str, Any] = {
        "store": default_store(),
        "run_name": "",
        "env": "calculator",
        "model_preset": "tiny",
        "num_actors": 2,
        "envs_per_actor": 8,
        "max_steps": 50,
        "max_staleness": 4,
        "publish_every": 2,
        "deadline_s": 3600,
        "env_latency_s": 0.0,
        "env_max_turns": 4,
        "seed": 0,
        "overrides": [],
    }
    unknown = set(defaults) - set(d)
    if unknown:
        raise TypeError(f"unknown training params: {sorted(unknown)}")
    d.update(defaults)
    return {
        "store": Param(
            d["store"],
            type="string",
            minLength=1,
            pattern=r"^(file|gs)://",
            title="Store URI",
            description="Root of the object store: file:///abs/dir or gs://bucket/prefix. "
            "The run lives under <store>/<run_name>.",
        ),
        "run_name": Param(
            d["run_name"],
            type="string",
            pattern=RUN_NAME_PATTERN,
            maxLength=128,
            title="Run name",
            description="Letters, digits, '.', '_', '-'. Empty: derived from the Airflow run_id. "
            "Reusing a name resumes that run from its latest checkpoint.",
        ),
        "env": Param(
            d["env"],
            type="string",
            enum=ENVIRONMENTS,
            title="Environment",
            description="The agentic environment the actors step.",
        ),
        "model_preset": Param(
            d["model_preset"],
            type="string",
            enum=MODEL_PRESETS,
            title="Model preset",
            description="tiny: tests (seconds); small: ~1M params demo; base: accelerator-sized.",
        ),
        "num_actors": Param(
            d["num_actors"],
            type="integer",
            minimum=1,
            maximum=256,
            title="Number of actors",
            description="CPU actor tasks (each a mapped task instance in pool 'cpu').",
        ),
        "envs_per_actor": Param(
            d["envs_per_actor"],
            type="integer",
            minimum=1,
            maximum=4096,
            title="Envs per actor",
            description="Environments each actor steps concurrently.",
        ),
        "max_steps": Param(
            d["max_steps"],
            type="integer",
            minimum=1,
            maximum=10_000_000,
            title="Max learner steps",
            description="Total optimizer steps of the run; the run is DONE when reached.",
        ),
        "max_staleness": Param(
            d["max_staleness"],
            type="integer",
            minimum=0,
            maximum=1024,
            title="Max staleness",
            description="Drop trajectories more than this many weight versions old "
            "(0 = on-policy only).",
        ),
        "publish_every": Param(
            d["publish_every"],
            type="integer",
            minimum=1,
            maximum=100_000,
            title="Publish interval (steps)",
            description="Publish a weight snapshot (and a tunix_weights asset event) every P steps.",
        ),
        "deadline_s": Param(
            d["deadline_s"],
            type="number",
            minimum=0,
            maximum=7 * 24 * 3600,
            title="Deadline (seconds)",
            description="Stop the whole run after this long (0: no deadline).",
        ),
        "env_latency_s": Param(
            d["env_latency_s"],
            type="number",
            minimum=0,
            maximum=600,
            title="Env latency (seconds)",
            description="Simulated latency added to every environment step.",
        ),
        "env_max_turns": Param(
            d["env_max_turns"],
            type="integer",
            minimum=1,
            maximum=64,
            title="Max turns per episode",
        ),
        "seed": Param(d["seed"], type="integer", minimum=0, title="Seed"),
        "overrides": Param(
            d["overrides"],
            type="array",
            items={"type": "string", "pattern": r"^[A-Za-z_][A-Za-z0-9_.]*=.*$"},
            title="Extra config overrides",
            description="Advanced: RunConfig overrides as 'section.field=value' "
            "(e.g. 'learner.batch_rows=4'), applied last.",
        ),
    }


def run_config_from_params(params: dict[str, Any], run_name: str) -> dict[str, Any]:
    """Map the flat DAG params onto the nested `RunConfig` dict (overrides not applied)."""
    return {
        "store": params["store"],
        "run_name": run_name,
        "seed": int(params.get("seed", 0)),
        "deadline_s": float(params.get("deadline_s", 0) or 0),
        "model": {"preset": params["model_preset"]},
        "env": {
            "name": params["env"],
            "latency_s": float(params.get("env_latency_s", 0.0)),
            "max_turns": int(params.get("env_max_turns", 4)),
        },
        "actor": {
            "num_actors": int(params["num_actors"]),
            "envs_per_actor": int(params["envs_per_actor"]),
        },
        "learner": {
            "max_steps": int(params["max_steps"]),
            "max_staleness": int(params["max_staleness"]),
            "publish_every": int(params["publish_every"]),
        },
    }


def optional_deadline(value: Any) -> float | None:
    value = float(value or 0)
    return value if value > 0 else None


# --------------------------------------------------------------------------- REST


class AirflowApiError(RuntimeError):
    """The Airflow REST API refused a request (or could not be reached)."""


@dataclass
class AirflowApiClient:
    """A very small client for the Airflow 3 public REST API (`/api/v2`)."""

    base_url: str
    token: str | None = None
    username: str | None = None
    password: str | None = None
    timeout_s: float = 10.0

    def __post_init__(self) -> None:
        self.base_url = self.base_url.rstrip("/")
        self._asset_ids: dict[str, int] = {}

    @classmethod
    def from_environment(cls) -> AirflowApiClient:
        """Build a client from the connection / env vars / Airflow config (module docstring)."""
        conn = _api_connection()
        if conn is not None:
            return conn
        url = os.environ.get("TUNIX_AIRFLOW_API_URL")
        if url:
            return cls(
                url,
                token=os.environ.get("TUNIX_AIRFLOW_API_TOKEN") or None,
                username=os.environ.get("TUNIX_AIRFLOW_API_USER") or None,
                password=os.environ.get("TUNIX_AIRFLOW_API_PASSWORD") or None,
            )
        return cls(_url_from_airflow_config())

    # -- plumbing
    def _request(self, method: str, path: str, body: Any = None, *, auth: bool = True) -> Any:
        headers = {"Accept": "application/json"}
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        if auth:
            token = self._bearer()
            if token:
                headers["Authorization"] = f"Bearer {token}"
        req = urllib.request.Request(
            self.base_url + path, data=data, method=method, headers=headers
        )
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as err:
            detail = err.read().decode(errors="replace")[:500]
            raise AirflowApiError(f"{method} {path}: HTTP {err.code}: {detail}") from None
        except (urllib.error.URLError, OSError) as err:
            raise AirflowApiError(f"{method} {path}: {err}") from None
        return json.loads(raw) if raw else None

    def _bearer(self) -> str | None:
        if self.token is None and self.username and self.password:
            out = self._request(
                "POST",
                "/auth/token",
                {"username": self.username, "password": self.password},
                auth=False,
            )
            self.token = out["access_token"]
        return self.token

    # -- API
    def get(self, path: str) -> Any:
        return self._request("GET", path)

    def post(self, path: str, body: Any) -> Any:
        return self._request("POST", path, body)

    def patch(self, path: str, body: Any) -> Any:
        return self._request("PATCH", path, body)

    def asset_id(self, asset: Asset = WEIGHTS_ASSET) -> int:
        """The database id of `asset` (it exists once a parsed DAG references it)."""
        if asset.name not in self._asset_ids:
            query = urllib.parse.urlencode({"name_pattern": asset.name, "limit": 100})
            out = self.get(f"/api/v2/assets?{query}")
            for row in out.get("assets", []):
                if row.get("name") == asset.name:
                    self._asset_ids[asset.name] = int(row["id"])
                    break
            else:
                raise AirflowApiError(
                    f"asset {asset.name!r} ({asset.uri}) is not registered: is a DAG that "
                    "uses it (tunix_eval) parsed?"
                )
        return self._asset_ids[asset.name]

    def post_asset_event(self, extra: dict[str, Any], asset: Asset = WEIGHTS_ASSET) -> dict:
        """`POST /api/v2/assets/events`: record that `asset` was updated (extra: JSON)."""
        return self.post(
            "/api/v2/assets/events", {"asset_id": self.asset_id(asset), "extra": extra}
        )


def _api_connection() -> AirflowApiClient | None:
    try:
        from airflow.sdk import BaseHook

        conn = BaseHook.get_connection(API_CONN_ID)
    except Exception:  # not defined (AirflowNotFoundException) or no Airflow context
        return None
    scheme = conn.schema or "http"
    if conn.conn_type in ("http", "https"):
        scheme = conn.conn_type
    url = f"{scheme}://{conn.host}" + (f":{conn.port}" if conn.port else "")
    extra = conn.extra_dejson or {}
    if extra.get("token"):
        return AirflowApiClient(url, token=conn.password)
    return AirflowApiClient(url, username=conn.login or None, password=conn.password or None)


def _url_from_airflow_config() -> str:
    from airflow.configuration import conf

    base = conf.get("api", "base_url", fallback="") or ""
    if base.startswith("http"):
        return base.rstrip("/")
    execution = conf.get("core", "execution_api_server_url", fallback="") or ""
    if execution.startswith("http"):
        return execution.rstrip("/").removesuffix("/execution")
    port = conf.get("api", "port", fallback="8080")
    return f"http://localhost:{port}"


class WeightsEventPublisher:
    """`on_publish(version, snapshot_uri)` callback: posts a `tunix_weights` asset event.

    Never raises: a lost event only means one snapshot is not evaluated, which must not
    kill a training run. Failures are logged and counted.
    """

    def __init__(self, run_uri: str, client: AirflowApiClient | None = None, attempts: int = 3):
        self.run_uri = run_uri
        self.client = client
        self.attempts = attempts
        self.posted: list[int] = []
        self.failed: list[int] = []

    def __call__(self, version: int, snapshot_uri: str) -> None:
        extra = {"run_uri": self.run_uri, "version": int(version), "path": snapshot_uri}
        if os.environ.get("TUNIX_AIRFLOW_ASSET_EVENTS", "1").lower() in ("0", "false", "off"):
            log.info("asset events disabled (TUNIX_AIRFLOW_ASSET_EVENTS): %s", extra)
            return
        for attempt in range(1, self.attempts + 1):
            try:
                if self.client is None:
                    self.client = AirflowApiClient.from_environment()
                self.client.post_asset_event(extra)
                self.posted.append(int(version))
                log.info("posted %s event: %s", WEIGHTS_ASSET.name, extra)
                return
            except Exception as err:
                log.warning("asset event for v%s failed (attempt %d): %s", version, attempt, err)
                if attempt < self.attempts:
                    time.sleep(min(2.0 * attempt, 5.0))
        self.failed.append(int(version))


# --------------------------------------------------------------------------- tasks


def _label_map_index(label: str) -> None:
    from airflow.sdk import get_current_context

    get_current_context()["tunix_label"] = label


@task(
    pool=CPU_POOL,
    queue=CPU_POOL,
    retries=2,
    retry_delay=timedelta(seconds=10),
    execution_timeout=ACTOR_TIMEOUT,
    map_index_template="{{ tunix_label }}",
)
def actor(run_uri: str, actor_id: int, deadline_s: float | None = None) -> dict:
    """One CPU actor: steps its envs and writes shards until the run is DONE."""
    _label_map_index(f"actor {actor_id}")
    from tunix_launchers import launch_actor

    return launch_actor(run_uri, int(actor_id), deadline_s=optional_deadline(deadline_s))


@task(
    pool=TPU_POOL,
    queue=TPU_POOL,
    retries=2,
    # > learner.lease_ttl_s (30 s): a crashed learner's lease must expire before the retry
    # takes it over, else the retry fails with LeaseHeldError.
    retry_delay=timedelta(seconds=float(os.environ.get("TUNIX_LEARNER_RETRY_DELAY_S", "45"))),
    execution_timeout=LEARNER_TIMEOUT,
)
def learner(run_uri: str, max_steps: int | None = None, deadline_s: float | None = None) -> dict:
    """The learner: trains from the shards, publishes snapshots (+ asset events).

    A retry resumes from the latest checkpoint (`run_learner` does that), so `retries`
    turns a crashed or pre-empted learner into a pause rather than a lost run.
    """
    from tunix_launchers import launch_learner

    publisher = WeightsEventPublisher(run_uri)
    summary = launch_learner(
        run_uri,
        max_steps=int(max_steps) if max_steps else None,
        deadline_s=optional_deadline(deadline_s),
        on_publish=publisher,
    )
    summary = dict(summary or {})
    summary["asset_events_posted"] = publisher.posted
    summary["asset_events_failed"] = publisher.failed
    return summary


@task(pool=CPU_POOL, queue=CPU_POOL, retries=3, retry_delay=timedelta(seconds=5))
def stop_fleet(run_uri: str) -> str:
    """Mark the run DONE once the learner has finished, whatever its outcome.

    Actors stop when they see the marker, so no actor outlives its learner. This is a
    teardown: it runs even when the learner failed, and does not change the run's state.
    """
    from airflow.sdk import get_current_context

    ctx = get_current_context()
    dag_id, run_id = ctx["dag"].dag_id, ctx["run_id"]
    try:  # for the DONE marker's reason only
        states = ctx["ti"].get_task_states(dag_id=dag_id, task_ids=["learner"], run_ids=[run_id])
        learner_state = states.get(run_id, {}).get("learner", "finished")
    except Exception:
        learner_state = "finished"
    reason = f"airflow {dag_id}/{run_id}: learner {learner_state}"
    entrypoints().mark_done(run_uri, reason)
    log.info("marked %s DONE: %s", run_uri, reason)
    return reason


@task(pool=CPU_POOL, queue=CPU_POOL, retries=1, retry_delay=timedelta(seconds=5))
def report(run_uri: str) -> str:
    """Write the run's HTML report (works for crashed runs too); returns its URI."""
    uri = entrypoints().write_report(run_uri)
    log.info("report: %s", uri)
    return uri


def publish_run_info(
    run_uri: str, num_actors: int, *, max_steps: int | None = None, deadline_s: float = 0.0
) -> list[dict]:
    """Called by the setup task: push the run's facts as XComs, return the actor kwargs.

    Airflow maps only over a task's `return_value`, so the setup task returns one kwargs
    dict per actor (`actor.expand_kwargs`) and pushes `run_uri`, `max_steps` and
    `deadline_s` under their own keys for the learner and the teardowns.
    """
    from airflow.sdk import get_current_context

    ti = get_current_context()["ti"]
    ti.xcom_push(key="run_uri", value=run_uri)
    # 0 = "the config's max_steps": an XCom whose value is None reads back as missing
    # (XComNotFound when the learner's arguments are resolved).
    ti.xcom_push(key="max_steps", value=int(max_steps or 0))
    ti.xcom_push(key="deadline_s", value=float(deadline_s or 0))
    return [
        {"run_uri": run_uri, "actor_id": i, "deadline_s": float(deadline_s or 0)}
        for i in range(int(num_actors))
    ]


def fleet(setup: Any):
    """Wire actors ∥ learner → stop_fleet → report under the `setup` task.

    `setup` is the XComArg of a task that returned `publish_run_info(...)`. The setup
    task becomes an Airflow *setup*, `stop_fleet` and `report` its *teardowns*, so the
    DAG run's state is that of the actors and the learner. Returns the report XComArg.
    """
    from airflow.sdk import XComArg

    setup_op = setup.operator
    run_uri = XComArg(setup_op, key="run_uri")
    actors = actor.expand_kwargs(setup)
    learn = learner(
        run_uri=run_uri,
        max_steps=XComArg(setup_op, key="max_steps"),
        deadline_s=XComArg(setup_op, key="deadline_s"),
    )
    stop = stop_fleet(run_uri)
    rep = report(run_uri)
    learn >> stop
    [actors, stop] >> rep
    setup_op.as_setup()
    stop.operator.as_teardown(setups=setup_op)
    rep.operator.as_teardown(setups=setup_op)
    return rep
