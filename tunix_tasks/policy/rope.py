"""RoPE frequency scalings: what a checkpoint's `rope_scaling` does to the rotary
embedding's inverse frequencies, as transformers computes it (`modeling_rope_utils.py`;
checked against its own numbers in tests/fixtures/hf/rope_reference.json).

Each kind is a frozen dataclass made from its config.json dict: `inv_freq` rescales the
plain frequencies, `attention_factor` is what cos and sin are multiplied by (yarn's; 1.0
for the others). A new kind is one more dataclass, named in `ROPE_SCALINGS`:

    scaling = ROPE_SCALINGS["yarn"].from_config({"factor": 4.0, ...})  # ValueError if bad
    inv = inv_freq(head_dim=128, theta=1e6, scaling=scaling)          # float32 [64]
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping
from typing import Any

import numpy as np

__all__ = [
    "ROPE_SCALINGS",
    "LinearScaling",
    "Llama3Scaling",
    "RopeScaling",
    "YarnScaling",
    "inv_freq",
    "positive",
]


def _number(scaling: Mapping[str, Any], key: str, default: float | None = None) -> float:
    """A positive finite number of a `rope_scaling` dict (config.json names the key)."""
    value = scaling.get(key)
    value = default if value is None else value
    if value is None:
        raise ValueError(f"config.json: rope scaling lacks {key!r}")
    return positive(f"rope scaling {key}", value)


def positive(what: str, value: Any) -> float:
    """`value`, a config.json number, as a positive finite float; ValueError naming
    `what` otherwise (a bool, a string, 0, inf, NaN)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"config.json: {what} must be a number, got {value!r}")
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"config.json: {what} must be > 0, got {value!r}")
    return float(value)


def _positions(scaling: Mapping[str, Any]) -> int:
    value = _number(scaling, "original_max_position_embeddings")
    if value != int(value) or value > 1 << 24:
        raise ValueError(
            "config.json: rope scaling original_max_position_embeddings must be an integer at "
            f"most {1 << 24}, got {value!r}"
        )
    return int(value)


@dataclasses.dataclass(frozen=True)
class Llama3Scaling:
    """`rope_type: llama3` frequency scaling (Llama 3.1+): transformers'
    `_compute_llama3_parameters`, in float64."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int
    attention_factor = 1.0

    @classmethod
    def from_config(cls, scaling: Mapping[str, Any]) -> Llama3Scaling:
        return cls(
            factor=_number(scaling, "factor"),
            low_freq_factor=_number(scaling, "low_freq_factor"),
            high_freq_factor=_number(scaling, "high_freq_factor"),
            original_max_position_embeddings=_positions(scaling),
        )

    def inv_freq(self, inv: np.ndarray, head_dim: int, theta: float) -> np.ndarray:
        old = self.original_max_position_embeddings
        low_wavelen = old / self.low_freq_factor
        high_wavelen = old / self.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > low_wavelen, inv / self.factor, inv)
        smooth = (old / wavelen - self.low_freq_factor) / (
            self.high_freq_factor - self.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return np.where(medium, smoothed, scaled)


@dataclasses.dataclass(frozen=True)
class LinearScaling:
    """`rope_type: linear` (position interpolation): every frequency divided by `factor`."""

    factor: float
    attention_factor = 1.0

    @classmethod
    def from_config(cls, scaling: Mapping[str, Any]) -> LinearScaling:
        return cls(factor=_number(scaling, "factor"))

    def inv_freq(self, inv: np.ndarray, head_dim: int, theta: float) -> np.ndarray:
        return inv / self.factor


@dataclasses.dataclass(frozen=True)
class YarnScaling:
    """`rope_type: yarn` (static YaRN, Qwen2.5/Qwen3 long context): transformers'
    `_compute_yarn_parameters`. Frequencies that turn fewer than `beta_slow` times over the
    original context are interpolated (divided by `factor`), those that turn more than
    `beta_fast` times kept, with a linear ramp between; cos and sin are scaled by
    `attention_factor` (by default 0.1 ln(factor) + 1, or DeepSeek's mscale ratio)."""

    factor: float
    original_max_position_embeddings: int
    attention_factor: float
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True

    @classmethod
    def from_config(cls, scaling: Mapping[str, Any]) -> YarnScaling:
        factor = _number(scaling, "factor")

        def mscale(m: float) -> float:
            return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

        if scaling.get("attention_factor") is not None:
            attention = _number(scaling, "attention_factor")
        elif scaling.get("mscale") and scaling.get("mscale_all_dim"):
            attention = mscale(_number(scaling, "mscale")) / mscale(
                _number(scaling, "mscale_all_dim")
            )
        else:
            attention = mscale(1.0)
        truncate = scaling.get("truncate", True)
        if not isinstance(truncate, bool):
            raise ValueError(f"config.json: rope scaling truncate {truncate!r}")
        # transformers' `x or default`: an explicit 0 (or null) means the default too.
        return cls(
            factor=factor,
            original_max_position_embeddings=_positions(scaling),
            attention_factor=attention,
            beta_fast=_number(scaling, "beta_fast") if scaling.get("beta_fast") else 32.0,
            beta_slow=_number(scaling, "beta_slow") if scaling.get("beta_slow") else 1.0,
            truncate=truncate,
        )

    def inv_freq(self, inv: np.ndarray, head_dim: int, theta: float) -> np.ndarray:
        def correction_dim(rotations: float) -> float:
            turns = self.original_max_position_embeddings / (rotations * 2 * math.pi)
            return head_dim * math.log(turns) / (2 * math.log(theta))

        low, high = correction_dim(self.beta_fast), correction_dim(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, head_dim - 1)
        high = high + 0.001 if low == high else high  # transformers' guard
        ramp = np.clip((np.arange(head_dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
        return inv / self.factor * ramp + inv * (1 - ramp)


RopeScaling = Llama3Scaling | LinearScaling | YarnScaling

#: config.json `rope_type` -> its scaling. A new kind is a frozen dataclass with
#: `from_config`, `inv_freq` and `attention_factor`, added here.
ROPE_SCALINGS: dict[str, type[Llama3Scaling] | type[LinearScaling] | type[YarnScaling]] = {
    "llama3": Llama3Scaling,
    "linear": LinearScaling,
    "yarn": YarnScaling,
}


@functools.lru_cache(maxsize=16)
def inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> np.ndarray:
    """Inverse frequencies, float32 [head_dim // 2] (rotate-half pairing), read-only."""
    inv = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    if scaling is not None:
        inv = scaling.inv_freq(inv, head_dim, theta)
    out = inv.astype(np.float32)
    out.setflags(write=False)
    return out
