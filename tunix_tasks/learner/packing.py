"""Host-side packing of episodes into a few fixed ``[batch_rows, bucket_len]`` shapes.

Owns: bucket choice, the truncation policy, first-fit-decreasing packing with segment
ids and positions (`plan` over lengths, `assemble` over any `Sequences`; `pack` over
`Episode`s is the two together), the two unpacked baselines (``pad_to_max``, ``bucket_no_pack``) and
the packing statistics. Pure numpy; no JAX, no I/O. The learner turns ``PackedBatch``
arrays into device arrays; the number of distinct shapes (and so of XLA compilations) is
at most ``len(buckets)`` whatever the episode lengths (DESIGN.md, "Shapes").

Alignment convention (``L = bucket_len``; row ``r``; ``p`` a position in the row)::

    tokens[r, p]             the token at p (0 on padding)
    positions[r, p]          index of p inside its segment, restarting at 0 (0 on padding)
    segment_ids[r, p]        1..k for the k episodes of row r, 0 on padding
    episode_index[r, p]      index into ``episode_ids`` (-1 on padding), on every token
    targets[r, p]            tokens[r, p + 1] if p + 1 is in the same segment, else 0
    loss_mask[r, p]          episode loss_mask of the TARGET token (the one at p + 1)
    behavior_logprobs[r, p]  behaviour log-prob of the TARGET token (the one at p + 1)
    advantages[r, p]         the episode's scalar advantage on all its positions, 0 on padding

So the learner computes ``logp[r, p] = log_softmax(logits[r, p])[targets[r, p]]`` and the
loss is elementwise over ``[r, p]`` with no shifting. The last position of every segment
has ``targets == 0`` and ``loss_mask == 0``: it never predicts the next segment's first
token. A loss-mask 1 on an episode's first token cannot be trained (nothing predicts it).

Truncation policy: an episode longer than the largest bucket keeps its prefix of that
length and is counted in ``PackStats.truncated`` (once: leftovers come back truncated).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np
from numpy.typing import ArrayLike

from tunix_tasks.episode import Episode

__all__ = [
    "EpisodeList",
    "PackResult",
    "PackStats",
    "PackedBatch",
    "Sequences",
    "assemble",
    "bucket_no_pack",
    "choose_bucket",
    "pack",
    "pad_to_max",
    "plan",
    "truncate",
]


@dataclasses.dataclass(frozen=True, eq=False)
class PackedBatch:
    """One ``[batch_rows, bucket_len]`` batch; see the module docstring for alignment."""

    bucket_len: int
    tokens: np.ndarray  # int32 [R, L]
    targets: np.ndarray  # int32 [R, L]
    positions: np.ndarray  # int32 [R, L]
    segment_ids: np.ndarray  # int32 [R, L]
    episode_index: np.ndarray  # int32 [R, L]
    loss_mask: np.ndarray  # float32 [R, L], target-aligned
    behavior_logprobs: np.ndarray  # float32 [R, L], target-aligned
    advantages: np.ndarray  # float32 [R, L]
    episode_ids: tuple[str, ...]  # episode_index -> episode_id
    policy_versions: np.ndarray  # int64 [num_episodes], same order as episode_ids

    @property
    def shape(self) -> tuple[int, int]:
        rows, length = self.tokens.shape
        return rows, length

    @property
    def real_tokens(self) -> int:
        return int(np.count_nonzero(self.segment_ids))

    @property
    def density(self) -> float:
        return self.real_tokens / self.tokens.size

    def per_token(self, values: ArrayLike | None) -> np.ndarray:
        """int32 [R, L]: each token's episode's entry of `values` (one per `episode_ids`,
        e.g. `staleness.updates_since`); 0 on padding, and everywhere when None. Values
        above the int32 range are clipped to its top."""
        if values is None or not self.episode_ids:
            return np.zeros(self.tokens.shape, np.int32)
        per_episode = np.minimum(np.asarray(values, np.int64), np.iinfo(np.int32).max)
        lag = per_episode[np.maximum(self.episode_index, 0)]
        return np.where(self.episode_index >= 0, lag, 0).astype(np.int32)


@dataclasses.dataclass(frozen=True)
class PackStats:
    """What one packing call did; ``density = real_tokens / total_slots`` over emitted batches."""

    num_sequences: int  # sequences given
    num_packed: int  # sequences placed in emitted batches
    num_leftover: int
    truncated: int  # sequences cut to the largest bucket
    real_tokens: int
    total_slots: int
    batches_per_bucket: dict[int, int]

    @property
    def density(self) -> float:
        return self.real_tokens / self.total_slots if self.total_slots else 0.0

    @property
    def num_batches(self) -> int:
        return sum(self.batches_per_bucket.values())


@dataclasses.dataclass(frozen=True)
class PackResult:
    batches: list[PackedBatch]
    leftover: list[Episode]  # to be kept by the caller for the next call
    stats: PackStats


# --------------------------------------------------------------------------- buckets


def _check_buckets(buckets: Sequence[int]) -> tuple[int, ...]:
    if not buckets or any(int(b) <= 0 for b in buckets):
        raise ValueError(f"buckets must be non-empty positive lengths, got {buckets!r}")
    return tuple(sorted({int(b) for b in buckets}))


def choose_bucket(length: int, buckets: Sequence[int]) -> int:
    """Smallest bucket ``>= length``; the largest bucket if none fits (the caller truncates)."""
    ordered = _check_buckets(buckets)
    for b in ordered:
        if length <= b:
            return b
    return ordered[-1]


def truncate(seq: Episode, max_len: int) -> Episode:
    """Keep the first ``max_len`` tokens (prompt and earliest turns survive)."""
    if seq.length <= max_len:
        return seq
    return dataclasses.replace(
        seq,
        tokens=seq.tokens[:max_len],
        loss_mask=seq.loss_mask[:max_len],
        behavior_logprobs=seq.behavior_logprobs[:max_len],
    )


# --------------------------------------------------------------------------- assembly

Row = list[int]  # indices into the sequences, in placement order


class Sequences(Protocol):
    """What packing reads of the sequences it packs, by index: `EpisodeList` over
    `Episode`s, or the learner's buffered columns (`batcher.py`), so packing needs no
    object per sequence. Lengths are the full ones (packing truncates)."""

    lengths: np.ndarray  # int [n]
    advantages: np.ndarray  # float [n]
    policy_versions: np.ndarray  # int [n]

    def episode_id(self, i: int) -> str: ...
    def arrays(self, i: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Sequence i's (tokens, loss_mask, behavior_logprobs)."""
        ...


class EpisodeList:
    """`Sequences` over a list of `Episode`s."""

    def __init__(self, episodes: Sequence[Episode]) -> None:
        self.episodes = episodes
        self.lengths = np.fromiter((e.length for e in episodes), np.int64, len(episodes))
        self.advantages = np.asarray([e.advantage for e in episodes], np.float64)
        self.policy_versions = np.asarray([e.policy_version for e in episodes], np.int64)

    def episode_id(self, i: int) -> str:
        return self.episodes[i].episode_id

    def arrays(self, i: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        e = self.episodes[i]
        return e.tokens, e.loss_mask, e.behavior_logprobs


def assemble(seqs: Sequences, rows: Sequence[Row], batch_rows: int, bucket_len: int) -> PackedBatch:
    """Write ``rows`` (padded with empty rows up to ``batch_rows``) into target-aligned
    arrays; a sequence longer than ``bucket_len`` (alone in its row) keeps its prefix."""
    shape = (batch_rows, bucket_len)
    tokens = np.zeros(shape, np.int32)
    targets = np.zeros(shape, np.int32)
    positions = np.zeros(shape, np.int32)
    segment_ids = np.zeros(shape, np.int32)
    episode_index = np.full(shape, -1, np.int32)
    loss_mask = np.zeros(shape, np.float32)
    blp = np.zeros(shape, np.float32)
    adv = np.zeros(shape, np.float32)
    ids: list[str] = []
    versions: list[int] = []
    for r, row in enumerate(rows):
        start = 0
        for seg, i in enumerate(row, start=1):
            n = min(int(seqs.lengths[i]), bucket_len)
            end = start + n
            seq_tokens, seq_mask, seq_blp = (a[:n] for a in seqs.arrays(i))
            tokens[r, start:end] = seq_tokens
            # Targets/mask/logprobs of token j+1 sit at position j; the segment's last
            # position keeps its zeros so it never predicts the next segment.
            targets[r, start : end - 1] = seq_tokens[1:]
            loss_mask[r, start : end - 1] = seq_mask[1:]
            blp[r, start : end - 1] = seq_blp[1:]
            positions[r, start:end] = np.arange(n, dtype=np.int32)
            segment_ids[r, start:end] = seg
            episode_index[r, start:end] = len(ids)
            adv[r, start:end] = seqs.advantages[i]
            ids.append(seqs.episode_id(i))
            versions.append(int(seqs.policy_versions[i]))
            start = end
        if start > bucket_len:
            raise AssertionError(f"row overflows bucket {bucket_len}: {start} tokens")
    return PackedBatch(
        bucket_len=bucket_len,
        tokens=tokens,
        targets=targets,
        positions=positions,
        segment_ids=segment_ids,
        episode_index=episode_index,
        loss_mask=loss_mask,
        behavior_logprobs=blp,
        advantages=adv,
        episode_ids=tuple(ids),
        policy_versions=np.asarray(versions, dtype=np.int64),
    )


def _result(
    episodes: Sequence[Episode],
    planned: Sequence[tuple[int, list[Row]]],
    leftover: Sequence[int],
    batch_rows: int,
    max_len: int,
) -> PackResult:
    seqs = EpisodeList(episodes)
    batches = [assemble(seqs, rows, batch_rows, b) for b, rows in planned]
    per_bucket: dict[int, int] = {}
    for b, _ in planned:
        per_bucket[b] = per_bucket.get(b, 0) + 1
    stats = PackStats(
        num_sequences=len(episodes),
        num_packed=sum(len(r) for _, rows in planned for r in rows),
        num_leftover=len(leftover),
        truncated=int(np.count_nonzero(seqs.lengths > max_len)),
        real_tokens=sum(b.real_tokens for b in batches),
        total_slots=sum(b.tokens.size for b in batches),
        batches_per_bucket=dict(sorted(per_bucket.items())),
    )
    return PackResult(batches, [truncate(episodes[i], max_len) for i in leftover], stats)


def _check_rows(batch_rows: int) -> None:
    if batch_rows < 1:
        raise ValueError(f"batch_rows must be >= 1, got {batch_rows}")


# --------------------------------------------------------------------------- packing


class _LengthPool:
    """Remaining sequences indexed by (tier, length), so "largest of a tier that fits in f"
    is one numpy scan. Tier 0 (`first`) is placed before tier 1 in every row.

    Within one tier and length, sequences leave in input order (determinism).
    """

    def __init__(self, lengths: Sequence[int], max_len: int, first: Sequence[bool]) -> None:
        self.counts = np.zeros((2, max_len + 1), np.int64)
        self.queues: dict[tuple[int, int], list[int]] = {}
        for i, (n, head) in enumerate(zip(lengths, first, strict=True)):
            key = (0 if head else 1, n)
            self.counts[key] += 1
            self.queues.setdefault(key, []).append(i)
        self.heads = dict.fromkeys(self.queues, 0)

    def __len__(self) -> int:
        return int(self.counts.sum())

    def longest(self) -> int:
        return int(np.flatnonzero(self.counts.sum(axis=0))[-1])

    def plan_batch(self, bucket_len: int, batch_rows: int) -> list[list[tuple[int, int]]]:
        """FFD into at most ``batch_rows`` rows of ``bucket_len``, tier 0 first; returns
        rows of (tier, LENGTH).

        FFD with a row limit equals filling rows one at a time with the largest remaining
        sequence that still fits: each row's content under FFD is exactly that greedy
        sequence, because every item tries the earlier rows first in decreasing order.
        With tiers, a row takes the largest tier-0 sequence that fits while one does.
        """
        counts = self.counts.copy()
        rows: list[list[tuple[int, int]]] = []
        while len(rows) < batch_rows:
            row, free = [], bucket_len
            for tier in (0, 1):
                while True:
                    fits = np.flatnonzero(counts[tier, : free + 1])
                    if fits.size == 0:
                        break
                    n = int(fits[-1])
                    counts[tier, n] -= 1
                    row.append((tier, n))
                    free -= n
            if not row:
                break
            rows.append(row)
        return rows

    def take(self, keyed_rows: list[list[tuple[int, int]]]) -> list[Row]:
        out: list[Row] = []
        for keys in keyed_rows:
            row = []
            for key in keys:
                row.append(self.queues[key][self.heads[key]])
                self.heads[key] += 1
                self.counts[key] -= 1
            out.append(row)
        return out

    def remaining(self) -> list[int]:
        return sorted(i for key, q in self.queues.items() for i in q[self.heads[key] :])


def plan(
    lengths: ArrayLike,
    *,
    buckets: tuple[int, ...],
    batch_rows: int,
    flush: bool = False,
    first: ArrayLike | None = None,
) -> tuple[list[tuple[int, list[Row]]], list[int]]:
    """`pack`'s placement over sequence lengths alone: ``[(bucket, rows)]`` for each batch,
    and the indices left over. Lengths over the largest bucket count as that bucket.
    `first` (a bool per sequence): those go into the first rows before any other, so the
    first batch holds as many of them as fit (the learner's episodes about to go stale:
    packing by length alone starves the shorter ones while longer ones keep coming)."""
    _check_rows(batch_rows)
    ordered = _check_buckets(buckets)
    capped = np.minimum(np.asarray(lengths, np.int64).reshape(-1), ordered[-1])
    head = np.zeros(capped.size, bool) if first is None else np.asarray(first, bool).reshape(-1)
    pool = _LengthPool(capped.tolist(), ordered[-1], head.tolist())
    planned: list[tuple[int, list[Row]]] = []
    while len(pool):
        need = pool.longest()
        candidates = []
        for b in (b for b in ordered if b >= need):
            rows = pool.plan_batch(b, batch_rows)
            full = len(rows) == batch_rows
            if full or flush:
                density = sum(n for row in rows for _, n in row) / (batch_rows * b)
                # Full batches first (partial ones only exist under flush), then density,
                # then the smaller bucket.
                candidates.append(((full, density, -b), b, rows))
        if not candidates:
            break
        _, b, rows = max(candidates, key=lambda c: c[0])
        planned.append((b, pool.take(rows)))
    return planned, pool.remaining()


def pack(
    sequences: Sequence[Episode],
    *,
    buckets: tuple[int, ...],
    batch_rows: int,
    flush: bool = False,
) -> PackResult:
    """Pack episodes, several per row, into full ``[batch_rows, bucket]`` batches.

    Batch by batch: the candidate buckets are those that fit the longest remaining episode
    (so it always makes progress and long episodes are never starved); each candidate is
    filled first-fit-decreasing, and the candidate with the highest density that opens
    all ``batch_rows`` rows wins (ties: the smaller bucket, cheaper attention). When no
    candidate fills all rows, the rest is returned as ``leftover`` for the caller to keep
    for its next call, unless ``flush`` where the densest partial batch is padded with
    empty rows, repeatedly, until nothing is left. (`plan` + `assemble`, over
    `Sequences`, do the same without `Episode` objects.)
    """
    lengths = [s.length for s in sequences]
    planned, leftover = plan(lengths, buckets=buckets, batch_rows=batch_rows, flush=flush)
    return _result(sequences, planned, leftover, batch_rows, max(_check_buckets(buckets)))


# --------------------------------------------------------------------------- baselines


def _one_per_row(
    sequences: Sequence[Episode],
    buckets: tuple[int, ...],
    batch_rows: int,
    flush: bool,
    bucket_of: Callable[[int, tuple[int, ...]], int],
) -> PackResult:
    _check_rows(batch_rows)
    ordered = _check_buckets(buckets)
    lengths = [min(s.length, ordered[-1]) for s in sequences]
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    groups: dict[int, list[int]] = {}
    for i in order:
        groups.setdefault(bucket_of(lengths[i], ordered), []).append(i)
    planned: list[tuple[int, list[Row]]] = []
    leftover: list[int] = []
    for b in sorted(groups, reverse=True):
        idx = groups[b]
        n_full = len(idx) // batch_rows * batch_rows
        cut = len(idx) if flush else n_full
        for k in range(0, cut, batch_rows):
            planned.append((b, [[i] for i in idx[k : k + batch_rows]]))
        leftover.extend(idx[cut:])
    return _result(sequences, planned, sorted(leftover), batch_rows, ordered[-1])


def pad_to_max(
    sequences: Sequence[Episode],
    *,
    buckets: tuple[int, ...],
    batch_rows: int,
    flush: bool = False,
) -> PackResult:
    """Baseline: one episode per row, every row padded to the largest bucket."""
    return _one_per_row(sequences, buckets, batch_rows, flush, lambda n, bs: bs[-1])


def bucket_no_pack(
    sequences: Sequence[Episode],
    *,
    buckets: tuple[int, ...],
    batch_rows: int,
    flush: bool = False,
) -> PackResult:
    """Baseline: one episode per row, padded to its own (smallest fitting) bucket."""
    return _one_per_row(sequences, buckets, batch_rows, flush, choose_bucket)
