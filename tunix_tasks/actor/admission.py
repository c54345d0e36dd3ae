"""Flow control: when an actor admits new episodes, from the learner's published position.

The learner writes `learner/flow.json` (`RunLayout.FLOW`, `learner/flow.py`
`FlowReport`): its published version, the episodes it has consumed (trained or dropped)
from each actor incarnation, how many episodes it consumes per published version and per
second of having data, and how many actors it is reading. An actor that generates faster
than the learner trains
builds a backlog whose tail is stale by the time the learner reaches it; the rule below
stops that before the episodes are made (in the spirit of Reverb's rate limiters).

    gate = AdmissionGate(store, actor_key="actor-0/3fa2", max_staleness=4,
                         fallback_episodes_per_version=32, fleet=2)
    gate.poll()                                  # at the weight-poll cadence (one GET)
    got = gate.decide(version=v, committed=n, in_flight=k)
    if got.admit: ...start episodes (a group; or up to `got.room` of them)

`admission` is the pure decision; `AdmissionGate` is its I/O and its pause bookkeeping.
Only the start of an episode is gated (async actor: a group at a time; vectorized actor:
a segment's budget of `room` episodes): episodes in flight finish.

With the autopilot on (`actor.autopilot`), the gate also *parks* an actor whose index is
at or above the fleet the autopilot asks for (`control/fleet.json`, `storage/runs.py`
`write_fleet`; before it writes one, `actor.num_actors` where the fleet was started at an
explicit `max_actors`, else nothing parks): a parked actor admits nothing
and loads no new weights (`runtime.py`), and resumes as soon as the fleet includes it
again, loading the latest weights first.
That is how a fleet started at its ceiling (the mapped Airflow fleet, its pods) sizes
itself without starting processes (docs/scaling.md, "Autopilot").
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import time
from dataclasses import dataclass
from typing import Any

from tunix_tasks.storage.layout import RunLayout
from tunix_tasks.storage.runs import read_fleet
from tunix_tasks.storage.store import NotFound, ObjectStore

log = logging.getLogger(__name__)

__all__ = ["LEARNER_WAITING", "Admission", "AdmissionGate", "LearnerFlow", "admission"]

#: A flow object older than this says nothing about the learner now (stopped, restarting):
#: the gate then admits, as without flow control.
FLOW_MAX_AGE_S = 120.0
#: How far past the flow object's time a paused actor extrapolates the learner's
#: consumption (its published rate) to guess when to read the position again; a stalled
#: learner must not look like it drains.
EXTRAPOLATE_S = 2.0
#: How often a paused actor decides again (no I/O: the extrapolated guess).
PAUSED_RECHECK_S = 0.05
#: A paused actor reads the learner's position again (and loads newer weights) once the
#: extrapolated guess says it could resume, at most this often (`confirm`): it resumes
#: within about this long of the backlog draining instead of a `weight_poll_s` later,
#: with one small GET per resume. A position older than `CONFIRM_MAX_S` (a learner
#: compiling, checkpointing or stalled writes none: it writes one every second at most)
#: is read again only every `CONFIRM_MAX_S`.
CONFIRM_S = 0.2
CONFIRM_MAX_S = 2.0
#: `stop_reason` of an actor that left because it was parked (`leave_when_parked`).
LEFT_PARKED = "parked by the autopilot"
#: The reason of an admission only because the learner waits for data (its `needs`).
LEARNER_WAITING = "learner waiting for data"


@dataclass(frozen=True)
class Admission:
    """One decision: `admit` new episodes or pause, why, the staleness it predicts for
    an episode started now when the learner reaches it, and the `room`: how many more
    episodes could start before the last of them would reach the bound."""

    admit: bool
    reason: str
    predicted_staleness: float
    room: float = float("inf")


def admission(
    *,
    unread_episodes: float,
    in_flight_episodes: float,
    episodes_per_version: float,
    version_lag: int,
    max_staleness: int,
    paused: bool,
    learner_needs: float = 0.0,
) -> Admission:
    """Admit new episodes, or pause: the pure rule of flow control.

    The last episode an admission leads to reaches the learner behind the
    `unread_episodes` committed but not yet read and the `in_flight_episodes` (started,
    not committed, including those this admission starts). The learner publishes a
    version per `episodes_per_version` it consumes, so by then that episode is
    `predicted = version_lag + (unread + in_flight) / episodes_per_version` versions
    stale (`version_lag`: the learner's version minus the actor's). A running actor
    pauses once `predicted >= max_staleness` (less than one version of headroom left for
    the episode's own generation time); a paused one resumes at `predicted <=
    max_staleness - 1` (hysteresis: no flapping at the bound). Nothing unread always
    admits: pausing then could only starve the learner, so flow control never deadlocks.
    So does a learner that `learner_needs` more episodes for a step, having read every
    shard (what it holds counts as unread here, so the actors would wait for the learner
    and the learner for them), while the actor's weights are within the bound: room for
    what it needs beyond the episodes in flight. (`AdmissionGate` counts what the actor
    committed since it read the need against it: a need read before a long learner stall
    admits at most the need and the actor's own concurrency more.)
    The same rule in episodes: `room = (max_staleness - version_lag) *
    episodes_per_version - unread - in_flight` more could start (`predicted <
    max_staleness` exactly while it is > 0; never below 0).
    """
    if episodes_per_version <= 0:
        raise ValueError(f"episodes_per_version must be > 0, got {episodes_per_version}")
    if max_staleness < 0:
        raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
    lag = max(0, version_lag)
    ahead = max(0.0, unread_episodes) + max(0.0, in_flight_episodes)
    room = max(0.0, (max_staleness - lag) * episodes_per_version - ahead)
    if unread_episodes <= 0:
        return Admission(True, "learner caught up", float(lag), room)
    predicted = lag + ahead / episodes_per_version
    if learner_needs > 0 and lag <= max_staleness:
        room = max(room, learner_needs - max(0.0, in_flight_episodes))
        return Admission(True, LEARNER_WAITING, predicted, room)
    if paused:
        if predicted <= max_staleness - 1:
            return Admission(True, "backlog drained", predicted, room)
        return Admission(False, "backlog would be stale", predicted, room)
    if predicted < max_staleness:
        return Admission(True, "backlog fresh", predicted, room)
    return Admission(False, "backlog would be stale", predicted, room)


@dataclass(frozen=True)
class LearnerFlow:
    """`learner/flow.json`, as the learner wrote it (`learner/flow.py` `FlowReport`)."""

    version: int
    consumed: dict[str, int]  # actor key (`<actor_id>/<incarnation>`) -> episodes consumed
    episodes_per_version: float | None  # measured over recent publishes; None before two
    episodes_per_s: float  # consumed, all actors, over the last seconds
    actors: int  # actor keys the learner consumed from recently (0: none yet)
    time: float  # when written (time.time())
    needs: int = 0  # episodes a step lacks, every listed shard read (0: not waiting)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> LearnerFlow:
        return cls(
            version=int(data["version"]),
            consumed={str(k): int(v) for k, v in data["consumed"].items()},
            episodes_per_version=data.get("episodes_per_version"),
            episodes_per_s=float(data.get("episodes_per_s") or 0.0),
            actors=int(data.get("actors", 0)),
            time=float(data["time"]),
            needs=int(data.get("needs", 0)),
        )


class AdmissionGate:
    """An actor's side of flow control: reads the learner's flow object (`poll`), decides
    (`decide`) and keeps the time paused and the last reason (its metrics).

    `park_index` (the actor's index in the fleet; None: never parked) turns parking on:
    `poll` also reads the autopilot's fleet file, and an actor at or above its `active`
    count (`default_active` before there is one) is paused with reason "parked". Time
    parked counts as paused: the audit measures an actor's supply over its unpaused time.
    """

    def __init__(
        self,
        store: ObjectStore,
        *,
        actor_key: str,
        max_staleness: int,
        fallback_episodes_per_version: float,
        fleet: int = 1,
        park_index: int | None = None,
        default_active: int | None = None,
    ) -> None:
        if fallback_episodes_per_version <= 0:
            raise ValueError(
                "AdmissionGate: fallback_episodes_per_version must be > 0, "
                f"got {fallback_episodes_per_version}"
            )
        self.store = store
        self.actor_key = actor_key
        self.max_staleness = max_staleness
        self.fallback_episodes_per_version = fallback_episodes_per_version
        self.fleet = fleet  # actors assumed until the learner has consumed from any
        self.flow: LearnerFlow | None = None
        self.park_index = park_index
        self.active = default_active  # the autopilot's fleet (parking), as last read
        self.last = Admission(True, "no learner position", 0.0)
        # `decide`: wants a fresh position and weights before it pauses or stays paused
        self.confirm = False
        self.paused_s = 0.0  # total time paused
        self.pauses = 0  # admit -> pause transitions
        self._paused_since: float | None = None
        self._polled_at = float("-inf")  # time.monotonic() of the last `poll`
        # (flow.time, `committed` then) of the learner's need as first decided on
        self._need_read: tuple[float, int] = (float("nan"), 0)

    def poll(self) -> None:
        """Read the learner's flow object (absent: nothing changes), and with parking
        the fleet file (absent or unreadable: the last count holds)."""
        self._polled_at = time.monotonic()
        if self.park_index is not None:
            try:
                active = read_fleet(self.store)
            except ValueError as err:  # a hand-edited file must not stop the actor
                log.warning("ignoring the fleet control file: %s", err)
            else:
                self.active = self.active if active is None else active
        try:
            raw = self.store.read_bytes(RunLayout.FLOW)
        except NotFound:
            return
        self.flow = LearnerFlow.from_json(json.loads(raw))

    @property
    def parked(self) -> bool:
        """Outside the autopilot's fleet: admit nothing."""
        return (
            self.park_index is not None
            and self.active is not None
            and (self.park_index >= self.active)
        )

    def decide(self, *, version: int, committed: int, in_flight: int) -> Admission:
        """Admit or pause an actor at weights `version` that has committed `committed`
        episodes in this incarnation and has `in_flight` more coming (started, and, for
        a kind that admits a unit at a time, that unit). The returned `room` is this
        actor's share of the fleet's.

        The decision is exact on the position as read, however old: the learner reads
        an episode started now after the backlog it had then, whatever it consumed since
        (what it consumed since, it published versions for; an episode started with the
        actor's weights is that much staler). Room grows only with newer weights, so an
        actor told to pause whose guess (the position extrapolated at the learner's
        drain rate, with its newest weights) says admit, on a read older than
        `CONFIRM_S`, sets `confirm`: its runtime reads the position and newer weights at
        once and decides again.
        """
        flow = self.flow
        self.confirm = False
        if self.parked:
            got = Admission(False, f"{LEFT_PARKED} ({self.active} active)", 0.0, 0.0)
        elif flow is None or time.time() - flow.time > FLOW_MAX_AGE_S:
            got = Admission(True, "no learner position", 0.0)
        else:
            # The learner reads all actors' shards oldest first, interleaved: this
            # actor's newest episode waits behind about every actor's backlog.
            actors = max(1, flow.actors or self.fleet)
            consumed = flow.consumed.get(self.actor_key, 0)
            rule = functools.partial(
                admission,
                in_flight_episodes=in_flight * actors,
                episodes_per_version=flow.episodes_per_version
                or self.fallback_episodes_per_version,
                max_staleness=self.max_staleness,
                paused=not self.last.admit,
                learner_needs=self._needs_left(flow, committed, actors),
            )
            got = rule(
                unread_episodes=(committed - consumed) * actors, version_lag=flow.version - version
            )
            got = dataclasses.replace(got, room=got.room / actors)
            if not got.admit:
                since = min(max(0.0, time.time() - flow.time), EXTRAPOLATE_S)
                drained = flow.episodes_per_s / actors * since
                guess = rule(
                    unread_episodes=(committed - consumed - drained) * actors, version_lag=0
                )
                stalled = time.time() - flow.time > CONFIRM_MAX_S
                every = CONFIRM_MAX_S if stalled else CONFIRM_S
                self.confirm = guess.admit and time.monotonic() - self._polled_at >= every
        self._account(got.admit)
        self.last = got
        return got

    def _needs_left(self, flow: LearnerFlow, committed: int, actors: int) -> float:
        """The learner's need less what this actor committed since it first decided on
        that position (on its way to the learner, unread by it then), times the fleet:
        in the rule's units, as its unread backlog."""
        if flow.needs <= 0:
            return 0.0
        if self._need_read[0] != flow.time:
            self._need_read = (flow.time, committed)
        return flow.needs - (committed - self._need_read[1]) * actors

    def _account(self, admit: bool) -> None:
        now = time.monotonic()
        if self._paused_since is not None:
            self.paused_s += now - self._paused_since
            self._paused_since = None
        if not admit:
            if self.last.admit:
                self.pauses += 1
            self._paused_since = now

    def metrics(self) -> dict[str, Any]:
        """For the actor's metrics record."""
        self._account(self.last.admit)  # bring paused_s up to now
        return {
            "flow_paused": not self.last.admit,
            "parked": self.parked,
            "flow_reason": self.last.reason,
            "flow_predicted_staleness": round(self.last.predicted_staleness, 2),
            "flow_paused_s": round(self.paused_s, 3),
            "flow_pauses": self.pauses,
        }
