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
    from tunix_tasks.frontdoor.audit import learner_steps

    records = [_record(1, T0 + 1, "a"), _record(2, T0 + 2, "a"), _record(2, T0 + 9, "b")]
    records.append({"time": T0 + 3, "process": "learner", "warm_start_step": 3, "nll": 1.0})
    records.append({"time": T0 + 4, "process": "actor/actor-0000", "episodes": 8})
    steps = learner_steps(records)
    assert [(r["step"], r["attempt"]) for r in steps] == [(1, "a"), (2, "b")]


# -- latency audit, versions, times, crashes, baselines (issue #12) ---------------------------
def _run(tmp_path, name: str, *, mode: str = "async", step_s: float = 0.5, crash: bool = False):
    """A run with 10 learner steps (one every 2 s) and two actors (records every 5 s); the
    learner published v6 after its last step record (v5). `crash`: the learner's records
    stop at step 10 while the actors go on for 60 s, and no DONE is written."""
    from tunix_tasks.storage.runs import mark_done

    cfg = config_from_dict(
        {"store": str(tmp_path), "run_name": name, "mode": mode, "actor": {"num_actors": 2}}
    )
    store = write_config(cfg)
    steps = []
    for s in range(1, 11):
        r = _record(s, T0 + 2 * s, "a")
        r.update(version=s // 2, episodes=8, step_s=step_s, duty_cycle=0.123456789)
        steps.append(r)
    _write_chunk(store, steps)
    end = 80 if crash else 20
    for a in ("actor-0000", "actor-0001"):
        recs = [
            {
                "time": T0 + 5 * i,
                "process": f"actor/{a}",
                "episodes": 10 * i,
                "episodes_per_s": 2.0 if i else None,
                "env_step_p50_s": 0.5,
                "env_step_p99_s": 0.9,
                "policy_latency_p50_s": 0.02,
                "weights_version": 3,
                "final": i * 5 == end,
            }
            for i in range(end // 5 + 1)
        ]
        key = f"{RunLayout.METRICS}actor/{a}/{int(T0 * 1000):013d}-x.jsonl"
        store.write_bytes(key, "".join(json.dumps(r) + "\n" for r in recs).encode())
    pointer = {"version": 6, "path": "weights/v00000006", "step": 10}
    store.write_if_generation(RunLayout.LATEST, json.dumps(pointer).encode(), 0)
    if not crash:
        mark_done(store, "learner max_steps at step 10")
    return store


def test_summary_has_the_latency_audit_and_the_version_latest_names(tmp_path):
    store = _run(tmp_path, "ok")
    s = summarize(store)
    assert s["version"] == 6  # weights/LATEST, not the last step record's 5
    assert s["version_last_step_record"] == 5
    audit = s["latency_audit"]
    # 8 episodes per 0.5 s step = 16 eps/s; two actors at 2 eps/s = 4 eps/s.
    assert audit["learner_capacity_eps_per_s"] == pytest.approx(16.0)
    assert audit["actor_supply_eps_per_s"] == pytest.approx(4.0)
    assert audit["bottleneck"] == "actors"
    assert (audit["suggest_envs_per_actor"], audit["suggest_num_actors"]) == (32, 8)
    assert "actor-bound" in s["duty_cycle_explained"]
    assert s["duty_cycle"] == 0.1235  # rounded, not 16 digits
    assert s["started_utc"] == "2023-11-14T22:13:20+00:00"
    assert s["done"]["time"].endswith("+00:00")  # ISO UTC, not epoch seconds
    assert s["health"]["finished"] and s["health"]["stopped_early"] == []
    # Finished: actors that go on flushing long after the learner's end are fine...
    late = {"time": T0 + 200, "process": "actor/actor-0000", "episodes": 99, "final": True}
    key = f"{RunLayout.METRICS}actor/actor-0000/{int((T0 + 200) * 1000):013d}-y.jsonl"
    store.write_bytes(key, (json.dumps(late) + "\n").encode())
    assert summarize(store)["health"]["stopped_early"] == []
    # ... but one whose records stopped well before the learner's last step did stop early.
    early = {"time": T0 - 60, "process": "actor/actor-0009", "episodes": 1, "final": False}
    key = f"{RunLayout.METRICS}actor/actor-0009/{int((T0 - 60) * 1000):013d}-z.jsonl"
    store.write_bytes(key, (json.dumps(early) + "\n").encode())
    assert summarize(store)["health"]["stopped_early"] == ["actor/actor-0009"]


def test_report_html_and_summary_json_are_readable(tmp_path, monkeypatch):
    from tunix_tasks.frontdoor import plots

    ylabels: list[str] = []
    real_png = plots._figure_png
    monkeypatch.setattr(
        plots, "_figure_png", lambda fig: ylabels.append(fig.axes[0].get_ylabel()) or real_png(fig)
    )
    store = _run(tmp_path, "ok")
    write_report(store.uri)
    assert len(ylabels) >= 6 and all(ylabels)  # every plot has a y-axis label
    page = store.read_bytes(RunLayout.REPORT).decode()
    summary_text = store.read_bytes(RunLayout.SUMMARY).decode()
    for text in (page, summary_text):
        assert "0.123456789" not in text and "17000000" not in text  # no raw floats, no epochs
        assert "actor-bound" in text
    assert "Utilization" in page and "waited for data" in page
    assert "seconds since the run's first metrics record" in page
    assert "No step trained fresh tokens" in page  # no mismatch metrics
    assert "No episodes in the run" in page  # what the model wrote: no shards


def test_report_sections_are_tables_not_json(tmp_path):
    """Issue #31.9: the Summary and Actors sections were raw JSON dumps, and each plot
    repeated its title (already in the image) as a caption."""
    store = _run(tmp_path, "ok")
    write_report(store.uri)
    page = store.read_bytes(RunLayout.REPORT).decode()
    assert "{&quot;" not in page and "<pre>" not in page and "<figcaption>" not in page
    actors = page[page.index("<h2>Actors</h2>") :]
    assert "<th>actor</th><th>episodes</th>" in actors
    assert "<td>actor/actor-0000</td><td>40</td><td>0.5</td><td>0.9</td><td>3</td>" in actors
    summary = page[page.index("<h2>Summary</h2>") : page.index("<h2>Utilization</h2>")]
    assert "<th>staleness_histogram</th><td>0: 80</td>" in summary
    assert "<th>done</th><td>reason: learner max_steps at step 10, time: 20" in summary
    assert "<th>evaluations</th><td>-</td>" in summary  # none
    # The learner logs no `final` record: its cell is empty, the columns stay aligned.
    processes = page[page.index("<h2>Processes</h2>") : page.index("<h2>Sampler")]
    assert "<th>final</th></tr>" in processes and "<td>learner</td>" in processes
    assert processes.count("<td>") == 3 * 5


@pytest.mark.filterwarnings("ignore:model.dtype=bfloat16")  # the expected ConfigWarning
def test_report_shows_the_sampler_learner_mismatch(tmp_path):
    """Mean approx_kl_s0 and the largest max_abs_logprob_diff_s0 over the steps that had
    fresh tokens (steps without them carry neither), with the dtypes and the why."""
    cfg = config_from_dict(
        {"store": str(tmp_path), "run_name": "bf16", "model": {"dtype": "bfloat16"}}
    )
    store = write_config(cfg)
    steps = [_record(s, T0 + s, "a") for s in range(1, 5)]
    for r, kl, diff in zip(steps, (1e-3, 3e-3, None, 2e-3), (0.25, 0.5, None, 0.125), strict=True):
        if kl is not None:
            r.update(approx_kl_s0=kl, max_abs_logprob_diff_s0=diff, tokens_s0=8)
    _write_chunk(store, steps)
    write_report(store.uri)
    m = json.loads(store.read_bytes(RunLayout.SUMMARY))["sampler_mismatch"]
    assert m["approx_kl_s0_mean"] == pytest.approx(2e-3)
    assert m["max_abs_logprob_diff_s0_max"] == 0.5
    assert (m["model_dtype"], m["learner_compute_dtype"]) == ("bfloat16", "float32")
    assert m["steps_with_fresh_tokens"] == 3
    page = store.read_bytes(RunLayout.REPORT).decode()
    assert "Sampler vs learner numerics" in page and "what bf16 costs" in page
    assert "approx_kl_s0_mean" in page and "0.002" in page and "0.5" in page


def test_report_of_a_crashed_run_says_which_process_died_and_why(tmp_path):
    store = _run(tmp_path, "dead", crash=True)
    logs = tmp_path / "_logs" / "dead"
    logs.mkdir(parents=True)
    (logs / "learner.log").write_text(
        "step 10\nTraceback (most recent call last):\nOSError: disk full\n"
    )
    (logs / "actor-0000.log").write_text("fine\n")
    write_report(store.uri)
    h = json.loads(store.read_bytes(RunLayout.SUMMARY))["health"]
    assert not h["finished"] and h["done_reason"] is None
    assert h["stopped_early"] == ["learner"]
    assert h["processes"]["learner"]["last_s"] == 20 and h["processes"]["learner"]["records"] == 10
    assert h["log_tails"]["learner"][-1] == "OSError: disk full"
    page = store.read_bytes(RunLayout.REPORT).decode()
    assert "did not finish" in page and "Metrics stopped early: learner" in page
    assert "OSError: disk full" in page
    from tunix_tasks.storage.runs import mark_done

    mark_done(store, "learner exited with code 1")  # what the launcher writes after a crash
    h = summarize(store)["health"]
    assert not h["finished"] and h["done_reason"] == "learner exited with code 1"


def test_report_compares_with_the_sync_baseline(tmp_path):
    from tunix_tasks.frontdoor.cli import main

    run = _run(tmp_path, "demo")
    _run(tmp_path, "demo-sync", mode="sync", step_s=0.25)
    write_report(run.uri)  # the sibling <run>-sync is found by itself
    base = json.loads(run.read_bytes(RunLayout.SUMMARY))["baseline"]
    assert base["run_uri"].endswith("demo-sync")
    rows = {r["metric"]: r for r in base["comparison"]}
    assert rows["learner steps"]["run"] == rows["learner steps"]["baseline"] == 10
    assert rows["real tokens trained / s"]["run_over_baseline"] == pytest.approx(1.0, rel=0.2)
    assert "Against the baseline" in run.read_bytes(RunLayout.REPORT).decode()
    other = _run(tmp_path, "other")
    assert main(["report", other.uri, "--baseline", run.uri]) == 0
    compared = json.loads(other.read_bytes(RunLayout.SUMMARY))["baseline"]
    assert compared["run_uri"].endswith("/demo")


def test_report_reads_the_logs_of_a_crashed_run_in_its_folder(tmp_path):
    """`train` writes its process logs in `<run>/logs/` (issue #30.12); the report finds
    them there."""
    store = _run(tmp_path, "dead", crash=True)
    logs = store.local_path() / "logs"
    logs.mkdir()
    (logs / "learner.log").write_text("Traceback (most recent call last):\nMemoryError\n")
    write_report(store.uri)
    h = json.loads(store.read_bytes(RunLayout.SUMMARY))["health"]
    assert h["log_tails"]["learner"][-1] == "MemoryError"


def test_report_shows_the_stale_drop_bias(tmp_path):
    """The last step record's cumulative `drop_bias` (stale drops 1.8x longer than the
    trained episodes, with more turns and lower rewards) reaches summary.json, a section
    with the hint and each side's figures, and a plot; a run without stale drops says so."""
    from tunix_tasks.learner import drop_bias

    store = _run(tmp_path, "biased")
    trained = drop_bias.add(drop_bias.empty(), [100] * 200, [2] * 200, [0.0, 1.0] * 100)
    stale = drop_bias.add(drop_bias.empty(), [180] * 40, [4] * 40, [0.0] * 40)
    last = _record(11, T0 + 30, "a")
    last.update(drop_bias={"trained": trained, "stale": stale}, dropped={"stale": 40})
    _write_chunk(store, [last])
    write_report(store.uri)
    got = json.loads(store.read_bytes(RunLayout.SUMMARY))["stale_drop_bias"]
    hint = "stale drops vs trained: 1.8x longer, 2.0x more turns, reward 0.00 vs 0.50"
    assert got["hint"] == hint
    assert got["length_ratio"] == pytest.approx(1.8) and got["stale_share"] == pytest.approx(
        1 / 6, abs=1e-4
    )
    sides = {s["side"]: s for s in got["by_side"]}
    assert (sides["trained"]["episodes"], sides["stale"]["episodes"]) == (200, 40)
    assert sides["stale"]["length_mean"] == 180 and sides["trained"]["reward_mean"] == 0.5
    page = store.read_bytes(RunLayout.REPORT).decode()
    section = page[page.index("<h2>Stale drops vs trained") : page.index("<h2>Plots")]
    assert "stale drops vs trained: 1.8x longer" in section
    assert "<td>stale</td><td>40</td><td>180.0</td><td>0.0</td><td>180.0</td>" in section
    assert 'alt="Length of trained vs stale-dropped episodes"' in page

    none = _run(tmp_path, "fresh")  # the learner records no drop_bias without stale drops
    write_report(none.uri)
    assert json.loads(none.read_bytes(RunLayout.SUMMARY))["stale_drop_bias"] is None
    page = none.read_bytes(RunLayout.REPORT).decode()
    assert "No episode was dropped as stale." in page
    assert "Length of trained vs stale-dropped" not in page
