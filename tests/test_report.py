"""The run report from a crafted metrics history: steps redone after a crash count once."""

from __future__ import annotations

import json

import pytest

from tunix_tasks.config import config_from_dict
from tunix_tasks.frontdoor.report import summarize, write_report
from tunix_tasks.storage.layout import RunLayout
from tunix_tasks.storage.runs import write_config

T0 = 1_700_000_000.0  # seconds since the epoch


def _record(step: int, t: float, attempt: str) -> dict:
    """A learner step record; `real_tokens` and `reward_mean` tell the attempts apart."""
    offset = {"a": 0, "b": 5, "c": 9}[attempt]
    return {
        "time": t,
        "process": "learner",
        "step": step,
        "version": step // 2,
        "loss": 0.1,
        "reward_mean": step / 10 + offset / 100,
        "real_tokens": 100 * step + offset,
        "step_s": 0.5,
        "duty_cycle": 0.8,
        "buffer": 4,
        "backlog_shards": 1,
        "compile_count": 2,
        "staleness": {"0": 8},
        "dropped": {},
        "attempt": attempt,
    }


def _write_chunk(store, records: list[dict]) -> None:
    ms = int(records[0]["time"] * 1000)
    key = f"{RunLayout.METRICS}learner/{ms:013d}-{records[0]['attempt']}.jsonl"
    store.write_bytes(key, "".join(json.dumps(r) + "\n" for r in records).encode())


@pytest.fixture
def crashed_run(tmp_path):
    """Three learner attempts of one run:
    a: logs steps 1-6, then crashes (checkpoint at step 4);
    b: restores step 4, redoes 5 and 6, logs up to 8, runs on to 10 (checkpoint at 10)
       and crashes before its metrics of steps 9 and 10 are flushed;
    c: restores step 10 and logs 11 and 12.
    """
    cfg = config_from_dict({"store": str(tmp_path), "run_name": "crashed"})
    store = write_config(cfg)
    a = [_record(s, T0 + s, "a") for s in range(1, 7)]
    b = [_record(s, T0 + 100 + s, "b") for s in range(5, 9)]
    c = [_record(s, T0 + 200 + s, "c") for s in (11, 12)]
    for chunk in (a[:3], a[3:], b[:2], b[2:], c):
        _write_chunk(store, chunk)
    return store, {r["step"]: r for r in a + b + c}  # later attempts overwrite: survivors


def test_redone_steps_count_once_keeping_the_surviving_attempt(crashed_run):
    store, survivors = crashed_run
    s = summarize(store)
    assert s["steps"] == 12
    assert s["steps_redone"] == 2  # 5 and 6: logged by attempt a, redone by b
    assert s["steps_without_metrics"] == 2  # 9 and 10: run by b, metrics never flushed
    # Tokens: once per step, from the record of the attempt that survived.
    assert s["trained_tokens"] == sum(r["real_tokens"] for r in survivors.values())
    assert s["trained_tokens"] == 100 * sum(survivors) + 5 * 4 + 9 * 2
    # The staleness histogram counts each step's episodes once too.
    assert s["staleness_histogram"] == {"0": 8 * len(survivors)}
    assert s["reward_last"] == pytest.approx(survivors[12]["reward_mean"])


def test_report_of_a_crashed_run_is_written(crashed_run):
    store, _ = crashed_run
    uri = write_report(store.uri)
    assert uri.endswith(RunLayout.REPORT)
    summary = json.loads(store.read_bytes(RunLayout.SUMMARY))
    assert (summary["steps_redone"], summary["steps_without_metrics"]) == (2, 2)
    assert "steps_redone" in store.read_bytes(RunLayout.REPORT).decode()


def test_learner_steps_keep_the_last_record_per_step():
    from tunix_tasks.frontdoor.report import _learner_steps

    records = [_record(1, T0 + 1, "a"), _record(2, T0 + 2, "a"), _record(2, T0 + 9, "b")]
    records.append({"time": T0 + 3, "process": "learner", "warm_start_step": 3, "nll": 1.0})
    records.append({"time": T0 + 4, "process": "actor/actor-0000", "episodes": 8})
    steps = _learner_steps(records)
    assert [(r["step"], r["attempt"]) for r in steps] == [(1, "a"), (2, "b")]
