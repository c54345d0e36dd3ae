"""The autopilot's policy over traces of a simulated fleet: it converges to the fleet that
keeps the learner busy, follows a world whose env latency jumps, shrinks a learner-bound
fleet, never oscillates on noisy rates, and stays within its bounds."""

from __future__ import annotations

import dataclasses
import itertools
import math

import numpy as np
import pytest

from tunix_tasks.config.autopilot import AutopilotConfig
from tunix_tasks.frontdoor.autopilot import (
    SMOOTHING,
    Autopilot,
    FleetDecision,
    FleetObservation,
)

EPISODES_PER_STEP = 32


@dataclasses.dataclass
class Trace:
    decisions: list[tuple[float, FleetDecision]]
    actors: np.ndarray  # per simulated second
    duty: np.ndarray  # the learner's busy share per second

    def changes(self, start: float = 0.0, end: float = math.inf) -> list[FleetDecision]:
        return [d for t, d in self.decisions if start <= t < end and d.action != "hold"]

    def reversals(self) -> int:
        actions = [d.action for d in self.changes()]
        return sum(a != b for a, b in itertools.pairwise(actions))


def simulate(
    cfg: AutopilotConfig,
    *,
    minutes: float,
    capacity: float,
    supply,  # seconds -> episodes/s one actor supplies then
    actors: int = 1,
    startup_s: float = 30.0,
    noise: float = 0.15,
    bound_steps: float = 4.0,
    seed: int = 0,
) -> Trace:
    """A fleet under flow control in 1 s ticks: each actor could produce `supply(t)`
    episodes/s once `startup_s` after it started; with `bound_steps` batches buffered
    flow control pauses them to what the learner trains (up to `capacity` episodes/s).
    Every `interval_s` the policy sees the audit's figures with multiplicative noise, as
    on a loaded machine, and the fleet is resized at once (stopped actors first)."""
    rng = np.random.default_rng(seed)
    pilot = Autopilot(cfg)
    started = [-startup_s] * actors  # the first fleet is warm
    backlog, decisions, fleet, duty = 0.0, [], [], []
    for t in range(int(minutes * 60)):
        producing = sum(t - s >= startup_s for s in started)
        could = producing * supply(t)
        made = min(could, capacity) if backlog >= bound_steps * EPISODES_PER_STEP else could
        trained = min(capacity, backlog + made)
        backlog += made - trained
        duty.append(trained / capacity)
        fleet.append(len(started))
        if t % cfg.interval_s == 0:
            audit = {
                "learner_capacity_eps_per_s": capacity * rng.lognormal(0, noise),
                "per_actor_eps_per_s": (made / producing) * rng.lognormal(0, noise)
                if producing and t >= startup_s
                else None,
                "actor_paused_share": 1 - made / could if could else 0.0,
                "backlog_steps": backlog / EPISODES_PER_STEP,
            }
            decision = pilot.decide(
                FleetObservation.of(audit, time_s=float(t), actors=len(started))
            )
            decisions.append((float(t), decision))
            while len(started) > decision.actors:
                started.pop()
            while len(started) < decision.actors:
                started.append(t)
    return Trace(decisions, np.array(fleet), np.array(duty))


CFG = AutopilotConfig(enabled=True, max_actors=16)


def test_a_single_actor_grows_to_the_fleet_that_keeps_the_learner_busy():
    # Learner 20 eps/s, an actor 4 eps/s: 1.25x capacity needs 7 actors.
    trace = simulate(CFG, minutes=20, capacity=20.0, supply=lambda t: 4.0)
    assert 6 <= trace.actors[-1] <= 9, trace.changes()
    first_full = int(np.argmax(trace.actors >= 6))
    assert first_full < 5 * 60, "1 -> 2 -> 4 -> 8 with a 60 s cooldown: within 5 minutes"
    assert trace.duty[first_full + 60 :].mean() > 0.97
    assert trace.reversals() <= 1
    grew = trace.changes()[0]
    assert grew.action == "grow" and grew.actors == 2  # at most x2 per decision
    assert "at most x2 per decision" in grew.reason and "needs 7" in grew.reason


def test_a_latency_jump_grows_the_fleet_to_its_ceiling_and_back_without_oscillating():
    # Env latency x10 between minutes 10 and 20: an actor supplies 4, then 0.4, then 4.
    def supply(t: float) -> float:
        return 0.4 if 600 <= t < 1200 else 4.0

    trace = simulate(CFG, minutes=30, capacity=20.0, supply=supply)
    assert 6 <= trace.actors[599] <= 9
    assert trace.actors[1199] == 16  # the slow phase wants 63: held at the ceiling
    ceiling = [d for d in trace.changes(600, 1200) if d.actors == 16]
    assert ceiling and "at the ceiling max_actors=16" in ceiling[0].reason
    assert 6 <= trace.actors[-1] <= 9, trace.changes(1200)  # back once the backlog builds
    # One direction per phase; a change at most every cooldown_s.
    assert trace.reversals() <= 3, [d.reason for d in trace.changes()]
    times = [t for t, d in trace.decisions if d.action != "hold"]
    assert all(b - a >= CFG.cooldown_s for a, b in itertools.pairwise(times))
    per_minute = len(times) / 30
    assert per_minute <= 0.5


def test_a_learner_bound_fleet_shrinks_once_data_piles_up_and_never_grows():
    # Each actor supplies twice what the learner trains: 1 actor would do.
    trace = simulate(CFG, minutes=15, capacity=5.0, supply=lambda t: 10.0, actors=8)
    assert all(d.action == "shrink" for d in trace.changes())
    assert trace.actors[-1] == 1
    assert trace.duty[120:].mean() > 0.99  # shrinking never starved it


def test_noisy_rates_around_a_balanced_fleet_change_nothing():
    # 1.25 x 20 / 3.6 = 6.9: 7 actors, each rate measured with 20% noise, 30 minutes.
    for seed in range(5):
        trace = simulate(
            CFG, minutes=30, capacity=20.0, supply=lambda t: 3.6, actors=7, noise=0.2, seed=seed
        )
        assert len(trace.changes()) <= 1, [d.reason for d in trace.changes()]


def test_a_fleet_paused_by_flow_control_is_measured_by_what_it_could_supply():
    # 12 actors of 6 eps/s against a learner of 20: flow control pauses them ~70% of the
    # time, so each reports ~1.7 eps/s; the rates alone would grow the fleet to 15.
    trace = simulate(CFG, minutes=15, capacity=20.0, supply=lambda t: 6.0, actors=12)
    assert not [d for d in trace.changes() if d.action == "grow"]
    assert 4 <= trace.actors[-1] <= 6  # 1.25 x 20 / 6 = 4.2 -> 5
    assert trace.duty[60:].mean() > 0.99


def _obs(**kw) -> FleetObservation:
    base = dict(time_s=0.0, actors=4, capacity_eps=10.0, per_actor_eps=1.0, backlog_steps=0.0)
    return FleetObservation(**{**base, **kw})


def test_no_decision_without_measurements_and_the_bounds_always_hold():
    pilot = Autopilot(AutopilotConfig(enabled=True, min_actors=2, max_actors=6))
    d = pilot.decide(_obs(per_actor_eps=None))
    assert (d.action, d.actors) == ("hold", 4) and d.reason.startswith("measuring")
    d = pilot.decide(_obs(actors=9))  # a resumed run with a lower ceiling
    assert (d.action, d.actors) == ("shrink", 6) and "bounds [2, 6]" in d.reason
    pilot = Autopilot(AutopilotConfig(enabled=True, min_actors=2, max_actors=6))
    surplus = _obs(actors=2, capacity_eps=1.0, per_actor_eps=10.0, backlog_steps=9.0)
    reasons = [pilot.decide(surplus).reason for _ in range(SMOOTHING)]
    assert reasons[0] == "measuring: 1 of 5 readings"
    d = pilot.decide(surplus)
    assert (d.action, d.actors) == ("hold", 2) and "at the floor min_actors=2" in d.reason
    assert d.record() == {
        "autopilot": "hold",
        "actors": 2,
        "actors_before": 2,
        "actors_wanted": 1,
        "reason": d.reason,
    }


def test_the_config_refuses_bounds_that_cannot_hold():
    from tunix_tasks.config import RunConfig

    with pytest.raises(ValueError, match=r"min_actors=5 is above actor\.autopilot\.max_actors=2"):
        AutopilotConfig(min_actors=5, max_actors=2)
    on = {"flow_control": True, "autopilot": {"enabled": True, "max_actors": 8}}
    with pytest.raises(ValueError, match=r"num_actors=9 .* outside actor.autopilot's bounds"):
        RunConfig.model_validate({"actor": {**on, "num_actors": 9}})
    with pytest.raises(ValueError, match=r"autopilot\.enabled=true with mode=sync"):
        RunConfig.model_validate({"mode": "sync", "actor": on})
    with pytest.raises(ValueError, match=r"needs actor\.flow_control=true"):
        RunConfig.model_validate({"actor": {"autopilot": {"enabled": True}, "flow_control": False}})
    with pytest.raises(ValueError, match=r"needs a ceiling"):
        Autopilot(AutopilotConfig())


def test_the_autopilot_is_on_by_default_where_it_is_safe_and_never_grows_past_the_run():
    """Unset, `actor.autopilot.enabled` is on in async mode with flow control (which
    withholds the surplus it aims for) and off elsewhere, without refusing the config;
    unset, `max_actors` is the fleet the run starts with (or the launcher started): the
    autopilot parks or stops actors the learner does not need, and starts no more."""
    from tunix_tasks.config import RunConfig
    from tunix_tasks.frontdoor.entrypoints import launched_actors

    cfg = RunConfig.model_validate({"actor": {"num_actors": 3}})
    assert cfg.autopilot_on and cfg.actor.flow_control and cfg.mode == "async"
    assert cfg.actor.autopilot.with_ceiling(cfg.actor.num_actors).max_actors == 3
    assert launched_actors(cfg) == 3 and launched_actors(cfg, 5) == 5  # a recurring interval
    assert not RunConfig.model_validate({"mode": "sync"}).autopilot_on
    assert not RunConfig.model_validate({"actor": {"flow_control": False}}).autopilot_on
    off = RunConfig.model_validate({"actor": {"autopilot": {"enabled": False}}})
    assert not off.autopilot_on and launched_actors(off, 5) == 5
    grows = RunConfig.model_validate({"actor": {"autopilot": {"max_actors": 6}}})
    assert grows.autopilot_on and launched_actors(grows) == 6  # the DAG maps the ceiling
    with pytest.raises(ValueError, match=r"num_actors=3 .* outside actor.autopilot's bounds"):
        RunConfig.model_validate({"actor": {"num_actors": 3, "autopilot": {"min_actors": 4}}})
    sync = {"mode": "sync", "actor": {"num_actors": 3, "autopilot": {"min_actors": 4}}}
    assert not RunConfig.model_validate(sync).autopilot_on  # off there: its bounds unchecked
    fewer = AutopilotConfig(min_actors=3).with_ceiling(2)  # a launcher started fewer
    assert (fewer.min_actors, fewer.max_actors) == (2, 2)
    assert AutopilotConfig(min_actors=3, max_actors=5).with_ceiling(2).max_actors == 5


@pytest.mark.parametrize(("ceiling", "first"), [(None, 4), (6, 2)])
def test_the_airflow_fleet_starts_with_every_mapped_actor_unless_a_ceiling_was_set(
    tmp_path, ceiling, first
):
    """A recurring interval may map more actors than the run's stored `num_actors` (2):
    without an explicit `max_actors` all 4 mapped ones start active, not 2 of them with
    the rest parked; with one (the DAG maps it), `num_actors` start and the rest park
    until the learner needs them."""
    from tunix_tasks.config import config_from_dict
    from tunix_tasks.frontdoor.entrypoints import prepare_run
    from tunix_tasks.frontdoor.fleet import FleetAutopilot
    from tunix_tasks.storage.runs import read_fleet
    from tunix_tasks.storage.store import open_store

    extra = [] if ceiling is None else [f"actor.autopilot.max_actors={ceiling}"]
    cfg = config_from_dict(
        {"store": f"file://{tmp_path}/runs", "run_name": "r"}, ["actor.num_actors=2", *extra]
    )
    run_uri = prepare_run(cfg)
    with FleetAutopilot(run_uri, launched=4 if ceiling is None else ceiling, poll_s=60.0):
        assert read_fleet(open_store(run_uri)) == first


def test_the_local_fleet_starts_and_stops_real_processes_and_logs_each_decision(tmp_path):
    """`LocalFleet` over real child processes: a grow starts the lowest free ids, a shrink
    sends SIGTERM to the highest, and every decision is a metrics record that the report
    reads back as the run's autopilot section."""
    import subprocess
    import sys

    from tunix_tasks.frontdoor.fleet import LocalFleet
    from tunix_tasks.frontdoor.report import autopilot_decisions
    from tunix_tasks.frontdoor.summary import format_train_summary
    from tunix_tasks.frontdoor.supervision import ActorPool, Child
    from tunix_tasks.storage.metrics import read_metrics
    from tunix_tasks.storage.store import open_store

    def start(i: int) -> Child:
        proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
        log = open(tmp_path / f"{i}.log", "ab")  # noqa: SIM115 - closed below
        return Child(f"actor-{i:04d}", [], str(tmp_path / f"{i}.log"), proc, log)

    store = open_store(f"file://{tmp_path}/run")
    started = [start(0)]
    pool = ActorPool(list(started), env={}, report=print)
    cfg = AutopilotConfig(enabled=True, max_actors=4, cooldown_s=1.0, interval_s=1.0)

    def start_more(i: int) -> Child:
        started.append(start(i))
        return started[-1]

    fleet = LocalFleet(cfg, store, pool, start_more, report=print)
    short = {"learner_capacity_eps_per_s": 20.0, "per_actor_eps_per_s": 5.0, "backlog_steps": 0.0}
    decisions = []

    def tick(audit: dict, now: float) -> None:
        decisions.append(fleet.tick(audit, now=now))
        assert fleet.tick(audit, now=now + 0.5) is None  # between intervals

    try:
        now = 0.0
        while len(pool.actors) < 4 and now < 60:
            tick(short, now := now + 1.0)
        assert [a.name for a in pool.actors] == [f"actor-{i:04d}" for i in range(4)]
        assert [d.action for d in decisions if d.action != "hold"] == ["grow", "grow"]
        surplus = {**short, "per_actor_eps_per_s": 25.0, "backlog_steps": 5.0}  # 1 would do
        while len(pool.actors) > 2 and now < 120:
            tick(surplus, now := now + 1.0)
        assert fleet.names() == {"actor-0000", "actor-0001"}  # x2 per decision: 4 -> 2
        gone = fleet.retired
        assert [a.name for a in gone] == ["actor-0002", "actor-0003"]
        for child in gone:
            assert child.proc.wait(timeout=10) == -15  # SIGTERM
        slow = {**short, "per_actor_eps_per_s": 10.0}  # 1.25 x 20 / 10: 3 actors
        while len(pool.actors) < 3 and now < 180:
            tick(slow, now := now + 1.0)
        assert fleet.names() == {"actor-0000", "actor-0001", "actor-0002"}  # an id reused
        fleet.close()
        summary = fleet.summary()
        assert summary["changes"] == ["1 -> 2", "2 -> 4", "4 -> 2", "2 -> 3"]
        line = format_train_summary({"autopilot": summary}).splitlines()
        assert any(ln.startswith("autopilot") and "4 changes (1 -> 2, 2 -> 4" in ln for ln in line)
    finally:
        for child in started:
            child.proc.kill()
            child.proc.wait()
            child.log.close()
    records = read_metrics(store, "autopilot")
    assert len(records) == len(decisions) and all(r["reason"] for r in records)
    report = autopilot_decisions(records)
    assert [c["actors"] for c in report["changes"]] == ["1 -> 2", "2 -> 4", "4 -> 2", "2 -> 3"]
    assert report["actors_range"] == [1, 4] and report["decisions"] == len(decisions)


def test_a_parked_actors_slot_holds_no_actor_and_starts_it_again_when_the_fleet_grows(
    tmp_path, caplog
):
    """`run_actor_shifts` (an actor's task on the Kubernetes launcher): parked by default
    (index 1 of a fleet that starts 1 of 2), it launches nothing; grown over, it launches
    the actor; an actor that left parked is not relaunched until the fleet file includes
    it again, nor on the very file it left on (no start-and-leave loop); an unreadable
    file changes nothing; the summary adds the shifts up and ends with the run's DONE."""
    import threading
    import time

    from tunix_tasks.actor.admission import LEFT_PARKED
    from tunix_tasks.config import config_from_dict
    from tunix_tasks.frontdoor.entrypoints import prepare_run
    from tunix_tasks.frontdoor.fleet import run_actor_shifts
    from tunix_tasks.storage.layout import RunLayout
    from tunix_tasks.storage.runs import mark_done, write_fleet
    from tunix_tasks.storage.store import open_store

    cfg = config_from_dict(
        {"store": f"file://{tmp_path}/runs", "run_name": "r"},
        ["actor.num_actors=1", "actor.autopilot.max_actors=2"],
    )
    run_uri = prepare_run(cfg)
    store = open_store(run_uri)
    launched: list[float | None] = []

    def launch(seconds_left: float | None) -> dict:
        launched.append(seconds_left)
        if len(launched) == 1:
            write_fleet(store, 1, "shrink")  # parked while it ran: it leaves
        if len(launched) == 3:
            mark_done(store, "finished")
            return {"stop_reason": "run done: finished", "episodes": 1, "shards": 1}
        # The second leaves parked on a file that includes it (it read another one).
        return {"stop_reason": LEFT_PARKED, "episodes": 3, "reward_mean": 1.0, "shards": 1}

    def until(n: int) -> None:
        while len(launched) < n and slot.is_alive():
            time.sleep(0.01)
        time.sleep(0.3)  # then nothing more starts
        assert len(launched) == n

    out: dict = {}
    slot = threading.Thread(
        target=lambda: out.update(
            run_actor_shifts(run_uri, 1, launch, deadline_s=60.0, poll_s=0.01)
        )
    )
    slot.start()
    time.sleep(0.3)
    assert launched == []  # parked before any fleet file: `num_actors` of 2 run
    write_fleet(store, 2, "grow")
    until(1)  # left parked: waits again
    assert 0 < launched[0] <= 60.0
    store.write_bytes(RunLayout.FLEET, b"not json")
    time.sleep(0.3)
    assert len(launched) == 1  # an unreadable file: the last count (parked) holds
    write_fleet(store, 2, "grow")
    until(2)  # left parked on a file that says 2: waits for a new decision
    write_fleet(store, 2, "grow again")
    slot.join(timeout=10)
    assert not slot.is_alive() and len(launched) == 3
    assert out["shifts"] == 3 and out["episodes"] == 7 and out["shards"] == 3
    assert out["reward_mean"] == 6 / 7 and out["stop_reason"] == "run done: finished"
    assert out["actor_id"] == "actor-0001"
    assert "ignoring the fleet control file" in caplog.text
    # DONE or the deadline while parked: the slot returns without launching.
    write_fleet(store, 0, "shrink")
    assert run_actor_shifts(run_uri, 1, launch, poll_s=0.01)["stop_reason"].startswith("run done")
    store.delete(RunLayout.DONE)
    idle = run_actor_shifts(run_uri, 1, launch, deadline_s=0.2, poll_s=0.01)
    assert idle["stop_reason"] == "deadline" and idle["shifts"] == 0 and len(launched) == 3
    timed = prepare_run(cfg.model_copy(update={"run_name": "timed", "deadline_s": 0.2}))
    write_fleet(open_store(timed), 0, "shrink")  # the run's own deadline, from the start
    assert run_actor_shifts(timed, 1, launch, poll_s=0.01)["stop_reason"] == "deadline"


def test_a_slot_of_a_run_created_again_since_it_was_prepared_starts_no_pod(tmp_path):
    """A retried actor task on the Kubernetes launcher: its slot joins the run its DAG run
    prepared, or none; no pod is started to be refused."""
    import shutil

    from tunix_tasks.config import config_from_dict
    from tunix_tasks.frontdoor.fleet import run_actor_shifts
    from tunix_tasks.storage.runs import RunReplaced, mark_done, run_id, write_config

    cfg = config_from_dict({"store": str(tmp_path), "run_name": "r"})
    ours = run_id(write_config(cfg))
    shutil.rmtree(tmp_path / "r")
    write_config(cfg)
    pods: list[float | None] = []
    with pytest.raises(RunReplaced, match="created again"):
        run_actor_shifts(cfg.run_uri, 0, lambda left: pods.append(left) or {}, run_id=ours)
    assert pods == []
    # Parked (actor 1 of a fleet of 1) when its run is created again and finishes: the
    # other run's DONE is not its success.
    fleet = config_from_dict(
        {"store": str(tmp_path), "run_name": "p"},
        ["actor.num_actors=1", "actor.autopilot.max_actors=2"],
    )
    ours = run_id(write_config(fleet))
    shutil.rmtree(tmp_path / "p")
    mark_done(write_config(fleet), "the other run finished")
    with pytest.raises(RunReplaced, match="created again"):
        run_actor_shifts(fleet.run_uri, 1, lambda left: pods.append(left) or {}, run_id=ours)
    assert pods == []


def test_the_autopilot_rides_out_a_store_outage(tmp_path, caplog):
    """A store that fails every write: the fleet starts anyway (its first fleet file owed),
    its decisions neither raise nor change the fleet; once the store answers, the owed
    file is written and the next decision applies."""
    from tunix_tasks.frontdoor.fleet import ParkedFleet
    from tunix_tasks.storage.backends.local import LocalStore
    from tunix_tasks.storage.runs import read_fleet
    from tunix_tasks.storage.store import StoreError

    class Down(LocalStore):
        down = True

        def write_bytes(self, key: str, data: bytes) -> None:
            if self.down:
                raise StoreError(f"{key}: 503 service unavailable")
            super().write_bytes(key, data)

    store = Down(f"file://{tmp_path}/run")
    cfg = AutopilotConfig(enabled=True, max_actors=4, cooldown_s=1.0, interval_s=1.0)
    fleet = ParkedFleet(cfg, store, actors=1, report=print)
    short = {"learner_capacity_eps_per_s": 20.0, "per_actor_eps_per_s": 5.0, "backlog_steps": 0.0}
    for t in range(1, 12):
        fleet.tick(short, now=float(t))
    assert fleet.active == 1 and read_fleet(store) is None
    assert "the fleet file is not written yet" in caplog.text and "fleet unchanged" in caplog.text
    store.down = False
    fleet.tick(None, now=12.0)
    assert read_fleet(store) == 1  # the owed first file
    t = 12.0
    while fleet.active == 1 and t < 30:
        fleet.tick(short, now=(t := t + 1.0))
    assert fleet.active == 2 and read_fleet(store) == 2
    fleet.close()
