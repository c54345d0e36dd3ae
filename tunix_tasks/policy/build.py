"""Builds the policy (tokenizer + transformer) a run's config describes.

Actors, learner and evaluation all call `build_policy`, so they agree on the vocabulary
and shapes; `model_meta` is what a weight manifest records about the model.

    tok, model = build_policy(cfg.model, seed=cfg.seed)
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
from flax import nnx

from tunix_tasks.config import ModelConfig
from tunix_tasks.policy.model import Transformer
from tunix_tasks.policy.tokenizer import Tokenizer


def build_policy(
    cfg: ModelConfig, *, seed: int = 0, compute_dtype: str | None = None
) -> tuple[Tokenizer, Transformer]:
    tok = Tokenizer()
    dtype = jnp.dtype(compute_dtype or cfg.dtype)
    model = Transformer(cfg, tok.vocab_size, rngs=nnx.Rngs(seed), compute_dtype=dtype)
    return tok, model


def model_meta(cfg: ModelConfig) -> dict[str, Any]:
    return {**cfg.model_dump(), "vocab_size": Tokenizer().vocab_size}
