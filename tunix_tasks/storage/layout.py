"""`RunLayout`: every key of a run, in one place. Nothing else spells a path.

A run is one folder (or `gs://` prefix); every process opens an `ObjectStore` at its root
and names objects by these keys. The table in `docs/architecture.md` mirrors this class.

    store.write_bytes(RunLayout.CONFIG, cfg.to_json().encode())
    key = RunLayout.shard_key("actor-0003")  # shards/actor-0003/<time folders>/<ms>-<rand>.parquet
    RunLayout.snapshot(42)                   # weights/v00000042
"""

from __future__ import annotations

import re
import time
import uuid

# An actor's shards go in nested time folders named by the first 6, 7 and 8 of the 13
# digits of their creation time in ms (~2.8 h, ~17 min, 100 s). A listing from a position
# then reads a few names per level, not the actor's history: a local folder has no seek,
# listing one reads every name in it. At a shard per 5 s a leaf holds ~20 shards, and the
# actor's folder gains one name per 2.8 h (docs/scaling.md).
SHARD_FOLDER_DIGITS = (6, 7, 8)
_STAMP = re.compile(r"\d{13}-")


def _time_folders(name: str) -> str:
    return "".join(f"{name[:d]}/" for d in SHARD_FOLDER_DIGITS)


def _stamp(created_at: float | None = None) -> str:
    """`<13-digit ms>-<random>`: unique, sorts by creation time."""
    ms = int((created_at if created_at is not None else time.time()) * 1000)
    return f"{ms:013d}-{uuid.uuid4().hex[:8]}"


class RunLayout:
    """Keys relative to the run root. Pure: no I/O, no state."""

    CONFIG = "config.json"
    RUN_ID = "run_id"  # this incarnation of the run: written when `prepare` creates it
    DONE = "control/DONE"
    FLEET = "control/fleet.json"  # the autopilot's active fleet: actors above it park
    SHARDS = "shards/"
    DEMOS = "demos/"
    QUARANTINE = "quarantine/"
    WEIGHTS = "weights/"
    LATEST = "weights/LATEST"
    LEASE = "learner/LEASE"
    FLOW = "learner/flow.json"  # the learner's consumption position (flow control)
    CHECKPOINTS = "learner/checkpoints"
    LEDGER = "learner/ledger/"
    METRICS = "metrics/"
    EVAL = "eval/"
    REPORT = "report/index.html"
    LOGS = "logs/"  # `tunix-tasks train`'s process logs, for a run in a local folder
    SUMMARY = "report/summary.json"

    @staticmethod
    def shard_key(actor_id: str, created_at: float | None = None) -> str:
        """`shards/<actor>/<ms[:6]>/<ms[:7]>/<ms[:8]>/<created_ms>-<random>.parquet`: sorts
        by creation time (each folder name is a prefix of the file name). Runs before #16
        wrote `shards/<actor>/<name>`; both are read, and the file name alone orders an
        actor's shards."""
        stamp = _stamp(created_at)
        return f"{RunLayout.SHARDS}{actor_id}/{_time_folders(stamp)}{stamp}.parquet"

    @staticmethod
    def actor_name(index: int) -> str:
        """The id (and shard folder) of the fleet's actor `index`: `actor-0003`."""
        return f"actor-{index:04d}"

    @staticmethod
    def actor_index(actor_id: str) -> int | None:
        """The fleet index of an `actor_name` id; None for another id (an endpoint's)."""
        prefix, _, digits = actor_id.partition("-")
        return int(digits) if prefix == "actor" and digits.isdigit() else None

    @staticmethod
    def shard_actor(key: str) -> str:
        """The actor folder of a shard key (`shards/<actor>/...`)."""
        return key[len(RunLayout.SHARDS) :].split("/", 1)[0]

    @staticmethod
    def shard_list_start(actor_id: str, name: str) -> str | None:
        """A `start_after` for listing every shard of `actor_id` whose file name sorts after
        `name`, in both layouts (None: list the whole folder). For a stamp name that is
        the key the name would have: it precedes every later key in time folders, and
        every flat key `<actor>/<later name>` too (past the common prefix, a digit sorts
        after '/'); a foreign name gets no shortcut."""
        if not _STAMP.match(name):
            return None
        return f"{RunLayout.SHARDS}{actor_id}/{_time_folders(name)}{name}"

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
    def written_once(key: str) -> bool:
        """Whether `key` is one only its writer ever writes (a shard, a metrics chunk:
        named by a time stamp and a random part, `_stamp`), so the same key in another
        incarnation of the run is never that run's own (`storage.runs.RunFence`)."""
        return key.startswith((RunLayout.SHARDS, RunLayout.METRICS))

    @staticmethod
    def eval_result(version: int) -> str:
        return f"{RunLayout.EVAL}v{version:08d}.json"
