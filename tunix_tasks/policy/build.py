"""Builds the policy (chat format + transformer) a run's `ModelConfig` describes.

Actors, learner and evaluation all call `build_policy`, so they agree on the vocabulary,
the chat template and the shapes. A char preset gets the character tokenizer and random
weights from `seed`; a `model.checkpoint` gets the checkpoint's tokenizer, chat template
and weights (every process loads the same base). `model_meta` is what a weight manifest
records about the model.

    chat, sampler = build_sampler(cfg.model, seed=cfg.seed)           # actors, evaluation
    chat, samplers = build_sampler(cfg.model, replicas=2)    # one per device (replicas.py)
    chat, model = build_policy(cfg.model, compute_dtype="bfloat16", mesh=mesh)   # learner

A checkpoint that cannot be built raises `PolicyError` (policy/preflight.py, where
`build_chat` and `check_policy`, the JAX-free part `prepare` runs, live) from either.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from tunix_tasks.config import ModelConfig
from tunix_tasks.policy.chat import ChatFormat
from tunix_tasks.policy.hf_checkpoint import CheckpointError, HFCheckpoint
from tunix_tasks.policy.model import Transformer
from tunix_tasks.policy.preflight import PolicyError, build_chat, check_policy
from tunix_tasks.policy.replicas import SamplerReplicas, replicate, sampler_devices
from tunix_tasks.policy.sampling import Sampler
from tunix_tasks.policy.spec import LoraSpec, spec_from_preset

__all__ = [
    "PolicyError",
    "base_fingerprint",
    "build_chat",
    "build_policy",
    "build_sampler",
    "check_policy",
    "lora_spec",
    "model_meta",
]


def build_policy(
    cfg: ModelConfig,
    *,
    seed: int = 0,
    compute_dtype: str | None = None,
    mesh: Mesh | None = None,
) -> tuple[ChatFormat, Transformer]:
    dtype = jnp.dtype(compute_dtype or cfg.dtype)
    chat = build_chat(cfg)
    lora = lora_spec(cfg)
    if cfg.checkpoint is None:
        spec = spec_from_preset(cfg, vocab_size=chat.tokenizer.vocab_size)
        return chat, Transformer(spec, rngs=nnx.Rngs(seed), compute_dtype=dtype, lora=lora)
    ckpt = HFCheckpoint(cfg.checkpoint)
    try:
        spec = ckpt.spec(max_seq_len=cfg.max_seq_len)
        model = ckpt.load_model(spec, mesh=mesh, compute_dtype=dtype, lora=lora, seed=seed)
    except CheckpointError as err:  # one error type for every checkpoint problem
        raise PolicyError(str(err)) from None
    return chat, model


def lora_spec(cfg: ModelConfig) -> LoraSpec | None:
    """The adapters a run trains, None for full fine-tuning."""
    if not cfg.lora_rank:
        return None
    return LoraSpec(cfg.lora_rank, cfg.lora_alpha, tuple(cfg.lora_targets))


def base_fingerprint(cfg: ModelConfig, seed: int) -> str:
    """Identifies the frozen base adapters apply to: a checkpoint's config.json and its
    safetensors headers (names, shapes, dtypes, offsets) with their sizes; a preset's
    dimensions and the seed its random weights come from."""
    h = hashlib.sha256()
    if cfg.checkpoint is None:
        shape = cfg.model_dump(include={"preset", "d_model", "n_layers", "n_heads", "d_ff"})
        h.update(json.dumps({**shape, "seed": seed}, sort_keys=True).encode())
    else:
        h.update(HFCheckpoint(cfg.checkpoint).fingerprint())
    return h.hexdigest()


def build_sampler(
    cfg: ModelConfig, *, seed: int = 0, max_sequences: int = 64, replicas: int = 1
) -> tuple[ChatFormat, Sampler | SamplerReplicas]:
    """The chat format and a sampler over the policy, stopping at the format's stop ids,
    with `max_sequences` KV-cache slots (conversations whose cache it keeps); with
    `replicas` > 1, that many samplers on as many local devices, sharing the slots."""
    if replicas > 1:
        sampler_devices(replicas)  # asks for CPU devices before building the policy starts JAX
    chat, model = build_policy(cfg, seed=seed)

    def make(device: jax.Device | None, slots: int) -> Sampler:
        return Sampler(
            model,
            pad_id=chat.tokenizer.pad_id,
            stop_ids=chat.stop_ids,
            max_seq_len=cfg.max_seq_len,
            max_sequences=slots,
            device=device,
        )

    return chat, replicate(make, max_sequences, replicas)


def model_meta(cfg: ModelConfig, model: Transformer) -> dict[str, Any]:
    return {**cfg.model_dump(), **dataclasses.asdict(model.spec)}
