"""The autopilot: how many actors the fleet should run, from the live latency audit.

A pure policy: `Autopilot.decide` takes what the audit measured (`FleetObservation`, no
clock, no store, no processes) and returns a `FleetDecision` with its reason. The local
launcher (launcher.py) starts or stops actor processes to match and logs every decision
as a metrics record of process `autopilot`, which the report and the live display show.

    pilot = Autopilot(cfg.actor.autopilot.with_ceiling(fleet))   # max_actors, else `fleet`
    every cfg.actor.autopilot.interval_s:
        decision = pilot.decide(FleetObservation.of(audit, time_s=now, ...))
        if decision.action != "hold": start or stop actors until decision.actors run

The rule (docs/scaling.md, "Autopilot"), with flow control on (the config requires it:
the fleet aims for a surplus, and flow control withholds it instead of letting it go
stale):
- **the fleet that covers the learner**: `ceil(target_supply x capacity / supply per
  actor)`, the learner's capacity and each actor's supply while not paused (what it
  could give, not what flow control let it) as the audit measures them; the median of the
  last `SMOOTHING` readings, since one reading's rates are noisy on a loaded machine;
- **the backlog decides the direction**: with `FULL_BACKLOG_STEPS` batches buffered the
  learner does not wait, so the fleet never grows; with less than one it is short of
  data, so the fleet never shrinks;
- **hysteresis**: no change unless each of the last `SMOOTHING` readings asks for a fleet
  more than `deadband` away from the current one, on the same side; none until
  `cooldown_s` after the last change (new actors start, compile, then report), at most
  `max_factor` per decision, always within `[min_actors, max_actors]` (the ceiling is the
  fleet's cost).

Environments per actor stay as configured: changing them means restarting every actor's
sampler (new programs to compile), while adding or removing an actor leaves the others
running. What the autopilot cannot fix: a learner-bound run (more actors only add
staleness; it shrinks the fleet to what the learner trains) and a store at its request
limit (more actors write more shards; docs/scaling.md).
"""

from __future__ import annotations

import collections
import dataclasses
import math
import statistics
from typing import Any, Literal

from tunix_tasks.config.autopilot import AutopilotConfig

PROCESS = "autopilot"  # the process name of its decisions' metrics records
# Batches buffered at which the learner certainly does not wait for data (one is the
# batch it is about to train; two leave a step of margin for a noisy step time).
FULL_BACKLOG_STEPS = 2.0
SMOOTHING = 5  # readings whose median fleet the policy acts on (about one cooldown)
# An actor paused nearly all the time says little about what it could supply: its
# capability is estimated from at least this share of its time.
MIN_ACTIVE_SHARE = 0.05

Action = Literal["grow", "shrink", "hold"]


@dataclasses.dataclass(frozen=True)
class FleetObservation:
    """One reading of the fleet and the learner, from the latency audit (audit.py).
    Rates are None until measured: the learner's capacity after its first steps, an
    actor's supply after its first episodes."""

    time_s: float  # a monotonic clock, seconds
    actors: int  # actor processes running now
    capacity_eps: float | None  # episodes/s the learner could train, never waiting
    per_actor_eps: float | None  # episodes/s one actor supplies while not paused
    backlog_steps: float | None  # episodes buffered by the learner / episodes per step

    @classmethod
    def of(cls, audit: dict[str, Any], *, time_s: float, actors: int) -> FleetObservation:
        """From a `latency_audit` result: the actors' measured supply over the share of
        their time flow control did not pause them."""
        supply = audit.get("per_actor_eps_per_s")
        active = 1.0 - (audit.get("actor_paused_share") or 0.0)
        return cls(
            time_s=time_s,
            actors=actors,
            capacity_eps=audit.get("learner_capacity_eps_per_s"),
            per_actor_eps=None if supply is None else supply / max(active, MIN_ACTIVE_SHARE),
            backlog_steps=audit.get("backlog_steps"),
        )


@dataclasses.dataclass(frozen=True)
class FleetDecision:
    """What to run: `actors` processes (the current count when `action` is "hold"),
    `wanted` the fleet the rates ask for before the bounds, and why."""

    action: Action
    actors: int
    previous: int
    wanted: int | None
    reason: str

    def record(self) -> dict[str, Any]:
        """The decision as a metrics record's fields."""
        return {
            "autopilot": self.action,
            "actors": self.actors,
            "actors_before": self.previous,
            "actors_wanted": self.wanted,
            "reason": self.reason,
        }


class Autopilot:
    """The policy's state: when it last changed the fleet (its cooldown) and its last
    `SMOOTHING` readings of the wanted fleet."""

    def __init__(self, cfg: AutopilotConfig) -> None:
        if cfg.max_actors is None:
            raise ValueError("Autopilot needs a ceiling: AutopilotConfig.with_ceiling(fleet)")
        self.cfg = cfg
        self.last_change_s: float | None = None
        self._wanted: collections.deque[int] = collections.deque(maxlen=SMOOTHING)

    def decide(self, obs: FleetObservation) -> FleetDecision:
        cfg, n = self.cfg, obs.actors
        bounded = min(max(n, cfg.min_actors), cfg.max_actors)
        if bounded != n:  # outside the bounds (a resumed run whose bounds changed)
            return self._change(obs, bounded, None, f"bounds [{cfg.min_actors}, {cfg.max_actors}]")
        if not obs.capacity_eps or not obs.per_actor_eps:
            return _hold(n, None, "measuring: no learner capacity or actor supply yet")
        self._wanted.append(
            math.ceil(cfg.target_supply * obs.capacity_eps / obs.per_actor_eps - 1e-9)
        )
        wanted = int(statistics.median_low(self._wanted))
        if len(self._wanted) < SMOOTHING:
            return _hold(n, wanted, f"measuring: {len(self._wanted)} of {SMOOTHING} readings")
        rates = (
            f"learner trains up to {obs.capacity_eps:.3g} eps/s, an actor supplies "
            f"{obs.per_actor_eps:.3g} eps/s; {cfg.target_supply:g}x capacity needs {wanted}"
        )
        backlog = obs.backlog_steps
        waiting = f"{backlog:.1f} batches buffered" if backlog is not None else "no backlog yet"
        if wanted > n and (backlog or 0.0) >= FULL_BACKLOG_STEPS:
            return _hold(n, wanted, f"not growing: the learner does not wait ({waiting}); {rates}")
        if wanted < n and (backlog is None or backlog < 1.0):
            return _hold(n, wanted, f"not shrinking: the learner is short of data ({waiting})")
        # Every recent reading must be outside the deadband, on the same side.
        if min(self._wanted) <= n * (1 + cfg.deadband) and max(self._wanted) >= n * (
            1 - cfg.deadband
        ):
            return _hold(n, wanted, f"within the deadband {cfg.deadband:g}: {rates}")
        if self.last_change_s is not None and obs.time_s - self.last_change_s < cfg.cooldown_s:
            left = cfg.cooldown_s - (obs.time_s - self.last_change_s)
            return _hold(n, wanted, f"cooling down ({left:.0f} s left): {rates}")
        step = min(max(wanted, math.ceil(n / cfg.max_factor)), math.floor(n * cfg.max_factor))
        target = min(max(step, cfg.min_actors), cfg.max_actors)
        limits = []
        if target != wanted:
            limits.append(
                f"at the ceiling max_actors={cfg.max_actors}"
                if target == cfg.max_actors and wanted > target
                else f"at the floor min_actors={cfg.min_actors}"
                if target == cfg.min_actors and wanted < target
                else f"at most x{cfg.max_factor:g} per decision"
            )
        if target == n:
            return _hold(n, wanted, f"{limits[0]}: {rates}")
        return self._change(obs, target, wanted, "; ".join([rates, waiting, *limits]))

    def _change(
        self, obs: FleetObservation, target: int, wanted: int | None, why: str
    ) -> FleetDecision:
        self.last_change_s = obs.time_s
        self._wanted.clear()  # readings of the old fleet say little about the new one
        action: Action = "grow" if target > obs.actors else "shrink"
        return FleetDecision(action, target, obs.actors, wanted, f"{obs.actors} -> {target}: {why}")


def _hold(n: int, wanted: int | None, why: str) -> FleetDecision:
    return FleetDecision("hold", n, n, wanted, why)
