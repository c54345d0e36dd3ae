"""Run Airflow 3 locally for tunix-tasks: SQLite, LocalExecutor, the repo's `dags/`.

    .venv/bin/python infra/airflow/local_airflow.py start          # foreground, Ctrl-C stops
    .venv/bin/python infra/airflow/local_airflow.py init           # db migrate + pools only
    .venv/bin/python infra/airflow/local_airflow.py env            # print the env (for `airflow ...`)

Starts `airflow scheduler`, `airflow dag-processor`, `airflow api-server` and
`airflow triggerer` as separate processes, each in its own session, and stops them all,
their tasks included (SIGTERM, then SIGKILL), on exit. The UI and REST API are at
http://127.0.0.1:8080 (`--port`). Local only: the API runs with
`simple_auth_manager_all_admins` (no login). The tests use the same class
(`LocalAirflow`) with a temporary AIRFLOW_HOME and a free port.

Knobs: `--home` (default `<repo>/airflow_home`), `--port`, `--parallelism`,
`--cpu-slots`, `--tpu-slots`, `--no-triggerer`; env `TUNIX_STORE` (default
`file://<repo>/runs`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent
COMPONENTS = ("scheduler", "dag-processor", "api-server", "triggerer")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tree_pids(leaders: set[int]) -> list[int]:
    """Live processes in the sessions of `leaders` (each component is a session leader),
    and their descendants.

    By session: Airflow 3.3 puts every task runner in a process group of its own
    (`os.setpgid(0, 0)`), but it stays in its worker's session. Descendants: PostgreSQL's
    children start sessions of their own (`setsid`).
    """
    procs: dict[int, tuple[int, int]] = {}  # pid -> (ppid, session)
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                stat = (entry / "stat").read_text()
                fields = stat[stat.rindex(")") + 2 :].split()  # state ppid pgrp session ...
                if fields[0] != "Z":
                    procs[int(entry.name)] = (int(fields[1]), int(fields[3]))
    found = {pid for pid, (_, sid) in procs.items() if sid in leaders}
    while True:
        more = {pid for pid, (ppid, _) in procs.items() if ppid in found} - found
        if not more:
            return sorted(found)
        found |= more


def left_alive(pids: Callable[[], list[int]], timeout: float = 10) -> list[int]:
    """`pids()` once it is empty, or what it still lists after `timeout`: a SIGKILLed
    process tearing down a large heap is not a zombie yet for a moment."""
    deadline = time.monotonic() + timeout
    while (left := pids()) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def airflow_env(
    home: Path,
    port: int,
    *,
    dags_folder: Path = REPO / "dags",
    parallelism: int = 16,
    base: dict[str, str] | None = None,
) -> dict[str, str]:
    """The environment every Airflow component (and so every task) runs with."""
    home = Path(home).resolve()
    home.mkdir(parents=True, exist_ok=True)
    secret_file = home / ".jwt_secret"
    if not secret_file.exists():
        secret_file.write_text(secrets.token_urlsafe(32))
        secret_file.chmod(0o600)
    env = dict(os.environ if base is None else base)
    url = f"http://127.0.0.1:{port}"
    pythonpath = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    pythonpath += [str(REPO), str(dags_folder)]  # tunix_tasks from this checkout, DAG helpers
    env.update(
        {
            "AIRFLOW_HOME": str(home),
            "PATH": f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}",
            "PYTHONPATH": os.pathsep.join(pythonpath),
            "AIRFLOW__CORE__DAGS_FOLDER": str(Path(dags_folder).resolve()),
            "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
            "AIRFLOW__CORE__EXECUTOR": "LocalExecutor",
            "AIRFLOW__CORE__PARALLELISM": str(parallelism),
            "AIRFLOW__CORE__MAX_ACTIVE_TASKS_PER_DAG": str(parallelism),
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS": "True",
            "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"{url}/execution/",
            "AIRFLOW__API__HOST": "127.0.0.1",
            "AIRFLOW__API__PORT": str(port),
            "AIRFLOW__API__WORKERS": "1",
            "AIRFLOW__API_AUTH__JWT_SECRET": secret_file.read_text().strip(),
            "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{home / 'airflow.db'}",
            "AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL": "15",
            "AIRFLOW__SCHEDULER__ENABLE_HEALTH_CHECK": "False",
            "AIRFLOW__LOGGING__BASE_LOG_FOLDER": str(home / "logs"),
            # where the learner task posts tunix_weights asset events (dags/tunix_api.py)
            "TUNIX_AIRFLOW_API_URL": url,
            "TUNIX_STORE": env.get("TUNIX_STORE") or f"file://{REPO / 'runs'}",
            "JAX_PLATFORMS": env.get("JAX_PLATFORMS", "cpu"),
        }
    )
    return env


class LocalAirflow:
    """Airflow components as child process groups, with readiness and clean shutdown."""

    def __init__(
        self,
        home: Path,
        port: int | None = None,
        *,
        dags_folder: Path = REPO / "dags",
        parallelism: int = 16,
        cpu_slots: int = 12,
        tpu_slots: int = 2,
        triggerer: bool = True,
        log_dir: Path | None = None,
    ) -> None:
        self.home = Path(home).resolve()
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = airflow_env(
            self.home, self.port, dags_folder=dags_folder, parallelism=parallelism
        )
        self.pools = {"cpu": cpu_slots, "tpu": tpu_slots}
        self.components = [c for c in COMPONENTS if triggerer or c != "triggerer"]
        self.log_dir = Path(log_dir or self.home / "component_logs")
        self.procs: dict[str, subprocess.Popen] = {}

    # -- setup
    def airflow(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
        """Run `airflow ARGS` with the components' environment; fail with its output."""
        out = subprocess.run(
            [str(VENV_BIN / "airflow"), *args],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if out.returncode:
            tail = (out.stdout[-2000:] + out.stderr[-4000:]).strip()
            raise RuntimeError(f"`airflow {' '.join(args)}` exited {out.returncode}:\n{tail}")
        return out

    def init(self) -> None:
        """`airflow db migrate` and the `cpu` / `tpu` pools (idempotent)."""
        self.airflow("db", "migrate")
        for name, slots in self.pools.items():
            self.airflow("pools", "set", name, str(slots), f"tunix {name} workers")

    # -- processes
    def start(self) -> None:
        for name in self.components:
            args = [str(VENV_BIN / "airflow"), name]
            if name == "api-server":
                args += ["--host", "127.0.0.1", "--port", str(self.port)]
            self.procs[name] = self.popen(args, self.env, self.home, name)

    def popen(self, args: list[str], env: dict[str, str], cwd: Path, name: str) -> subprocess.Popen:
        """Start one component, output to `log_path(name)`, in a session of its own."""
        path = self.log_path(name)
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "ab") as out:
            return subprocess.Popen(
                args,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # own session/process group: stop() kills tasks too
                cwd=str(cwd),
            )

    def log_path(self, name: str) -> Path:
        return self.log_dir / f"{name}.log"

    def check_alive(self) -> None:
        dead = {n: p.returncode for n, p in self.procs.items() if p.poll() is not None}
        if dead:
            tails = {n: self.log_tail(n) for n in dead}
            raise RuntimeError(f"Airflow components exited: {dead}\n{json.dumps(tails, indent=1)}")

    def log_tail(self, name: str, chars: int = 3000) -> str:
        path = self.log_path(name)
        return path.read_text(errors="replace")[-chars:] if path.exists() else ""

    def wait_ready(self, timeout: float = 240) -> float:
        """Wait until the API answers and the scheduler and dag-processor are healthy."""
        t0 = time.monotonic()
        while True:
            self.check_alive()
            try:
                health = self.request("GET", "/api/v2/monitor/health")
                if health["scheduler"]["status"] == "healthy" and health.get(
                    "dag_processor", {}
                ).get("status") in ("healthy", None):
                    return time.monotonic() - t0
            except (OSError, urllib.error.URLError, KeyError, ValueError):
                pass
            if time.monotonic() - t0 > timeout:
                raise TimeoutError(f"Airflow not ready after {timeout:.0f}s at {self.url}")
            time.sleep(2)

    def wait_dags(self, dag_ids: list[str], timeout: float = 180) -> None:
        t0 = time.monotonic()
        while True:
            self.check_alive()
            found = {d["dag_id"] for d in self.request("GET", "/api/v2/dags?limit=100")["dags"]}
            if set(dag_ids) <= found:
                return
            errors = self.request("GET", "/api/v2/importErrors")
            if errors.get("total_entries"):
                raise RuntimeError(f"DAG import errors: {errors}")
            if time.monotonic() - t0 > timeout:
                raise TimeoutError(
                    f"DAGs {dag_ids} not parsed after {timeout:.0f}s (found {found})"
                )
            time.sleep(2)

    def unpause(self, *dag_ids: str) -> None:
        for dag_id in dag_ids:
            self.request("PATCH", f"/api/v2/dags/{dag_id}", {"is_paused": False})

    def pids(self) -> list[int]:
        """Every live process the components started (tasks included)."""
        return tree_pids({p.pid for p in self.procs.values()})

    def stop(self, timeout: float = 30) -> list[int]:
        """SIGTERM each process group, SIGKILL what is left; return pids still alive (none)."""
        for proc in self.procs.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while self.pids() and time.monotonic() < deadline:
            for proc in self.procs.values():
                proc.poll()
            time.sleep(0.5)
        for pid in self.pids():  # task runners too: they have process groups of their own
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for proc in self.procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
        return left_alive(self.pids)

    # -- REST
    def request(self, method: str, path: str, body: object = None, timeout: float = 30) -> dict:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(
            self.url + path,
            data=data,
            method=method,
            headers={"Content-Type": "application/json", "Accept": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            raw = resp.read()
        return json.loads(raw) if raw else {}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("command", choices=["start", "init", "env", "clean"])
    parser.add_argument("--home", type=Path, default=REPO / "airflow_home")
    parser.add_argument("--port", type=int, default=int(os.environ.get("TUNIX_AIRFLOW_PORT", 8080)))
    parser.add_argument("--parallelism", type=int, default=16)
    parser.add_argument("--cpu-slots", type=int, default=12)
    parser.add_argument("--tpu-slots", type=int, default=2)
    parser.add_argument("--no-triggerer", action="store_true")
    args = parser.parse_args(argv)

    if args.command == "clean":
        shutil.rmtree(args.home, ignore_errors=True)
        print(f"removed {args.home}")
        return 0
    af = LocalAirflow(
        args.home,
        args.port,
        parallelism=args.parallelism,
        cpu_slots=args.cpu_slots,
        tpu_slots=args.tpu_slots,
        triggerer=not args.no_triggerer,
    )
    if args.command == "env":
        for key, value in sorted(af.env.items()):
            if key.startswith(("AIRFLOW", "TUNIX", "PYTHONPATH")):
                print(f"export {key}={value!r}")
        return 0
    print(f"AIRFLOW_HOME={af.home}: airflow db migrate + pools {af.pools} ...", flush=True)
    af.init()
    if args.command == "init":
        return 0

    stop = {"now": False}

    def _handle(signum, frame):
        stop["now"] = True

    signal.signal(signal.SIGINT, _handle)
    signal.signal(signal.SIGTERM, _handle)
    af.start()
    try:
        waited = af.wait_ready()
        af.wait_dags(["tunix_train", "tunix_eval"])
        af.unpause("tunix_train", "tunix_eval")  # tunix_recurring stays paused: it is scheduled
        print(
            f"Airflow is up after {waited:.0f}s: {af.url}  (no login: all-admins mode)\n"
            f"  logs: {af.home / 'logs'} (tasks), {af.log_dir} (components)\n"
            "  Ctrl-C stops everything.",
            flush=True,
        )
        while not stop["now"]:
            af.check_alive()
            time.sleep(1)
    except Exception as err:  # show why, then stop everything
        print(f"error: {err}", file=sys.stderr)
        return_code = 1
    else:
        return_code = 0
    finally:
        left = af.stop()
        print("stopped" + (f"; still alive: {left}" if left else ""), flush=True)
    return return_code


if __name__ == "__main__":
    sys.exit(main())
