"""Small real learner runs for tests: a prepared run on the tiny model, episodes, shards
written in order, and what the learner accounted, read back. Shared by the learner's
and the actor's unit tests and the end-to-end tests (a real store, real shards, the real
learner: no mocks)."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from tunix_tasks.episode import Episode
from tunix_tasks.frontdoor.entrypoints import prepare_run
from tunix_tasks.learner.accounting import read_ledger
from tunix_tasks.learner.learner import Learner
from tunix_tasks.storage.metrics import read_metrics
from tunix_tasks.storage.runs import read_config
from tunix_tasks.storage.shards import ShardWriter
from tunix_tasks.storage.store import ObjectStore
from tunix_tasks.storage.weights import WeightsPublisher
from tunix_tasks.testing.shard_factory import make_episode

EP_LEN = 32  # two episodes per row of the 64 bucket: 16 episodes per step of 8 rows
PER_STEP = 16


def prepare_tiny_run(root: str, name: str = "r", **learner) -> str:
    """A run with the tiny model, buckets (64, 128), 8 rows, 16 episodes a step."""
    lc = {
        "buckets": [64, 128],
        "batch_rows": 8,
        "min_episodes_per_step": PER_STEP,
        "publish_every": 1,
        "checkpoint_every": 1000,
        "data_timeout_s": 60,
        **learner,
    }
    store = root if "://" in root else f"file://{root}"
    return prepare_run({"store": store, "model": {"preset": "tiny"}, "learner": lc}, run_name=name)


def make_episodes(rng, n, *, length=EP_LEN, version=0, group=4, **kw) -> list[Episode]:
    return [
        make_episode(rng, length=length, policy_version=version, group_id=f"g{i // group}", **kw)
        for i in range(n)
    ]


def write_shards(
    store: ObjectStore, shards: list[list[Episode]], actor: str = "actor-0"
) -> list[str]:
    """One shard per list, committed in order (distinct creation-ms names keep the order)."""
    keys = []
    for eps in shards:
        writer = ShardWriter(store, actor_id=actor, max_episodes=len(eps) + 1)
        for e in eps:
            writer.add(e)
        keys.append(writer.close())
        time.sleep(0.003)
    return keys


def prepublish(store: ObjectStore, version: int) -> None:
    """Pretend weights `version` exist already, so the learner starts at version + 1."""
    WeightsPublisher(store).publish(
        {"w": np.zeros(1, np.float32)}, version=version, step=0, model={}
    )


def read_ledger_ids(store: ObjectStore) -> tuple[list[str], dict[str, list[str]]]:
    trained: list[str] = []
    dropped: dict[str, list[str]] = {}
    for entry in read_ledger(store):
        trained += entry["trained"]
        for reason, ids in entry["dropped"].items():
            dropped.setdefault(reason, []).extend(ids)
    return trained, dropped


def step_records(store: ObjectStore) -> list[dict]:
    return [r for r in read_metrics(store, "learner") if "step" in r and "loss" in r]


def learner_of(uri: str, **kw) -> Learner:
    cfg, store = read_config(uri)
    return Learner(cfg, store, **kw)


def checkpoint_steps(run_dir: Path) -> list[int]:
    d = run_dir / "learner" / "checkpoints"
    return sorted(int(p.name) for p in d.iterdir() if p.name.isdigit()) if d.exists() else []
