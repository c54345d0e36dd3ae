"""Advantages, on the host with numpy, per episode, before packing (pure functions).

Which episodes count: ``keep`` marks the episodes that are trained (not ``env_error`` /
``env_timeout``). Group and batch statistics are over the kept episodes only, so an
episode the learner drops never moves its peers' baseline (a broken or slow environment
must not turn into a negative advantage for the others); dropped episodes get 0.

* ``group_advantages``: GRPO group normalisation (Shao et al. 2024, DeepSeekMath,
  arXiv:2402.03300): episodes sharing an env seed are the natural baseline and need no
  value network.
* ``batch_advantages``: normalisation over all (kept) episodes given.
* ``shard_group_codes``: group ids of several shards as integers, a group per shard (the
  learner computes a round of shards' advantages at once).
* ``zero_variance_mask``: groups that carry no signal (all kept rewards equal, or fewer
  than two kept episodes): DAPO's dynamic sampling filter (Yu et al. 2025,
  arXiv:2503.14476) drops them instead of spending compute on zero gradients.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.typing import ArrayLike

__all__ = [
    "batch_advantages",
    "group_advantages",
    "shard_advantages",
    "shard_group_codes",
    "zero_variance_mask",
]


def _groups(group_ids: Sequence[object] | np.ndarray, size: int) -> tuple[np.ndarray, int]:
    ids = np.asarray(group_ids)
    if ids.dtype.kind not in "iu":  # integer codes (a shard's dictionary) are used as they are
        ids = np.asarray(group_ids, dtype=object).astype(str)
    _, inverse = np.unique(ids, return_inverse=True)
    if inverse.size != size:
        raise ValueError(f"{size} rewards but {inverse.size} group ids")
    return inverse, int(inverse.max(initial=-1)) + 1


def _keep(keep: ArrayLike | None, size: int) -> np.ndarray:
    return np.ones(size, bool) if keep is None else np.asarray(keep, bool).reshape(-1)


def group_advantages(
    rewards: ArrayLike,
    group_ids: Sequence[object] | np.ndarray,
    *,
    keep: ArrayLike | None = None,
    eps: float = 1e-6,
    fallback_baseline: float | None = None,
    normalize_std: bool = True,
    ddof: int = 0,
) -> np.ndarray:
    """GRPO advantages: ``(r - mean_group) / (std_group + eps)`` over kept episodes.

    * A group of one (kept) episode has no peers: advantage 0 (no learning signal), or
      ``r - fallback_baseline`` (unnormalised) when a fallback baseline is given.
    * A zero-variance group (all rewards equal) gets 0, not NaN: its numerator is 0.
    * Episodes with ``keep`` False get 0 and are not in their group's mean or std.
    * ``ddof=0``: population std (DeepSeekMath does not specify; TRL/verl use ``ddof=1``).
    * ``normalize_std=False`` drops the division (Dr. GRPO, Liu et al. 2025,
      arXiv:2503.20783, argue it over-weights too-easy and too-hard groups).
    """
    r = np.asarray(rewards, np.float64).reshape(-1)
    inverse, n = _groups(group_ids, r.size)
    k = _keep(keep, r.size).astype(np.float64)
    counts = np.bincount(inverse, weights=k, minlength=n)
    mean = (np.bincount(inverse, weights=r * k, minlength=n) / np.maximum(counts, 1))[inverse]
    adv = r - mean
    if normalize_std:
        sq = np.bincount(inverse, weights=k * adv**2, minlength=n)
        dof = np.maximum(counts - ddof, 1)
        adv = adv / (np.sqrt(sq / dof)[inverse] + eps)
    single = counts[inverse] <= 1
    adv = np.where(single, 0.0 if fallback_baseline is None else r - fallback_baseline, adv)
    return np.where(k > 0, adv, 0.0).astype(np.float32)


def batch_advantages(
    rewards: ArrayLike,
    *,
    keep: ArrayLike | None = None,
    eps: float = 1e-6,
    normalize_std: bool = True,
) -> np.ndarray:
    """Batch-normalised advantages ``(r - mean) / (std + eps)`` over the kept episodes
    (``normalize_std=False``: ``r - mean``): the group normalisation with one group.

    Use when episodes have no meaningful groups (e.g. one episode per env seed).
    """
    r = np.asarray(rewards, np.float64).reshape(-1)
    return group_advantages(
        r, np.zeros(r.size, np.int64), keep=keep, eps=eps, normalize_std=normalize_std
    )


def shard_group_codes(group_ids: Sequence[object] | np.ndarray, shards: ArrayLike) -> np.ndarray:
    """One integer per (shard, group id) of the episodes of several shards, each episode's
    shard index in `shards`: a group id names a group within its shard only."""
    shard = np.asarray(shards, np.int64).reshape(-1)
    # A dict of Python's own equality on the objects: a fixed-width copy (`astype(str)`)
    # would cost rows x the longest id and drop trailing NULs ("a" and "a\0" would merge);
    # `np.unique` sorts them, 4x slower (measured, #29).
    codes: dict[object, int] = {}
    ids = np.asarray(group_ids, dtype=object).reshape(-1)
    inverse = np.fromiter((codes.setdefault(g, len(codes)) for g in ids), np.int64, ids.size)
    if inverse.size != shard.size:
        raise ValueError(f"{shard.size} shard indices but {inverse.size} group ids")
    return shard * max(len(codes), 1) + inverse


def zero_variance_mask(
    rewards: ArrayLike, group_ids: Sequence[object] | np.ndarray, *, keep: ArrayLike | None = None
) -> np.ndarray:
    """True for each kept episode whose group has no signal: fewer than two kept episodes
    or all kept rewards equal (every advantage of the group is 0)."""
    r = np.asarray(rewards, np.float64).reshape(-1)
    inverse, n = _groups(group_ids, r.size)
    k = _keep(keep, r.size)
    lo = np.full(n, np.inf)
    hi = np.full(n, -np.inf)
    np.minimum.at(lo, inverse[k], r[k])
    np.maximum.at(hi, inverse[k], r[k])
    counts = np.bincount(inverse[k], minlength=n)
    flat = (counts < 2) | (hi <= lo)
    return k & flat[inverse]


def shard_advantages(
    rewards: ArrayLike,
    group_ids: Sequence[object] | np.ndarray,
    mode: str,
    keep: ArrayLike | None = None,
    *,
    normalize_std: bool = True,
    shards: ArrayLike | None = None,
) -> np.ndarray:
    """Advantages for the episodes of one shard, or of several (`shards`: each episode's
    shard index; `group_ids` then `shard_group_codes`): group-normalised (GRPO) or over
    each shard; ``normalize_std=False`` only centres them (Dr. GRPO,
    ``learner.normalize_advantage_std``)."""
    if mode == "group":
        return group_advantages(rewards, group_ids, keep=keep, normalize_std=normalize_std)
    if shards is None:
        return batch_advantages(rewards, keep=keep, normalize_std=normalize_std)
    return group_advantages(rewards, shards, keep=keep, normalize_std=normalize_std)
