"""The multi-host learner on one machine: 2 CPU processes x 4 devices, gloo collectives.

One global ("data", "fsdp") mesh of 8 devices either way: the parameters after N steps on
2 processes equal those of one process with 8 devices; a SIGKILL of either process
stops both, and the restarted pair resumes with every episode accounted exactly once.
Shards are written directly (`tests/unit/learner/test_learner.py`'s helpers); no actors.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from tests.paths import REPO
from tests.runs import (
    PER_STEP,
    checkpoint_steps,
    make_episodes,
    prepare_tiny_run,
    read_ledger_ids,
    write_shards,
)
from tunix_tasks.frontdoor.entrypoints import run_learner
from tunix_tasks.learner.multihost import process_group
from tunix_tasks.storage.layout import RunLayout
from tunix_tasks.storage.store import open_store
from tunix_tasks.storage.weights import load_snapshot, read_latest
from tunix_tasks.testing.gcs_server import free_port

HEARTBEAT_S = 10  # the survivor of a SIGKILL is stopped within about this long


class Pairs:
    """The learner pairs a test starts: `tunix-tasks learner --run URI` in 2 processes of
    4 CPU devices each, wired as on Kubernetes (dags/tunix_k8s.py); logs in `log_dir`."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.started: list[subprocess.Popen] = []
        log_dir.mkdir()

    def start(self, uri: str, max_steps: int | None = None) -> list[subprocess.Popen]:
        port = free_port()  # a fresh one: the last coordinator's may still be in TIME_WAIT
        cmd = [sys.executable, "-m", "tunix_tasks.frontdoor.cli", "learner", "--run", uri]
        cmd += ["--max-steps", str(max_steps)] if max_steps else []
        for pid in range(2):
            env = {
                **os.environ,
                "JAX_PLATFORMS": "cpu",
                "XLA_FLAGS": "--xla_force_host_platform_device_count=4",
                "PYTHONPATH": str(REPO),
                "TUNIX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}",
                "TUNIX_NUM_PROCESSES": "2",
                "TUNIX_PROCESS_ID": str(pid),
                "TUNIX_HEARTBEAT_TIMEOUT_S": str(HEARTBEAT_S),
            }
            with open(self.log_dir / f"p{pid}-{port}.log", "w") as out:  # the child has a copy
                self.started.append(
                    subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=out)
                )
        return self.started[-2:]

    def run(self, uri: str, max_steps: int | None = None) -> None:
        codes = [p.wait(timeout=240) for p in self.start(uri, max_steps)]
        logs = "\n".join(f"--- {p.name}\n{p.read_text()[-2500:]}" for p in self.log_dir.iterdir())
        assert codes == [0, 0], logs

    def close(self) -> None:
        for proc in self.started:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@pytest.fixture
def pairs(tmp_path: Path) -> Iterator[Pairs]:
    pairs = Pairs(tmp_path / "logs")
    yield pairs
    pairs.close()


def test_env_contract():
    assert process_group({}) is None and process_group({"TUNIX_NUM_PROCESSES": "1"}) is None
    group = process_group(
        {
            "TUNIX_COORDINATOR_ADDRESS": "h:8476",
            "TUNIX_NUM_PROCESSES": "2",
            "TUNIX_PROCESS_ID": "1",
        }
    )
    assert group is not None and group.num_processes == 2 and not group.leader
    with pytest.raises(ValueError, match="TUNIX_COORDINATOR_ADDRESS"):
        process_group({"TUNIX_NUM_PROCESSES": "2", "TUNIX_PROCESS_ID": "0"})


@pytest.mark.slow
def test_two_processes_train_as_one(tmp_path, pairs):
    """3 steps on the same shards: 1 process x 8 devices vs 2 processes x 4 devices, the
    latter stopped after step 2 and resumed from its (multi-process) checkpoint."""
    rng = np.random.default_rng(3)
    shards = [make_episodes(rng, PER_STEP) for _ in range(3)]
    uris = {}
    for name in ("one", "two"):
        uris[name] = prepare_tiny_run(str(tmp_path), name=name, max_steps=3, checkpoint_every=2)
        write_shards(open_store(uris[name]), shards)

    t0 = time.monotonic()
    assert run_learner(uris["one"], handle_signals=False)["steps"] == 3
    t_one = time.monotonic() - t0
    pairs.run(uris["two"], max_steps=2)
    pairs.run(uris["two"])
    t_two = time.monotonic() - t0 - t_one

    one, two = open_store(uris["one"]), open_store(uris["two"])
    assert read_latest(two)[0] == read_latest(one)[0] + 1  # the restart republished step 2
    want, _ = load_snapshot(one, read_latest(one)[0])
    got, _ = load_snapshot(two, read_latest(two)[0])
    assert sorted(want) == sorted(got)
    diff = {k: np.abs(got[k] - want[k]) for k in want}
    worst = max(float(d.max()) for d in diff.values())
    rel = max(float(np.max(diff[k] / np.maximum(np.abs(want[k]), 1e-3))) for k in want)
    print(
        f"1 process {t_one:.1f}s, 2 processes (2 runs) {t_two:.1f}s; max abs diff {worst:.2e}, "
        f"max diff relative to max(|w|, 1e-3) {rel:.2e}"
    )
    for k in want:  # summation order differs (gloo vs in-process reductions): ~1 ulp
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=5e-7, err_msg=k)
    initial, _ = load_snapshot(one, 0)
    assert any(not np.array_equal(initial[k], want[k]) for k in want)  # it did train
    assert read_ledger_ids(one) == read_ledger_ids(
        two
    )  # the same episodes, trained in the same steps


def _kill_one(procs: list[subprocess.Popen], victim: int, run_dir: Path, after: int) -> float:
    """SIGKILL `procs[victim]` once a checkpoint after step `after` exists; seconds the
    other one took to exit."""
    deadline = time.monotonic() + 120
    while (checkpoint_steps(run_dir) or [0])[-1] <= after:
        assert time.monotonic() < deadline, "no checkpoint"
        assert all(p.poll() is None for p in procs), "a process ended before the kill"
        time.sleep(0.05)
    procs[victim].send_signal(signal.SIGKILL)
    t0 = time.monotonic()
    procs[victim].wait(timeout=30)  # reaped: a zombie pid would look alive to the lease
    survivor = procs[1 - victim]
    survivor.wait(timeout=60)
    return time.monotonic() - t0


@pytest.mark.slow
def test_sigkill_of_either_process_stops_both_and_resumes_exactly_once(tmp_path, pairs):
    steps = 8
    uri = prepare_tiny_run(
        str(tmp_path),
        max_steps=steps,
        checkpoint_every=2,
        max_staleness=10_000,  # every restart publishes a new version
        lease_ttl_s=300,
        data_timeout_s=60,
    )
    store = open_store(uri)
    rng = np.random.default_rng(5)
    shards = [make_episodes(rng, PER_STEP) for _ in range(steps)]
    write_shards(store, shards)
    written = {ep.episode_id for shard in shards for ep in shard}

    exits = []
    for victim in (1, 0):  # the follower first (found by heartbeat), then the leader
        procs = pairs.start(uri)
        after = (checkpoint_steps(tmp_path / "r") or [0])[-1]
        exits.append(_kill_one(procs, victim, tmp_path / "r", after))
        assert procs[1 - victim].returncode != 0  # it stopped because its peer died
    print(
        f"survivor exit after SIGKILL of the follower / leader: {exits[0]:.1f}s / {exits[1]:.1f}s"
    )
    assert max(exits) < 60

    pairs.run(uri)
    trained, dropped = read_ledger_ids(store)
    accounted = trained + [i for ids in dropped.values() for i in ids]
    assert len(accounted) == len(set(accounted)), "an episode was accounted twice"
    assert set(trained) == written and not dropped
    assert store.exists(RunLayout.DONE) and checkpoint_steps(tmp_path / "r")[-1] == steps
    assert json.loads(store.read_bytes(RunLayout.LEASE))["released"] is True
