"""LoRA adapters in Hugging Face PEFT's format: the folder `peft` saves and loads, and
vLLM and SGLang serve with `--enable-lora`.

A PEFT LoRA folder is `adapter_config.json` (peft_type LORA, r, lora_alpha,
target_modules, ...) and `adapter_model.safetensors`, with two tensors per adapted
projection of each layer:

    base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight   [r, in]
    base_model.model.model.layers.{i}.self_attn.q_proj.lora_B.weight   [out, r]

PEFT applies them as W + (lora_alpha / r) * B @ A on the [out, in] weight. Ours
(policy/lora.py) are `a` [in..., r] and `b` [r, out...] in the model's layout, with the
same scale, so A is `a` flattened to [in, r] and transposed, and B is `b` flattened to
[r, out] and transposed. The reference: tests/fixtures/hf/tiny-qwen3-lora, made by
`peft` (make_peft_fixture.py).

    tensors = adapters_to_peft(flat, spec, lora)     # our LoRAParams -> PEFT's names
    config = peft_config(lora, base="HuggingFaceTB/SmolLM2-135M-Instruct")
    lora = lora_from_peft_config(config)             # rank, alpha, targets (checked)
    flat = adapters_from_peft(tensors, spec, lora)   # and back
    w = merged(base_w, flat, "blocks/0/attn/wq", lora)  # W + scale * a @ b, our layout
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from tunix_tasks.policy.hf_headers import CheckpointError
from tunix_tasks.policy.spec import LORA_TARGETS, DecoderSpec, LoraSpec
from tunix_tasks.storage.snapshot_format import short_repr

__all__ = [
    "adapters_from_peft",
    "adapters_to_peft",
    "lora_from_peft_config",
    "merged",
    "peft_config",
    "peft_tensor_shapes",
]

# Our target -> (the module holding it, its base weight, the Hugging Face projection).
_TARGETS = {
    "q": ("attn", "wq", "self_attn.q_proj"),
    "k": ("attn", "wk", "self_attn.k_proj"),
    "v": ("attn", "wv", "self_attn.v_proj"),
    "o": ("attn", "wo", "self_attn.o_proj"),
    "gate": ("mlp", "gate", "mlp.gate_proj"),
    "up": ("mlp", "up", "mlp.up_proj"),
    "down": ("mlp", "down", "mlp.down_proj"),
}
_BY_MODULE = {hf.rsplit(".", 1)[1]: ours for ours, (_, _, hf) in _TARGETS.items()}
_PREFIX = "base_model.model.model.layers"
_MAX_FLOAT = sys.float_info.max
# What an adapter_config.json may hold at any value: what it is, and options that change
# nothing at inference (dropout) or that only matter when another option is on. Any other
# key must be at its default (`_unset`): an option ours cannot honour is refused by name.
_FREE = frozenset(
    {
        "base_model_name_or_path",
        "peft_type",
        "task_type",
        "r",
        "lora_alpha",
        "target_modules",
        "lora_dropout",
        "inference_mode",
        "init_lora_weights",
        "revision",
        "peft_version",
        "auto_mapping",
        "megatron_core",
        "qalora_group_size",
    }
)
# The options `peft_config` writes at their defaults (PEFT's names).
_DEFAULTS = {
    "use_dora": False,
    "use_rslora": False,
    "fan_in_fan_out": False,
    "bias": "none",
    "modules_to_save": None,
    "layers_to_transform": None,
    "rank_pattern": {},
    "alpha_pattern": {},
}


def _shapes(spec: DecoderSpec, target: str, rank: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Our (a, b) shapes of one layer's adapter on `target` (policy/model.py)."""
    d, h, kv, hd, ff = spec.d_model, spec.n_heads, spec.n_kv_heads, spec.head_dim, spec.d_ff
    return {
        "q": ((d, rank), (rank, h, hd)),
        "k": ((d, rank), (rank, kv, hd)),
        "v": ((d, rank), (rank, kv, hd)),
        "o": ((h, hd, rank), (rank, d)),
        "gate": ((d, rank), (rank, ff)),
        "up": ((d, rank), (rank, ff)),
        "down": ((ff, rank), (rank, d)),
    }[target]


def _pairs(spec: DecoderSpec, lora: LoraSpec) -> Iterator[tuple[str, str, tuple, str, tuple]]:
    """(our a name, PEFT A name, a shape, our b name, b shape) of every adapter, layer by
    layer; PEFT's B name is its A name with lora_B."""
    for i in range(spec.n_layers):
        for target in sorted(lora.targets):
            module, _, hf = _TARGETS[target]
            ours = f"blocks/{i}/{module}/lora_{target}"
            a_shape, b_shape = _shapes(spec, target, lora.rank)
            yield f"{ours}/a", f"{_PREFIX}.{i}.{hf}.lora_A.weight", a_shape, f"{ours}/b", b_shape


def adapters_to_peft(
    flat: Mapping[str, np.ndarray], spec: DecoderSpec, lora: LoraSpec
) -> dict[str, np.ndarray]:
    """Our adapter tensors (`flat_params(model, nnx.LoRAParam)` names, as an adapter
    snapshot holds them) as PEFT's state dict (names, [r, in] / [out, r], dtypes kept). A
    tensor missing or of the wrong shape: `CheckpointError` naming it."""
    out = {}
    for a_name, peft_a, a_shape, b_name, b_shape in _pairs(spec, lora):
        for name, shape in ((a_name, a_shape), (b_name, b_shape)):
            if name not in flat:
                raise CheckpointError(f"missing adapter {name}")
            if tuple(flat[name].shape) != shape:
                raise CheckpointError(
                    f"adapter {name} has shape {list(flat[name].shape)}, expected {list(shape)}"
                )
        r = lora.rank
        out[peft_a] = np.ascontiguousarray(np.asarray(flat[a_name]).reshape(-1, r).T)
        out[peft_a.replace(".lora_A.", ".lora_B.")] = np.ascontiguousarray(
            np.asarray(flat[b_name]).reshape(r, -1).T
        )
    return out


def peft_tensor_shapes(spec: DecoderSpec, lora: LoraSpec) -> dict[str, tuple[int, ...]]:
    """The PEFT tensors (name -> shape) an adapter folder of `spec` and `lora` holds."""
    out, r = {}, lora.rank
    for _, peft_a, a_shape, _, b_shape in _pairs(spec, lora):
        out[peft_a] = (r, math.prod(a_shape) // r)
        out[peft_a.replace(".lora_A.", ".lora_B.")] = (math.prod(b_shape) // r, r)
    return out


def adapters_from_peft(
    tensors: Mapping[str, np.ndarray], spec: DecoderSpec, lora: LoraSpec
) -> dict[str, np.ndarray]:
    """PEFT's state dict (as `adapter_model.safetensors` holds it) as our adapter tensors
    (float32, our layout): what `load_flat_params(model, flat, nnx.LoRAParam)` takes. A
    tensor missing, of the wrong shape, or one this spec has no place for:
    `CheckpointError` naming it."""
    out, known = {}, set()
    r = lora.rank
    for a_name, peft_a, a_shape, b_name, b_shape in _pairs(spec, lora):
        peft_b = peft_a.replace(".lora_A.", ".lora_B.")
        for name, ours, shape in ((peft_a, a_name, a_shape), (peft_b, b_name, b_shape)):
            if name not in tensors:
                raise CheckpointError(f"missing adapter tensor {name}")
            w = np.asarray(tensors[name])
            flat_in = int(np.prod(shape)) // r
            want = (r, flat_in) if ours.endswith("/a") else (flat_in, r)
            if tuple(w.shape) != want:
                raise CheckpointError(
                    f"adapter tensor {name} has shape {list(w.shape)}, expected {list(want)}"
                )
            known.add(name)
            out[ours] = w.T.astype(np.float32).reshape(shape)
    extra = sorted(set(tensors) - known)
    if extra:
        raise CheckpointError(f"adapter tensor(s) this model has no place for: {extra[:5]}")
    return out


def peft_config(lora: LoraSpec, *, base: str) -> dict[str, Any]:
    """The `adapter_config.json` of `lora` on the base model `base` (a hub id or path)."""
    return {
        "base_model_name_or_path": base,
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "target_modules": sorted(_TARGETS[t][2].rsplit(".", 1)[1] for t in lora.targets),
        "lora_dropout": 0.0,
        "inference_mode": True,
        "init_lora_weights": True,
    } | _DEFAULTS


def _unset(value: Any) -> bool:
    """A PEFT option left at its default: off, empty, or (bias) "none"; 0 is not."""
    return value is None or value is False or value in ({}, [], "none")


def lora_from_peft_config(config: Mapping[str, Any]) -> LoraSpec:
    """The `LoraSpec` an `adapter_config.json` describes; `CheckpointError` for what ours
    cannot hold: another PEFT method, or any option not at its default (DoRA, rsLoRA,
    per-layer ranks, biases, activated LoRA, ... and those of later PEFT versions)."""
    if config.get("peft_type") != "LORA":
        kind = short_repr(config.get("peft_type"))
        raise CheckpointError(f"peft_type {kind}: only LORA is supported")
    for key, value in config.items():
        if key not in _FREE and not _unset(value):
            raise CheckpointError(
                f"adapter_config.json: {short_repr(key)}={short_repr(value)} is not supported"
            )
    modules = config.get("target_modules")
    if not isinstance(modules, list) or not modules or not all(isinstance(m, str) for m in modules):
        raise CheckpointError(
            f"target_modules {short_repr(modules)}: a list of module names among "
            f"{sorted(_BY_MODULE)}"
        )
    unknown = sorted(set(modules) - set(_BY_MODULE))
    if unknown:
        raise CheckpointError(
            f"target_modules {short_repr(unknown)}: not among {sorted(_BY_MODULE)}"
        )
    rank, alpha = config.get("r"), config.get("lora_alpha")
    numbers = all(isinstance(x, int | float) and not isinstance(x, bool) for x in (rank, alpha))
    # An int alpha past float's range (10**400) is refused here, not by float() below.
    if not numbers or not isinstance(rank, int) or rank < 1 or not 0 < alpha <= _MAX_FLOAT:
        raise CheckpointError(
            f"r={short_repr(rank)}, lora_alpha={short_repr(alpha)}: need r >= 1 and a finite "
            "alpha > 0"
        )
    targets = tuple(t for t in LORA_TARGETS if _TARGETS[t][2].rsplit(".", 1)[1] in modules)
    return LoraSpec(rank, float(alpha), targets)


def merged(
    base: np.ndarray, adapters: Mapping[str, np.ndarray], name: str, lora: LoraSpec
) -> np.ndarray:
    """The base param `name` (`flat_params` name, our layout) with its adapter merged in,
    W + scale * a @ b in float32; the base as it is where no adapter targets it."""
    parts = name.split("/")  # blocks/{i}/{module}/{weight}
    for target in lora.targets:
        module, weight, _ = _TARGETS[target]
        if len(parts) == 4 and parts[0] == "blocks" and parts[2:] == [module, weight]:
            prefix = f"blocks/{parts[1]}/{module}/lora_{target}"
            a = np.asarray(adapters[f"{prefix}/a"], np.float32)
            b = np.asarray(adapters[f"{prefix}/b"], np.float32)
            delta = lora.scale * np.tensordot(a, b, axes=([a.ndim - 1], [0]))
            return np.asarray(base, np.float32) + delta
    return base
