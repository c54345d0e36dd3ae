"""The lines `tunix-tasks train` ends with (frontdoor/summary.py): wording that says what
each number is (issue #31.9)."""

from __future__ import annotations

from tunix_tasks.frontdoor.summary import format_train_summary


def test_summary_lines_say_what_each_number_covers():
    text = format_train_summary(
        {
            "run_uri": "file:///runs/demo",
            "mode": "async",
            "interrupted": "SIGINT",
            "wall_s": 246.2,
            "last_step": {"step": 12, "staleness": {"1": 47}, "dropped": {"stale": 3}},
            "latency_audit": {"advice": "balanced (actors supply 9 eps/s, ...)"},
            "duty_cycle_steady": 0.05,
        }
    )
    lines = {line.split()[0]: line for line in text.splitlines()}
    # Not "resumes it in 246 s", which reads as a countdown.
    assert lines["run"].endswith("the same command resumes it (wall time 246 s)")
    # The staleness counts are the last step's; the drops are cumulative.
    assert "last step's episodes by staleness 1: 47; over the run: dropped stale: 3" in text
    assert lines["audit"].endswith("balanced (actors supply 9 eps/s, ...)")
    # The report's steady duty cycle, not the last step's (compilation included).
    assert "duty cycle 0.05: the learner trained 5% of its wall time" in lines["utilization"]
    assert lines["utilization"].endswith("(after its first step, as in the report)")
