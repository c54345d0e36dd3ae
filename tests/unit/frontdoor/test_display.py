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
