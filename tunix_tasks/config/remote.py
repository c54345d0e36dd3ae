"""`RemoteEngineConfig`: `actor.remote`, an OpenAI-compatible completions server as the
async actor's rollout engine instead of its own JAX sampler (docs/remote-engine.md).

With `url` set, the actor sends each turn's token ids to `<url>/v1/completions` (vLLM's
token-in / token-out form) and pushes each new snapshot to the server as a Hugging Face
checkpoint under `weights_dir` (SGLang's `POST /update_weights_from_disk`), or a LoRA
run's adapters as a PEFT folder loaded by name (vLLM's `POST /v1/load_lora_adapter`).
Empty `url`: the actor samples itself, as before.
"""

from __future__ import annotations

from pydantic import Field, model_validator

from tunix_tasks.config.agent import ENV_VAR
from tunix_tasks.config.base import Float, Frozen, Int

__all__ = ["RemoteEngineConfig"]


class RemoteEngineConfig(Frozen):
    """`actor.remote` (module docstring)."""

    url: str = Field(
        "",
        description="the server's base URL, e.g. http://10.0.0.5:8000 (empty: the actor samples "
        "with its own JAX sampler); vLLM, SGLang or `tunix-tasks serve`",
    )
    model: str = Field(
        "", description="the model name requests carry (empty: the first of GET /v1/models)"
    )
    api_key_env: str = Field(
        "", description="the variable holding the server's bearer token (empty: none)"
    )
    weights_dir: str = Field(
        "",
        description="a folder the actor writes each snapshot to (as a Hugging Face checkpoint) "
        "and the server reads it from: shared by both (empty: a temporary folder, for a "
        "server on the actor's machine)",
    )
    weights_route: str = Field(
        "/update_weights_from_disk",
        description="the server's route that loads a checkpoint folder (SGLang's; vLLM "
        "needs a weight-reload extension serving it)",
    )
    adapter_route: str = Field(
        "/v1/load_lora_adapter",
        description="a LoRA run's: the server's route that loads a PEFT adapter folder by "
        "name (vLLM's, with VLLM_ALLOW_RUNTIME_LORA_UPDATING; SGLang's is /load_lora_adapter)",
    )
    unload_route: str = Field(
        "/v1/unload_lora_adapter",
        description="a LoRA run's: the route that unloads an adapter by name (SGLang's is "
        "/unload_lora_adapter)",
    )
    timeout_s: Float = Field(
        600.0,
        gt=0.0,
        le=86400.0,
        description="how long a turn or a weights push may wait for the server (retried "
        "while it is unreachable or busy) before the actor stops with an error; also how "
        "long an actor waits for another's write of the run's weights folder",
    )
    max_connections: Int = Field(
        0, ge=0, le=65536, description="concurrent requests to the server (0: envs_per_actor)"
    )

    @model_validator(mode="after")
    def _check(self) -> RemoteEngineConfig:
        if self.url and not self.url.startswith(("http://", "https://")):
            raise ValueError(f"actor.remote.url {self.url!r} must start with http:// or https://")
        if self.api_key_env and not ENV_VAR.fullmatch(self.api_key_env):
            raise ValueError(
                f"actor.remote.api_key_env {self.api_key_env!r} is not a variable name"
            )
        for name in ("weights_route", "adapter_route", "unload_route"):
            if not getattr(self, name).startswith("/"):
                raise ValueError(f"actor.remote.{name} {getattr(self, name)!r} must start with /")
        return self
