"""Supervision by `tunix-tasks train` (frontdoor/launcher.py, frontdoor/supervision.py):
dead actors reported and restarted a bounded number of times, a run with no actor left
stopped, Ctrl-C and SIGHUP stopping a run that resumes, children that die with a SIGKILLed
launcher.

The first tests use real child processes but no training; the others (marked slow) run
the real command on the tiny preset, as `tests/e2e/test_train_e2e.py` does.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.e2e.test_train_e2e import _cmd
from tests.paths import REPO
from tunix_tasks.config import config_from_dict
from tunix_tasks.frontdoor.launcher import FINAL_EXITS
from tunix_tasks.frontdoor.supervision import ActorPool, close_logs, spawn
from tunix_tasks.learner.accounting import read_ledger
from tunix_tasks.storage.layout import RunLayout
from tunix_tasks.storage.metrics import read_metrics
from tunix_tasks.storage.runs import is_done, run_id, write_config
from tunix_tasks.storage.store import open_store

ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "JAX_PLATFORMS": "cpu"}


def _until(pred, what: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def _alive(pid: int) -> bool:
    """Running (a zombie, dead but not yet reaped, counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _catches(pid: int, sig: int) -> bool:
    """Whether process `pid` has a handler installed for `sig`."""
    try:
        with open(f"/proc/{pid}/status") as f:
            caught = next(ln for ln in f if ln.startswith("SigCgt:")).split()[1]
    except (OSError, StopIteration):
        return False
    return bool(int(caught, 16) >> (sig - 1) & 1)


def _children(pid: int) -> dict[int, str]:
    """pid -> command line of the processes whose parent is `pid`."""
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            if ppid == pid:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    out[int(entry)] = f.read().replace(b"\0", b" ").decode()
        except (OSError, ValueError, IndexError):
            continue
    return out


def _steps(run_uri: str) -> list[int]:
    try:
        return [r["step"] for r in read_metrics(open_store(run_uri), "learner") if "loss" in r]
    except Exception:  # not there yet
        return []


# ------------------------------------------------------------------ no training


def test_failed_actors_are_reported_and_restarted_a_bounded_number_of_times(tmp_path):
    """Issue #12.1: each death is reported at once with the end of the actor's log; a
    failed actor is restarted `max_restarts` times, then given up; an actor that exits 0
    (its run is done) is not restarted, nor one fenced off a run created again since it
    was started (exit 3); `failed_for_good` only once none is left."""
    missing = f"file://{tmp_path}/no-such-run"
    cfg = config_from_dict({"store": f"file://{tmp_path}", "run_name": "again"})
    gone = run_id(write_config(cfg))
    shutil.rmtree(tmp_path / "again")
    write_config(cfg)
    replaced = ["actor", "--run", cfg.run_uri, f"--run-id={gone}", "--actor-id", "2"]
    actors = [
        spawn("actor-0000", ["actor", "--run", missing, "--actor-id", "0"], str(tmp_path), ENV),
        spawn("actor-0001", ["--help"], str(tmp_path), ENV),  # exits 0
        spawn("actor-0002", replaced, str(tmp_path), ENV),
    ]
    reports: list[str] = []
    pool = ActorPool(
        actors,
        env=ENV,
        report=reports.append,
        max_restarts=2,
        restart_delay_s=0.2,
        final=FINAL_EXITS,
    )
    try:
        t0 = time.monotonic()
        while not pool.failed_for_good():
            assert time.monotonic() - t0 < 60, reports
            pool.check()
            time.sleep(0.05)
    finally:
        close_logs(actors)
    failed, done, fenced = actors
    assert failed.restarts == 2 and done.restarts == 0 and fenced.restarts == 0
    assert fenced.proc.returncode == 3
    assert [r.split(". Last")[0] for r in reports if r.startswith("actor-0002")] == [
        "actor-0002 exited with code 3; not restarting it: its run was deleted or created "
        "again (fenced off)"
    ]
    assert failed.exit_codes == [2, 2] and failed.proc.returncode == 2  # no config.json
    deaths = [r for r in reports if r.startswith("actor-0000 exited with code 2")]
    assert len(deaths) == 3, reports
    assert "restarting it in 0s (1/2)" in deaths[0] and "(2/2)" in deaths[1]
    assert "not restarting it: 2 restarts used" in deaths[2]
    # The end of the actor's own log, where the reason is.
    assert "no-such-run" in deaths[2] and "  | " in deaths[2]
    assert not any(r.startswith("actor-0001") for r in reports)
    log = (tmp_path / "actor-0000.log").read_text()
    assert log.count("=== launcher: restart") == 2


def test_children_die_with_a_sigkilled_parent(tmp_path):
    """Issue #11.9: a child started by `spawn` gets SIGTERM when the process that started
    it is SIGKILLed (PR_SET_PDEATHSIG), and stops as on Ctrl-C: here an actor waiting for
    its run's first weights."""
    cfg = config_from_dict({"store": f"file://{tmp_path}", "run_name": "orphan"})
    write_config(cfg)
    script = textwrap.dedent(
        f"""
        import time
        from tunix_tasks.frontdoor.supervision import spawn
        c = spawn("actor-0000", ["actor", "--run", {cfg.run_uri!r}, "--actor-id", "0"],
                  {str(tmp_path)!r}, None)
        print(c.proc.pid, flush=True)
        time.sleep(600)
        """
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", script], cwd=REPO, env=ENV, stdout=subprocess.PIPE, text=True
    )
    try:
        child = int(parent.stdout.readline())
        log = tmp_path / "actor-0000.log"
        # Started for real: the model built, its SIGTERM handler installed, polling weights.
        _until(lambda: _catches(child, signal.SIGTERM), "the actor up", 120)
        time.sleep(1.0)
        assert _alive(child)
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        _until(lambda: not _alive(child), "the orphaned child to exit", 15)
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
    assert "stopping: SIGTERM" in log.read_text(errors="replace")


# ------------------------------------------------------------------ real runs (slow)


@pytest.mark.slow
def test_dead_actors_stop_the_run(tmp_path):
    """Issue #12.1: actors that keep crashing (here: an environment that cannot be built)
    are restarted, then given up; with none left the launcher stops the learner (it
    checkpoints) and returns at once with a clear `failed`, instead of idling until the
    learner's `data_timeout_s`."""
    script = textwrap.dedent(
        f"""
        import json, logging
        logging.basicConfig(level=logging.INFO)
        from tunix_tasks.config import load_config
        from tunix_tasks.frontdoor.launcher import train_local
        cfg = load_config(None, {_overrides(tmp_path)!r})
        summary = train_local(cfg, quiet=True, report=False, max_restarts=1,
                              restart_delay_s=0.5, log_dir={str(tmp_path / "logs")!r})
        print("SUMMARY " + json.dumps(summary, default=str), flush=True)
        """
    )
    t0 = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-c", script],
        cwd=tmp_path,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )
    wall = time.monotonic() - t0
    assert out.returncode == 0, out.stderr[-3000:]
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("SUMMARY "))
    summary = json.loads(line[8:])
    assert summary["failed"].startswith("all 2 actors died"), summary
    assert summary["interrupted"] == "actors dead" and summary["learner_exit_code"] == 0
    assert summary["actor_restarts"] == {"actor-0000": 1, "actor-0001": 1}
    assert wall < 240  # the learner's data_timeout_s is 600
    err = out.stderr
    assert re.search(r"actor-0000 exited with code 1; restarting it in 0s \(1/1\)", err), err
    assert "actor-0001 exited with code 1; not restarting it" in err
    assert "TypeError" in err and "no_such_option" in err  # the tail of the actor's log
    assert "all 2 actors died" in err and "stopping learner (checkpoint)" in err
    assert is_done(open_store(summary["run_uri"])) is None  # resumable, not finished


def test_a_run_created_again_under_train_stops_it_with_exit_3(tmp_path):
    """The run `train` prepared is deleted and created again (another `train`, a DAG run)
    while it trains: its actors stop at their next write (or are stopped by `train`, should
    the learner be fenced first) and write nothing into the new run, none is restarted,
    its learner is fenced off at its next write or by its lease, and `train` exits 3
    naming what happened (not "run it again to resume", which would join the new run)."""
    cmd = _cmd(str(tmp_path / "runs"), "again", "learner.max_steps=100000")
    proc = subprocess.Popen(
        cmd, cwd=tmp_path, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    run = tmp_path / "runs" / "again"
    try:
        _until(lambda: any(run.rglob("shards/**/*.parquet")), "a shard of the first run", 240)
        os.rename(run, tmp_path / "runs" / "again-deleted")
        new = write_config(config_from_dict({"store": str(tmp_path / "runs"), "run_name": "again"}))
        out, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 3, err[-3000:]
    assert f"created again (run_id {run_id(new)})" in err.strip().splitlines()[-1], err[-3000:]
    summary = json.loads(out[out.index("\n{") + 1 :])
    assert summary["actor_restarts"] == {}
    assert set(summary["actor_exit_codes"]) == {3}, (summary, err[-3000:])
    # 3: its fence or lease (or a save cut off by the deletion) stopped it; 0: stopped by
    # `train` before it had a step to checkpoint. Never a storage failure (5, seen in CI).
    assert summary["learner_exit_code"] in (0, 3) and "report" not in summary
    assert [i.key for i in new.list("shards/")] == [] and not new.exists(RunLayout.DONE)


def _overrides(tmp_path: Path) -> list[str]:
    return [
        f"store={tmp_path}/runs",
        "run_name=dead",
        "model.preset=tiny",
        "env.name=calculator",
        "env.kwargs.no_such_option=1",  # every actor fails building its environments
        "actor.num_actors=2",
        "learner.buckets=[64,128]",
        "learner.batch_rows=8",
        "learner.min_episodes_per_step=8",
        "learner.max_steps=5",
    ]


@pytest.mark.slow
def test_signals_stop_cleanly_the_run_resumes_and_a_killed_actor_is_restarted(tmp_path):
    """One run, four launches of the same command. Issue #11.9: Ctrl-C (SIGINT) stops the
    run: exit 130, the learner checkpointed, not DONE. The same command resumes it from
    that checkpoint; SIGHUP (the terminal closed) stops it the same way; resumed again, a
    SIGKILL of the launcher takes its learner and actors with it within seconds. Issue
    #12.1: in the last launch an actor is SIGKILLed (as by the OOM killer): it is reported
    and restarted, and the run finishes normally with every episode trained once."""
    cmd = _cmd(
        str(tmp_path / "runs"), "stops", "learner.max_steps=40", "learner.checkpoint_every=3"
    )
    run_uri = f"file://{tmp_path}/runs/stops"

    def stop_at(step: int, sig: signal.Signals) -> tuple[dict, str, dict[int, str]]:
        """Start the command, send `sig` once the learner passed `step`; its summary,
        stderr and the children it had."""
        proc = subprocess.Popen(
            cmd, cwd=tmp_path, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        try:
            _until(lambda: max(_steps(run_uri), default=0) > step, f"step {step + 1}", 300)
            children = _children(proc.pid)
            assert len(children) == 3, children
            proc.send_signal(sig)
            out, err = proc.communicate(timeout=180)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
        assert proc.returncode == 130, out[-2000:] + err[-2000:]
        assert not any(_alive(p) for p in children)
        summary = json.loads(out[out.index("\n{") + 1 :])
        assert summary["interrupted"] == sig.name and summary["learner_exit_code"] == 0
        assert is_done(open_store(run_uri)) is None, "an interrupted run must not be DONE"
        return summary, err, children

    first, _, _ = stop_at(3, signal.SIGINT)
    stopped_at = first["last_step"]["step"]
    logs = Path(first["logs"])
    assert "stopping: SIGTERM" in (logs / "actor-0000.log").read_text()
    resumed = re.search(r"resumed\b.*\bat step (\d+)", (logs / "learner.log").read_text())
    assert resumed is None, "the first run starts fresh"

    second, err, _ = stop_at(stopped_at + 1, signal.SIGHUP)
    assert "SIGHUP: stopping learner (checkpoint)" in err
    resumed = re.search(r"resumed\b.*\bat step (\d+)", (logs / "learner.log").read_text())
    assert resumed and 3 <= int(resumed.group(1)) <= stopped_at

    # Resume again, then SIGKILL the launcher: its children must not outlive it.
    proc = subprocess.Popen(
        cmd, cwd=tmp_path, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        again = second["last_step"]["step"] + 1
        _until(lambda: max(_steps(run_uri), default=0) > again, "resumed steps", 300)
        children = _children(proc.pid)
        assert len(children) == 3, children
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        t0 = time.monotonic()
        _until(lambda: not any(_alive(p) for p in children), "children to exit", 30)
        print(f"children gone {time.monotonic() - t0:.1f}s after the launcher's SIGKILL")
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()

    # The last launch: an actor SIGKILLed mid-run is restarted and the run still finishes.
    # It runs longer (max_steps may change on resume): the restart comes 5 s after the kill,
    # and 24 more tiny steps took only ~6 s, so the run could end before the restart was due
    # (50 more with one actor take ~15 s; the restarted actor joined ~20 steps in).
    last_cmd = _cmd(
        str(tmp_path / "runs"), "stops", "learner.max_steps=60", "learner.checkpoint_every=3"
    )
    proc = subprocess.Popen(
        last_cmd, cwd=tmp_path, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        again = max(_steps(run_uri)) + 1
        _until(lambda: max(_steps(run_uri), default=0) > again, "resumed steps", 300)
        victim = next(p for p, c in _children(proc.pid).items() if "--actor-id 1" in c)
        os.kill(victim, signal.SIGKILL)
        out, err = proc.communicate(timeout=400)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err[-3000:]
    summary = json.loads(out[out.index("\n{") + 1 :])
    assert summary["actor_restarts"] == {"actor-0001": 1}
    assert summary["actor_exit_codes"] == [0, 0] and summary["last_step"]["step"] == 60
    assert "actor-0001 killed by SIGKILL; restarting it in 5s (1/3)" in err
    steps = [r["step"] for r in read_metrics(open_store(run_uri), "learner") if "loss" in r]
    assert max(steps) == 60
    trained = [i for e in read_ledger(open_store(run_uri)) for i in e["trained"]]
    assert len(trained) == len(set(trained)) > 0
