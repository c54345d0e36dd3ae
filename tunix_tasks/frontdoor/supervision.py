"""Child processes of `tunix-tasks train`: start, watch, restart, stop.

Every child is a fresh Python running one `tunix-tasks` command (`learner ...`,
`actor ...`) in its own session (a terminal's Ctrl-C or hang-up reaches only the
launcher, which stops the children in order), logging to `<log_dir>/<name>.log`
(`process_log_dir`: the run's `logs/` folder, or a local cache for a `gs://` run). It
starts through this module's `__main__`, which first asks the kernel for SIGTERM when
the launcher dies (Linux `prctl(PR_SET_PDEATHSIG)`; it exits at once if the launcher is
already gone), then runs the command: a launcher killed with SIGKILL, which can clean
nothing up, still takes its children with it, and they stop as on Ctrl-C (the learner
checkpoints, actors flush). Done in the child, not between fork and exec: the launcher
may have JAX's threads running, and forking those into Python code can deadlock.

`ActorPool` watches the actors: one that exits with an error is reported at once with
the last lines of its log and restarted after a backoff (5 s, 10 s, 20 s ...), at most
`max_restarts` times; `failed_for_good()` says when none is left running or due to
restart, so the launcher can stop the run instead of idling until the learner's
`data_timeout_s`.

    pool = ActorPool([spawn("actor-0000", args, log_dir, env), ...], env=env, report=print)
    pool.check()                   # every loop of the launcher
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import runpy
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from tunix_tasks.frontdoor.compile_cache import user_cache_dir
from tunix_tasks.storage.layout import RunLayout

PR_SET_PDEATHSIG = 1
TAIL_LINES = 20


def die_with_parent(parent: int, sig: int = signal.SIGTERM) -> bool:
    """Have the kernel send `sig` to this process when `parent` dies (Linux); False
    where that is not available. Exits now if `parent` is already gone."""
    armed = False
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            armed = ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0) == 0
    if os.getppid() != parent:  # it died before the prctl: no signal will come
        sys.exit(f"launcher (pid {parent}) gone before this child started")
    return armed


@dataclass
class Child:
    name: str
    args: list[str]
    log_path: str
    proc: subprocess.Popen
    log: IO[bytes]
    restarts: int = 0
    exit_codes: list[int] = field(default_factory=list)  # of earlier, failed lives

    @property
    def running(self) -> bool:
        return self.proc.poll() is None


def process_log_dir(run_dir: Path | None, run_name: str) -> Path:
    """Where `tunix-tasks train` writes its children's logs: with the run, in its folder
    (`<run>/logs/`), for a run on this machine (`run_dir`, the store's `local_path()`);
    `$XDG_CACHE_HOME/tunix-tasks/logs/<run_name>/` (`~/.cache/...`) for a remote (`gs://`)
    one (`compile_cache.user_cache_dir`)."""
    if run_dir is not None:
        return run_dir / RunLayout.LOGS
    return user_cache_dir() / "logs" / run_name


def spawn(name: str, args: list[str], log_dir: str, env: dict[str, str]) -> Child:
    log_path = os.path.join(log_dir, f"{name}.log")
    log_file = open(log_path, "ab")  # noqa: SIM115 - closed by close_logs
    proc = _popen(args, log_file, env)
    return Child(name, args, log_path, proc, log_file)


def _popen(args: list[str], log_file: IO[bytes], env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "tunix_tasks.frontdoor.supervision", str(os.getpid()), *args],
        stdout=log_file,
        stderr=log_file,
        start_new_session=True,  # terminal Ctrl-C / hang-up go to the launcher only
        env=env,
    )


def respawn(child: Child, env: dict[str, str]) -> None:
    """Start `child` again (same name, arguments and log file)."""
    child.exit_codes.append(child.proc.returncode)
    child.restarts += 1
    child.log.write(f"\n=== launcher: restart {child.restarts} of {child.name} ===\n".encode())
    child.log.flush()
    child.proc = _popen(child.args, child.log, env)


def log_tail(path: str, lines: int = TAIL_LINES) -> str:
    """The last `lines` lines of a log file, indented ('' if unreadable)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64 * 1024))
            text = f.read().decode(errors="replace")
    except OSError:
        return ""
    return "\n".join(f"  | {line}" for line in text.rstrip("\n").splitlines()[-lines:])


def stop(children: list[Child], sig: int, grace_s: float) -> None:
    """Send `sig` to each running child's process group; SIGKILL those left after grace."""
    for c in children:
        if c.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(c.proc.pid, sig)
    deadline = time.monotonic() + grace_s
    for c in children:
        try:
            c.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(c.proc.pid, signal.SIGKILL)
            c.proc.wait()


def stop_after(children: list[Child], grace_s: float) -> None:
    """Children exit on their own once DONE is visible; terminate any that do not."""
    deadline = time.monotonic() + grace_s
    for c in children:
        try:
            c.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            stop([c], signal.SIGTERM, 10.0)


def close_logs(children: list[Child]) -> None:
    for c in children:
        c.log.close()


class ActorPool:
    """Restarts failed actors a bounded number of times; reports every death at once."""

    def __init__(
        self,
        actors: list[Child],
        *,
        env: dict[str, str],
        report: Callable[[str], None],
        max_restarts: int = 3,
        restart_delay_s: float = 5.0,
        final: Mapping[int, str] | None = None,
    ) -> None:
        """`final`: exit statuses after which a restart would not help, each with why
        (the launcher's: `FENCED_EXIT_CODE`, the actor's run is gone)."""
        self.actors = actors
        self._final = dict(final or {})
        self._env = env
        self._report = report
        self.max_restarts = max_restarts
        self.restart_delay_s = restart_delay_s
        self._due: dict[str, float] = {}  # actor name -> monotonic time of its restart
        self._seen: set[str] = set()  # names whose current exit was handled

    @property
    def alive(self) -> int:
        return sum(a.running for a in self.actors)

    def add(self, child: Child) -> None:
        """Watch (and restart) one more actor."""
        self.actors.append(child)
        self._seen.discard(child.name)

    def retire(self, children: list[Child]) -> None:
        """Stop watching `children` and ask them to stop (SIGTERM: they flush their
        shards and exit); the caller waits for them."""
        for child in children:
            self.actors.remove(child)
            self._due.pop(child.name, None)
            if child.running:
                child.proc.send_signal(signal.SIGTERM)

    def check(self, *, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        for a in self.actors:
            code = a.proc.poll()
            if code is None:
                continue
            if a.name not in self._seen:
                self._seen.add(a.name)
                self._exited(a, code, now)
            if a.name in self._due and now >= self._due[a.name]:
                del self._due[a.name]
                self._seen.discard(a.name)
                respawn(a, self._env)
                self._report(f"{a.name}: restarted ({a.restarts}/{self.max_restarts})")

    def _exited(self, a: Child, code: int, now: float) -> None:
        if code == 0:
            return  # finished: the run is done, or its deadline passed
        what = f"killed by {_signal_name(-code)}" if code < 0 else f"exited with code {code}"
        if code in self._final:
            then = f"not restarting it: {self._final[code]}"
        elif a.restarts < self.max_restarts:
            delay = self.restart_delay_s * 2**a.restarts
            self._due[a.name] = now + delay
            then = f"restarting it in {delay:.0f}s ({a.restarts + 1}/{self.max_restarts})"
        else:
            then = f"not restarting it: {self.max_restarts} restarts used"
        self._report(
            f"{a.name} {what}; {then}. Last lines of {a.log_path}:\n{log_tail(a.log_path)}"
        )

    def failed_for_good(self) -> bool:
        """Every actor exited, was seen by `check`, none is due to restart, one failed."""
        exited = [a for a in self.actors if not a.running]
        return (
            len(exited) == len(self.actors)
            and not self._due
            and all(a.name in self._seen for a in exited)
            and any(a.proc.returncode != 0 for a in exited)
        )

    def describe(self) -> str:
        return ", ".join(
            f"{a.name}: exit {a.proc.returncode} after {a.restarts} restarts" for a in self.actors
        )


def _signal_name(num: int) -> str:
    try:
        return signal.Signals(num).name
    except ValueError:
        return f"signal {num}"


def _exiting(parent: int) -> None:
    """Ignore stop signals for the rest of the exit; a launcher that dies meanwhile still
    takes this process with it (SIGKILL, which nothing ignores)."""
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    with contextlib.suppress(SystemExit):  # the launcher is gone already: exiting anyway
        die_with_parent(parent, signal.SIGKILL)


def _child_main(argv: list[str]) -> None:
    """`python -m tunix_tasks.frontdoor.supervision LAUNCHER_PID COMMAND...`: arm the
    parent-death signal, then run `python -m tunix_tasks.frontdoor.cli COMMAND...`."""
    parent = int(argv[0])
    die_with_parent(parent)
    # Python puts its signal handlers back to the default late in its exit, after the
    # last atexit callback: a stop signal then (the launcher stopping the run as this
    # process ends on its own, fenced say) would make its status "killed by SIGTERM"
    # (-15), hiding its own. Registered first, this callback runs last.
    atexit.register(_exiting, parent)
    sys.argv = [sys.argv[0], *argv[1:]]
    runpy.run_module("tunix_tasks.frontdoor.cli", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    _child_main(sys.argv[1:])
