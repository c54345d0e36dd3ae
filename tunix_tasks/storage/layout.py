"""`RunLayout`: every key of a run, in one place. Nothing else spells a path.

A run is one folder (or `gs://` prefix); every process opens an `ObjectStore` at its root
and names objects by these keys. The table in `docs/architecture.md` mirrors this class.

    store.write_bytes(RunLayout.CONFIG, cfg.to_json().encode())
    key = RunLayout.shard_key("actor-0003")          # shards/actor-0003/<ms>-<rand>.parquet
    RunLayout.snapshot(42)                           # weights/v00000042
"""

from __future__ import annotations

import time
import uuid


def _stamp(created_at: float | None = None) -> str:
    """`<13-digit ms>-<random>`: unique, sorts by creation time."""
    ms = int((created_at if created_at is not None else time.time()) * 1000)
    return f"{ms:013d}-{uuid.uuid4().hex[:8]}"


class RunLayout:
    """Keys relative to the run root. Pure: no I/O, no state."""

    CONFIG = "config.json"
    DONE = "control/DONE"
    SHARDS = "shards/"
    DEMOS = "demos/"
    QUARANTINE = "quarantine/"
    WEIGHTS = "weights/"
    LATEST = "weights/LATEST"
    LEASE = "learner/LEASE"
    CHECKPOINTS = "learner/checkpoints"
    LEDGER = "learner/ledger/"
    METRICS = "metrics/"
    EVAL = "eval/"
    REPORT = "report/index.html"
    SUMMARY = "report/summary.json"

    @staticmethod
    def shard_key(actor_id: str, created_at: float | None = None) -> str:
        """`shards/<actor>/<created_ms>-<random>.parquet`: sorts by creation time."""
        return f"{RunLayout.SHARDS}{actor_id}/{_stamp(created_at)}.parquet"

    @staticmethod
    def shard_actor(key: str) -> str:
        """The actor folder of a shard key (`shards/<actor>/...`)."""
        return key[len(RunLayout.SHARDS) :].split("/", 1)[0]

    @staticmethod
    def demo_key(index: int) -> str:
        return f"{RunLayout.DEMOS}{index:06d}.parquet"

    @staticmethod
    def quarantined(key: str) -> str:
        return RunLayout.QUARANTINE + key

    @staticmethod
    def quarantine_reason(key: str) -> str:
        return RunLayout.QUARANTINE + key + ".reason.json"

    @staticmethod
    def snapshot(version: int) -> str:
        return f"{RunLayout.WEIGHTS}v{version:08d}"

    @staticmethod
    def ledger(step: int) -> str:
        return f"{RunLayout.LEDGER}{step:010d}.json"

    @staticmethod
    def metrics_chunk(process: str) -> str:
        return f"{RunLayout.METRICS}{process}/{_stamp()}.jsonl"

    @staticmethod
    def eval_result(version: int) -> str:
        return f"{RunLayout.EVAL}v{version:08d}.json"
