"""Flow control: the admission rule over traces, the gate's I/O against a real store, and
the learner's side (consumed counts, the flow report)."""

from __future__ import annotations

import collections
import json
import time

import pytest

from tunix_tasks.actor.admission import (
    CONFIRM_S,
    FLOW_MAX_AGE_S,
    LEARNER_WAITING,
    Admission,
    AdmissionGate,
    admission,
)
from tunix_tasks.actor.endpoint.episodes import EpisodeRegistry
from tunix_tasks.actor.endpoint.wire import ApiError
from tunix_tasks.actor.episodes import EpisodeBuilder
from tunix_tasks.config import MAX_ACTORS
from tunix_tasks.episode import DropReason, Episode
from tunix_tasks.learner.accounting import CONSUMED_KEYS, Accounting, actor_key
from tunix_tasks.learner.flow import FlowReport
from tunix_tasks.storage.layout import RunLayout
from tunix_tasks.storage.store import open_store


def _decide(unread: float, lag: int = 0, *, paused: bool = False, bound: int = 4, needs=0):
    return admission(
        unread_episodes=unread - 5,
        in_flight_episodes=5,
        episodes_per_version=10,
        version_lag=lag,
        max_staleness=bound,
        paused=paused,
        learner_needs=needs,
    )


def test_admission_rule_and_its_hysteresis():
    assert _decide(39) == _decide(39)  # pure
    got = _decide(35)  # 3.5 versions behind: fresh enough
    assert (got.admit, got.reason, got.predicted_staleness) == (True, "backlog fresh", 3.5)
    got = _decide(25, lag=2)  # 2 + 2.5 >= 4: would be stale by the time it is read
    assert (got.admit, got.reason) == (False, "backlog would be stale")
    assert not _decide(35, paused=True).admit  # paused: resumes only at <= bound - 1
    assert _decide(30, paused=True).reason == "backlog drained"
    # An empty backlog always admits, whatever the lag or the bound: no deadlock.
    assert _decide(5, lag=9, paused=True, bound=0).reason == "learner caught up"
    assert not _decide(6, bound=0).admit
    assert _decide(-5).admit  # a restarted learner re-reads: counts may cross
    # Unread episodes the learner holds but cannot train without more (its `needs`):
    # waiting for each other would be a deadlock. Room for what it lacks beyond the 5
    # in flight (at 2 + 35 / 10 versions the backlog's own room is none).
    got = _decide(35, lag=2, paused=True, needs=8)
    assert (got.admit, got.reason, got.room) == (True, LEARNER_WAITING, 3.0)
    assert _decide(35, lag=2, paused=True, needs=2).room == 0.0  # in flight covers it
    assert not _decide(35, lag=5, paused=True, needs=8).admit  # its weights: past the bound


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"episodes_per_version": 0}, "episodes_per_version must be > 0, got 0"),
        ({"max_staleness": -1}, "max_staleness must be >= 0, got -1"),
    ],
)
def test_admission_rejects_impossible_inputs(kwargs, match):
    args = dict(
        unread_episodes=1,
        in_flight_episodes=1,
        episodes_per_version=1,
        version_lag=0,
        max_staleness=1,
        paused=False,
    )
    with pytest.raises(ValueError, match=match):
        admission(**{**args, **kwargs})


def _simulate(*, flow: bool, produce: int, consume: int, per_version: int, bound: int, ticks: int):
    """An actor making `produce` episodes a tick against a learner that reads `consume`
    a tick, oldest first, and publishes a version per `per_version` read; the actor holds
    the learner's version of the previous tick. Returns (the share of what was made that
    is wasted: read as stale or never read, ticks the learner found nothing to read)."""
    queue: collections.deque[int] = collections.deque()
    version = read = stale = made = starved = 0
    paused = False
    for _ in range(ticks):
        actor_version = version
        if flow:
            got = admission(
                unread_episodes=len(queue),
                in_flight_episodes=produce,
                episodes_per_version=per_version,
                version_lag=version - actor_version,
                max_staleness=bound,
                paused=paused,
            )
            paused = not got.admit
        if not paused:
            queue.extend([actor_version] * produce)
            made += produce
        if not queue:
            starved += 1
        for _ in range(min(consume, len(queue))):
            stale += version - queue.popleft() > bound
            read += 1
            if read % per_version == 0:
                version += 1
    return (stale + len(queue)) / made, starved


@pytest.mark.parametrize("produce", [7, 20, 60])  # 1.4x, 4x and 12x the learner's pace
def test_flow_control_over_a_trace_keeps_drops_low_without_starving_the_learner(produce):
    kw = dict(produce=produce, consume=5, per_version=16, bound=4, ticks=2000)
    stale_off, starved_off = _simulate(flow=False, **kw)
    stale_on, starved_on = _simulate(flow=True, **kw)
    assert stale_off > 0.25  # without it the backlog goes stale or is never read
    assert stale_on <= 0.02
    assert starved_on == starved_off == 0  # the learner always had something to read


def _write_flow(store, *, version=5, consumed=None, epv=10.0, actors=1, age_s=0.0, rate=0.0):
    body = {
        "version": version,
        "consumed": consumed or {},
        "episodes_per_version": epv,
        "episodes_per_s": rate,
        "actors": actors,
        "time": time.time() - age_s,
    }
    store.write_bytes(RunLayout.FLOW, json.dumps(body).encode())


def test_gate_reads_the_learners_position_and_accounts_pauses(tmp_path):
    store = open_store(f"file://{tmp_path}/run")
    gate = AdmissionGate(
        store, actor_key="actor-0/abc", max_staleness=4, fallback_episodes_per_version=32, fleet=3
    )
    gate.poll()  # nothing published yet: admit, as without flow control
    assert gate.decide(version=0, committed=10_000, in_flight=0).reason == "no learner position"
    _write_flow(store, consumed={"actor-0/abc": 100, "actor-1/def": 90}, actors=2)
    gate.poll()
    # 10 unread of this actor's and 5 in flight, times 2 actors, at 10 per version:
    # 3 versions, + lag 1.
    got = gate.decide(version=4, committed=110, in_flight=5)
    assert (got.admit, got.predicted_staleness) == (False, 4.0)
    time.sleep(0.05)
    m = gate.metrics()
    assert m["flow_paused"] and m["flow_pauses"] == 1 and m["flow_paused_s"] >= 0.05
    assert gate.decide(version=5, committed=110, in_flight=5).admit  # 3.0 <= 4 - 1: resumes
    # No publishes measured: the fallback (32); no actor consumed yet: the fleet (3).
    _write_flow(store, consumed={}, epv=None, actors=0)
    gate.poll()
    got = gate.decide(version=5, committed=120, in_flight=7)
    assert got.predicted_staleness == pytest.approx(3 * 127 / 32)
    # The decision stays on the position as read, however old (what the learner consumed
    # since, it published versions for): 22 unread x 2 actors at 10 per version.
    _write_flow(store, consumed={"actor-0/abc": 100}, actors=2, rate=20.0, age_s=0.5)
    gate.poll()
    got = gate.decide(version=5, committed=122, in_flight=0)
    assert (got.admit, got.predicted_staleness, got.room) == (False, 4.4, 0.0)
    assert not gate.confirm  # read just now: nothing fresher to read
    # The guess moves it on at the learner's drain rate (per actor 20 / 2 a second) with
    # the newest weights: after 0.7 s or more, 15 unread or fewer, 3.0 <= 4 - 1 could
    # resume, so read again first (until the position is CONFIRM_MAX_S old: 1.3 s slack).
    time.sleep(CONFIRM_S)
    got = gate.decide(version=5, committed=122, in_flight=0)
    assert not got.admit and gate.confirm
    # A position older than CONFIRM_MAX_S (a learner compiling or stalled writes none) is
    # read again only that often, not every CONFIRM_S.
    _write_flow(store, consumed={"actor-0/abc": 100}, actors=2, rate=20.0, age_s=3.0)
    gate.poll()
    time.sleep(CONFIRM_S)
    assert not gate.decide(version=5, committed=122, in_flight=0).admit and not gate.confirm
    # ...for at most EXTRAPOLATE_S: a stalled learner must not look like it drains.
    _write_flow(store, consumed={"actor-0/abc": 100}, actors=2, rate=20.0, age_s=60.0)
    gate.poll()
    time.sleep(CONFIRM_S)
    got = gate.decide(version=5, committed=150, in_flight=0)
    assert not got.admit and not gate.confirm  # 50 - 10 x 2 s unread: 6.0 > 3
    # Admitted, the room is this actor's share of what may still start: (4 - 0) x 10
    # episodes per version, less 3 unread and 1 in flight, x 2 actors; over 2.
    _write_flow(store, consumed={"actor-0/abc": 100}, actors=2)
    gate.poll()
    got = gate.decide(version=5, committed=103, in_flight=1)
    assert got.admit and got.room == pytest.approx((40 - 8) / 2)
    _write_flow(store, age_s=FLOW_MAX_AGE_S + 1)  # a stopped learner: fail open
    gate.poll()
    assert gate.decide(version=0, committed=10_000, in_flight=0).reason == "no learner position"
    with pytest.raises(ValueError, match="fallback_episodes_per_version must be > 0, got 0"):
        AdmissionGate(store, actor_key="a/b", max_staleness=1, fallback_episodes_per_version=0)


def test_gate_parks_an_actor_outside_the_autopilots_fleet(tmp_path, caplog):
    """Actor 2 of a fleet started at 4, with 2 active before any fleet file: parked (and
    paused for the audit); admitted once the file grows the fleet past it, parked again
    when it shrinks; a malformed file is ignored with a warning, the last count kept."""
    from tunix_tasks.storage.runs import write_fleet

    store = open_store(f"file://{tmp_path}/run")
    _write_flow(store, consumed={}, actors=4)
    kw = {"max_staleness": 4, "fallback_episodes_per_version": 32, "fleet": 4}
    gate = AdmissionGate(store, actor_key="actor-0002/a", park_index=2, default_active=2, **kw)
    never = AdmissionGate(store, actor_key="ep/a", park_index=None, default_active=2, **kw)
    gate.poll(), never.poll()
    got = gate.decide(version=5, committed=0, in_flight=1)
    assert (got.admit, got.reason) == (False, "parked by the autopilot (2 active)")
    assert gate.metrics()["parked"] and gate.metrics()["flow_paused"]
    assert never.decide(version=5, committed=0, in_flight=1).admit and not never.parked
    write_fleet(store, 3, "grow")
    gate.poll()
    assert gate.decide(version=5, committed=0, in_flight=1).admit and not gate.parked
    write_fleet(store, 2, "shrink")
    gate.poll()
    assert not gate.decide(version=5, committed=0, in_flight=1).admit
    store.write_bytes(RunLayout.FLEET, b'{"active": "all"}')
    gate.poll()
    assert gate.active == 2 and "'active' must be a count >= 0" in caplog.text
    assert RunLayout.actor_index(RunLayout.actor_name(12)) == 12
    assert RunLayout.actor_index("endpoint-1") is None and RunLayout.actor_index("actor-x") is None


class _Acks:
    def ack(self, episode: Episode) -> None:
        pass


def _ep(group_id: str) -> Episode:
    return Episode("e", [1, 2], [0, 1], [0, -1], policy_version=0, group_id=group_id)


def test_learner_counts_consumption_per_actor_and_reports_it(tmp_path):
    acct = Accounting(_Acks())
    acct.trained([_ep("actor-0/abc/1"), _ep("actor-0/abc/1")], real_tokens=4, longest_bucket=8)
    acct.drop(_ep("actor-1/def/7"), DropReason.STALE)
    acct.drop(_ep(""), DropReason.STALE)  # a demonstration: no actor to tell
    assert acct.counters["consumed"] == {"actor-0/abc": 2, "actor-1/def": 1}
    assert actor_key(_ep("actor-1/def/7")) == "actor-1/def"
    for i in range(CONSUMED_KEYS + 5):  # a fleet's restarts: only the newest keys stay
        acct.drop(_ep(f"actor-{i}/x/0"), DropReason.STALE)
    assert len(acct.counters["consumed"]) == CONSUMED_KEYS
    assert "actor-0/abc" not in acct.counters["consumed"]

    store = open_store(f"file://{tmp_path}/run")
    report = FlowReport(store, every_s=0.0)
    report.maybe_write(1, {}, 0, waited_s=2.0)
    assert json.loads(store.read_bytes(RunLayout.FLOW))["episodes_per_s"] == 0.0
    report.published(1, 0)
    assert report.episodes_per_version() is None  # one publish says nothing yet
    report.published(3, 50)
    time.sleep(0.2)
    report.maybe_write(3, {"actor-0/abc": 30, "actor-1/def": 20}, 50, waited_s=2.1)
    body = json.loads(store.read_bytes(RunLayout.FLOW))
    assert body["episodes_per_version"] == 25.0 and body["actors"] == 2
    # 50 consumed between the two writes, over the time it had data (0.1 s of it waited):
    # how fast it drains a backlog, not its wall-clock pace. (The report's own times: the
    # test's clock would add whatever a loaded host stalls around them.)
    between = report._samples[-1][0] - report._samples[0][0]
    assert between >= 0.2
    assert body["episodes_per_s"] == pytest.approx(50 / (between - 0.1))
    assert body["version"] == 3 and body["consumed"]["actor-1/def"] == 20


def test_the_largest_fleet_keeps_every_live_actors_count():
    """Every actor of the largest fleet keeps its consumed count beside as many dead
    incarnations. With 256 kept, an actor of a bigger fleet was evicted, took every
    episode it had committed for unread and paused for good."""
    acct = Accounting(_Acks())
    dead = [f"actor-{i}/old" for i in range(MAX_ACTORS)]  # an earlier launch's
    live = [f"actor-{i}/new" for i in range(MAX_ACTORS)]
    for key in dead:
        acct.drop(_ep(f"{key}/0"), DropReason.STALE)
    for group in range(3):
        for key in live:
            acct.drop(_ep(f"{key}/{group}"), DropReason.STALE)
    consumed = acct.counters["consumed"]
    assert [consumed.get(k) for k in live] == [3] * MAX_ACTORS
    acct.drop(_ep("actor-0/restarted/0"), DropReason.STALE)  # one more: the oldest goes
    assert dead[0] not in consumed and dead[1] in consumed and len(consumed) == CONSUMED_KEYS


def test_endpoint_refuses_new_groups_while_paused_but_completes_started_ones():
    refusal: list[str | None] = [None]
    registry = EpisodeRegistry(
        EpisodeBuilder(actor_id="actor-t", env="agent", group_key="actor-t/x"),
        end_ids=(0,),
        on_group=lambda _name, _eps: None,
        timeout_s=60.0,
        max_open=8,
        refuse_group=lambda _name: refusal[0],
    )
    registry.open(group="g", group_size=2)
    refusal[0] = "flow control: backlog would be stale"
    registry.open(group="g", group_size=2)  # the started group gets its second member
    with pytest.raises(ApiError) as err:
        registry.open(group="h", group_size=2)
    assert (err.value.status, err.value.body["error"]["code"]) == (429, "flow_control_paused")
    assert "backlog would be stale" in str(err.value)


def test_a_resumed_learner_counts_only_the_actors_that_consume_again(tmp_path):
    """The counts a resumed learner's checkpoint holds (every earlier launch's actor
    incarnations) are not actors now: counted as active, eight dead keys for two live
    actors made each actor take the backlog ahead of it for four times what it was and
    pause while the learner waited for data (a 50 s stall after each resume)."""
    dead = {f"actor-{i % 2}/launch{i // 2}": 8 for i in range(8)}
    store = open_store(f"file://{tmp_path}/run")
    report = FlowReport(store, every_s=0.0, restored=dead)
    report.maybe_write(5, dict(dead), 64, waited_s=0.0)
    body = json.loads(store.read_bytes(RunLayout.FLOW))
    assert body["actors"] == 0  # none yet: the actors assume their configured fleet
    live = {**dead, "actor-0/launch4": 4, "actor-1/launch4": 4}
    report.maybe_write(5, live, 72, waited_s=0.0)
    assert json.loads(store.read_bytes(RunLayout.FLOW))["actors"] == 2
    # An old incarnation's late shard (or a restarted actor's previous life) moves again:
    # still actor 0. Another actor id is another actor.
    dead["actor-0/launch3"] += 1
    report.maybe_write(5, {**live, **dead}, 73, waited_s=0.0)
    assert json.loads(store.read_bytes(RunLayout.FLOW))["actors"] == 2
    report.maybe_write(5, {**live, **dead, "actor-2/launch4": 1}, 74, waited_s=0.0)
    assert json.loads(store.read_bytes(RunLayout.FLOW))["actors"] == 3

    # What the gate of a live actor with one shard unread decides from each: the dead
    # keys' count paused it at the bound (4); the live count leaves it room.
    def decide(actors: int) -> Admission:
        flow = {"version": 5, "consumed": {}, "actors": actors, "time": time.time()}
        flow |= {"episodes_per_version": 8.0, "episodes_per_s": 10.0}
        store.write_bytes(RunLayout.FLOW, json.dumps(flow).encode())
        gate = AdmissionGate(
            store, actor_key="actor-0/launch4", max_staleness=4, fallback_episodes_per_version=8
        )
        gate.poll()
        return gate.decide(version=5, committed=8, in_flight=0)

    assert not decide(actors=8).admit and decide(actors=2).admit


def test_a_need_read_once_admits_only_what_it_asked_for(tmp_path):
    """The learner's `needs` as read: the actor counts what it commits after the read
    against its share, so a position that goes stale (a learner compiling, checkpointing,
    writing at most every second on GCS) does not admit without bound."""
    store = open_store(f"file://{tmp_path}/run")
    flow = {"version": 5, "consumed": {"actor-0/x": 8}, "actors": 2, "time": time.time()}
    flow |= {"episodes_per_version": 8.0, "episodes_per_s": 10.0, "needs": 8}
    store.write_bytes(RunLayout.FLOW, json.dumps(flow).encode())
    gate = AdmissionGate(
        store, actor_key="actor-0/x", max_staleness=2, fallback_episodes_per_version=8
    )
    gate.poll()
    got = gate.decide(version=5, committed=24, in_flight=4)  # 2 x 16 unread: 5 versions
    assert (got.admit, got.reason) == (True, LEARNER_WAITING)
    assert gate.decide(version=5, committed=27, in_flight=0).admit  # 3 of its share of 4
    assert not gate.decide(version=5, committed=28, in_flight=0).admit  # its share is in
    # The learner writes again, still lacking 8: a new need.
    store.write_bytes(RunLayout.FLOW, json.dumps({**flow, "time": time.time() + 1}).encode())
    gate.poll()
    assert gate.decide(version=5, committed=28, in_flight=0).reason == LEARNER_WAITING
