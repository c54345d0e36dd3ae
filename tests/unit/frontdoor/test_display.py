"""The live display of `tunix-tasks train` as a terminal shows it: rendered captures at
80 and 160 columns (issue #31.4), and what it says while no step comes (issue #31.5)."""

from __future__ import annotations

from rich.console import Console

from tunix_tasks.frontdoor.launcher import LiveStatus

T0 = 1_700_000_000.0


def _status() -> LiveStatus:
    """Step 120 of 140 with a backlog: the values a reader must be able to read."""
    status = LiveStatus(140, actors_total=2)
    status.actors_alive = 2
    record = {
        "time": T0,
        "process": "learner",
        "step": 120,
        "version": 60,
        "loss": 0.1,
        "reward_mean": 0.8125,
        "duty_cycle": 0.52,
        "buffer": 797,
        "backlog_shards": 3,
        "staleness": {"3": 6, "4": 10},
        "dropped": {"stale": 40},
    }
    status.update([record], now=T0 + 1)
    return status


def _capture(status: LiveStatus, width: int) -> str:
    console = Console(width=width, record=True, color_system=None)
    console.print(status.render(now=T0 + 1))
    return console.export_text()


NARROW_VALUES = ("120/140", "0.812", "0.52", "797 eps + 3 shards", "3.6 (max 4)", "2/2")


def test_at_80_columns_the_narrow_table_shows_every_value_whole():
    """Rich used to squeeze all 11 columns into 80 columns, 1-5 characters each."""
    text = _capture(_status(), 80)
    assert "…" not in text, text
    assert max(map(len, text.splitlines())) <= 80
    for label in ("step", "reward", "duty", "backlog", "staleness", "actors"):
        assert label in text, (label, text)
    for value in NARROW_VALUES:
        assert value in text, (value, text)
    assert "version" not in text and "dropped" not in text  # the wide table's extras


def test_at_160_columns_the_wide_table_shows_every_field():
    text = _capture(_status(), 160)
    assert "…" not in text, text
    for value in ("120/140", "v60", "0.812", "797 eps", "3 shards", "3.6 (max 4)", "40", "2/2"):
        assert value in text, (value, text)
    assert "updated" in text and "dropped" in text


def _actor(name: str, t: float, phase: str, episodes: int = 0) -> dict:
    return {"time": t, "process": f"actor/{name}", "episodes": episodes, "phase": phase}


def test_after_the_warm_start_the_display_says_what_it_waits_for():
    """Issue #31.5: the display sat at `warm start 140/140` for ~6 min while the actors
    compiled. The learner's and the actors' phase records say so."""
    status = LiveStatus(30, warm_start_steps=140, actors_total=2)
    status.started_at = T0 - 10  # the display started before these records
    assert status.phase(now=T0 - 5) == "learner starting (5s); actors: 2 starting"
    compiling = "compiling the sampler (3 programs so far)"
    status.update([{"time": T0, "process": "learner", "phase": "warm start: compiling"}])
    status.update([{"time": T0 + 1, "process": "learner", "warm_start_step": 1, "nll": 3.0}])
    assert status.phase(now=T0 + 2) == "actors: 2 starting"  # the learner: warm-start steps
    status.update(
        [
            {"time": T0 + 2, "process": "learner", "warm_start_step": 140, "nll": 0.5},
            {"time": T0 + 3, "process": "learner", "phase": "waiting for the first shard"},
            _actor("actor-0000", T0 + 3, "waiting for the first weights"),
            _actor("actor-0000", T0 + 5, compiling),
            _actor("actor-0001", T0 + 6, compiling),
        ],
        now=T0 + 7,
    )
    now = T0 + 363
    phase = status.phase(now=now)
    # Waiting since the warm start's last step (then it published the first weights).
    assert phase == f"learner waiting for the first shard (361s); actors: 2 {compiling}"
    assert f"now: {phase}" in status.line(now=now)
    assert "warm start 140/140" in status.line(now=now)
    console = Console(width=80, record=True, color_system=None)
    console.print(status.render(now=now))
    shown = " ".join(console.export_text().split())  # the phase line wraps at 80 columns
    assert f"now: {phase}" in shown, shown
    # One actor samples, its first shard not written yet; the learner still waits.
    status.update([_actor("actor-0000", now, "sampling, first shard not written yet", 8)])
    assert status.phase(now=now).endswith(
        f"actors: 1 sampling, first shard not written yet, 1 {compiling}"
    )


def test_phases_give_way_to_steps():
    status = LiveStatus(30, actors_total=1)
    status.started_at = T0 - 10
    status.update(
        [
            {
                "time": T0,
                "process": "learner",
                "phase": "compiling the train step for bucket 64 (1 of 2)",
            },
            _actor("actor-0000", T0, "sampling", 16),
        ]
    )
    assert status.phase(now=T0 + 20) == (
        "learner compiling the train step for bucket 64 (1 of 2) (20s); actors: 1 sampling"
    )
    step = {"time": T0 + 21, "process": "learner", "step": 1, "loss": 0.1, "reward_mean": 0.5}
    status.update([step])
    assert status.phase(now=T0 + 22) == ""  # training, every actor sampling: nothing to say
    assert "now:" not in status.line(now=T0 + 22)
    # Recorded once the wait lasts 10 s; it began with the last step record.
    status.update([{"time": T0 + 31, "process": "learner", "phase": "waiting for data"}])
    assert status.phase(now=T0 + 36) == "learner waiting for data (15s); actors: 1 sampling"


def test_a_resumed_runs_old_phases_say_nothing_about_now():
    """The display reads the run's records from the start: an earlier attempt's last
    phases (its actors `stopped`) are not what the new processes do."""
    status = LiveStatus(30, actors_total=2)
    status.update(
        [
            {"time": T0, "process": "learner", "phase": "waiting for data"},
            _actor("actor-0000", T0, "stopped", 40),
            _actor("actor-0001", T0, "stopped", 40),
        ]
    )
    status.started_at = T0 + 100  # this display (the resume) started later
    assert status.phase(now=T0 + 103) == "learner starting (3s); actors: 2 starting"
    status.update([_actor("actor-0000", T0 + 104, "waiting for the first weights")])
    assert status.phase(now=T0 + 105).endswith("actors: 1 waiting for the first weights")


def test_significant_stale_drop_bias_gets_a_line_of_its_own():
    """The step record's cumulative `drop_bias`: stale drops 1.8x longer than the trained
    episodes are named under the table (also at 80 columns) and in the plain line; drops
    alike the trained ones, or too few, say nothing."""
    from tunix_tasks.learner import drop_bias

    def with_bias(stale_length: int, stale_n: int) -> LiveStatus:
        status = _status()
        trained = drop_bias.add(drop_bias.empty(), [100] * 400, [2] * 400, [0.5] * 400)
        n = stale_n
        stale = drop_bias.add(drop_bias.empty(), [stale_length] * n, [2] * n, [0.5] * n)
        record = {**status.record, "step": 121, "time": T0 + 1}
        status.update([{**record, "drop_bias": {"trained": trained, "stale": stale}}])
        return status

    hint = "stale drops vs trained: 1.8x longer"
    biased = with_bias(180, 40)
    assert f"({hint})" in biased.line(now=T0 + 1)
    text = _capture(biased, 80)
    assert hint in text and "…" not in text, text
    for status in (with_bias(110, 40), with_bias(180, 10)):  # 1.1x; 10 drops
        assert "stale drops" not in status.line(now=T0 + 1)
        assert "stale drops" not in _capture(status, 160)
