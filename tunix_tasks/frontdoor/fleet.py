"""Self-sizing fleets: the autopilot's decisions (autopilot.py) applied to a run's actors,
each one logged as a metrics record of process `autopilot`.

Every fleet writes the size it wants to `control/fleet.json` (`storage/runs.py`
`write_fleet`): an actor whose index is at or above it parks, admitting no new episodes
(`actor/admission.py`). Two ways to apply a decision:

- `LocalFleet` (`tunix-tasks train`): starts and stops actor processes. A new actor takes
  the lowest free actor id (`start_actor(i)` spawns `actor-000i`); a shrink stops the
  highest ids first with SIGTERM, so they flush their shards and exit.
- `ParkedFleet` (the mapped Airflow fleet): every actor up to `max_actors` was started
  by the DAG; the file alone parks and unparks them. `FleetAutopilot` runs it in a
  thread beside the learner (the learner task does). With the local launcher a parked
  actor keeps its process, its weights and its compiled programs, and resumes at once.
  With the Kubernetes launcher each mapped task runs `run_actor_shifts`: a parked actor
  leaves (`leave_when_parked`) and its pod is deleted, the task waits holding no pod,
  and a new pod starts when the fleet grows over it again.

    bounds = cfg.actor.autopilot.with_ceiling(cfg.actor.num_actors)
    fleet = LocalFleet(bounds, store, pool, start_actor, report=display.message)
    while the run goes on:
        fleet.tick(status.audit(running=fleet.names()), now=time.monotonic())
    fleet.close()
    stop(fleet.retired, ...)   # actors it asked to stop, for the launcher to wait for

    with FleetAutopilot(run_uri):   # a ParkedFleet over the run's metrics, until exit
        run_learner(run_uri)
    run_actor_shifts(run_uri, i, launch_pod)   # meanwhile, in each actor's task
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from tunix_tasks.actor.admission import LEFT_PARKED
from tunix_tasks.config.autopilot import AutopilotConfig
from tunix_tasks.frontdoor.audit import AuditWindow
from tunix_tasks.frontdoor.autopilot import PROCESS, Autopilot, FleetDecision, FleetObservation
from tunix_tasks.frontdoor.supervision import ActorPool, Child
from tunix_tasks.storage.layout import RunLayout
from tunix_tasks.storage.metrics import MetricsTail, MetricsWriter
from tunix_tasks.storage.runs import (
    RunFence,
    RunReplaced,
    is_done,
    join_run,
    parse_fleet,
    read_fleet,
    replaced_since,
    write_fleet,
)
from tunix_tasks.storage.store import NotFound, ObjectStore, StoreError

log = logging.getLogger(__name__)


class Fleet:
    """The policy's loop over one fleet: decide every `interval_s`, log the decision,
    resize (`_resize`, per kind of fleet) and keep the changes for the summary."""

    def __init__(
        self,
        cfg: AutopilotConfig,
        store: ObjectStore,
        *,
        actors: int,
        report: Callable[[str], None],
    ) -> None:
        self.cfg = cfg
        self.pilot = Autopilot(cfg)
        self.store = store
        self.active = actors  # actors 0 .. active-1 run; the others are stopped or parked
        self._report = report
        self.metrics = MetricsWriter(store, PROCESS, tensorboard=False)
        self._next_s = 0.0
        self.decisions: list[FleetDecision] = []  # the changes, and the latest decision
        self._unwritten: str | None = "the run's first fleet"  # the file's reason, if owed
        self._write_owed()

    def names(self) -> set[str]:
        """The ids of the actors in the fleet now (the others are not audited)."""
        return {RunLayout.actor_name(i) for i in range(self.active)}

    def tick(self, audit: dict[str, Any] | None, *, now: float) -> FleetDecision | None:
        """Every `interval_s`: decide from `audit` (a `latency_audit` of the fleet's
        actors), log the decision, resize the fleet. None between intervals."""
        self._write_owed()
        if audit is None or now < self._next_s:
            return None
        self._next_s = now + self.cfg.interval_s
        obs = FleetObservation.of(audit, time_s=now, actors=self.active)
        decision = self.pilot.decide(obs)
        try:  # an outage: the record stays buffered, the next flush writes it
            self.metrics.log(
                **decision.record(),
                capacity_eps=obs.capacity_eps,
                per_actor_eps=obs.per_actor_eps,
                backlog_steps=obs.backlog_steps,
            )
        except StoreError as err:
            log.warning("autopilot: decision record not written yet (%r)", err)
        if decision.action != "hold":
            try:  # before new actors start, which park by it
                write_fleet(self.store, decision.actors, decision.reason)
            except StoreError as err:  # the fleet stays as it is; the next tick decides again
                log.warning("autopilot: the store did not answer (%r); fleet unchanged", err)
                return None
            self._unwritten = None  # this file supersedes an unwritten first one
            self._resize(decision.actors)
            self.active = decision.actors
            self._report(f"autopilot: {decision.reason}")
        if self.decisions and self.decisions[-1].action == "hold":
            self.decisions.pop()  # keep the changes and the latest hold only: bounded
        self.decisions.append(decision)
        return decision

    def _write_owed(self) -> None:
        """The first fleet file, once the store answers: until then actors keep
        `RunConfig.first_active_actors`, and the autopilot still decides."""
        if self._unwritten is None:
            return
        try:
            write_fleet(self.store, self.active, self._unwritten)
        except StoreError as err:
            log.warning("autopilot: the fleet file is not written yet (%r)", err)
        else:
            self._unwritten = None

    def _resize(self, actors: int) -> None:
        """What a change means beyond the fleet file (nothing: the actors park)."""

    def summary(self) -> dict[str, Any]:
        """For `train`'s summary: the changes and the latest reason."""
        changes = [d for d in self.decisions if d.action != "hold"]
        return {
            "actors": self.active,
            "changes": [f"{d.previous} -> {d.actors}" for d in changes],
            "last": self.decisions[-1].reason if self.decisions else "no decision yet",
        }

    def close(self) -> None:
        try:
            self.metrics.close()
        except (StoreError, RunReplaced) as err:  # the decisions' records: a view, not fatal
            log.warning("autopilot: its last records were not written: %r", err)


class LocalFleet(Fleet):
    """Actor processes of the local launcher, started and stopped to the decision."""

    def __init__(
        self,
        cfg: AutopilotConfig,
        store: ObjectStore,
        pool: ActorPool,
        start_actor: Callable[[int], Child],
        *,
        report: Callable[[str], None],
    ) -> None:
        super().__init__(cfg, store, actors=len(pool.actors), report=report)
        self.pool = pool
        self._start_actor = start_actor
        self._by_id: dict[int, Child] = dict(enumerate(pool.actors))  # the running fleet
        self.retired: list[Child] = []

    def _resize(self, actors: int) -> None:
        while len(self._by_id) < actors:
            i = min(set(range(len(self._by_id) + 1)) - self._by_id.keys())
            self._by_id[i] = self._start_actor(i)
            self.pool.add(self._by_id[i])
        if len(self._by_id) > actors:
            gone = [self._by_id.pop(i) for i in sorted(self._by_id)[actors:]]
            self.pool.retire(gone)
            self.retired += gone


class ParkedFleet(Fleet):
    """Actors started at the ceiling (`max_actors`); those outside the fleet park."""


class FleetAutopilot:
    """A `ParkedFleet` driven by the run's own metrics, in a background thread: what the
    Airflow learner task runs beside the learner when the autopilot is on (the DAG
    mapped `launched` actors, its ceiling; `actor.num_actors` of them active at first).
    Off, it does nothing. Stops at exit, or once the run is DONE.

        with FleetAutopilot(run_uri):
            run_learner(run_uri)
    """

    POLL_S = 5.0  # actors write a metrics record every ~5 s

    def __init__(
        self,
        run_uri: str,
        *,
        launched: int | None = None,
        run_id: str | None = None,
        poll_s: float = POLL_S,
    ) -> None:
        # The run as the caller prepared it (`run_id`; `RunReplaced` if it is another
        # now); its fleet file written only while it still is (`RunFence`).
        self.cfg, store, joined = join_run(run_uri, run_id)
        self.store = RunFence(store, joined, on_replaced=lambda _why: self._stop.set())
        # The ceiling: the actors the DAG mapped (a recurring run's fleet may differ from
        # the stored config's), else what it maps for this config (`launched_actors`).
        pilot = self.cfg.actor.autopilot
        self.launched = launched or pilot.with_ceiling(self.cfg.actor.num_actors).max_actors
        self.poll_s = poll_s
        self.fleet: ParkedFleet | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> FleetAutopilot:
        pilot = self.cfg.actor.autopilot
        autopilot = pilot.with_ceiling(self.launched)
        if self.cfg.autopilot_on:
            # A retried learner task goes on with the fleet its predecessor chose (a new
            # or resumed run has none: `write_config` deleted it). Else every actor the
            # DAG mapped, or without an explicit ceiling `actor.num_actors` of them.
            first = self.launched if pilot.max_actors is None else self.cfg.actor.num_actors
            try:
                active = read_fleet(self.store) or first
            except ValueError as err:  # a hand-edited file: start over
                log.warning("autopilot: %s; starting from %d actors", err, first)
                active = first
            active = min(max(active, autopilot.min_actors), autopilot.max_actors)
            try:
                self.fleet = ParkedFleet(autopilot, self.store, actors=active, report=log.info)
            except RunReplaced as err:  # since it was joined: the learner's join fences it
                log.error("autopilot: %s: not starting", err)
                return self
            self._thread = threading.Thread(target=self._run, name="autopilot", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self.fleet is not None:
            self.fleet.close()

    def _run(self) -> None:
        assert self.fleet is not None
        tail, window = MetricsTail(self.store), AuditWindow()
        while not self._stop.wait(self.poll_s):
            try:
                if is_done(self.store):
                    return
                window.add(tail.poll())
                audit = window.audit(self.cfg, running=self.fleet.names(), actors=self.fleet.active)
                self.fleet.tick(audit, now=time.monotonic())
            except StoreError as err:  # an outage: the fleet stays as it is, try again
                log.warning("autopilot: the store did not answer (%r); fleet unchanged", err)
            except RunReplaced as err:  # the learner is fenced off too
                log.error("autopilot: %s: stopping", err)
                return


SHIFT_POLL_S = 5.0  # how often a parked actor's slot reads the fleet file


def run_actor_shifts(
    run_uri: str,
    actor_id: int,
    launch: Callable[[float | None], dict[str, Any]],
    *,
    deadline_s: float | None = None,
    poll_s: float = SHIFT_POLL_S,
    run_id: str | None = None,
) -> dict[str, Any]:
    """One slot of a fleet whose parked actors give their resources back (the mapped
    Airflow fleet on Kubernetes). While the autopilot's fleet holds actor `actor_id`,
    `launch(seconds_left)` runs it until it returns (one pod, started with
    `leave_when_parked`: it leaves once parked with its episodes committed); while the
    actor is parked the slot holds nothing and reads `control/fleet.json` every `poll_s`.
    Returns when the run is DONE, at the deadline, or when a shift ended for another
    reason than parking (a launch that raises fails the slot as it would the actor);
    the summary adds its shifts up. `run_id`: the run as the caller prepared it; a run
    deleted or created again since raises `RunReplaced`, before any shift.

        launch = lambda left: run_pod(actor_pod(run_uri, i, deadline_s=left))
        summary = run_actor_shifts(run_uri, i, launch, deadline_s=deadline_s)
    """
    cfg, store, joined = join_run(run_uri, run_id)
    t0 = time.monotonic()
    deadline_s = deadline_s or cfg.deadline_s  # from the slot's start, not each shift's
    end = t0 + deadline_s if deadline_s else None
    active = cfg.first_active_actors  # None: nothing parks until the fleet file says so
    left_on: bytes | None = None  # the fleet file as the actor left parked
    shifts: list[dict[str, Any]] = []
    reason = ""
    while True:
        try:
            if why := replaced_since(store, joined):  # its DONE and fleet are another run's
                raise RunReplaced(why)
            done = is_done(store)
            active, file = _read_active(store, active)
        except StoreError as err:  # an outage: wait as we are, try again
            log.warning("actor %d: the store did not answer (%r)", actor_id, err)
            done, file = None, left_on
        left = None if end is None else end - time.monotonic()
        if done is not None or (left is not None and left <= 0):
            reason = f"run done: {done.get('reason', '')}" if done is not None else "deadline"
            break
        # Parked, or left parked and no new decision since: a slot never restarts an
        # actor on the same fleet file it left on (no start-and-leave loop).
        if (active is not None and actor_id >= active) or (left_on and file == left_on):
            time.sleep(poll_s if left is None else min(poll_s, left))
            continue
        log.info("actor %d: starting shift %d (%s active)", actor_id, len(shifts) + 1, active)
        shifts.append(launch(left))
        reason = str(shifts[-1].get("stop_reason", ""))
        if reason != LEFT_PARKED:
            break
        try:
            left_on = _read_active(store, active)[1] or b"none"
        except StoreError:  # unknown: the next file read counts as new
            left_on = b"unknown"
        log.info("actor %d: parked, its resources given back until the fleet grows", actor_id)
    return _add_shifts(RunLayout.actor_name(actor_id), shifts, reason, time.monotonic() - t0)


def _read_active(store: ObjectStore, last: int | None) -> tuple[int | None, bytes | None]:
    """The fleet file's count (`last` when there is none yet or it is unreadable), and
    the file as read (None: absent)."""
    try:
        raw = store.read_bytes(RunLayout.FLEET)
    except NotFound:
        return last, None
    try:
        return parse_fleet(raw), raw
    except ValueError as err:  # a hand-edited file must not stop the slot
        log.warning("ignoring the fleet control file: %s", err)
        return last, raw


def _add_shifts(
    name: str, shifts: list[dict[str, Any]], reason: str, wall_s: float
) -> dict[str, Any]:
    """One actor summary (`ActorRuntime.run`'s keys) over its shifts."""
    episodes = sum(int(s.get("episodes", 0)) for s in shifts)
    rewards = sum(float(s.get("reward_mean", 0.0)) * int(s.get("episodes", 0)) for s in shifts)
    return {
        "actor_id": name,
        "episodes": episodes,
        "shards": sum(int(s.get("shards", 0)) for s in shifts),
        "reward_mean": rewards / max(1, episodes),
        "last_version": max((int(s.get("last_version", -1)) for s in shifts), default=-1),
        "stop_reason": reason,
        "compile_count": sum(int(s.get("compile_count", 0)) for s in shifts),
        "wall_s": wall_s,
        "shifts": len(shifts),
    }
