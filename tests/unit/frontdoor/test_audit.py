"""The latency audit on crafted metrics records: who is the bottleneck, and by how much."""

from __future__ import annotations

from typing import Any

import pytest

from tunix_tasks.config import config_from_dict
from tunix_tasks.frontdoor.audit import (
    actor_rate,
    audit_line,
    compare_runs,
    display_line,
    explain_duty,
    latency_audit,
    rounded,
    run_utilization,
)
from tunix_tasks.frontdoor.launcher import LiveStatus
from tunix_tasks.frontdoor.planning import main as planning_main
from tunix_tasks.frontdoor.planning import plan_fleet

T0 = 1_700_000_000.0


def _cfg(mode: str = "async", actors: int = 2, envs: int = 4):
    return config_from_dict(
        {
            "store": "/tmp/unused",
            "run_name": "audit",
            "mode": mode,
            "actor": {"num_actors": actors, "envs_per_actor": envs},
        }
    )


def _steps(n: int = 10, step_s: float = 0.5, episodes: int = 16) -> list[dict]:
    """Learner step records: the first one compiled (slow), the rest take `step_s`."""
    return [
        {
            "time": T0 + 10 * i,
            "process": "learner",
            "step": i,
            "loss": 0.1,
            "step_s": 30.0 if i == 1 else step_s,
            "episodes": episodes,
            "real_tokens": 1000,
            "compile_count": 1,
            "duty_cycle": 0.05,
        }
        for i in range(1, n + 1)
    ]


def _actor(name: str, rate: float, *, n: int = 6, env_p50: float = 1.0) -> list[dict]:
    """Actor records every 5 s; the first one, before any episode, has no rate yet."""
    return [
        {
            "time": T0 + 5 * i,
            "process": f"actor/{name}",
            "episodes": int(rate * 5 * i),
            "episodes_per_s": None if i == 0 else rate,
            "env_step_p50_s": env_p50,
            "env_step_p99_s": 2 * env_p50,
            "policy_latency_p50_s": 0.01,
        }
        for i in range(n)
    ]


def test_actor_bound_run_suggests_the_fleet_that_keeps_the_learner_busy():
    # Learner: 16 episodes per 0.5 s step = 32 eps/s. Actors: 2 x 4 eps/s = 8 eps/s.
    audit = latency_audit(_steps(), _actor("a0", 4.0) + _actor("a1", 4.0), _cfg())
    assert audit["learner_step_s"] == pytest.approx(0.5)  # the compiling first step left out
    assert audit["learner_capacity_eps_per_s"] == pytest.approx(32.0)
    assert audit["learner_capacity_tokens_per_s"] == pytest.approx(2000.0)
    assert audit["actor_supply_eps_per_s"] == pytest.approx(8.0)
    assert audit["supply_over_capacity"] == pytest.approx(0.25)
    assert audit["bottleneck"] == "actors"
    # 4x the supply: 16 envs per actor (add 12), or 8 actors (add 6).
    assert (audit["suggest_envs_per_actor"], audit["suggest_num_actors"]) == (16, 8)
    assert "actor-bound" in audit["advice"]
    assert "add ~12 envs per actor or 6 actors" in audit["advice"]
    assert (audit["env_step_p50_s"], audit["env_step_p99_s"]) == (1.0, 2.0)
    assert audit["policy_latency_p50_s"] == pytest.approx(0.01)
    assert audit_line(audit).startswith("actor-bound, supply 8 / capacity 32 eps/s")
    assert "add ~12 envs/actor or 6 actors" in audit_line(audit)


def test_learner_bound_run_says_fewer_actors_would_do():
    # Learner: 16 episodes per 2 s = 8 eps/s. Actors: 4 x 6 eps/s = 24 eps/s.
    actors = [r for i in range(4) for r in _actor(f"a{i}", 6.0)]
    audit = latency_audit(_steps(step_s=2.0), actors, _cfg(actors=4))
    assert audit["bottleneck"] == "learner"
    assert audit["supply_over_capacity"] == pytest.approx(3.0)
    assert audit["suggest_num_actors"] == 2  # ceil(4 / 3)
    assert "learner-bound" in audit["advice"] and "~2 actors" in audit["advice"]


def test_balanced_sync_and_empty_cases():
    balanced = latency_audit(_steps(), _actor("a0", 31.0), _cfg(actors=1))
    assert balanced["bottleneck"] == "balanced"
    sync = latency_audit(_steps(), _actor("a0", 4.0), _cfg(mode="sync", actors=1))
    assert sync["bottleneck"] == "sync" and "by design" in sync["advice"]
    empty = latency_audit([], [], _cfg())
    assert empty["bottleneck"] == "unknown" and empty["supply_over_capacity"] is None
    assert audit_line(empty).startswith("audit: waiting")


def test_policy_bound_actors_get_more_actors_not_envs():
    actors = _actor("a0", 4.0, env_p50=0.001)  # env steps cost nothing: the sampler is slow
    audit = latency_audit(_steps(), actors, _cfg(actors=1))
    assert audit["bottleneck"] == "actors"
    assert audit["policy_bound"] is True
    assert audit["advice"].endswith("policy latency dominates: add ~7 actors")
    assert "(policy latency)" in audit_line(audit) and "envs/actor" not in audit_line(audit)


def test_duty_cycle_is_explained_with_the_audit():
    audit = latency_audit(_steps(), _actor("a0", 4.0), _cfg(actors=1))
    text = explain_duty(0.25, audit)
    assert "trained 25% of its wall time" in text and "waited for data 75%" in text
    assert "actor-bound" in text
    assert "waited" not in explain_duty(0.97, audit)
    assert display_line(0.25, audit).startswith("duty = train time / wall time (0.25); ")
    assert display_line(0.25, None) == ""


def test_live_status_shows_one_audit_line():
    status = LiveStatus(10, actors_total=1, cfg=_cfg(actors=1))
    status.update(_steps() + _actor("a0", 4.0), now=T0 + 100)
    line = status.line(now=T0 + 100)
    assert "| duty = train time / wall time" in line and "actor-bound" in line
    assert status.audit()["bottleneck"] == "actors"
    assert LiveStatus(10).audit() is None  # without a config: no audit, no line
    assert "|" not in LiveStatus(10).line()


def _bursty_actor(name: str, *, compile_records: int = 12, bursts: int = 4) -> list[dict]:
    """A real actor's records (every 5 s): `compile_records` with no episode (loading,
    compiling the sampler), then a group of 60 episodes committed every third record
    and nothing in between, so most records' `episodes_per_s` are 0. From its first
    episode on it makes 60 episodes per 15 s = 4 eps/s."""
    records, episodes = [], 0
    for i in range(compile_records + 3 * (bursts - 1) + 1):
        k = i - compile_records
        burst = k >= 0 and k % 3 == 0
        episodes += 60 if burst else 0
        records.append(
            {
                "time": T0 + 5 * i,
                "process": f"actor/{name}",
                "episodes": episodes,
                "episodes_per_s": 12.0 if burst else 0.0,
                "env_step_p50_s": 1.0,
                "env_step_p99_s": 2.0,
                "policy_latency_p50_s": 0.01,
            }
        )
    return records


def test_supply_is_episodes_over_time_after_the_start_up():
    """Issue #31.2: 61% of a finished run's actor records had `episodes_per_s = 0`
    (compilation, windows without a committed group): their median was 0 and the report
    said "not enough metrics yet". Episodes over time from the first episode on is not."""
    records = _bursty_actor("a0") + _bursty_actor("a1")
    zeros = sum(r["episodes_per_s"] == 0 for r in records) / len(records)
    assert zeros > 0.6  # the finished run's share
    assert actor_rate(_bursty_actor("a0")) == pytest.approx(4.0)
    audit = latency_audit(_steps(), records, _cfg())
    assert audit["actor_supply_eps_per_s"] == pytest.approx(8.0)
    assert audit["bottleneck"] == "actors" and "add ~12 envs per actor" in audit["advice"]


def test_a_restarted_actor_counts_each_life():
    """The count starts again in a restarted actor (same name): each life's episodes
    over its own producing time, never a negative difference."""
    first = _bursty_actor("a0", bursts=3)  # 120 episodes over 30 s
    second = _bursty_actor("a0", bursts=2)  # 60 over 15 s, counted from 0 again
    for r in second:
        r["time"] += first[-1]["time"] - T0 + 5
    assert actor_rate(first + second) == pytest.approx(180 / 45)
    assert actor_rate(_bursty_actor("a0", bursts=1)) is None  # one producing record only
    assert actor_rate(_bursty_actor("a0")[:12]) is None  # still compiling


def test_latencies_are_the_producing_records_not_the_final_one():
    """A finished run's latest actor record is its final one, logged after it stopped:
    its policy latency (0.02 s here, 2 s while it produced) must not decide."""
    records = _bursty_actor("a0")
    for r in records:
        r["policy_latency_p50_s"] = 2.0 if r["episodes"] else 30.0  # compiling: slow
    records.append({**records[-1], "time": records[-1]["time"] + 5, "final": True})
    records[-1]["policy_latency_p50_s"] = 0.02
    audit = latency_audit(_steps(), records, _cfg(actors=1))
    assert audit["policy_latency_p50_s"] == 2.0 and audit["policy_bound"] is True


def test_a_visible_backlog_never_advises_more_actors():
    """Issue #31.2: under load the live audit advised "add 5 actors" while 797 episodes
    were buffered and staleness sat at its bound: the learner was not waiting for data."""
    steps = _steps()
    for r in steps:
        r.update(buffer=797, backlog_shards=3, staleness={"3": 6, "4": 10})
    audit = latency_audit(steps, _actor("a0", 4.0) + _actor("a1", 4.0), _cfg())
    assert audit["supply_over_capacity"] == pytest.approx(0.25)  # the rates alone: actors
    assert audit["bottleneck"] == "learner"
    assert audit["buffered_episodes"] == 797 and audit["backlog_steps"] == pytest.approx(797 / 16)
    assert "797 episodes buffered (~50 steps), 3 shards unread" in audit["advice"]
    assert "staleness at its bound 4" in audit["advice"]
    assert "add ~" not in audit["advice"]
    assert audit["advice"].endswith("more actors would only add staleness")
    assert (audit["suggest_num_actors"], audit["suggest_envs_per_actor"]) == (2, 4)
    assert audit_line(audit).endswith("797 eps buffered: no more actors")
    # Less than a batch waiting: the rates decide again.
    for r in steps:
        r.update(buffer=10, staleness={"1": 16})
    assert latency_audit(steps, _actor("a0", 4.0), _cfg())["bottleneck"] == "actors"


def test_run_utilization_reads_a_whole_run_of_records():
    """The report's and the summary's figures: every record of the run, in any order,
    the learner's steps once each (a redone step's surviving record)."""
    records = [*reversed(_steps()), *_bursty_actor("a0"), *_bursty_actor("a1")]
    redone = {**_steps()[4], "step_s": 99.0, "time": T0 - 1}  # an earlier attempt's step 5
    extra = {"time": T0, "process": "learner", "phase": "waiting for the first shard"}
    got = run_utilization([*records, redone, extra], _cfg())
    audit = got["latency_audit"]
    assert audit == latency_audit(_steps(), _bursty_actor("a0") + _bursty_actor("a1"), _cfg())
    assert audit["actor_supply_eps_per_s"] == pytest.approx(8.0)
    # Steps every 10 s, 0.5 s each after the first: a steady duty cycle of 0.05.
    assert got["duty_cycle_steady"] == pytest.approx(0.05)
    assert got["duty_cycle_explained"] == explain_duty(0.05, audit)


def test_live_status_shows_the_run_audit_at_the_end():
    status = LiveStatus(10, actors_total=1, cfg=_cfg(actors=1))
    status.update(_steps() + _actor("a0", 4.0), now=T0 + 100)
    status.final_audit = latency_audit(_steps(), _actor("a0", 31.0), _cfg(actors=1))
    assert status.audit()["bottleneck"] == "balanced" and "balanced" in status.line()


def test_rounded_keeps_ints_and_rounds_floats_to_significant_digits():
    got = rounded({"a": 0.123456789, "b": [1234567.891, 3], "c": True, "d": None, "e": 0.0})
    assert got == {"a": 0.1235, "b": [1234568.0, 3], "c": True, "d": None, "e": 0.0}
    assert rounded(1.0e-7 / 3) == pytest.approx(3.333e-8)


def test_compare_runs_side_by_side():
    run = {"duty_cycle_steady": 0.9, "learner_wall_s": 10.0, "reward_last": 0.5}
    base = {"duty_cycle_steady": 0.1, "learner_wall_s": 70.0, "reward_last": None}
    rows = {r["metric"]: r for r in compare_runs(run, base)}
    assert rows["learner duty cycle (steady)"]["run_over_baseline"] == pytest.approx(9.0)
    assert rows["learner wall time (s)"]["baseline"] == 70.0
    assert rows["reward, last 10% of steps"]["run_over_baseline"] is None


# 3 turns x (2 + 0.5) s = 7.5 s episodes; 64 envs -> 8.53 eps/s per actor; the learner
# trains 64 episodes per 0.4 s = 160 eps/s -> 19 actors (18.75 rounded up).
_FLEET = {
    "env_latency_s": 2.0,
    "policy_latency_s": 0.5,
    "turns": 3,
    "envs_per_actor": 64,
    "learner_step_s": 0.4,
    "episodes_per_step": 64,
}


def _plan(**overrides: float) -> dict[str, Any]:
    """`plan_fleet` of `_FLEET`, with `overrides`."""
    return plan_fleet(**{**_FLEET, **overrides})


def test_fleet_plan_arithmetic_and_staleness():
    plan = _plan()
    assert plan["episode_s"] == 7.5 and plan["actors_needed"] == 19
    assert plan["envs_needed"] == 19 * 64 and not plan["sampler_bound"]
    # A version lasts 2 x 0.4 s; an episode is trained 7.5 s + a 3.75 s shard wait later.
    assert plan["expected_staleness"] == pytest.approx((7.5 + 32 / (64 / 7.5)) / 0.8)
    assert plan["within_max_staleness"] is False
    # A sampler that makes 400 tokens/s for 100-token episodes caps the actor at 4 eps/s.
    capped = _plan(actor_tokens_per_s=400, policy_tokens_per_episode=100)
    assert capped["sampler_bound"] and capped["actors_needed"] == 40
    with pytest.raises(ValueError, match="learner_step_s must be > 0"):
        _plan(learner_step_s=0)
    argv = [arg for k, v in _FLEET.items() for arg in (f"--{k.replace('_', '-')}", str(v))]
    assert planning_main(argv) == 0
