"""Builds the policy (chat format + transformer) a run's `ModelConfig` describes.

Actors, learner and evaluation all call `build_policy`, so they agree on the vocabulary,
the chat template and the shapes. A char preset gets the character tokenizer and random
weights from `seed`; a `model.checkpoint` gets the checkpoint's tokenizer, chat template
and weights (every process loads the same base). `model_meta` is what a weight manifest
records about the model.

    chat, sampler = build_sampler(cfg.model, seed=cfg.seed)           # actors, evaluation
    chat, samplers = build_sampler(cfg.model, replicas=2)    # one per device (replicas.py)
    chat, sampler = build_sampler(cfg.model, max_sequences=384, shrink_to_fit=True)
    chat, model = build_policy(cfg.model, compute_dtype="bfloat16", mesh=mesh)   # learner
    chat, spec = policy_spec(cfg.model)     # the shapes only (a remote engine's actor)

A sampler decodes every slot it has in one batch (`row_buckets`; at most `max_rows`), so
its memory grows with the slots: `build_sampler` holds them against the device's
(`costs.sampler_slots`, 80% of the memory JAX reports for an accelerator, of the host's
RAM shared by CPU replicas) and raises `ConfigError` naming the most that fit, or
(`shrink_to_fit`) builds that many.

A checkpoint that cannot be built raises `PolicyError` (policy/preflight.py, where
`build_chat` and `check_policy`, the JAX-free part `prepare` runs, live) from either.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from tunix_tasks.config import ConfigError, ModelConfig, RunConfig
from tunix_tasks.policy import costs
from tunix_tasks.policy.chat import ChatFormat
from tunix_tasks.policy.hf_checkpoint import CheckpointError, HFCheckpoint
from tunix_tasks.policy.model import Transformer
from tunix_tasks.policy.packaged_models import resolve_checkpoint
from tunix_tasks.policy.preflight import PolicyError, build_chat, check_policy
from tunix_tasks.policy.replicas import SamplerReplicas, replicate, sampler_devices
from tunix_tasks.policy.sampling import Sampler, row_buckets
from tunix_tasks.policy.spec import DecoderSpec, LoraSpec, spec_from_preset

__all__ = [
    "PolicyError",
    "base_fingerprint",
    "build_actor_sampler",
    "build_chat",
    "build_policy",
    "build_sampler",
    "check_policy",
    "device_memory_bytes",
    "lora_spec",
    "model_meta",
    "policy_spec",
]


def policy_spec(cfg: ModelConfig) -> tuple[ChatFormat, DecoderSpec]:
    """The chat format and the model's shapes, without building the model (from the
    checkpoint's config.json, or the preset): what a process that only converts weights
    needs (an actor whose engine is a remote server)."""
    chat = build_chat(cfg)
    if cfg.checkpoint is None:
        return chat, spec_from_preset(cfg, vocab_size=chat.tokenizer.vocab_size)
    with _as_policy_error():
        return chat, _checkpoint_spec(cfg)[1]


def build_policy(
    cfg: ModelConfig,
    *,
    seed: int = 0,
    compute_dtype: str | None = None,
    mesh: Mesh | None = None,
) -> tuple[ChatFormat, Transformer]:
    """The chat format and the model: a preset's random weights from `seed`, or the
    checkpoint's (read once: its shapes, then its tensors, sharded over `mesh`), computing
    in `compute_dtype` (default `cfg.dtype`); `seed` also initialises LoRA adapters."""
    dtype = jnp.dtype(compute_dtype or cfg.dtype)
    lora = lora_spec(cfg)
    if cfg.checkpoint is None:
        chat, spec = policy_spec(cfg)
        return chat, Transformer(spec, rngs=nnx.Rngs(seed), compute_dtype=dtype, lora=lora)
    chat = build_chat(cfg)
    with _as_policy_error():
        ckpt, spec = _checkpoint_spec(cfg)
        return chat, ckpt.load_model(spec, mesh=mesh, compute_dtype=dtype, lora=lora, seed=seed)


def _checkpoint_spec(cfg: ModelConfig) -> tuple[HFCheckpoint, DecoderSpec]:
    """`cfg.checkpoint` opened, and its shapes (its config.json, at `cfg.max_seq_len`)."""
    ckpt = HFCheckpoint(resolve_checkpoint(cfg.checkpoint))
    return ckpt, ckpt.spec(max_seq_len=cfg.max_seq_len)


@contextlib.contextmanager
def _as_policy_error() -> Iterator[None]:
    """One error type for every checkpoint problem: `CheckpointError` becomes `PolicyError`."""
    try:
        yield
    except CheckpointError as err:
        raise PolicyError(str(err)) from None


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
        h.update(HFCheckpoint(resolve_checkpoint(cfg.checkpoint)).fingerprint())
    return h.hexdigest()


def build_sampler(
    cfg: ModelConfig,
    *,
    seed: int = 0,
    max_sequences: int = 64,
    replicas: int = 1,
    max_rows: int = 0,
    shrink_to_fit: bool = False,
) -> tuple[ChatFormat, Sampler | SamplerReplicas]:
    """The chat format and a sampler over the policy, stopping at the format's stop ids,
    with `max_sequences` KV-cache slots (conversations whose cache it keeps, all of them
    decoding in one batch when busy, or at most `max_rows` of a replica's); with `replicas`
    > 1, that many samplers on as many local devices, sharing the slots. Slots the
    device's memory cannot hold raise `ConfigError`, or with `shrink_to_fit` are dropped
    (module docstring)."""
    devices = sampler_devices(replicas) if replicas > 1 else [jax.local_devices()[0]]
    chat, model = build_policy(cfg, seed=seed)
    max_sequences = _fit_slots(cfg, model, devices, max_sequences, max_rows, shrink_to_fit)

    def make(device: jax.Device | None, slots: int) -> Sampler:
        return Sampler(
            model,
            pad_id=chat.tokenizer.pad_id,
            stop_ids=chat.stop_ids,
            max_seq_len=cfg.max_seq_len,
            max_sequences=slots,
            batch_buckets=row_buckets(min(max_rows, slots)) if max_rows else None,
            device=device,
        )

    return chat, replicate(make, max_sequences, replicas)


def build_actor_sampler(cfg: RunConfig) -> tuple[ChatFormat, Sampler | SamplerReplicas]:
    """`build_sampler` as a run's `actor` section sizes it: what an async actor samples
    with, and `tunix-tasks serve` for remote actors."""
    return build_sampler(
        cfg.model,
        seed=cfg.seed,
        max_sequences=cfg.actor.cache_slots,
        replicas=cfg.actor.sampler_replicas,
        max_rows=cfg.actor.decode_rows,
        shrink_to_fit=not cfg.actor.kv_cache_slots,  # 0: as many as fit
    )


def device_memory_bytes(device: jax.Device) -> int:
    """The memory JAX may allocate on `device`; for a CPU (no such figure) the host's RAM."""
    stats = device.memory_stats() or {}
    if "bytes_limit" in stats:
        return int(stats["bytes_limit"])
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _fit_slots(
    cfg: ModelConfig,
    model: Transformer,
    devices: list[jax.Device],
    slots: int,
    rows: int,
    shrink: bool,
) -> int:
    """`slots` if every replica's share fits its device (`costs.sampler_bytes`), else the
    most that fit (`shrink`) or a `ConfigError` naming them."""
    share = 1 if devices[0].platform != "cpu" else len(devices)  # CPU devices share RAM
    memory = device_memory_bytes(devices[0])
    itemsize = jnp.dtype(model.compute_dtype).itemsize
    fit = costs.sampler_slots(
        model.spec,
        budget_bytes=(1 - costs.HEADROOM) * memory / share,
        max_seq_len=cfg.max_seq_len,
        itemsize=itemsize,
        rows=rows,
    )
    if -(-slots // len(devices)) <= fit:
        return slots
    if shrink and fit:
        return fit * len(devices)
    need = costs.sampler_bytes(
        model.spec,
        slots=-(-slots // len(devices)),
        max_seq_len=cfg.max_seq_len,
        itemsize=itemsize,
        rows=rows,
    )
    raise ConfigError(
        f"actor.kv_cache_slots: {slots} KV-cache slots of model.max_seq_len={cfg.max_seq_len} "
        f"positions over {len(devices)} sampler replica(s) need {need / 2**30:.1f} GiB each "
        f"(weights, slot cache, decode working set), more than {1 - costs.HEADROOM:.0%} of "
        f"{memory / share / 2**30:.1f} GiB ({devices[0].platform}); at most "
        f"{fit * len(devices)} fit: lower actor.kv_cache_slots, actor.decode_rows or "
        "model.max_seq_len"
    )


def model_meta(cfg: ModelConfig, model: Transformer) -> dict[str, Any]:
    return {**cfg.model_dump(), **dataclasses.asdict(model.spec)}
