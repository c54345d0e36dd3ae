"""`EnvConfig` and the environment names a config accepts (built-ins and plug-ins).

Kept apart from `config.py` so the names are listed without importing any environment:
the learner reads config.json and imports no environment.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import sys
from typing import Any

from pydantic import Field, field_validator

from tunix_tasks.config_model import _Frozen

__all__ = [
    "BUILTIN_ENVS",
    "BUILTIN_VEC_ENVS",
    "EnvConfig",
    "known_env_names",
    "known_vec_env_names",
]

#: The environments shipped with tunix_tasks.envs. `env.name` accepts any registered name
#: (plug-ins too); the JSON schema (and so the Airflow form) offers these.
BUILTIN_ENVS = ("arithmetic", "calculator", "guess_number", "python_exec", "sorting")
#: The vectorized (JAX) twins shipped with tunix_tasks.envs.vectorized (`actor.kind=vectorized`).
BUILTIN_VEC_ENVS = ("calculator", "sorting")


def _names(builtin: tuple[str, ...], module: str, attr: str, group: str) -> list[str]:
    registry = sys.modules.get(module)
    if registry is not None:  # its registry and the entry points
        return sorted(set(builtin) | set(getattr(registry, attr)()))
    names = set(builtin)
    with contextlib.suppress(Exception):  # a broken distribution: built-ins stay valid
        names.update(ep.name for ep in importlib.metadata.entry_points(group=group))
    return sorted(names)


def known_env_names() -> list[str]:
    """Valid `env.name` values: the built-ins, the `tunix_tasks.envs` entry points, and
    names registered in code if `tunix_tasks.envs` is loaded. Never imports it (the
    learner reads config.json and imports no environment): ship plug-ins as entry points."""
    return _names(BUILTIN_ENVS, "tunix_tasks.envs", "available_envs", "tunix_tasks.envs")


def known_vec_env_names() -> list[str]:
    """Valid `env.name` values for `actor.kind=vectorized`, found the same way."""
    return _names(
        BUILTIN_VEC_ENVS,
        "tunix_tasks.envs.vectorized",
        "available_vec_envs",
        "tunix_tasks.vec_envs",
    )


class EnvConfig(_Frozen):
    """Which environment the actors step, and how slow it is (simulated remote latency)."""

    name: str = Field(
        "calculator",
        description="the environment the actors step (a built-in or a registered plug-in)",
        json_schema_extra={"enum": list(BUILTIN_ENVS)},
    )
    max_turns: int = Field(4, ge=1, le=64, description="turns before an episode is truncated")
    latency_s: float = Field(0.0, ge=0.0, description="added delay per env step (seconds)")
    latency_jitter: float = Field(
        0.0, ge=0.0, description="relative jitter of the delay: uniform in [1-j, 1+j]"
    )
    step_timeout_s: float = Field(
        30.0, gt=0.0, description="an env reset/step slower than this ends the episode (dropped)"
    )
    kwargs: dict[str, Any] = Field(default_factory=dict, description="extra env constructor args")

    @field_validator("name")
    @classmethod
    def _known_env(cls, value: str) -> str:
        names = known_env_names()
        if value not in names:
            raise ValueError(
                f"unknown environment; valid: {', '.join(names)} (or a plug-in "
                "of the entry-point group 'tunix_tasks.envs')"
            )
        return value
