"""Airflow with the CeleryExecutor: Redis broker, PostgreSQL metadata DB, one worker per host.

    .venv/bin/python infra/airflow/celery_cluster.py start    # = make airflow-cluster; Ctrl-C stops
    .venv/bin/python infra/airflow/celery_cluster.py workers  # print the worker topology

Starts a throwaway Redis and PostgreSQL (`services.py`), then `airflow scheduler`,
`dag-processor`, `api-server` (and `triggerer`) as `LocalAirflow` does, and Celery
workers as if each were on its own host: `cpu-a` and `cpu-b` consume the `cpu` queue
(actors, and `prepare`/`stop_fleet`/`report` through `[operators] default_queue=cpu`),
`tpu-a` the `tpu` queue (the learner). Each worker has its own working directory,
AIRFLOW_HOME (task logs, pid file), HOME and TMPDIR, and reports its name as the task
instances' `hostname` (`[core] hostname_callable`); the object store is the only state the
workers share. Every process runs in its own session and is stopped (SIGTERM, then
SIGKILL) on exit; `kill_worker()` SIGKILLs a whole worker, tasks included, like a host
that dies. The metadata DB is thrown away at stop, so each start begins empty.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from local_airflow import REPO, VENV_BIN, LocalAirflow, tree_pids
from services import Postgres, Redis, missing_services

INFRA = Path(__file__).resolve().parent


@dataclass(frozen=True)
class WorkerSpec:
    """One Celery worker: its name (Celery hostname and task `hostname`), queues, slots."""

    name: str
    queues: str
    concurrency: int


#: Small concurrency: this runs on 2 cores. A cpu worker must hold both actors plus the
#: teardowns when the other cpu worker dies.
DEFAULT_WORKERS = (
    WorkerSpec("cpu-a", "cpu", 3),
    WorkerSpec("cpu-b", "cpu", 3),
    WorkerSpec("tpu-a", "tpu", 1),
)


def worker_hostname() -> str:
    """`[core] hostname_callable` on a worker: its name, as if it were its own host."""
    return os.environ.get("TUNIX_WORKER_HOSTNAME") or socket.getfqdn()


def celery_settings(
    broker_url: str, db_url: str, result_backend: str, *, heartbeat_timeout_s: int
) -> dict[str, str]:
    """The env that turns `local_airflow.airflow_env` into a Celery deployment."""
    return {
        "AIRFLOW__CORE__EXECUTOR": "CeleryExecutor",
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": db_url,
        "AIRFLOW__CELERY__BROKER_URL": broker_url,
        "AIRFLOW__CELERY__RESULT_BACKEND": result_backend,
        # Tasks without a queue (`prepare`) would go to queue "default", which no worker
        # here consumes: route them to the cpu workers.
        "AIRFLOW__OPERATORS__DEFAULT_QUEUE": "cpu",
        "AIRFLOW__CELERY__WORKER_PREFETCH_MULTIPLIER": "1",
        "AIRFLOW__CELERY__SYNC_PARALLELISM": "1",  # one process polls task states, not N-1
        # A dead worker's running tasks are failed (then retried elsewhere) once their
        # heartbeats stop for this long; task runners heartbeat every 5 s.
        "AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT": str(heartbeat_timeout_s),
        "AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT_DETECTION_INTERVAL": "5",
    }


class CeleryAirflow(LocalAirflow):
    """`LocalAirflow` with the CeleryExecutor and Celery workers in their own directories."""

    def __init__(
        self,
        home: Path,
        port: int | None = None,
        *,
        broker_url: str,
        db_url: str,
        result_backend: str,
        workers: tuple[WorkerSpec, ...] = DEFAULT_WORKERS,
        heartbeat_timeout_s: int = 60,
        **kwargs: Any,
    ) -> None:
        super().__init__(home, port, **kwargs)
        self.env.update(
            celery_settings(
                broker_url, db_url, result_backend, heartbeat_timeout_s=heartbeat_timeout_s
            )
        )
        self.broker_url = broker_url
        self.workers = {w.name: w for w in workers}
        self.killed: set[str] = set()

    @classmethod
    def on(cls, redis: Redis, postgres: Postgres, home: Path, **kwargs: Any) -> CeleryAirflow:
        """A cluster on running `services.Redis` / `services.Postgres` servers."""
        return cls(
            home,
            broker_url=redis.url,
            db_url=postgres.url("postgresql+psycopg2"),
            # The driver explicitly: SQLAlchemy 2.1 defaults postgresql:// to psycopg 3.
            result_backend=postgres.url("db+postgresql+psycopg2"),
            **kwargs,
        )

    # -- workers
    def worker_dir(self, name: str) -> Path:
        return self.home / "workers" / name

    def worker_env(self, spec: WorkerSpec) -> dict[str, str]:
        """The shared settings, with this "host"'s own AIRFLOW_HOME, HOME, TMPDIR and name."""
        root = self.worker_dir(spec.name)
        env = dict(self.env)
        env.update(
            {
                "AIRFLOW_HOME": str(root / "airflow"),
                "AIRFLOW__LOGGING__BASE_LOG_FOLDER": str(root / "airflow" / "logs"),
                "HOME": str(root / "home"),
                "TMPDIR": str(root / "tmp"),
                "TUNIX_WORKER_HOSTNAME": spec.name,
                "AIRFLOW__CORE__HOSTNAME_CALLABLE": "celery_cluster.worker_hostname",
                "PYTHONPATH": os.pathsep.join([env["PYTHONPATH"], str(INFRA)]),
            }
        )
        return env

    def start(self) -> None:
        super().start()
        for spec in self.workers.values():
            self.start_worker(spec)

    def start_worker(self, spec: WorkerSpec) -> None:
        env = self.worker_env(spec)
        for key in ("AIRFLOW_HOME", "HOME", "TMPDIR"):
            Path(env[key]).mkdir(parents=True, exist_ok=True)
        args = [str(VENV_BIN / "airflow"), "celery", "worker", "--queues", spec.queues]
        args += ["--celery-hostname", spec.name, "--concurrency", str(spec.concurrency)]
        # No log server: three "hosts" on one machine would share its port (8793).
        args += ["--skip-serve-logs", "--without-mingle", "--without-gossip"]
        self.procs[spec.name] = self.popen(args, env, self.worker_dir(spec.name), spec.name)

    def log_path(self, name: str) -> Path:
        if name in self.workers:
            return self.worker_dir(name) / f"{name}.log"
        return super().log_path(name)

    def check_alive(self) -> None:
        killed = {n: self.procs.pop(n) for n in self.killed if n in self.procs}
        try:
            super().check_alive()
        finally:
            self.procs.update(killed)

    def wait_workers(self, timeout: float = 180) -> float:
        """Wait until every worker answers a Celery ping; return the seconds waited."""
        from celery import Celery

        t0 = time.monotonic()
        app = Celery(broker=self.broker_url)
        try:
            want = {f"celery@{n}" for n in self.workers if n not in self.killed}
            while True:
                self.check_alive()
                replies = app.control.ping(timeout=1.0)
                if want <= {name for reply in replies for name in reply}:
                    return time.monotonic() - t0
                if time.monotonic() - t0 > timeout:
                    raise TimeoutError(f"Celery workers {sorted(want)} not all up: {replies}")
                time.sleep(1)
        finally:
            app.close()

    def kill_worker(self, name: str) -> list[int]:
        """SIGKILL a worker and everything it started (its tasks too), as if its host died."""
        self.killed.add(name)
        pids = tree_pids({self.procs[name].pid})
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(Exception):
            self.procs[name].wait(timeout=10)
        return pids


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("command", choices=["start", "workers"])
    parser.add_argument("--home", type=Path, default=REPO / "airflow_home" / "cluster")
    parser.add_argument("--port", type=int, default=int(os.environ.get("TUNIX_AIRFLOW_PORT", 8080)))
    parser.add_argument("--heartbeat-timeout", type=int, default=60)
    parser.add_argument("--no-triggerer", action="store_true")
    args = parser.parse_args(argv)
    if args.command == "workers":
        for w in DEFAULT_WORKERS:
            print(
                f"{w.name}: airflow celery worker --queues {w.queues} --concurrency {w.concurrency}"
            )
        return 0
    if missing := missing_services():
        print(f"error: {' '.join(missing)} missing: run `make services` as root", file=sys.stderr)
        return 1
    shutil.rmtree(args.home, ignore_errors=True)  # the metadata DB starts empty every time
    stop = {"now": False}
    signal.signal(signal.SIGINT, lambda *_: stop.update(now=True))
    signal.signal(signal.SIGTERM, lambda *_: stop.update(now=True))
    redis, postgres = Redis(args.home / "services"), Postgres(args.home / "services")
    af: CeleryAirflow | None = None
    return_code = 0
    try:
        redis.start()
        postgres.start()
        print(f"redis {redis.url}, postgres {postgres.url()}: airflow db migrate ...", flush=True)
        af = CeleryAirflow.on(
            redis, postgres, args.home, port=args.port, cpu_slots=12, tpu_slots=1,
            heartbeat_timeout_s=args.heartbeat_timeout, triggerer=not args.no_triggerer,
        )  # fmt: skip
        af.init()
        af.start()
        waited = af.wait_ready()
        af.wait_dags(["tunix_train", "tunix_eval"])
        af.unpause("tunix_train", "tunix_eval")
        af.wait_workers()
        print(
            f"Airflow (CeleryExecutor) is up after {waited:.0f}s: {af.url} (no login)\n"
            + "".join(f"  worker {n}: {af.worker_dir(n)}\n" for n in af.workers)
            + f"  components: {af.log_dir}\n  Ctrl-C stops everything.",
            flush=True,
        )
        while not stop["now"]:
            af.check_alive()
            time.sleep(1)
    except Exception as err:  # show why, then stop everything
        print(f"error: {err}", file=sys.stderr)
        return_code = 1
    finally:
        left = af.stop() if af else []
        left += postgres.stop() + redis.stop()
        print("stopped" + (f"; still alive: {left}" if left else ""), flush=True)
    return return_code


if __name__ == "__main__":
    sys.exit(main())
