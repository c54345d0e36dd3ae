"""The learner as its own process: exactly once across SIGKILLs, and the roles it loads.

Shards are written directly (`tests/runs.py`); the learner runs in a subprocess as
`tunix-tasks learner` would, is killed at random moments and restarted, and its loaded
modules are read back from `sys.modules` there.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from tests.paths import REPO
from tests.runs import (
    PER_STEP,
    checkpoint_steps,
    make_episodes,
    prepare_tiny_run,
    prepublish,
    read_ledger_ids,
    write_shards,
)
from tunix_tasks.frontdoor.entrypoints import prepare_run
from tunix_tasks.storage.layout import RunLayout
from tunix_tasks.storage.shards import ShardWriter
from tunix_tasks.storage.store import open_store
from tunix_tasks.storage.weights import read_latest
from tunix_tasks.testing.shard_factory import make_episode

pytestmark = pytest.mark.slow


def test_exactly_once_across_sigkills(tmp_path):
    """SIGKILL a learner subprocess 3 times at random moments; restart it each time.

    Data: 15 shards, each 32 fresh episodes (policy_version 1000) + 8 stale ones
    (policy_version 0). Weights v1000 are pre-published, so the learner runs at versions
    > 1000: with max_staleness=500 the stale ones are always dropped, the fresh ones are
    always trained, 16 per step, i.e. exactly 30 steps; max_steps=30 ends the final run
    once everything is consumed. The stale rows are shorter, so they sort first in each
    shard and every one of them is read before the last fresh one.

    lease_ttl_s=300: a restart can only take the lease over because the killed pid is
    gone (same host), never by expiry, within this test.
    """
    n_shards, fresh_per, stale_per = 15, 32, 8
    steps = n_shards * fresh_per // PER_STEP
    uri = prepare_tiny_run(
        str(tmp_path),
        checkpoint_every=3,
        max_steps=steps,
        max_staleness=500,
        lease_ttl_s=300,
        data_timeout_s=120,
    )
    store = open_store(uri)
    run_dir = tmp_path / "r"
    prepublish(store, 1000)
    rng = np.random.default_rng(7)
    fresh, stale, shards = set(), set(), []
    for s in range(n_shards):
        f = make_episodes(rng, fresh_per, version=1000)
        st = [
            dataclasses.replace(e, group_id=f"stale{s}")
            for e in make_episodes(rng, stale_per, length=24, version=0)
        ]
        fresh |= {e.episode_id for e in f}
        stale |= {e.episode_id for e in st}
        shards.append(f + st)
    write_shards(store, shards)

    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": "--xla_force_host_platform_device_count=1",
        "PYTHONPATH": str(REPO),
    }
    code = (
        "import json, logging; logging.basicConfig(level=logging.WARNING); "
        "from tunix_tasks.frontdoor.entrypoints import run_learner; "
        f"print('SUMMARY', json.dumps(run_learner({uri!r})))"
    )

    def start() -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, "-c", code],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )

    chooser = random.Random(1234)
    kills, last_step = [], 0
    for _ in range(3):
        proc = start()
        deadline = time.monotonic() + 90
        while proc.poll() is None and time.monotonic() < deadline:
            done = checkpoint_steps(run_dir)
            if done and done[-1] > last_step:  # progress since the last restart
                break
            time.sleep(0.05)
        if proc.poll() is not None:  # finished before we could kill it
            break
        assert time.monotonic() < deadline, "learner made no progress after a restart"
        time.sleep(chooser.uniform(0.0, 0.8))
        if proc.poll() is not None:
            break
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)  # reap it: a zombie pid would still look alive to the lease
        last_step = (checkpoint_steps(run_dir) or [0])[-1]
        kills.append(last_step)
    else:
        proc = start()
    out, _ = proc.communicate(timeout=180)
    assert proc.returncode == 0, out[-3000:]
    summary = json.loads(out.split("SUMMARY ", 1)[1].splitlines()[0])
    print(f"killed after checkpoints {kills}; final run: {summary}")
    assert kills, "the learner finished before it could be killed once"
    assert summary["steps"] == steps and summary["stop_reason"] == "max_steps"

    trained, dropped = read_ledger_ids(store)
    accounted = trained + [i for ids in dropped.values() for i in ids]
    assert len(accounted) == len(set(accounted)), "an episode was accounted twice"
    assert set(trained) == fresh
    assert set(dropped) == {"stale"} and set(dropped["stale"]) == stale
    assert set(accounted) == fresh | stale
    assert store.exists(RunLayout.DONE)
    lease = json.loads(store.read_bytes(RunLayout.LEASE))
    assert lease["released"] is True
    assert read_latest(store)[0] > 1000 + steps  # every restart published a newer version


def test_learner_process_imports_no_environment_or_sandbox(tmp_path):
    """A real learner (warm start on the run's demonstration shards, then RL steps) in its
    own process: afterwards no `tunix_tasks.envs` module is loaded there."""
    from tunix_tasks.storage.layout import RunLayout
    from tunix_tasks.storage.store import open_store

    uri = prepare_run(
        {
            "store": f"file://{tmp_path}",
            "env": {"name": "calculator"},
            "warm_start_steps": 2,
            "learner": {"max_steps": 2, "batch_rows": 8, "min_episodes_per_step": 8},
        },
        run_name="roles",
    )
    store = open_store(uri)
    assert store.list(RunLayout.DEMOS), "prepare writes the demonstration shards"
    writer = ShardWriter(store, actor_id="actor-0000", max_episodes=64)
    rng = np.random.default_rng(0)
    for i in range(32):
        writer.add(make_episode(rng, length=40, group_id=f"g{i // 4}", vocab_size=100))
    writer.close()
    script = (
        "import json, sys\n"
        "from tunix_tasks.frontdoor.entrypoints import run_learner\n"
        f"summary = run_learner({uri!r}, handle_signals=False)\n"
        "mods = sorted(m for m in sys.modules if m.startswith('tunix_tasks'))\n"
        "print(json.dumps({'steps': summary['steps'], 'modules': mods}))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=REPO
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["steps"] == 2
    assert "tunix_tasks.learner.warm_start" in result["modules"]
    leaked = [m for m in result["modules"] if m.startswith("tunix_tasks.envs")]
    assert not leaked, leaked
