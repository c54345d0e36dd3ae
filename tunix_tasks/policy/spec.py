"""`DecoderSpec`: the exact architecture of a decoder, for every family the model builds.

One decoder (`policy/model.py`) covers the families by options: Llama 3.x (GQA, RoPE with
llama3 frequency scaling, tied or untied embeddings), Qwen3 (GQA, RMSNorm on q and k per
head, head_dim independent of d_model), Qwen2/2.5 (bias on q/k/v), Gemma 3 text (local
sliding-window layers with their own rope theta between global ones, norm scales stored
less one, sandwich norms, scaled embeddings, GeGLU, its own query scale), Mistral (Llama's
layers, every one sliding when `sliding_window` is set), and the built-in char presets
(multi-head attention, untied). A spec comes from a preset or from a Hugging Face
`config.json` (both the older top-level `rope_theta`/`rope_scaling` form most published
checkpoints use and the newer `rope_parameters` form). Its RoPE scaling is one of
`policy/rope.py`'s (llama3, linear, yarn):

    spec = spec_from_preset(cfg.model, vocab_size=tok.vocab_size)
    spec = spec_from_hf_config(json.loads(config_json), max_seq_len=4096)
    inv_freq = rope_inv_freq(spec)                   # float32 [head_dim // 2]
    scale = rope_attention_factor(spec)              # cos and sin are multiplied by it
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np

from tunix_tasks.config import ModelConfig
from tunix_tasks.policy.rope import ROPE_SCALINGS, RopeScaling, inv_freq, positive

__all__ = [
    "HF_FAMILIES",
    "LORA_TARGETS",
    "SHAPE_BOUNDS",
    "DecoderSpec",
    "HfFamily",
    "LoraSpec",
    "UnsupportedCheckpoint",
    "register_family",
    "rope_attention_factor",
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
    qk_norm: bool = False  # RMSNorm on q and k per head (Qwen3, Gemma 3)
    qkv_bias: bool = False  # q/k/v projections always biased (Qwen2)
    attention_bias: bool = True  # config.json `attention_bias: true` (q/k/v biases) accepted
    # Gemma 3: RMSNorm weights stored as (scale - 1), embeddings scaled by sqrt(d_model),
    # a norm on each sublayer's output too, and local (sliding-window) layers with their
    # own rope theta between global ones (`layer_types`, `sliding_window`,
    # `rope_local_base_freq`, `query_pre_attn_scalar`).
    norm_offset: float = 0.0
    embed_scale: bool = False
    sandwich_norms: bool = False
    sliding_layers: bool = False
    # Mistral: `sliding_window`, when not null, is every layer's window.
    sliding_everywhere: bool = False
    # transformers' defaults for keys a config.json may leave out, where they are not the
    # decoder's: (key, value) pairs, read under the file's own keys.
    config_defaults: tuple[tuple[str, Any], ...] = ()


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
register_family(
    HfFamily(
        "gemma3",
        ("Gemma3ForCausalLM",),
        "gemma3_text",
        qk_norm=True,
        attention_bias=False,
        norm_offset=1.0,
        embed_scale=True,
        sandwich_norms=True,
        sliding_layers=True,
        config_defaults=(  # Gemma3TextConfig's
            ("head_dim", 256),
            ("hidden_activation", "gelu_pytorch_tanh"),
            ("query_pre_attn_scalar", 256),
            ("sliding_window", 4096),
            ("rope_theta", 1_000_000.0),
            ("rope_local_base_freq", 10_000.0),
        ),
    )
)

register_family(
    HfFamily(
        "mistral",
        ("MistralForCausalLM",),
        "mistral",
        attention_bias=False,
        sliding_everywhere=True,
        config_defaults=(  # MistralConfig's
            ("num_key_value_heads", 8),
            ("sliding_window", 4096),
            ("rope_theta", 10_000.0),
            ("tie_word_embeddings", False),
        ),
    )
)

#: config.json `hidden_act` / `hidden_activation` -> the MLP gate's activation.
ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}


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
    rope_scaling: RopeScaling | None = None
    qk_norm: bool = False
    qkv_bias: bool = False
    tie_embeddings: bool = False
    norm_offset: float = 0.0  # RMSNorm multiplies by (norm_offset + weight)
    embed_scale: bool = False  # embeddings times sqrt(d_model), in the compute dtype
    sandwich_norms: bool = False  # an RMSNorm on each sublayer's output before the residual
    activation: str = "silu"  # the MLP gate's: a value of ACTIVATIONS
    query_scale: float = 0.0  # the attention scores' scale (0: head_dim ** -0.5)
    layer_windows: tuple[int, ...] = ()  # per layer, its sliding window; 0 (or none): full
    rope_local_theta: float = 0.0  # sliding layers' plain-rope theta (0: the global rope)

    def __post_init__(self) -> None:
        if self.n_heads % self.n_kv_heads:
            raise UnsupportedCheckpoint(
                f"n_heads={self.n_heads} must be a multiple of n_kv_heads={self.n_kv_heads}"
            )
        if self.head_dim % 2:
            raise UnsupportedCheckpoint(f"head_dim={self.head_dim} must be even for RoPE")
        if self.activation not in ACTIVATIONS.values():
            raise UnsupportedCheckpoint(
                f"activation {self.activation!r}: one of {sorted(ACTIVATIONS.values())}"
            )
        if self.layer_windows and len(self.layer_windows) != self.n_layers:
            raise UnsupportedCheckpoint(
                f"{len(self.layer_windows)} layer windows for {self.n_layers} layers"
            )

    def window(self, layer: int) -> int:
        """Layer `layer`'s sliding window: a query at position i reads keys after i - window
        (0: every earlier key)."""
        return self.layer_windows[layer] if self.layer_windows else 0

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


def _rope(config: Mapping[str, Any]) -> tuple[float, RopeScaling | None]:
    """(theta, scaling) from either config form."""
    params = config.get("rope_parameters")
    if isinstance(params, Mapping) and isinstance(params.get("full_attention"), Mapping):
        params = params["full_attention"]  # per layer type (Gemma 3): the global layers'
    if isinstance(params, Mapping) and "default" not in params:
        scaling, theta = params, params.get("rope_theta", config.get("rope_theta"))
    else:  # the older form
        scaling, theta = config.get("rope_scaling") or {}, config.get("rope_theta")
    if theta is None:
        raise UnsupportedCheckpoint("config.json: no rope_theta (nor rope_parameters.rope_theta)")
    partial = config.get("partial_rotary_factor", scaling.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise UnsupportedCheckpoint(
            f"config.json: partial_rotary_factor {partial!r} is not supported (1.0)"
        )
    kind = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    if kind == "default":
        return float(theta), None
    if kind not in ROPE_SCALINGS:
        raise UnsupportedCheckpoint(
            f"config.json: rope scaling {kind!r} is not supported (supported: default, "
            f"{', '.join(ROPE_SCALINGS)})"
        )
    if kind in ("llama3", "yarn"):  # transformers' standardization: a top-level value
        # wins (Phi-3's form), else the scaling's own, else the checkpoint's context length
        top = config.get("original_max_position_embeddings")
        own = scaling.get("original_max_position_embeddings")
        fallback = config.get("max_position_embeddings")
        scaling = {**scaling, "original_max_position_embeddings": top or own or fallback}
    try:
        return float(theta), ROPE_SCALINGS[kind].from_config(scaling)
    except ValueError as err:
        raise UnsupportedCheckpoint(str(err)) from None


def _positive(key: str, value: Any) -> float:
    try:
        return positive(key, value)
    except ValueError as err:
        raise UnsupportedCheckpoint(str(err)) from None


def _local_rope_theta(config: Mapping[str, Any]) -> float:
    """Gemma 3's sliding layers' theta: plain rope, `rope_local_base_freq` (older form) or
    `rope_parameters.sliding_attention` (newer); transformers' default 10,000."""
    params = config.get("rope_parameters")
    local = params.get("sliding_attention") if isinstance(params, Mapping) else None
    theta = config.get("rope_local_base_freq", 10_000.0)
    if isinstance(local, Mapping):
        kind = local.get("rope_type", local.get("type", "default"))
        if kind != "default":
            raise UnsupportedCheckpoint(
                f"config.json: sliding layers' rope scaling {kind!r} is not supported (default)"
            )
        theta = local.get("rope_theta", theta)
    return _positive("rope_local_base_freq", theta)


def _layer_windows(config: Mapping[str, Any], n_layers: int) -> tuple[int, ...]:
    """Per layer, its sliding window (0: full attention), from `layer_types` or, in older
    Gemma 3 files, `sliding_window_pattern` (every pattern-th layer global; default 6)."""
    types = config.get("layer_types")
    if types is None:
        pattern = config.get("sliding_window_pattern", 6)  # transformers' default
        if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern < 1:
            raise UnsupportedCheckpoint(
                f"config.json: sliding_window_pattern must be a positive integer, got {pattern!r}"
            )
        types = [
            "full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
            for i in range(n_layers)
        ]
    kinds = {"full_attention", "sliding_attention"}
    if not isinstance(types, list) or len(types) != n_layers or not set(types) <= kinds:
        raise UnsupportedCheckpoint(
            f"config.json: layer_types must list {n_layers} of {sorted(kinds)}"
        )
    window = _sliding_window(config)
    if "sliding_attention" in types and window is None:
        raise UnsupportedCheckpoint(
            "config.json: sliding_window must be a positive integer where layer_types "
            "names sliding layers, got null"
        )
    return tuple(window if t == "sliding_attention" else 0 for t in types)


def _sliding_window(config: Mapping[str, Any]) -> int | None:
    """`sliding_window`: None when null or absent, else a positive integer (one bound for
    every family: a window past 2**24 positions is a corrupt file, not a model)."""
    window = config.get("sliding_window")
    if window is None:
        return None
    if isinstance(window, bool) or not isinstance(window, int) or not 0 < window <= 1 << 24:
        raise UnsupportedCheckpoint(
            f"config.json: sliding_window must be a positive integer at most {1 << 24} or "
            f"null, got {window!r}"
        )
    return window


def _uniform_windows(config: Mapping[str, Any], n_layers: int, max_seq_len: int) -> tuple[int, ...]:
    """Mistral's windows: `sliding_window` on every layer, none when it is null or at least
    `max_seq_len` (it then drops no key, and full attention is the same and cheaper)."""
    window = _sliding_window(config)
    if window is None or window >= max_seq_len:
        return ()
    # transformers' MistralForCausalLM slides every layer and reads no `layer_types`; one
    # that names full layers (Ministral's interleaving) was trained otherwise.
    types = config.get("layer_types")
    if isinstance(types, list) and "full_attention" in types:
        raise UnsupportedCheckpoint(
            f"config.json: layer_types names full-attention layers between sliding ones "
            f"(sliding_window {window}), which MistralForCausalLM does not run; it is exact "
            f"with model.max_seq_len at most {window}"
        )
    return (window,) * n_layers


def _check_sliding_window(config: Mapping[str, Any], max_seq_len: int) -> None:
    """Refuse sliding-window attention that could drop a key at this context length.

    Qwen2/Qwen3 turn it on with `use_sliding_window` (or name it in `layer_types`); a query
    at position i reads the keys after i - sliding_window, so a window of at least
    max_seq_len never drops one: the decoder's full attention is then exact."""
    types = config.get("layer_types")
    on = bool(config.get("use_sliding_window")) or (
        isinstance(types, list) and "sliding_attention" in types
    )
    if not on:
        return
    window = _sliding_window(config)
    if window is None or window < max_seq_len:
        raise UnsupportedCheckpoint(
            f"config.json: sliding-window attention (sliding_window {window!r}) is not "
            f"supported where it drops keys, at max_seq_len {max_seq_len}; it is exact with "
            "model.max_seq_len at most the window"
        )


def spec_from_hf_config(config: Mapping[str, Any], *, max_seq_len: int) -> DecoderSpec:
    """The spec of a Hugging Face Llama / Qwen2 / Qwen3 / Gemma 3 / Mistral `config.json`
    (a dict)."""
    family = _family(config)
    config = {**dict(family.config_defaults), **config}

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
    act = config.get("hidden_activation") or config.get("hidden_act") or "silu"
    if act not in ACTIVATIONS:
        raise UnsupportedCheckpoint(
            f"config.json: hidden activation {act!r} is not supported ({', '.join(ACTIVATIONS)})"
        )
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if config.get(key) is not None:  # Gemma 2's
            raise UnsupportedCheckpoint(f"config.json: {key} is not supported")
    if config.get("use_bidirectional_attention"):
        raise UnsupportedCheckpoint("config.json: bidirectional attention is not supported")
    d_model, n_heads = need("hidden_size"), need("num_attention_heads")
    n_layers = need("num_hidden_layers")
    windows, local_theta, query_scale = (), 0.0, 0.0
    if family.sliding_layers:
        windows, local_theta = _layer_windows(config, n_layers), _local_rope_theta(config)
        scalar = config.get("query_pre_attn_scalar")
        query_scale = 0.0 if scalar is None else _positive("query_pre_attn_scalar", scalar) ** -0.5
    elif family.sliding_everywhere:
        windows = _uniform_windows(config, n_layers, max_seq_len)
    else:
        _check_sliding_window(config, max_seq_len)
    theta, scaling = _rope(config)
    return DecoderSpec(
        family=family.name,
        vocab_size=need("vocab_size"),
        d_model=d_model,
        n_layers=n_layers,
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
        norm_offset=family.norm_offset,
        embed_scale=family.embed_scale,
        sandwich_norms=family.sandwich_norms,
        activation=ACTIVATIONS[act],
        query_scale=query_scale,
        layer_windows=windows,
        rope_local_theta=local_theta,
    )


def rope_inv_freq(spec: DecoderSpec, *, local: bool = False) -> np.ndarray:
    """RoPE inverse frequencies, float32 [head_dim // 2] (rotate-half pairing); `local`:
    a sliding layer's, where the spec gives them their own theta (Gemma 3)."""
    if local and spec.rope_local_theta:
        return inv_freq(spec.head_dim, spec.rope_local_theta, None)
    return inv_freq(spec.head_dim, spec.rope_theta, spec.rope_scaling)


def rope_attention_factor(spec: DecoderSpec, *, local: bool = False) -> float:
    """What cos and sin are multiplied by (1.0 but for yarn): q and k scale by it."""
    if spec.rope_scaling is None or (local and spec.rope_local_theta):
        return 1.0
    return float(spec.rope_scaling.attention_factor)
