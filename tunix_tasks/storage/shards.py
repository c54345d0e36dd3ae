"""Trajectory shards, format v1: the contract between actors and the learner.

A shard is one Parquet file with one row per episode, rows sorted by `length`, small row
groups, and key-value metadata (`tunix.schema_version`, `tunix.length_histogram`, ...).
Anyone can read one with `pyarrow.parquet.read_table(path)`.

Actors append episodes to a `ShardWriter`, which commits a shard atomically every N
episodes or T seconds. The learner follows new shards with a `ShardStream`, which
yields episodes and remembers which ones were acknowledged (trained or dropped), so its
state can go into a checkpoint:

    stream = ShardStream(store, vocab_size=tok.vocab_size)
    stream.set_state(checkpoint["stream"])        # resume
    for item in stream.poll():                     # episodes of newly complete shards
        ...train or drop item.episode...
        stream.ack(item.shard, [item.row])
    checkpoint["stream"] = stream.get_state()
"""

from __future__ import annotations

import io
import json
import logging
import time
import uuid
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from tunix_tasks.storage.store import ObjectStore

log = logging.getLogger(__name__)

SCHEMA_VERSION = 1
SHARDS_PREFIX = "shards/"
STATUSES = ("ok", "truncated", "env_error")
HISTOGRAM_EDGES = (0, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
ROW_GROUP_ROWS = 256

SHARD_SCHEMA = pa.schema(
    [
        pa.field("episode_id", pa.string(), nullable=False),
        pa.field("actor_id", pa.string(), nullable=False),
        pa.field("env", pa.string(), nullable=False),
        pa.field("group_id", pa.string(), nullable=False),
        pa.field("seed", pa.int64(), nullable=False),
        pa.field("policy_version", pa.int64(), nullable=False),
        pa.field("tokens", pa.list_(pa.int32()), nullable=False),
        pa.field("loss_mask", pa.list_(pa.int8()), nullable=False),
        pa.field("behavior_logprobs", pa.list_(pa.float32()), nullable=False),
        pa.field("reward", pa.float32(), nullable=False),
        pa.field("num_turns", pa.int32(), nullable=False),
        pa.field("length", pa.int32(), nullable=False),
        pa.field("status", pa.string(), nullable=False),
        pa.field("created_at", pa.timestamp("ms", tz="UTC"), nullable=False),
    ]
)


@dataclass(slots=True)
class Episode:
    """One finished episode as the actor records it (one shard row)."""

    episode_id: str
    actor_id: str
    env: str
    group_id: str
    seed: int
    policy_version: int
    tokens: np.ndarray  # int32 [length]
    loss_mask: np.ndarray  # int8 [length], 1 on policy-generated tokens
    behavior_logprobs: np.ndarray  # float32 [length], 0 where loss_mask is 0
    reward: float
    num_turns: int
    status: str = "ok"
    created_at: float = field(default_factory=time.time)

    @property
    def length(self) -> int:
        return len(self.tokens)


def length_histogram(lengths: Iterable[int]) -> dict[str, list[int]]:
    lengths = np.asarray(list(lengths), dtype=np.int64)
    edges = list(HISTOGRAM_EDGES)
    if lengths.size and lengths.max() >= edges[-1]:
        edges.append(int(lengths.max()) + 1)
    counts, _ = np.histogram(lengths, bins=edges)
    return {"edges": edges, "counts": counts.tolist()}


def episodes_to_table(episodes: Sequence[Episode]) -> pa.Table:
    """Rows sorted by length (ties by episode_id, so the file is deterministic)."""
    eps = sorted(episodes, key=lambda e: (e.length, e.episode_id))
    columns: dict[str, Any] = {
        "episode_id": [e.episode_id for e in eps],
        "actor_id": [e.actor_id for e in eps],
        "env": [e.env for e in eps],
        "group_id": [e.group_id for e in eps],
        "seed": [int(e.seed) for e in eps],
        "policy_version": [int(e.policy_version) for e in eps],
        "tokens": _list_array([e.tokens for e in eps], pa.int32()),
        "loss_mask": _list_array([e.loss_mask for e in eps], pa.int8()),
        "behavior_logprobs": _list_array([e.behavior_logprobs for e in eps], pa.float32()),
        "reward": [float(e.reward) for e in eps],
        "num_turns": [int(e.num_turns) for e in eps],
        "length": [e.length for e in eps],
        "status": [e.status for e in eps],
        "created_at": [int(e.created_at * 1000) for e in eps],
    }
    return pa.table(columns, schema=SHARD_SCHEMA)


def _list_array(values: Sequence[np.ndarray], value_type: pa.DataType) -> pa.ListArray:
    lengths = np.fromiter((len(v) for v in values), dtype=np.int32, count=len(values))
    offsets = np.zeros(len(values) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    flat = (np.concatenate([np.asarray(v) for v in values]) if values else np.zeros(0)).astype(
        value_type.to_pandas_dtype(), copy=False
    )
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat, type=value_type))


def table_to_parquet_bytes(
    table: pa.Table, *, extra_metadata: dict[str, str] | None = None
) -> bytes:
    meta = {
        "tunix.schema_version": str(SCHEMA_VERSION),
        "tunix.num_rows": str(table.num_rows),
        "tunix.length_histogram": json.dumps(length_histogram(table.column("length").to_numpy())),
        **(extra_metadata or {}),
    }
    table = table.replace_schema_metadata({**(table.schema.metadata or {}), **meta})
    sink = io.BytesIO()
    pq.write_table(
        table,
        sink,
        row_group_size=ROW_GROUP_ROWS,
        compression="zstd",
        use_dictionary=["actor_id", "env", "status"],
    )
    return sink.getvalue()


def shard_key(actor_id: str, created_at: float | None = None) -> str:
    """`shards/<actor>/<created_ms>-<random>.parquet`: unique, sorts by creation time."""
    ms = int((created_at if created_at is not None else time.time()) * 1000)
    return f"{SHARDS_PREFIX}{actor_id}/{ms:013d}-{uuid.uuid4().hex[:8]}.parquet"


class ShardWriter:
    """Buffers episodes and commits them as one shard every N episodes or T seconds.

    writer = ShardWriter(store, actor_id="actor-0", max_episodes=32, max_interval_s=30)
    writer.add(episode)          # may commit a shard
    writer.maybe_flush()         # call periodically: time-based commit
    writer.close()               # commits what is left
    """

    def __init__(
        self,
        store: ObjectStore,
        *,
        actor_id: str,
        max_episodes: int = 32,
        max_interval_s: float = 30.0,
        metadata: dict[str, str] | None = None,
    ) -> None:
        self._store = store
        self.actor_id = actor_id
        self.max_episodes = max_episodes
        self.max_interval_s = max_interval_s
        self._metadata = {"tunix.actor_id": actor_id, **(metadata or {})}
        self._buffer: list[Episode] = []
        self._opened_at = time.monotonic()
        self.shards_written: list[str] = []
        self.episodes_written = 0

    @property
    def pending(self) -> int:
        return len(self._buffer)

    def add(self, episode: Episode) -> str | None:
        return self.add_group([episode])

    def add_group(self, episodes: Sequence[Episode]) -> str | None:
        """Add episodes that must land in the same shard (one advantage group)."""
        if not episodes:
            return None
        if not self._buffer:
            self._opened_at = time.monotonic()
        self._buffer.extend(episodes)
        if len(self._buffer) >= self.max_episodes:
            return self.flush()
        return None

    def maybe_flush(self) -> str | None:
        if self._buffer and time.monotonic() - self._opened_at >= self.max_interval_s:
            return self.flush()
        return None

    def flush(self) -> str | None:
        """Commit buffered episodes as one shard (atomic); returns its key."""
        if not self._buffer:
            return None
        data = table_to_parquet_bytes(
            episodes_to_table(self._buffer), extra_metadata=self._metadata
        )
        key = shard_key(self.actor_id)
        self._store.write_bytes(key, data)
        self.episodes_written += len(self._buffer)
        self.shards_written.append(key)
        self._buffer = []
        return key

    def close(self) -> str | None:
        return self.flush()


@dataclass(frozen=True)
class StreamItem:
    """One episode from the stream, with where it came from (for `ack`)."""

    shard: str
    row: int
    episode: Episode
    acked: bool = False  # only with poll(include_acked=True)


def table_episodes(table: pa.Table) -> Iterator[Episode]:
    """Episodes of a (validated) shard table, in row order, as numpy views."""
    cols = {name: table.column(name).combine_chunks() for name in table.column_names}
    lists = {}
    for name in ("tokens", "loss_mask", "behavior_logprobs"):
        arr: pa.ListArray = cols[name]
        lists[name] = (arr.offsets.to_numpy(), arr.values.to_numpy(zero_copy_only=False))
    scalars = {
        name: cols[name].to_pylist()
        for name in ("episode_id", "actor_id", "env", "group_id", "status")
    }
    nums = {
        name: cols[name].to_numpy() for name in ("seed", "policy_version", "reward", "num_turns")
    }
    nums = {name: values.tolist() for name, values in nums.items()}
    created = (cols["created_at"].cast(pa.int64()).to_numpy() / 1000.0).tolist()
    (tok_off, tok), (mask_off, mask), (lp_off, lp) = (
        lists["tokens"],
        lists["loss_mask"],
        lists["behavior_logprobs"],
    )
    for i in range(table.num_rows):
        yield Episode(
            episode_id=scalars["episode_id"][i],
            actor_id=scalars["actor_id"][i],
            env=scalars["env"][i],
            group_id=scalars["group_id"][i],
            seed=nums["seed"][i],
            policy_version=nums["policy_version"][i],
            tokens=tok[tok_off[i] : tok_off[i + 1]],
            loss_mask=mask[mask_off[i] : mask_off[i + 1]],
            behavior_logprobs=lp[lp_off[i] : lp_off[i + 1]],
            reward=nums["reward"][i],
            num_turns=nums["num_turns"][i],
            status=scalars["status"][i],
            created_at=created[i],
        )


class ShardStream:
    """Follows complete shards under `shards/` and remembers what was acknowledged.

    Position = the set of fully acknowledged shards plus, for shards in progress, the
    acknowledged row indices. After `set_state`, unacknowledged rows are yielded again,
    which is what makes the learner's accounting exactly-once across crashes.
    Shards that fail validation are passed to `on_invalid(key, error)` and marked done.
    """

    def __init__(
        self,
        store: ObjectStore,
        *,
        vocab_size: int,
        prefix: str = SHARDS_PREFIX,
        on_invalid: Any = None,
        read_threads: int = 4,
    ) -> None:
        self._store = store
        self.vocab_size = vocab_size
        self.prefix = prefix
        self._on_invalid = on_invalid
        self._done: set[str] = set()
        self._acked: dict[str, set[int]] = {}  # shard -> acked rows (shard opened, not done)
        self._rows: dict[str, int] = {}  # shard -> row count, for shards in progress
        self._emitted: set[str] = set()  # shards whose rows were handed out this process
        self.read_threads = read_threads
        self._pool: ThreadPoolExecutor | None = None

    # -- position -----------------------------------------------------------------
    def get_state(self) -> dict[str, Any]:
        return {
            "version": 1,
            "done": sorted(self._done),
            "partial": {k: sorted(v) for k, v in sorted(self._acked.items())},
            "rows": dict(sorted(self._rows.items())),
        }

    def set_state(self, state: dict[str, Any]) -> None:
        if state.get("version") != 1:
            raise ValueError(f"unsupported ShardStream state version {state.get('version')!r}")
        self._done = set(state["done"])
        self._acked = {k: set(v) for k, v in state["partial"].items()}
        self._rows = dict(state.get("rows", {}))
        self._emitted = set()

    # -- reading ------------------------------------------------------------------
    def pending_shards(self) -> list[str]:
        """Complete shards not yet fully handed out by this process, oldest first."""
        keys = [
            info.key
            for info in self._store.list(self.prefix)
            if info.key.endswith(".parquet") and info.key not in self._done
        ]
        # Sort by the creation-time file name, so shards of all actors interleave fairly.
        keys.sort(key=lambda k: (k.rsplit("/", 1)[-1], k))
        return [k for k in keys if k not in self._emitted]

    def backlog_hint(self) -> int:
        """Number of complete shards not yet fully acknowledged."""
        return sum(
            1
            for info in self._store.list(self.prefix)
            if info.key.endswith(".parquet") and info.key not in self._done
        )

    def poll(
        self, *, max_shards: int | None = None, include_acked: bool = False
    ) -> list[StreamItem]:
        """Episodes from newly complete shards (each shard's rows in length order).

        `include_acked=True` also returns rows acknowledged before a restart (flagged
        `acked`), for statistics that need whole groups, such as advantages."""
        from tunix_tasks.storage.validation import ShardValidationError, read_shard

        def read(key: str) -> pa.Table | ShardValidationError:
            try:
                return read_shard(self._store, key, vocab_size=self.vocab_size)
            except ShardValidationError as err:
                return err

        keys = self.pending_shards()[: max_shards or None]
        # Shards are read concurrently (Parquet decoding and object-store requests release
        # the GIL), then handed out in order.
        if len(keys) > 1:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(
                    max_workers=self.read_threads, thread_name_prefix="shard-read"
                )
            tables = list(self._pool.map(read, keys))
        else:
            tables = [read(k) for k in keys]
        items: list[StreamItem] = []
        for key, table in zip(keys, tables, strict=True):
            if isinstance(table, ShardValidationError):
                err = table
                log.warning("invalid shard %s: %s", key, err.reason)
                if self._on_invalid is not None:
                    self._on_invalid(key, err)
                self._done.add(key)
                self._acked.pop(key, None)
                self._rows.pop(key, None)
                continue
            self._emitted.add(key)
            acked = self._acked.setdefault(key, set())
            self._rows[key] = table.num_rows
            for row, episode in enumerate(table_episodes(table)):
                if row not in acked:
                    items.append(StreamItem(key, row, episode))
                elif include_acked:
                    items.append(StreamItem(key, row, episode, acked=True))
            self._maybe_done(key)
        return items

    def ack(self, shard: str, rows: Iterable[int]) -> None:
        """Mark rows as accounted for (trained on, or dropped)."""
        if shard in self._done:
            return
        self._acked.setdefault(shard, set()).update(rows)
        self._maybe_done(shard)

    def _maybe_done(self, shard: str) -> None:
        total = self._rows.get(shard)
        if total is not None and len(self._acked.get(shard, ())) >= total:
            self._done.add(shard)
            self._acked.pop(shard, None)
            self._rows.pop(shard, None)

    def mark_invalid_done(self, shard: str) -> None:
        self._done.add(shard)
        self._acked.pop(shard, None)
        self._rows.pop(shard, None)
