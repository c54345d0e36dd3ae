"""Stale-drop bias: the length, turn-count and reward distributions of the episodes the
learner drops as stale against those it trains, so a user sees when staleness filtering
removes the long (slow, often hard) episodes.

Each side is a `Distribution`: cumulative, of bounded size whatever the run's length (a
count, exact sums, sums of squares, minima and maxima, and counts over fixed bins), a
plain dict that the learner checkpoints with its counters and writes into every step
record once an episode was dropped as stale (`drop_bias: {"trained": ..., "stale":
...}`). Everything else is derived from it by pure functions: `describe` (means and
bin-estimated quantiles), `compare` and `hint`, the live display's phrase, empty unless
the drops are significant. Pure numpy.

    dist = add(empty(), lengths, turns, rewards)        # a new dict
    describe(dist)   # {"episodes": 3, "length_mean": ..., "length_p50": ..., ...}
    hint(trained, stale)  # "stale drops vs trained: 1.8x longer" or ""
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from numpy.typing import ArrayLike

__all__ = ["EDGES", "FEATURES", "SIDES", "add", "compare", "describe", "empty", "hint"]

#: {"n": int, "sum": {f: x}, "sumsq": {f: x}, "min": {f: x}, "max": {f: x}, "bins": {f: [n]}}
#: per feature f; min and max are None without episodes.
Distribution = dict[str, Any]

FEATURES = ("length", "turns", "reward")
#: The step record's sides: trained episodes, and those dropped as `DropReason.STALE`.
SIDES = ("trained", "stale")

_INF = math.inf
#: Bin edges per feature: bin i holds [edges[i], edges[i+1]); a value below the first
#: edge counts in the first bin. Lengths in tokens, four bins an octave from 16 to 2^17
#: (each ~19% wide: quantiles within a few percent), turns, and rewards (the built-in
#: environments reward in [0, 1]; finer there).
EDGES: dict[str, tuple[float, ...]] = {
    "length": (0, *(round(2 ** (k / 4)) for k in range(16, 69)), _INF),
    "turns": (0, 1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32, 64, _INF),
    "reward": (-_INF, -1.0, -0.5, *(k / 10 for k in range(11)), 2.0, _INF),
}
QUANTILES = (0.5, 0.9)
#: Whole-number features: a bin [a, b) of one holds a..b-1 (turns [2, 3) is 2 alone).
INTEGER = ("length", "turns")

#: `hint` speaks only when the stale drops are at least this share of stale + trained
#: episodes and this many, and a mean differs by this ratio (length, turns) or by this
#: many standard deviations of the trained rewards.
SIGNIFICANT_SHARE = 0.05
SIGNIFICANT_COUNT = 20
SIGNIFICANT_RATIO = 1.25
SIGNIFICANT_REWARD_SD = 0.25


def empty() -> Distribution:
    """The distribution of no episodes."""
    return {
        "n": 0,
        "sum": dict.fromkeys(FEATURES, 0.0),
        "sumsq": dict.fromkeys(FEATURES, 0.0),
        "min": dict.fromkeys(FEATURES),
        "max": dict.fromkeys(FEATURES),
        "bins": {f: [0] * (len(EDGES[f]) - 1) for f in FEATURES},
    }


def add(
    dist: Distribution, lengths: ArrayLike, turns: ArrayLike, rewards: ArrayLike
) -> Distribution:
    """`dist` with the episodes of these (equal-length) arrays added; `dist` is unchanged."""
    values = {
        f: np.asarray(v, np.float64).reshape(-1)
        for f, v in zip(FEATURES, (lengths, turns, rewards), strict=True)
    }
    n = {v.size for v in values.values()}
    if len(n) != 1:
        raise ValueError(f"drop_bias.add: lengths, turns and rewards differ in size ({sorted(n)})")
    out = empty()
    out["n"] = int(dist["n"]) + n.pop()
    for f, x in values.items():
        out["sum"][f] = float(dist["sum"][f] + x.sum())
        out["sumsq"][f] = float(dist["sumsq"][f] + np.square(x).sum())
        lo, hi = dist["min"][f], dist["max"][f]
        if x.size:
            out["min"][f] = float(x.min() if lo is None else min(lo, x.min()))
            out["max"][f] = float(x.max() if hi is None else max(hi, x.max()))
        else:
            out["min"][f], out["max"][f] = lo, hi
        inner = np.asarray(EDGES[f][1:-1])  # the first and last edge bound nothing
        counts = np.bincount(np.searchsorted(inner, x, side="right"), minlength=len(inner) + 1)
        out["bins"][f] = (np.asarray(dist["bins"][f], np.int64) + counts).tolist()
    return out


def _quantile(dist: Distribution, feature: str, q: float) -> float | None:
    """The `q` quantile of `feature` estimated from its bin counts: linear within the bin
    it falls in, between the bin's edges narrowed to the values seen and, for a
    whole-number feature, to the whole numbers in it (so one repeated value is exact,
    and an open-ended bin has its bounds)."""
    bins, edges = dist["bins"][feature], EDGES[feature]
    total = sum(bins)
    if not total:
        return None
    cum = np.cumsum(bins)
    i = int(np.searchsorted(cum, q * total, side="left"))
    lo = max(edges[i], dist["min"][feature])
    hi = min(edges[i + 1] - (feature in INTEGER), dist["max"][feature])
    before = cum[i] - bins[i]
    return float(lo + (hi - lo) * (q * total - before) / bins[i])


def describe(dist: Distribution) -> dict[str, float | int | None]:
    """Episodes, and per feature the mean and standard deviation (exact), p50 and p90
    (bin estimates, within the values seen). None where there are no episodes."""
    n = int(dist["n"])
    out: dict[str, float | int | None] = {"episodes": n}
    for f in FEATURES:
        mean = dist["sum"][f] / n if n else None
        out[f"{f}_mean"] = mean
        out[f"{f}_sd"] = math.sqrt(max(0.0, dist["sumsq"][f] / n - mean**2)) if n else None
        for q in QUANTILES:
            out[f"{f}_p{round(q * 100)}"] = _quantile(dist, f, q)
    return out


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def compare(trained: Distribution, stale: Distribution) -> dict[str, float | None]:
    """The stale drops against the trained episodes: their share of both, the ratios of
    their mean length and turns to the trained ones', the difference of mean rewards."""
    t, s = describe(trained), describe(stale)
    both = t["episodes"] + s["episodes"]
    diff = None
    if s["reward_mean"] is not None and t["reward_mean"] is not None:
        diff = s["reward_mean"] - t["reward_mean"]
    return {
        "stale_share": s["episodes"] / both if both else None,
        "length_ratio": _ratio(s["length_mean"], t["length_mean"]),
        "turns_ratio": _ratio(s["turns_mean"], t["turns_mean"]),
        "reward_diff": diff,
    }


def _times(ratio: float | None, more: str, less: str) -> str:
    if not ratio or 1 / SIGNIFICANT_RATIO < ratio < SIGNIFICANT_RATIO:  # None, 0: no words
        return ""
    return f"{ratio:.1f}x {more}" if ratio > 1 else f"{1 / ratio:.1f}x {less}"


def hint(trained: Distribution, stale: Distribution) -> str:
    """A short phrase when the stale drops are significant (`SIGNIFICANT_*`) and differ
    from the trained episodes, else "": `stale drops vs trained: 1.8x longer, 2.0x more
    turns, reward 0.21 vs 0.55`."""
    c, t = compare(trained, stale), describe(trained)
    if int(stale["n"]) < SIGNIFICANT_COUNT or (c["stale_share"] or 0.0) < SIGNIFICANT_SHARE:
        return ""
    parts = [
        _times(c["length_ratio"], "longer", "shorter"),
        _times(c["turns_ratio"], "more turns", "fewer turns"),
    ]
    diff, sd = c["reward_diff"], t["reward_sd"]
    if diff is not None and sd is not None and abs(diff) >= max(SIGNIFICANT_REWARD_SD * sd, 1e-9):
        parts.append(f"reward {t['reward_mean'] + diff:.2f} vs {t['reward_mean']:.2f}")
    parts = [p for p in parts if p]
    return f"stale drops vs trained: {', '.join(parts)}" if parts else ""
