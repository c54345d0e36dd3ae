"""`DecoderSpec`: the exact architecture of a decoder, for every family the model builds.

One decoder (`policy/model.py`) covers the families by options: Llama 3.x (GQA, RoPE with
llama3 frequency scaling, tied or untied embeddings), Qwen3 (GQA, RMSNorm on q and k per
head, head_dim independent of d_model), Qwen2/2.5 (bias on q/k/v), and the built-in char
presets (multi-head attention, untied). A spec comes from a preset or from a Hugging Face
`config.json` (both the older top-level `rope_theta`/`rope_scaling` form most published
checkpoints use and the newer `rope_parameters` form):

    spec = spec_from_preset(cfg.model, vocab_size=tok.vocab_size)
    spec = spec_from_hf_config(json.loads(config_json), max_seq_len=4096)
    inv_freq = rope_inv_freq(spec)                   # float32 [head_dim // 2]
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from tunix_tasks.config import ModelConfig

__all__ = [
    "HF_FAMILIES",
    "LORA_TARGETS",
    "SHAPE_BOUNDS",
    "DecoderSpec",
    "HfFamily",
    "Llama3Scaling",
    "LoraSpec",
    "UnsupportedCheckpoint",
    "register_family",
    "rope_inv_freq",
    "spec_from_hf_config",
    "spec_from_preset",
]


@dataclasses.dataclass(frozen=True)
class HfFamily:
    """What one Hugging Face model family changes in the shared decoder, and how its
    config.json names it. A new family that fits the decoder is one `register_family`."""

    name: str
    architectures: tuple[str, ...]  # config.json `architectures` entries
    model_type: str  # config.json `model_type` (when `architectures` is absent)
    qk_norm: bool = False  # RMSNorm on q and k per head (Qwen3)
    qkv_bias: bool = False  # q/k/v projections always biased (Qwen2)
    attention_bias: bool = True  # config.json `attention_bias: true` (q/k/v biases) accepted


#: Family name -> its options; `char` (the presets) is not a Hugging Face family.
HF_FAMILIES: dict[str, HfFamily] = {}


def register_family(family: HfFamily) -> HfFamily:
    """Add a Hugging Face family (its name and architectures must be new)."""
    taken = {a for f in HF_FAMILIES.values() for a in f.architectures}
    if family.name in HF_FAMILIES or taken & set(family.architectures):
        raise ValueError(f"model family {family.name!r} or its architectures are registered")
    HF_FAMILIES[family.name] = family
    return family


register_family(HfFamily("llama", ("LlamaForCausalLM",), "llama", attention_bias=False))
register_family(HfFamily("qwen2", ("Qwen2ForCausalLM",), "qwen2", qkv_bias=True))
register_family(HfFamily("qwen3", ("Qwen3ForCausalLM",), "qwen3", qk_norm=True))


#: The largest value each config.json shape field may hold: far above any published
#: decoder (Llama 3.1 405B: 126 layers, hidden 16384, 128 heads, intermediate 53248; the
#: largest vocabularies ~262k), low enough that checking a checkpoint against its
#: config.json lists at most ~11,000 tensors (a `num_hidden_layers` of 10^7 listed 10^8).
SHAPE_BOUNDS = {
    "vocab_size": 1 << 22,
    "hidden_size": 1 << 16,
    "num_hidden_layers": 1024,
    "num_attention_heads": 1024,
    "num_key_value_heads": 1024,
    "head_dim": 4096,
    "intermediate_size": 1 << 20,
}


class UnsupportedCheckpoint(ValueError):
    """A checkpoint's config.json describes something this decoder cannot run."""


@dataclasses.dataclass(frozen=True)
class Llama3Scaling:
    """`rope_type: llama3` frequency scaling (Llama 3.1+)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclasses.dataclass(frozen=True)
class DecoderSpec:
    family: str  # "char" or a key of HF_FAMILIES
    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    d_ff: int
    max_seq_len: int
    norm_eps: float = 1e-6
    rope_theta: float = 10_000.0
    rope_scaling: Llama3Scaling | None = None
    qk_norm: bool = False
    qkv_bias: bool = False
    tie_embeddings: bool = False

    def __post_init__(self) -> None:
        if self.n_heads % self.n_kv_heads:
            raise UnsupportedCheckpoint(
                f"n_heads={self.n_heads} must be a multiple of n_kv_heads={self.n_kv_heads}"
            )
        if self.head_dim % 2:
            raise UnsupportedCheckpoint(f"head_dim={self.head_dim} must be even for RoPE")

    @property
    def groups(self) -> int:
        """Query heads per key/value head (1 = multi-head attention)."""
        return self.n_heads // self.n_kv_heads


#: Projections LoRA can adapt: attention q, k, v, o and the MLP's gate, up, down.
LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")


@dataclasses.dataclass(frozen=True)
class LoraSpec:
    """Low-rank adapters: W x + (alpha / rank) * B(A x) on each target projection; A is
    initialised at random, B at zero, so adapters start as the identity of the base."""

    rank: int
    alpha: float
    targets: tuple[str, ...] = LORA_TARGETS

    def __post_init__(self) -> None:
        bad = sorted(set(self.targets) - set(LORA_TARGETS))
        if self.rank < 1 or bad or not self.targets:
            raise ValueError(
                f"LoRA needs rank >= 1 and targets among {', '.join(LORA_TARGETS)}; got "
                f"rank {self.rank}, targets {list(self.targets)}"
            )

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def spec_from_preset(cfg: ModelConfig, *, vocab_size: int) -> DecoderSpec:
    """The char presets' architecture: multi-head attention, untied, RoPE theta 1e4."""
    return DecoderSpec(
        family="char",
        vocab_size=vocab_size,
        d_model=cfg.d_model,
        n_layers=cfg.n_layers,
        n_heads=cfg.n_heads,
        n_kv_heads=cfg.n_heads,
        head_dim=cfg.d_model // cfg.n_heads,
        d_ff=cfg.d_ff,
        max_seq_len=cfg.max_seq_len,
    )


def _family(config: Mapping[str, Any]) -> HfFamily:
    for family in HF_FAMILIES.values():
        if set(config.get("architectures") or ()) & set(family.architectures):
            return family
    for family in HF_FAMILIES.values():
        if config.get("model_type") == family.model_type:
            return family
    supported = [a for f in HF_FAMILIES.values() for a in f.architectures]
    raise UnsupportedCheckpoint(
        f"config.json: unsupported architecture {config.get('architectures')} "
        f"(model_type {config.get('model_type')!r}); supported: {', '.join(supported)}"
    )


def _rope(config: Mapping[str, Any]) -> tuple[float, Llama3Scaling | None]:
    """(theta, llama3 scaling) from either config form."""
    params = config.get("rope_parameters")
    if isinstance(params, Mapping) and "default" not in params:
        scaling, theta = params, params.get("rope_theta", config.get("rope_theta"))
    else:  # older form (or per-layer-type parameters, which these families do not use)
        scaling, theta = config.get("rope_scaling") or {}, config.get("rope_theta")
    if theta is None:
        raise UnsupportedCheckpoint("config.json: no rope_theta (nor rope_parameters.rope_theta)")
    kind = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    if kind == "default":
        return float(theta), None
    if kind != "llama3":
        raise UnsupportedCheckpoint(
            f"config.json: rope scaling {kind!r} is not supported (supported: default, llama3)"
        )
    try:
        return float(theta), Llama3Scaling(
            factor=float(scaling["factor"]),
            low_freq_factor=float(scaling["low_freq_factor"]),
            high_freq_factor=float(scaling["high_freq_factor"]),
            original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
        )
    except KeyError as missing:
        raise UnsupportedCheckpoint(f"config.json: llama3 rope scaling lacks {missing}") from None


def spec_from_hf_config(config: Mapping[str, Any], *, max_seq_len: int) -> DecoderSpec:
    """The spec of a Hugging Face Llama / Qwen2 / Qwen3 `config.json` (a dict)."""
    family = _family(config)

    def need(key: str, default: int | None = None) -> int:
        value = config.get(key)
        value = default if value is None and default is not None else value
        bound = SHAPE_BOUNDS[key]
        if not isinstance(value, int) or isinstance(value, bool) or not 0 < value <= bound:
            raise UnsupportedCheckpoint(
                f"config.json: {key} must be a positive integer at most {bound}, got {value!r}"
            )
        return value

    if config.get("mlp_bias"):
        raise UnsupportedCheckpoint("config.json: mlp_bias=true is not supported")
    if config.get("attention_bias") and not family.attention_bias:
        raise UnsupportedCheckpoint(
            f"config.json: attention_bias=true is not supported for {family.name}"
        )
    if config.get("hidden_act", "silu") != "silu":
        raise UnsupportedCheckpoint(
            f"config.json: hidden_act {config['hidden_act']!r} is not supported (silu)"
        )
    if config.get("use_sliding_window"):
        raise UnsupportedCheckpoint("config.json: sliding-window attention is not supported")
    d_model, n_heads = need("hidden_size"), need("num_attention_heads")
    theta, scaling = _rope(config)
    return DecoderSpec(
        family=family.name,
        vocab_size=need("vocab_size"),
        d_model=d_model,
        n_layers=need("num_hidden_layers"),
        n_heads=n_heads,
        n_kv_heads=need("num_key_value_heads", n_heads),
        head_dim=need("head_dim", max(d_model // n_heads, 1)),
        d_ff=need("intermediate_size"),
        max_seq_len=max_seq_len,
        norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        qk_norm=family.qk_norm,
        qkv_bias=family.qkv_bias or bool(config.get("attention_bias")),
        # Hugging Face's default is tied when the key is absent.
        tie_embeddings=bool(config.get("tie_word_embeddings", True)),
    )


@functools.lru_cache(maxsize=16)
def _inv_freq(head_dim: int, theta: float, scaling: Llama3Scaling | None) -> np.ndarray:
    inv = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    if scaling is not None:  # transformers' _compute_llama3_parameters, in float64
        old = scaling.original_max_position_embeddings
        low_wavelen = old / scaling.low_freq_factor
        high_wavelen = old / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > low_wavelen, inv / scaling.factor, inv)
        smooth = (old / wavelen - scaling.low_freq_factor) / (
            scaling.high_freq_factor - scaling.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv = np.where(medium, smoothed, scaled)
    out = inv.astype(np.float32)
    out.setflags(write=False)
    return out


def rope_inv_freq(spec: DecoderSpec) -> np.ndarray:
    """RoPE inverse frequencies, float32 [head_dim // 2] (rotate-half pairing)."""
    return _inv_freq(spec.head_dim, spec.rope_theta, spec.rope_scaling)
