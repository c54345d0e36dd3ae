"""Self-sizing fleets: the autopilot's decisions (autopilot.py) applied to a run's actors,
each one logged as a metrics record of process `autopilot`.

Every fleet writes the size it wants to `control/fleet.json` (`storage/runs.py`
`write_fleet`): an actor whose index is at or above it parks, admitting no new episodes
(`actor/admission.py`). Two ways to apply a decision:

- `LocalFleet` (`tunix-tasks train`): starts and stops actor processes. A new actor takes
  the lowest free actor id (`start_actor(i)` spawns `actor-000i`); a shrink stops the
  highest ids first with SIGTERM, so they flush their shards and exit.
- `ParkedFleet` (the mapped Airflow fleet, its Kubernetes pods): every actor up to
  `max_actors` was started by the DAG; the file alone parks and unparks them. A parked
  actor keeps its process (and its pod's resources): the ceiling is the fleet's cost.
  `FleetAutopilot` runs it in a thread beside the learner (the learner task does).

    bounds = cfg.actor.autopilot.with_ceiling(cfg.actor.num_actors)
    fleet = LocalFleet(bounds, store, pool, start_actor, report=display.message)
    while the run goes on:
        fleet.tick(status.audit(running=fleet.names()), now=time.monotonic())
    fleet.close()
    stop(fleet.retired, ...)   # actors it asked to stop, for the launcher to wait for

    with FleetAutopilot(run_uri):   # a ParkedFleet over the run's metrics, until exit
        run_learner(run_uri)
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from tunix_tasks.config.autopilot import AutopilotConfig
from tunix_tasks.frontdoor.audit import AuditWindow
from tunix_tasks.frontdoor.autopilot import PROCESS, Autopilot, FleetDecision, FleetObservation
from tunix_tasks.frontdoor.supervision import ActorPool, Child
from tunix_tasks.storage.layout import RunLayout
from tunix_tasks.storage.metrics import MetricsTail, MetricsWriter
from tunix_tasks.storage.runs import is_done, read_config, read_fleet, write_fleet
from tunix_tasks.storage.store import ObjectStore, StoreError

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
        write_fleet(store, actors, "the run's first fleet")

    def names(self) -> set[str]:
        """The ids of the actors in the fleet now (the others are not audited)."""
        return {RunLayout.actor_name(i) for i in range(self.active)}

    def tick(self, audit: dict[str, Any] | None, *, now: float) -> FleetDecision | None:
        """Every `interval_s`: decide from `audit` (a `latency_audit` of the fleet's
        actors), log the decision, resize the fleet. None between intervals."""
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
            self._resize(decision.actors)
            self.active = decision.actors
            self._report(f"autopilot: {decision.reason}")
        if self.decisions and self.decisions[-1].action == "hold":
            self.decisions.pop()  # keep the changes and the latest hold only: bounded
        self.decisions.append(decision)
        return decision

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
        except StoreError as err:  # the decisions' records are a view: never fatal
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
        self, run_uri: str, *, launched: int | None = None, poll_s: float = POLL_S
    ) -> None:
        self.cfg, self.store = read_config(run_uri)
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
            self.fleet = ParkedFleet(autopilot, self.store, actors=active, report=log.info)
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
