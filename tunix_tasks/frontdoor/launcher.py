"""Local launcher: one learner + N actor processes on this machine, from one config.

This is `tunix-tasks train`. Every process is a fresh Python (`tunix-tasks learner ...`,
`tunix-tasks actor ...`) in its own session, so a terminal Ctrl-C reaches only the
launcher, which then stops the children in order: the learner checkpoints and exits,
actors flush their shards, stragglers are killed after a grace period. SIGTERM and SIGHUP
(the terminal closed) do the same; children also get SIGTERM if the launcher itself is
killed. Running the same command again resumes the run from its checkpoint. A failed
actor is reported with its last log lines and restarted a few times; when none is left,
the run stops with a message instead of idling (supervision.py).

The live display reads the learner's metrics records with `MetricsTail`, the same records
(and the same reader) the report uses; there is no second telemetry channel. On a
terminal it is a `rich` live table; otherwise a plain line every few seconds. Its audit
line is the latency audit of the recent records; when the run ends, the last frame and
the summary show the report's audit of every record of the run (audit.py,
`run_utilization`).

    summary = train_local(cfg)        # blocks; shows live progress; writes the report
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import signal
import sys
import time
from collections.abc import Iterable
from typing import Any

from tunix_tasks.config import RunConfig
from tunix_tasks.frontdoor.audit import (
    AuditWindow,
    display_line,
    explain_duty,
    rounded,
    run_utilization,
    utc,
)
from tunix_tasks.frontdoor.entrypoints import (
    FENCED_EXIT_CODE,
    actor_name,
    mark_done,
    prepare_run,
    prepared_run_id,
    resume_note,
)
from tunix_tasks.frontdoor.fleet import LocalFleet
from tunix_tasks.frontdoor.supervision import (
    ActorPool,
    Child,
    close_logs,
    log_tail,
    process_log_dir,
    spawn,
    stop,
    stop_after,
)
from tunix_tasks.learner import drop_bias
from tunix_tasks.storage.metrics import MetricsTail, Stopwatch
from tunix_tasks.storage.runs import RunFence, RunReplaced, is_done, replaced_if_known
from tunix_tasks.storage.store import ObjectStore, StoreError, open_store

log = logging.getLogger(__name__)

#: Actor exits a restart would not mend (`ActorPool`'s `final`): fenced off the run.
FINAL_EXITS = {FENCED_EXIT_CODE: "its run was deleted or created again (fenced off)"}

GRACE_S = 60.0
POLL_S = 1.0  # metrics poll; with the learner's 1 s flush the display lags ~1-2 s
PLAIN_EVERY_S = 5.0  # one plain line this often when stdout is not a terminal
ACTOR_POLL_S = 5.0  # actor metrics (for the latency audit): actors log every ~5 s
MAX_RESTARTS = 3  # per actor
RESTART_DELAY_S = 5.0  # doubled after each restart of the same actor
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


NARROW_BELOW = 120  # terminal columns: below this the table shows the narrow fields
NARROW = ("step", "reward", "duty", "backlog", "staleness", "actors")


def _phase_counts(phases: list[str]) -> str:
    """`["compiling the sampler (3 programs)"] * 2 + ["sampling"]` ->
    `2 compiling the sampler (3 programs), 1 sampling`."""
    counts = collections.Counter(phases)
    return ", ".join(f"{n} {phase}" for phase, n in counts.items())


class LiveStatus:
    """What the live display shows, from the learner's (and actors', for the audit) records."""

    def __init__(
        self,
        max_steps: int,
        *,
        warm_start_steps: int = 0,
        actors_total: int = 0,
        watch: Stopwatch | None = None,
        cfg: RunConfig | None = None,
    ) -> None:
        self.cfg = cfg
        self.window = AuditWindow()  # what the live audit reads
        self.max_steps = max_steps
        self.warm_start_steps = warm_start_steps
        self.actors_total = actors_total
        self.actors_alive = 0
        self.watch = watch or Stopwatch()
        self.started_at = time.time()
        self.record: dict[str, Any] = {}  # the latest learner step record
        self.learner_phase: dict[str, Any] = {}  # the latest learner record with a `phase`
        self.learner_seen = 0.0  # the time of its latest other record
        # When the phase began: its record's time, or the learner's last other record
        # when that came after the previous phase (a wait for data starts at a step and
        # is recorded only once it lasts WAIT_NOTED_S, learner.py).
        self.learner_phase_from = 0.0
        self.warm_step = 0
        self.reward_ema: float | None = None
        self.last_record_time: float | None = None
        # Set at the end: the audit of every record of the run (the report's), which the
        # last frame and the summary show instead of the recent window's.
        self.final_audit: dict[str, Any] | None = None
        # Display lag = when a record reached us - when the learner logged it.
        self.lag_n, self.lag_sum, self.lag_max = 0, 0.0, 0.0

    def update(self, records: Iterable[dict[str, Any]], *, now: float | None = None) -> None:
        now = time.time() if now is None else now
        for r in records:
            t = r.get("time")
            if isinstance(t, int | float):
                self.last_record_time = max(self.last_record_time or t, t)
                if t >= self.started_at:  # a resumed run's old records are not "lag"
                    lag = max(0.0, now - t)
                    self.lag_n, self.lag_sum = self.lag_n + 1, self.lag_sum + lag
                    self.lag_max = max(self.lag_max, lag)
            if "warm_start_step" in r:
                self.warm_step = max(self.warm_step, int(r["warm_start_step"]))
            if str(r.get("process", "")).startswith("actor/"):
                self.window.add([r])
            elif "phase" in r:
                if r.get("time", 0.0) >= self.learner_phase.get("time", 0.0):
                    after_phase = self.learner_phase.get("time", 0.0) >= self.learner_seen
                    self.learner_phase_from = r["time"] if after_phase else self.learner_seen
                    self.learner_phase = r
            elif isinstance(t, int | float):  # a warm-start or step record ends a phase
                self.learner_seen = max(self.learner_seen, t)
            if "step" in r and "loss" in r:
                self.window.add([r])
                if int(r["step"]) >= int(self.record.get("step", -1)):
                    self.record = r
                reward = r.get("reward_mean")
                if reward is not None:
                    self.reward_ema = (
                        reward if self.reward_ema is None else 0.9 * self.reward_ema + 0.1 * reward
                    )

    def audit(self, running: set[str] | None = None) -> dict[str, Any] | None:
        """The latency audit of the recent records (of the `running` actors' processes
        only, when given), or `final_audit` once set (None without the run's config)."""
        if self.final_audit is not None or self.cfg is None:
            return self.final_audit
        # actors_total: the fleet the autopilot resized, when it did
        return self.window.audit(self.cfg, running=running, actors=self.actors_total)

    def lag_summary(self) -> dict[str, Any]:
        return {
            "records": self.lag_n,
            "mean": self.lag_sum / self.lag_n if self.lag_n else None,
            "max": self.lag_max if self.lag_n else None,
        }

    def phase(self, *, now: float | None = None) -> str:
        """What is happening while no step comes, from the processes' `phase` records
        since this display started (a resumed run's old ones say nothing about now): the
        learner's, when newer than its other records (`waiting for the first shard`,
        `compiling the train step for bucket 64 (1 of 2)`, ...), with how long it has
        lasted, and the actors' latest (`2 compiling the sampler (3 programs so far)`);
        `starting` for processes that have written nothing yet (imports, the model).
        Empty while the learner steps and every actor samples."""
        now = time.time() if now is None else now
        parts = []
        lp = self.learner_phase
        if lp.get("time", 0.0) >= self.started_at and lp["time"] > self.learner_seen:
            parts.append(f"learner {lp['phase']} ({max(0.0, now - self.learner_phase_from):.0f}s)")
        elif max(lp.get("time", 0.0), self.learner_seen) < self.started_at:
            parts.append(f"learner starting ({max(0.0, now - self.started_at):.0f}s)")
        latest = self.window.latest_actor_records()
        phases = [str(r["phase"]) for r in latest if "phase" in r and r["time"] >= self.started_at]
        if not phases:
            phases = ["starting"] * self.actors_total
        if parts or any(p != "sampling" for p in phases):
            parts.append("actors: " + _phase_counts(phases))
        return "; ".join(parts)

    def fields(self, *, now: float | None = None, narrow: bool = False) -> list[tuple[str, str]]:
        """(label, value) pairs, the same for the table and the plain line. `narrow`: the
        `NARROW` ones only, the buffer folded into `backlog`, for terminals under
        `NARROW_BELOW` columns."""
        now = time.time() if now is None else now
        r = self.record
        out = [("time", f"{self.watch.wall_s:.0f}s")]
        if r:
            out.append(("step", f"{r['step']}/{self.max_steps}"))
            out.append(("version", f"v{r.get('version', '?')}"))
        elif self.warm_step:
            out.append(("step", f"warm start {self.warm_step}/{self.warm_start_steps}"))
        else:
            out.append(("step", "starting"))
        if r:
            stale = {int(k): int(v) for k, v in (r.get("staleness") or {}).items()}
            n = sum(stale.values())
            mean_stale = sum(k * v for k, v in stale.items()) / n if n else 0.0
            shards = r.get("backlog_shards", 0)
            out += [
                ("reward", f"{self.reward_ema or 0.0:.3f}"),
                ("duty", f"{r.get('duty_cycle', 0.0):.2f}"),
                ("buffer", f"{r.get('buffer', 0)} eps"),
                (
                    "backlog",
                    f"{r.get('buffer', 0)} eps + {shards} shards" if narrow else f"{shards} shards",
                ),
                ("staleness", f"{mean_stale:.1f} (max {max(stale, default=0)})"),
                ("dropped", str(sum((r.get("dropped") or {}).values()))),
            ]
        out.append(("actors", f"{self.actors_alive}/{self.actors_total}"))
        if self.last_record_time is not None:
            out.append(("updated", f"{max(0.0, now - self.last_record_time):.0f}s ago"))
        return [f for f in out if f[0] in NARROW] if narrow else out

    def drop_hint(self) -> str:
        """`stale drops vs trained: 1.8x longer, ...` from the latest step record's
        cumulative `drop_bias`, only when the stale drops are significant and differ
        (`learner/drop_bias.py: hint`); else ""."""
        bias = self.record.get("drop_bias")
        return drop_bias.hint(bias["trained"], bias["stale"]) if bias else ""

    def line(self, *, now: float | None = None) -> str:
        text = "  ".join(f"{k} {v}" for k, v in self.fields(now=now))
        phase = self.phase(now=now)
        text += f"  now: {phase}" if phase else ""
        hint = self.drop_hint()
        text += f"  ({hint})" if hint else ""
        audit = display_line(self.record.get("duty_cycle"), self.audit())
        return f"{text}  | {audit}" if audit else text

    def render(self, *, now: float | None = None) -> Any:
        """A rich renderable: a step progress bar, what is happening (`phase`) and a
        one-row table of the fields, narrow (`NARROW`) under `NARROW_BELOW` columns."""
        return _Frame(self, now)

    def frame(self, width: int, *, now: float | None = None) -> Any:
        """The renderable for a console `width` columns wide (`render`)."""
        from rich import box
        from rich.console import Group
        from rich.progress_bar import ProgressBar
        from rich.table import Table
        from rich.text import Text

        fields = self.fields(now=now, narrow=width < NARROW_BELOW)
        table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
        for label, _ in fields:
            table.add_column(label, justify="right", no_wrap=True)
        table.add_row(*(v for _, v in fields))
        step = int(self.record.get("step", 0))
        bar = Table.grid(padding=(0, 1))
        bar.add_row(
            "learner",
            ProgressBar(
                total=max(1, self.max_steps), completed=min(step, self.max_steps), width=40
            ),
            f"{100 * step / max(1, self.max_steps):.0f}%",
        )
        parts: list[Any] = [bar]
        phase = self.phase(now=now)
        if phase:
            parts.append(Text(f"now: {phase}"))  # record text: never rich markup
        parts.append(table)
        hint = self.drop_hint()
        if hint:
            parts.append(Text(hint))
        audit = display_line(self.record.get("duty_cycle"), self.audit())
        if audit:
            parts.append(audit)
        return Group(*parts)


class _Frame:
    """`LiveStatus.frame` laid out for the width rich renders it at (a resized terminal
    switches layouts at the next refresh)."""

    def __init__(self, status: LiveStatus, now: float | None) -> None:
        self.status, self.now = status, now

    def __rich_console__(self, console: Any, options: Any) -> Any:
        yield self.status.frame(options.max_width, now=self.now)


class _Display:
    """`rich` live table on a terminal; plain periodic lines otherwise; nothing if quiet."""

    def __init__(self, status: LiveStatus, *, quiet: bool, console: Any = None) -> None:
        from rich.console import Console

        self.status = status
        self.console = console or Console()
        self.kind = "off" if quiet else ("live" if self.console.is_terminal else "plain")
        self._live: Any = None
        self._last_plain = -PLAIN_EVERY_S

    def __enter__(self) -> _Display:
        if self.kind == "live":
            from rich.live import Live

            self._live = Live(
                self.status.render(), console=self.console, auto_refresh=False, transient=False
            )
            self._live.__enter__()
        return self

    def refresh(self, *, force: bool = False) -> None:
        if self.kind == "live":
            self._live.update(self.status.render(), refresh=True)
        elif self.kind == "plain":
            now = time.monotonic()
            if force or now - self._last_plain >= PLAIN_EVERY_S:
                print(self.status.line(), flush=True)
                self._last_plain = now

    def message(self, text: str) -> None:
        if self.kind == "live":
            self.console.print(text)  # above the live table
        elif self.kind == "plain":
            print(text, flush=True)

    def alert(self, text: str) -> None:
        """Something went wrong: shown even with --quiet (on stderr then)."""
        if self.kind == "live":
            self.console.print(text, markup=False, highlight=False)
        else:
            print(f"tunix-tasks train: {text}", file=sys.stderr, flush=True)

    def __exit__(self, *exc: Any) -> None:
        if self._live is not None:
            self._live.__exit__(*exc)


def train_local(
    cfg: RunConfig,
    *,
    log_dir: str | None = None,
    quiet: bool = False,
    report: bool = True,
    max_restarts: int = MAX_RESTARTS,
    restart_delay_s: float = RESTART_DELAY_S,
) -> dict[str, Any]:
    """Run a whole training run locally; returns the summary (also in the report).

    A failed actor is reported with the end of its log and restarted up to `max_restarts`
    times; when no actor is left the learner is stopped (it checkpoints) and the summary
    says why in `failed` (with `interrupted` set: the run can be resumed). A finished run
    (`resume_note`) is left as it is: the summary says so in `finished`, nothing runs; a
    change a resume may not make raises `ConfigError`."""
    note = resume_note(cfg)
    if note is not None:
        return {"run_uri": cfg.run_uri, "mode": cfg.mode, "finished": note, "learner_exit_code": 0}
    run_uri = prepare_run(cfg)
    store = open_store(run_uri)
    # Every process this run starts (restarts too) joins this incarnation or none.
    run_id = prepared_run_id(run_uri)
    joins = ["--run", run_uri, f"--run-id={run_id}"]
    if log_dir is None:  # with the run (docs/configuration.md, "Process logs")
        log_dir = str(process_log_dir(store.local_path(), cfg.run_name))
    os.makedirs(log_dir, exist_ok=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    watch = Stopwatch()
    status = LiveStatus(
        cfg.learner.max_steps,
        warm_start_steps=cfg.warm_start_steps,
        actors_total=cfg.actor.num_actors,
        watch=watch,
        cfg=cfg,
    )
    tail, actor_tail = MetricsTail(store, "learner"), MetricsTail(store, "actor/")
    next_actor_poll = [0.0]

    def poll(*, actors: bool = False) -> None:
        due = actors or time.monotonic() >= next_actor_poll[0]
        for t in (tail, actor_tail) if due else (tail,):
            with watch.timed("metrics_poll"):
                try:
                    records = t.poll()
                except Exception as err:  # the display must never stop a run; retried later
                    log.warning("reading metrics failed: %r", err)
                    continue
            status.update(records)
        if due:
            next_actor_poll[0] = time.monotonic() + ACTOR_POLL_S

    interrupted: list[str] = []

    def on_signal(signum: int, _frame: Any) -> None:
        if signum == signal.SIGHUP:
            _detach_from_terminal()  # the terminal is gone: writing to it would fail
        interrupted.append(signal.Signals(signum).name)

    old = {s: signal.signal(s, on_signal) for s in STOP_SIGNALS}

    def start_actor(i: int) -> Child:
        return spawn(actor_name(i), ["actor", *joins, "--actor-id", str(i)], log_dir, env)

    learner = spawn("learner", ["learner", *joins], log_dir, env)
    actors = [start_actor(i) for i in range(cfg.actor.num_actors)]  # every one started
    children = [learner, *actors]
    fleet: LocalFleet | None = None
    failed: str | None = None
    polls = 0
    utilization: dict[str, Any] = {}  # the report's figures of the whole run (run_utilization)
    try:
        with _Display(status, quiet=quiet) as display:
            pool = ActorPool(
                list(actors),  # the running fleet; `actors`: every actor started
                env=env,
                report=display.alert,
                max_restarts=max_restarts,
                restart_delay_s=restart_delay_s,
                final=FINAL_EXITS,
            )
            if cfg.autopilot_on:

                def start_more(i: int) -> Child:
                    actors.append(start_actor(i))
                    return actors[-1]

                bounds = cfg.actor.autopilot.with_ceiling(cfg.actor.num_actors)
                ours = RunFence(store, run_id)  # the fleet file is written to this run only
                fleet = LocalFleet(bounds, ours, pool, start_more, report=display.message)
            next_poll = 0.0
            while learner.running and not interrupted:
                pool.check()
                status.actors_alive = pool.alive
                if pool.failed_for_good() and not _done(store):
                    failed = f"all {len(pool.actors)} actors died ({pool.describe()})"
                    interrupted.append("actors dead")
                    break
                if time.monotonic() >= next_poll:
                    poll()
                    polls += 1
                    next_poll = time.monotonic() + POLL_S
                if fleet is not None:
                    try:
                        fleet.tick(status.audit(running=fleet.names()), now=time.monotonic())
                    except RunReplaced:  # the children are fenced off too: stop them all
                        interrupted.append("run replaced")
                        break
                    status.actors_total = len(pool.actors)
                display.refresh()
                time.sleep(0.25)
            if interrupted:
                why = failed or interrupted[0]
                display.alert(f"{why}: stopping learner (checkpoint) and actors (flush)...")
                stop([learner], signal.SIGTERM, GRACE_S)
                stop(actors, signal.SIGTERM, GRACE_S)
            else:
                code = learner.proc.returncode
                if code != 0:
                    display.alert(
                        f"learner exited with code {code}; last lines of {learner.log_path}:\n"
                        + log_tail(learner.log_path)
                    )
                # The learner marks DONE when it finishes; make sure actors see it even if
                # it crashed (and stop them directly if the store cannot say so). A fenced
                # learner lost the run to another one: DONE would stop that one's actors.
                fenced = code == FENCED_EXIT_CODE
                if code == 0 or (
                    not fenced and _mark_done(run_uri, run_id, f"learner exited with code {code}")
                ):
                    stop_after(actors, GRACE_S)
                stop(actors, signal.SIGTERM, GRACE_S)
            poll(actors=True)  # the learner closed its metrics writer: final records there
            polls += 1
            try:  # every process has stopped: the run's records are all there
                utilization = run_utilization(MetricsTail(store).poll(), cfg)
                status.final_audit = utilization["latency_audit"]
            except StoreError as err:  # the summary keeps the recent window's audit
                log.warning("reading the run's metrics failed: %r", err)
            status.actors_alive = pool.alive
            display.refresh(force=True)
    finally:
        if fleet is not None:
            fleet.close()
        children = [learner, *actors]  # with those the autopilot started
        stop(children, signal.SIGTERM, GRACE_S)  # none left running, unless we failed
        for s, h in old.items():
            signal.signal(s, h)
        close_logs(children)
    summary: dict[str, Any] = {
        "run_uri": run_uri,
        "mode": cfg.mode,
        "wall_s": watch.wall_s,
        "learner_exit_code": learner.proc.returncode,
        "actor_exit_codes": [a.proc.returncode for a in actors],
        "actor_restarts": {a.name: a.restarts for a in actors if a.restarts},
        "autopilot": fleet.summary() if fleet is not None else None,
        "interrupted": interrupted[0] if interrupted else None,
        "failed": failed,
        "fenced": _fenced(store, run_id, learner.proc.returncode),
        "logs": log_dir,
        "last_step": {**status.record, "time": utc(status.record.get("time"))},
        # The report's utilization of the whole run; the recent window's if unreadable.
        **(
            utilization
            or {
                "latency_audit": status.audit(),
                "duty_cycle_explained": explain_duty(
                    status.record.get("duty_cycle"), status.audit()
                ),
            }
        ),
        "display": {
            "lag_s": status.lag_summary(),
            "polls": polls,
            "poll_s": watch.totals.get("metrics_poll", 0.0),
        },
    }
    if report and not summary["fenced"]:  # a run that is not this command's: left alone
        from tunix_tasks.frontdoor.report import latest_version, write_report

        try:
            summary["report"] = write_report(run_uri)
            summary["version"] = latest_version(store)  # weights/LATEST: the last published
        except StoreError as err:  # an outage at the very end: the run itself is fine
            summary["report_error"] = str(err)
    return rounded(summary)


def _fenced(store: ObjectStore, run_id: str, learner_code: int | None) -> str | None:
    """Why the run is no longer this command's (deleted or created again since it was
    prepared, or taken over by another learner), or None."""
    why = replaced_if_known(store, run_id)
    if why is None and learner_code == FENCED_EXIT_CODE:
        why = "another learner took the run over (the learner's log names it)"
    return why


def _done(store: ObjectStore) -> bool:
    try:
        return is_done(store) is not None
    except StoreError:
        return False


def _mark_done(run_uri: str, run_id: str, reason: str) -> bool:
    """Mark this run DONE; False (the caller stops the actors itself) when the store
    fails or the run was deleted or created again since (not ours to stop)."""
    try:
        return mark_done(run_uri, reason, run_id=run_id) is None
    except StoreError as err:
        log.error("could not mark the run done (%s); stopping the actors directly", err)
        return False


def _detach_from_terminal() -> None:
    """After a hang-up, point stdout/stderr that were the terminal at /dev/null."""
    null = os.open(os.devnull, os.O_WRONLY)
    for fd in (1, 2):
        with contextlib.suppress(OSError):
            if os.isatty(fd):
                os.dup2(null, fd)
    os.close(null)
