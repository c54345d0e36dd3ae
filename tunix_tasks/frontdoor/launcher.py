"""Local launcher: one learner + N actor processes on this machine, from one config.

This is `tunix-tasks train`. Every process is a fresh Python (`tunix-tasks learner ...`,
`tunix-tasks actor ...`) in its own session, so a terminal Ctrl-C reaches only the
launcher, which then stops the children in order: the learner checkpoints and exits,
actors flush their shards, stragglers are killed after a grace period. Running the same
command again resumes the run from its checkpoint.

    summary = train_local(cfg)        # blocks; prints live progress; writes the report
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import IO, Any

from tunix_tasks.config import RunConfig
from tunix_tasks.frontdoor.entrypoints import actor_name, prepare_run
from tunix_tasks.storage.runs import mark_done

PROGRESS_PREFIX = "TUNIX_PROGRESS "
GRACE_S = 60.0


@dataclass
class _Child:
    name: str
    proc: subprocess.Popen
    log: IO[bytes]


@dataclass
class LiveStatus:
    """What the progress line shows; updated from the learner's progress records."""

    max_steps: int
    started: float = field(default_factory=time.monotonic)
    record: dict[str, Any] = field(default_factory=dict)
    reward_ema: float | None = None
    actors_alive: int = 0

    def update(self, record: dict[str, Any]) -> None:
        self.record = record
        r = record.get("reward_mean")
        if r is not None:
            self.reward_ema = r if self.reward_ema is None else 0.9 * self.reward_ema + 0.1 * r

    def line(self) -> str:
        r = self.record
        if not r:
            return f"[{time.monotonic() - self.started:6.0f}s] waiting for the learner (compiling, warm start, first data)... actors alive {self.actors_alive}"
        stale = r.get("staleness", {})
        n = sum(stale.values()) or 1
        mean_stale = sum(int(k) * v for k, v in stale.items()) / n
        dropped = sum(r.get("dropped", {}).values())
        return (
            f"[{time.monotonic() - self.started:6.0f}s] step {r['step']}/{self.max_steps} v{r['version']}"
            f"  reward {self.reward_ema or 0:.3f}  duty {r['duty_cycle']:.2f}"
            f"  buffer {r['buffer']} backlog {r['backlog_shards']} shards"
            f"  staleness {mean_stale:.1f}  dropped {dropped}  actors {self.actors_alive}"
        )


def _spawn(name: str, args: list[str], log_dir: str, env: dict[str, str]) -> _Child:
    log = open(os.path.join(log_dir, f"{name}.log"), "ab")  # noqa: SIM115 - closed at exit
    proc = subprocess.Popen(
        [sys.executable, "-m", "tunix_tasks.frontdoor.cli", *args],
        stdout=subprocess.PIPE if name == "learner" else log,
        stderr=log,
        start_new_session=True,  # terminal Ctrl-C goes to the launcher only
        env=env,
    )
    return _Child(name, proc, log)


def _read_progress(
    child: _Child, status: LiveStatus, echo: Callable[[dict[str, Any]], None]
) -> None:
    assert child.proc.stdout is not None
    for raw in child.proc.stdout:
        line = raw.decode(errors="replace")
        if line.startswith(PROGRESS_PREFIX):
            try:
                record = json.loads(line[len(PROGRESS_PREFIX) :])
            except ValueError:
                continue
            status.update(record)
            echo(record)
        else:
            child.log.write(raw)
            child.log.flush()


def _stop(children: list[_Child], sig: int, grace_s: float) -> None:
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


def train_local(
    cfg: RunConfig,
    *,
    log_dir: str | None = None,
    quiet: bool = False,
    report: bool = True,
) -> dict[str, Any]:
    """Run a whole training run locally; returns the summary (also in the report)."""
    run_uri = prepare_run(cfg)
    if log_dir is None:
        log_dir = os.path.join(os.getcwd(), "runs", "_logs", cfg.run_name)
    os.makedirs(log_dir, exist_ok=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    status = LiveStatus(max_steps=cfg.learner.max_steps)
    tty = sys.stdout.isatty() and not quiet
    last_print = [0.0]

    def echo(_record: dict[str, Any]) -> None:
        if quiet:
            return
        now = time.monotonic()
        if tty:
            print("\r" + status.line()[:200].ljust(200), end="", flush=True)
        elif now - last_print[0] >= 5.0:
            print(status.line(), flush=True)
            last_print[0] = now

    learner = _spawn("learner", ["learner", "--run", run_uri, "--progress"], log_dir, env)
    actors = [
        _spawn(actor_name(i), ["actor", "--run", run_uri, "--actor-id", str(i)], log_dir, env)
        for i in range(cfg.actor.num_actors)
    ]
    children = [learner, *actors]
    reader = threading.Thread(target=_read_progress, args=(learner, status, echo), daemon=True)
    reader.start()
    interrupted: list[str] = []

    def on_signal(signum: int, _frame: Any) -> None:
        interrupted.append(signal.Signals(signum).name)

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    t0 = time.monotonic()
    try:
        while learner.proc.poll() is None and not interrupted:
            status.actors_alive = sum(a.proc.poll() is None for a in actors)
            if not status.record:
                echo({})
            time.sleep(0.5)
        if interrupted:
            if not quiet:
                print(
                    f"\n{interrupted[0]}: stopping learner (checkpoint) and actors (flush)...",
                    flush=True,
                )
            _stop([learner], signal.SIGTERM, GRACE_S)
            _stop(actors, signal.SIGTERM, GRACE_S)
        else:
            # The learner marks DONE when it finishes; make sure actors see it even if it crashed.
            from tunix_tasks.storage.store import open_store

            if learner.proc.returncode != 0:
                mark_done(
                    open_store(run_uri), f"learner exited with code {learner.proc.returncode}"
                )
            _stop_after(actors, GRACE_S)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        reader.join(timeout=5)
        for c in children:
            c.log.close()
    if tty:
        print()
    summary: dict[str, Any] = {
        "run_uri": run_uri,
        "mode": cfg.mode,
        "wall_s": time.monotonic() - t0,
        "learner_exit_code": learner.proc.returncode,
        "actor_exit_codes": [a.proc.returncode for a in actors],
        "interrupted": interrupted[0] if interrupted else None,
        "logs": log_dir,
        "last_step": status.record,
    }
    if report:
        from tunix_tasks.frontdoor.report import write_report

        summary["report"] = write_report(run_uri)
    return summary


def _stop_after(actors: list[_Child], grace_s: float) -> None:
    """Actors exit on their own once DONE is visible; terminate any that do not."""
    deadline = time.monotonic() + grace_s
    for a in actors:
        try:
            a.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _stop([a], signal.SIGTERM, 10.0)
