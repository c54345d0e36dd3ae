"""The local launcher's self-sizing fleet: the autopilot's decisions (autopilot.py)
applied to actor processes, each one logged as a metrics record of process `autopilot`.

    fleet = LocalFleet(cfg.actor.autopilot, store, pool, start_actor, report=display.message)
    while the run goes on:
        fleet.tick(status.audit(running=fleet.names()), now=time.monotonic())
    fleet.close()
    stop(fleet.retired, ...)   # actors it asked to stop, for the launcher to wait for

A new actor takes the lowest free actor id (`start_actor(i)` spawns `actor-000i`); a
shrink stops the highest ids first with SIGTERM, so they flush their shards and exit.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tunix_tasks.config.autopilot import AutopilotConfig
from tunix_tasks.frontdoor.autopilot import PROCESS, Autopilot, FleetDecision, FleetObservation
from tunix_tasks.frontdoor.supervision import ActorPool, Child
from tunix_tasks.storage.metrics import MetricsWriter
from tunix_tasks.storage.store import ObjectStore


class LocalFleet:
    def __init__(
        self,
        cfg: AutopilotConfig,
        store: ObjectStore,
        pool: ActorPool,
        start_actor: Callable[[int], Child],
        *,
        report: Callable[[str], None],
    ) -> None:
        self.cfg = cfg
        self.pilot = Autopilot(cfg)
        self.pool = pool
        self._start_actor = start_actor
        self._report = report
        self._by_id: dict[int, Child] = dict(enumerate(pool.actors))  # the running fleet
        self.retired: list[Child] = []
        self.metrics = MetricsWriter(store, PROCESS, tensorboard=False)
        self._next_s = 0.0
        self.decisions: list[FleetDecision] = []  # the changes, and the latest decision

    def names(self) -> set[str]:
        """The processes of the actors it runs now."""
        return {a.name for a in self.pool.actors}

    def tick(self, audit: dict[str, Any] | None, *, now: float) -> FleetDecision | None:
        """Every `interval_s`: decide from `audit` (a `latency_audit` of the running
        actors), log the decision, start or stop actors. None between intervals."""
        if audit is None or now < self._next_s:
            return None
        self._next_s = now + self.cfg.interval_s
        obs = FleetObservation.of(audit, time_s=now, actors=len(self.pool.actors))
        decision = self.pilot.decide(obs)
        self.metrics.log(
            **decision.record(),
            capacity_eps=obs.capacity_eps,
            per_actor_eps=obs.per_actor_eps,
            backlog_steps=obs.backlog_steps,
        )
        if decision.action == "grow":
            while len(self._by_id) < decision.actors:
                i = min(set(range(len(self._by_id) + 1)) - self._by_id.keys())
                self._by_id[i] = self._start_actor(i)
                self.pool.add(self._by_id[i])
        elif decision.action == "shrink":
            gone = [self._by_id.pop(i) for i in sorted(self._by_id)[decision.actors :]]
            self.pool.retire(gone)
            self.retired += gone
        if decision.action != "hold":
            self._report(f"autopilot: {decision.reason}")
        if self.decisions and self.decisions[-1].action == "hold":
            self.decisions.pop()  # keep the changes and the latest hold only: bounded
        self.decisions.append(decision)
        return decision

    def summary(self) -> dict[str, Any]:
        """For `train`'s summary: the changes and the latest reason."""
        changes = [d for d in self.decisions if d.action != "hold"]
        return {
            "actors": len(self.pool.actors),
            "changes": [f"{d.previous} -> {d.actors}" for d in changes],
            "last": self.decisions[-1].reason if self.decisions else "no decision yet",
        }

    def close(self) -> None:
        self.metrics.close()
