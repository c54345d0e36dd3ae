"""Trajectory shards, format v1: the contract between actors and the learner.

A shard is one Parquet file with one row per episode, rows sorted by `length`, small row
groups, and key-value metadata (`tunix.schema_version`, `tunix.length_histogram`, ...).
Anyone can read one with `pyarrow.parquet.read_table(path)`.

Actors append `Episode`s to a `ShardWriter`, which commits a shard atomically every N
episodes, B bytes or T seconds; `table_episodes` turns a (validated, see `validation.py`) table
back into `Episode`s. The learner's `EpisodeSource` follows the shards.

    writer = ShardWriter(store, actor_id="actor-0003", max_episodes=32, max_interval_s=30)
    writer.add_group(episodes)                       # may commit a shard
    episodes = list(table_episodes(read_shard(store, key, vocab_size=103)))
"""

from __future__ import annotations

import dataclasses
import io
import json
import logging
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from tunix_tasks.episode import Episode, EpisodeStatus, ShardRow
from tunix_tasks.storage.layout import RunLayout
from tunix_tasks.storage.store import ObjectStore

log = logging.getLogger(__name__)

SCHEMA_VERSION = 1
# The id of the run whose actor wrote the shard (`storage.runs.run_id`), when it has one:
# the learner quarantines another incarnation's shards (`validation.py`, `other_run`).
RUN_ID_KEY = "tunix.run_id"
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


def episode_bytes(episode: Episode) -> int:
    """An episode's size in a shard before compression: its arrays and ~128 bytes of ids."""
    arrays = (episode.tokens, episode.loss_mask, episode.behavior_logprobs)
    return 128 + sum(np.asarray(a).nbytes for a in arrays)


class ShardWriter:
    """Buffers episodes and commits them as one shard every N episodes, B bytes or T seconds.

    writer = ShardWriter(store, actor_id="actor-0", max_episodes=32, max_interval_s=30)
    writer.add(episode)          # may commit a shard
    writer.maybe_flush()         # call periodically: time-based commit
    writer.close()               # commits what is left

    Memory and a slow or failing store: a commit is synchronous, so a caller waits for
    the upload (backpressure) and a failed commit raises with the episodes still buffered
    (nothing is lost; the next flush takes them). With callers that retry (the actor goes
    through `StoreOutage.call`), the buffer holds at most one shard (`max_episodes` or
    `max_bytes`) plus one group per caller blocked meanwhile (docs/scaling.md).
    """

    def __init__(
        self,
        store: ObjectStore,
        *,
        actor_id: str,
        max_episodes: int = 32,
        max_interval_s: float = 30.0,
        max_bytes: int = 8 << 20,
        metadata: dict[str, str] | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._store = store
        self.actor_id = actor_id
        self.max_episodes = max_episodes
        self.max_interval_s = max_interval_s
        # A byte cap too: with long episodes, N episodes would make shards (and the memory
        # holding them on both sides) of any size. 8 MiB: past a few hundred KB a shard
        # reads no faster (benchmarks/buffer.py), and 2 KB episodes never reach it.
        self.max_bytes = max_bytes
        self._clock = clock  # names the shards (creation time); simulated in benchmarks
        self._metadata = {"tunix.actor_id": actor_id, **(metadata or {})}
        self._buffer: list[Episode] = []
        self._bytes = 0
        self._opened_at = time.monotonic()
        self.shards_written: list[str] = []
        self.episodes_written = 0

    @property
    def pending(self) -> int:
        return len(self._buffer)

    @property
    def pending_bytes(self) -> int:
        return self._bytes

    def add(self, episode: Episode) -> str | None:
        return self.add_group([episode])

    def add_group(self, episodes: Sequence[Episode]) -> str | None:
        """Add episodes that must land in the same shard (one advantage group)."""
        if not episodes:
            return None
        if not self._buffer:
            self._opened_at = time.monotonic()
        self._buffer.extend(episodes)
        self._bytes += sum(episode_bytes(e) for e in episodes)
        if len(self._buffer) >= self.max_episodes or self._bytes >= self.max_bytes:
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
        key = RunLayout.shard_key(self.actor_id, self._clock())
        self._store.write_bytes(key, data)
        self.episodes_written += len(self._buffer)
        self.shards_written.append(key)
        self._buffer, self._bytes = [], 0
        return key

    def close(self) -> str | None:
        return self.flush()


_STATUSES = {s.value: s for s in EpisodeStatus}
_LISTS = ("tokens", "loss_mask", "behavior_logprobs")


@dataclasses.dataclass(frozen=True, eq=False)
class ShardColumns:
    """A validated shard's rows column by column: numpy views of the decoded Arrow buffers
    (strings as object arrays). What the learner keeps instead of one Python object per
    row; `episode(i)` builds row i's `Episode` when one is needed.

        cols = read_shard_columns(store, key, vocab_size=103)
        cols.policy_version[cols.length > 64]    # any column, vectorised
        tokens, loss_mask, logprobs = cols.arrays(3)
        cols.episode(3, advantage=0.5, source=ShardRow(key, 3))
    """

    episode_id: np.ndarray  # object [n]
    actor_id: np.ndarray  # object [n]
    env: np.ndarray  # object [n]
    group_id: np.ndarray  # object [n]
    status: np.ndarray  # object [n] of str (`EpisodeStatus` values)
    seed: np.ndarray  # int64 [n]
    policy_version: np.ndarray  # int64 [n]
    reward: np.ndarray  # float32 [n]
    num_turns: np.ndarray  # int32 [n]
    length: np.ndarray  # int32 [n]
    created_at: np.ndarray  # float64 [n], seconds
    # Each list column: all rows' values back to back, and row i's start in them
    # (offsets [n + 1]); the shard's validation checked the three have equal lengths.
    tokens: np.ndarray
    loss_mask: np.ndarray
    behavior_logprobs: np.ndarray
    offsets: tuple[np.ndarray, np.ndarray, np.ndarray]

    @classmethod
    def of(cls, table: pa.Table, rows: dict[str, np.ndarray] | None = None) -> ShardColumns:
        """The columns of a validated table (`validation.read_shard`'s, or a decoded
        shard's, `validation.validate_tables`); `rows`: its `row_columns`, where the
        checks already extracted them. The list columns are views of the table's
        buffers: those of a shard decoded as one row group (`ROW_GROUP_ROWS`) are not
        copied, and keep nothing but that shard alive."""
        lists, offsets = [], []
        for name in _LISTS:
            column = table.column(name)
            arr = column.chunk(0) if column.num_chunks == 1 else column.combine_chunks()
            offsets.append(arr.offsets.to_numpy())
            lists.append(arr.values.to_numpy(zero_copy_only=False))
        return cls(
            **(row_columns(table) if rows is None else rows),
            tokens=lists[0],
            loss_mask=lists[1],
            behavior_logprobs=lists[2],
            offsets=tuple(offsets),
        )

    def __len__(self) -> int:
        return len(self.episode_id)

    def arrays(self, i: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Row i's (tokens, loss_mask, behavior_logprobs), views."""
        (t, m, b), (to, mo, bo) = (
            (self.tokens, self.loss_mask, self.behavior_logprobs),
            self.offsets,
        )
        return t[to[i] : to[i + 1]], m[mo[i] : mo[i + 1]], b[bo[i] : bo[i + 1]]

    def episode(self, i: int, *, advantage: float = 0.0, source: ShardRow | None = None) -> Episode:
        """Row i as an `Episode` (its arrays views of the columns')."""
        tokens, loss_mask, logprobs = self.arrays(i)
        return Episode.from_validated(
            self.episode_id[i],
            tokens,
            loss_mask,
            logprobs,
            float(self.reward[i]),
            int(self.policy_version[i]),
            self.actor_id[i],
            self.env[i],
            self.group_id[i],
            int(self.seed[i]),
            int(self.num_turns[i]),
            _STATUSES[self.status[i]],
            float(self.created_at[i]),
            float(advantage),
            source,
        )


#: `ShardColumns`' one-value-per-row columns (all but the lists and their offsets).
_ROW_COLUMNS = tuple(
    f.name for f in dataclasses.fields(ShardColumns) if f.name not in (*_LISTS, "offsets")
)


def row_columns(table: pa.Table) -> dict[str, np.ndarray]:
    """A shard table's one-value-per-row columns, as `ShardColumns` holds them (strings,
    dictionary-encoded or not, as object arrays; `created_at` in seconds)."""
    out = {name: table.column(name).to_numpy() for name in _ROW_COLUMNS if name != "created_at"}
    out["created_at"] = table.column("created_at").cast(pa.int64()).to_numpy() / 1000.0
    return out


def table_episodes(
    table: pa.Table | ShardColumns,
    *,
    shard: str | None = None,
    advantages: Sequence[float] | None = None,
) -> Iterator[Episode]:
    """Episodes of a validated shard (`validation.read_shard`'s table, or the columns
    `read_shard_columns` already extracted), in row order, their arrays numpy views of
    the shard's. With `shard`, each is tagged with its `ShardRow`; `advantages` (one per
    row) fill `advantage`."""
    cols = table if isinstance(table, ShardColumns) else ShardColumns.of(table)
    for i in range(len(cols)):
        yield cols.episode(
            i,
            advantage=0.0 if advantages is None else advantages[i],
            source=None if shard is None else ShardRow(shard, i),
        )
