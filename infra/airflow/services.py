"""Throwaway Redis and PostgreSQL servers for the Celery cluster (`celery_cluster.py`).

Both are the Debian packages (`make services` installs them as root: `redis-server`,
`postgresql`); nothing is configured system-wide and no system service is started. Each
server runs in a temporary directory on a free loopback port, in its own session, and
is stopped (and its directory removed) by `stop()`:

    with Redis(tmp) as redis, Postgres() as pg:
        redis.url  # redis://127.0.0.1:PORT/0
        pg.url("postgresql+psycopg2")  # postgresql+psycopg2://airflow@127.0.0.1:PORT/airflow

PostgreSQL refuses to run as root: as root, `initdb` and `postgres` run as the
`postgres` user (created by the Debian package; else `nobody`) through `setpriv`, in a
data directory under the system temp dir owned by that user.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Self

from local_airflow import free_port, left_alive, tree_pids


def redis_server_bin() -> str | None:
    """`redis-server` on PATH or in /usr/bin (Debian's package)."""
    return shutil.which("redis-server") or shutil.which("redis-server", path="/usr/bin:/usr/sbin")


def postgres_bin_dir() -> Path | None:
    """The newest `/usr/lib/postgresql/<ver>/bin` (Debian keeps it off PATH), else PATH."""
    found = sorted(
        (Path(p).parent for p in glob.glob("/usr/lib/postgresql/*/bin/postgres")),
        key=lambda p: int(p.parent.name) if p.parent.name.isdigit() else 0,
    )
    if found:
        return found[-1]
    on_path = shutil.which("postgres")
    return Path(on_path).parent if on_path else None


def missing_services() -> list[str]:
    """Debian packages that `make services` would install ([] when both are present)."""
    return [
        pkg
        for pkg, ok in (("redis-server", redis_server_bin()), ("postgresql", postgres_bin_dir()))
        if not ok
    ]


class Server:
    """A server process in its own session; `stop()` signals it, then SIGKILLs leftovers."""

    name = "server"
    stop_signal = signal.SIGTERM

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = Path(log_dir)
        self.port = free_port()
        self.proc: subprocess.Popen | None = None

    def _spawn(self, args: list[str], cwd: Path) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        with open(self.log_dir / f"{self.name}.log", "ab") as out:
            self.proc = subprocess.Popen(
                args, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                cwd=str(cwd), start_new_session=True,
            )  # fmt: skip

    def log_tail(self, chars: int = 2000) -> str:
        path = self.log_dir / f"{self.name}.log"
        return path.read_text(errors="replace")[-chars:] if path.exists() else ""

    def _wait(self, probe: Callable[[], bool], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if self.proc is None or self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited:\n{self.log_tail()}")
            with contextlib.suppress(Exception):
                if probe():
                    return
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{self.name} not ready after {timeout:.0f}s:\n{self.log_tail()}"
                )
            time.sleep(0.2)

    def pids(self) -> list[int]:
        return tree_pids({self.proc.pid}) if self.proc else []

    def stop(self, timeout: float = 20) -> list[int]:
        """Stop the server; return the pids still alive (none)."""
        if self.proc is None:
            return []
        if self.proc.poll() is None:  # not reaped yet: the pid is still ours
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, self.stop_signal)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=timeout)
        for pid in self.pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5)
        return left_alive(self.pids)

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self, typ: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def start(self) -> None:  # pragma: no cover - abstract
        raise NotImplementedError


class Redis(Server):
    """`redis-server` without persistence on 127.0.0.1:PORT (the Celery broker)."""

    name = "redis"

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 30) -> None:
        binary = redis_server_bin()
        if not binary:
            raise FileNotFoundError("redis-server not found: run `make services` (as root)")
        work = self.log_dir / "redis"
        work.mkdir(parents=True, exist_ok=True)
        args = [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", ""]
        args += ["--appendonly", "no", "--daemonize", "no", "--dir", str(work)]
        self._spawn(args, work)

        def ping() -> bool:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")

        self._wait(ping, timeout)


class Postgres(Server):
    """A fresh PostgreSQL cluster (`initdb`) with database `airflow`, user `airflow`, trust
    auth on 127.0.0.1 only. Durability is off (fsync, synchronous_commit): it is thrown away."""

    name = "postgres"
    stop_signal = signal.SIGINT  # "fast" shutdown: don't wait for clients to disconnect
    user = "airflow"
    database = "airflow"

    def __init__(self, log_dir: Path) -> None:
        super().__init__(log_dir)
        self.data_root: Path | None = None

    def url(self, scheme: str = "postgresql+psycopg2") -> str:
        return f"{scheme}://{self.user}@127.0.0.1:{self.port}/{self.database}"

    def _as_user(self) -> tuple[list[str], int | None, int | None]:
        """The command prefix (and uid/gid) that drops root; nothing when not root."""
        if os.geteuid() != 0:
            return [], None, None
        try:
            pw = pwd.getpwnam("postgres")
        except KeyError:
            pw = pwd.getpwnam("nobody")
        prefix = ["setpriv", f"--reuid={pw.pw_uid}", f"--regid={pw.pw_gid}", "--clear-groups"]
        return [*prefix, "--"], pw.pw_uid, pw.pw_gid

    def start(self, timeout: float = 90) -> None:
        bindir = postgres_bin_dir()
        if bindir is None:
            raise FileNotFoundError("PostgreSQL not found: run `make services` (as root)")
        prefix, uid, gid = self._as_user()
        # Under the system temp dir: a pytest tmp dir (0700, root's) is closed to `postgres`.
        self.data_root = Path(tempfile.mkdtemp(prefix="tunix-pg-"))
        data = self.data_root / "data"
        data.mkdir(mode=0o700)
        if uid is not None:
            for path in (self.data_root, data):
                os.chown(path, uid, gid)
        initdb = [*prefix, str(bindir / "initdb"), "-D", str(data), "-U", self.user]
        initdb += ["--auth=trust", "--encoding=UTF8", "--locale=C", "--no-sync"]
        out = subprocess.run(
            initdb, cwd=self.data_root, capture_output=True, text=True, timeout=120
        )
        if out.returncode:
            raise RuntimeError(f"initdb failed ({out.returncode}): {out.stdout}{out.stderr}")
        args = [*prefix, str(bindir / "postgres"), "-D", str(data), "-k", str(data)]
        args += ["-p", str(self.port), "-c", "listen_addresses=127.0.0.1"]
        for setting in ("fsync=off", "synchronous_commit=off", "full_page_writes=off"):
            args += ["-c", setting]
        self._spawn(args, self.data_root)
        self._wait(self._create_database, timeout)

    def _create_database(self) -> bool:
        import psycopg2

        conn = psycopg2.connect(
            host="127.0.0.1", port=self.port, user=self.user, dbname="postgres", connect_timeout=2
        )
        try:
            conn.autocommit = True
            with conn.cursor() as cur:
                cur.execute("SELECT 1 FROM pg_database WHERE datname = %s", (self.database,))
                if cur.fetchone() is None:
                    cur.execute(f'CREATE DATABASE "{self.database}"')
        finally:
            conn.close()
        return True

    def stop(self, timeout: float = 20) -> list[int]:
        left = super().stop(timeout)
        if self.data_root is not None:
            shutil.rmtree(self.data_root, ignore_errors=True)
        return left
