"""The plug-in environment of docs/environments.md, installed and trained as a user would.

examples/plugin_env is installed into a temporary virtual environment, as its own
package: `pip install --no-deps --no-build-isolation`. The project's dependencies live
in the project's venv, not in the base interpreter, so `--system-site-packages` would not
show them; a `.pth` line adds the project's site-packages (with its editable tunix_tasks)
instead. Then `tunix-tasks train` runs in that venv: config validation must find `reverse`
among the `tunix_tasks.envs` entry points, prepare plays its demonstrations, and one actor
plays it for a few learner steps.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.paths import REPO
from tunix_tasks.storage.runs import is_done
from tunix_tasks.storage.store import open_store
from tunix_tasks.storage.tensorboard import read_scalars

pytestmark = pytest.mark.slow


def _venv_with_plugin(tmp_path: Path) -> Path:
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    python = venv / "bin" / "python"
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    project_site = sysconfig.get_paths()["purelib"]
    Path(purelib, "tunix_project.pth").write_text(
        f"import site; site.addsitedir({project_site!r})\n"
    )
    source = tmp_path / "plugin_env"  # a copy: building leaves build/ and *.egg-info
    # without what a test beside this one may be writing there (bytecode of a docs test)
    ignore = shutil.ignore_patterns("__pycache__", "build", "*.egg-info")
    shutil.copytree(REPO / "examples" / "plugin_env", source, ignore=ignore)
    out = subprocess.run(
        [str(python), "-m", "pip", "install", "--no-deps", "--no-build-isolation", str(source)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return python


def test_plugin_env_installs_and_trains(tmp_path):
    python = _venv_with_plugin(tmp_path)
    probe = subprocess.run(
        [str(python), "-c", "from tunix_tasks.envs import available_envs; print(available_envs())"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert "'reverse'" in probe.stdout, probe.stdout + probe.stderr

    cmd = [str(python), "-m", "tunix_tasks.frontdoor.cli", "train", "--quiet", "--json"]
    cmd += ["--config", str(REPO / "examples" / "plugin_env" / "reverse.yaml")]
    cmd += ["--store", str(tmp_path / "runs"), "--run-name", "plugin"]
    for item in (
        "warm_start_steps=10",
        "learner.max_steps=5",
        "learner.checkpoint_every=5",
        "actor.envs_per_actor=8",
        "actor.episodes_per_shard=8",
    ):
        cmd += ["--set", item]
    out = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    summary = json.loads(out.stdout[out.stdout.index("\n{") + 1 :])
    assert summary["learner_exit_code"] == 0 and summary["actor_exit_codes"] == [0]
    assert summary["last_step"]["step"] == 5

    store = open_store(summary["run_uri"])
    assert is_done(store)
    shards = [i.key for i in store.list("shards/") if i.key.endswith(".parquet")]
    demos = [i.key for i in store.list("demos/") if i.key.endswith(".parquet")]
    assert shards and demos
    for key in (shards[0], demos[0]):
        table = pq.read_table(pa.BufferReader(store.read_bytes(key)))
        assert set(table.column("env").to_pylist()) == {"reverse"}, key
    learner = read_scalars(store, "learner")  # TensorBoard files beside the metrics
    assert [s for s, _ in learner["reward_mean"]] == [1, 2, 3, 4, 5]
    assert len(learner["warm_start/nll"]) == 10
    assert read_scalars(store, "actor/actor-0000")["episodes"]
