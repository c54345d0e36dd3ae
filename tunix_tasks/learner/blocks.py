"""`EpisodeBlock`: the learner's unit of buffered data, one shard's unacknowledged rows
column by column, so nothing between the shard and the packer builds one Python object
per episode.

The source reads a shard into one block: its `ShardColumns` (numpy views of the decoded
Parquet), the rows not yet acknowledged, each row's advantage over its group, and the
source's flags (a replayed id: `duplicate`; a group without signal: `zero_variance`).
The batcher then works on whole columns: the flow's drop rules as masks, advantages
recentred in place, the packing window gathered by index. Only the episodes of a batch
it trains become `Episode` objects (`episode(j)`), for acknowledgement and metrics.

    block = source.drain()[0]
    block.policy_version[block.live]           # entry j is shard row block.rows[j]
    block.live[j] = False                      # taken into a batch, or dropped
    ep = block.episode(j)                      # an Episode, source = ShardRow(shard, row)
"""

from __future__ import annotations

import dataclasses

import numpy as np

from tunix_tasks.episode import Episode, ShardRow
from tunix_tasks.storage.shards import ShardColumns


@dataclasses.dataclass(eq=False)
class EpisodeBlock:
    """Entries j = 0..n-1 are the shard's rows `rows[j]` (ascending). The per-entry
    columns below are gathered from `columns` once; `advantage`, `live` and
    `in_baseline` are the batcher's to change; the gathered columns are read-only."""

    shard: str
    columns: ShardColumns  # the whole shard, acknowledged rows included
    rows: np.ndarray  # int64 [n]
    advantage: np.ndarray  # float64 [n], over the entry's group (recentred by the batcher)
    duplicate: np.ndarray  # bool [n]: its id was accounted or in flight when read
    zero_variance: np.ndarray  # bool [n]: its group has no signal
    # In its group's advantage baseline: not dropped (trained entries stay in it), and
    # not an env_error / env_timeout, which never were (`flow.DROPPED_STATUSES`).
    in_baseline: np.ndarray  # bool [n]
    policy_version: np.ndarray = dataclasses.field(init=False)  # int64 [n]
    status: np.ndarray = dataclasses.field(init=False)  # object [n] of str
    group_id: np.ndarray = dataclasses.field(init=False)  # object [n]
    episode_id: np.ndarray = dataclasses.field(init=False)  # object [n]
    reward: np.ndarray = dataclasses.field(init=False)  # float32 [n]
    length: np.ndarray = dataclasses.field(init=False)  # int32 [n]
    num_turns: np.ndarray = dataclasses.field(init=False)  # int32 [n]
    live: np.ndarray = dataclasses.field(init=False)  # bool [n]: buffered, not yet taken

    def __post_init__(self) -> None:
        c, rows = self.columns, self.rows
        # Views when the block holds every row (the usual case), so read-only: a write
        # would change what `episode(j)` builds.
        take = slice(None) if len(rows) == len(c) else rows
        for name in _GATHERED:
            column = getattr(c, name)[take]
            column.flags.writeable = False
            setattr(self, name, column)
        self.live = np.ones(len(rows), bool)

    def __len__(self) -> int:
        return len(self.rows)

    def arrays(self, j: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Entry j's (tokens, loss_mask, behavior_logprobs), views of the shard's."""
        return self.columns.arrays(int(self.rows[j]))

    def episode(self, j: int) -> Episode:
        """Entry j as an `Episode` with its current advantage and its `ShardRow`."""
        row = int(self.rows[j])
        return self.columns.episode(
            row, advantage=float(self.advantage[j]), source=ShardRow(self.shard, row)
        )

    def entry(self, row: int) -> int:
        """The entry of shard row `row` (which this block holds)."""
        j = int(np.searchsorted(self.rows, row))
        if j >= len(self.rows) or self.rows[j] != row:
            raise KeyError(f"{self.shard} row {row} is not in this block")
        return j


#: The columns an `EpisodeBlock` gathers from its shard's, one value per entry.
_GATHERED = ("policy_version", "status", "group_id", "episode_id", "reward", "length", "num_turns")
