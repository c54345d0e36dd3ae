"""`EnvConfig`, and the environment names a config accepts, read from entry points.

Every environment, built-in or plug-in, is an entry point: the built-ins are declared in
tunix-tasks' own pyproject.toml, under the same groups a plug-in package uses
(`tunix_tasks.envs` for the asynchronous ones, `tunix_tasks.vec_envs` for the JAX ones).
So the names are known without importing any environment (the learner reads config.json
and imports none), and a plug-in is valid as soon as it is installed. An environment
registered in code (`@register_env` in a test or a notebook) is valid in that process
(`tunix_tasks.registry.registered_in_code`, standard library only).

`env.kwargs` are checked the same way: an environment may declare a check of its kwargs
in the entry-point group `tunix_tasks.env_kwargs`, a function in a light module
(`tunix_tasks/env_kwargs.py` holds the built-ins'), called when the config is loaded.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
from typing import Any

from pydantic import Field, ValidationInfo, field_validator

from tunix_tasks.config.base import Float, Frozen, Int
from tunix_tasks.env_kwargs import KWARGS_GROUP
from tunix_tasks.registry import registered_in_code

__all__ = [
    "ENV_GROUP",
    "VEC_ENV_GROUP",
    "EnvConfig",
    "builtin_env_names",
    "check_env_kwargs",
    "known_env_names",
    "known_vec_env_names",
]

ENV_GROUP = "tunix_tasks.envs"
VEC_ENV_GROUP = "tunix_tasks.vec_envs"
_OWN_DISTRIBUTION = "tunix-tasks"


def _entry_points(group: str) -> list[importlib.metadata.EntryPoint]:
    with contextlib.suppress(Exception):  # a broken distribution must not break loading
        return list(importlib.metadata.entry_points(group=group))
    return []


def _names(group: str) -> list[str]:
    return sorted({ep.name for ep in _entry_points(group)} | registered_in_code(group))


def known_env_names() -> list[str]:
    """Valid `env.name` values: the `tunix_tasks.envs` entry points (built-ins included)
    and the names registered in code in this process."""
    return _names(ENV_GROUP)


def known_vec_env_names() -> list[str]:
    """Valid `env.name` values for `actor.kind=vectorized` (`tunix_tasks.vec_envs`)."""
    return _names(VEC_ENV_GROUP)


def builtin_env_names() -> list[str]:
    """The environments tunix-tasks itself ships (what the JSON schema, and so the
    Airflow form, offers)."""
    eps = _entry_points(ENV_GROUP)
    return sorted({ep.name for ep in eps if ep.dist and ep.dist.name == _OWN_DISTRIBUTION})


def check_env_kwargs(name: str, kwargs: dict[str, Any]) -> None:
    """Run the checks environment `name` declares for its kwargs (entry-point group
    `tunix_tasks.env_kwargs`); raises `ValueError` naming the bad kwarg. An environment
    without one is not checked here (its constructor checks, in the actor)."""
    for ep in _entry_points(KWARGS_GROUP):
        if ep.name != name:
            continue
        try:
            check = ep.load()
        except Exception as err:  # a broken plug-in: say which, in one line
            raise ValueError(
                f"cannot load the kwargs check {ep.value} of {name}: {err!r}"
            ) from None
        try:
            check(kwargs)
        except (TypeError, ValueError) as err:
            raise ValueError(str(err)) from None


def _offer_builtins(schema: dict[str, Any]) -> None:
    schema["enum"] = builtin_env_names()


class EnvConfig(Frozen):
    """Which environment the actors step, and how slow it is (simulated remote latency)."""

    name: str = Field(
        "calculator",
        description="the environment the actors step (a built-in or a registered plug-in)",
        json_schema_extra=_offer_builtins,
    )
    max_turns: Int = Field(4, ge=1, le=64, description="turns before an episode is truncated")
    latency_s: Float = Field(0.0, ge=0.0, description="added delay per env step (seconds)")
    latency_jitter: Float = Field(
        0.0, ge=0.0, description="relative jitter of the delay: uniform in [1-j, 1+j]"
    )
    latency_schedule: tuple[tuple[Float, Float], ...] = Field(
        (),
        description="the delay changing during the run, [[after_s, latency_s], ...]: from "
        "after_s seconds after the run was prepared (its config.json written), latency_s "
        "replaces env.latency_s (a fleet tested against a changing world; docs/scaling.md)",
    )
    step_timeout_s: Float = Field(
        30.0, gt=0.0, description="an env reset/step slower than this ends the episode (dropped)"
    )
    kwargs: dict[str, Any] = Field(default_factory=dict, description="extra env constructor args")

    @field_validator("latency_schedule")
    @classmethod
    def _schedule(cls, value: tuple[tuple[float, float], ...]) -> tuple[tuple[float, float], ...]:
        after = [a for a, _ in value]
        if len(value) > 64 or after != sorted(set(after)) or min(after, default=0.0) < 0:
            raise ValueError(
                "env.latency_schedule: at most 64 [after_s, latency_s] pairs, after_s >= 0 and "
                f"strictly increasing (got after_s {after})"
            )
        if any(lat < 0 for _, lat in value):
            raise ValueError("env.latency_schedule: each latency_s must be >= 0")
        return value

    @field_validator("name")
    @classmethod
    def _known_env(cls, value: str) -> str:
        names = known_env_names()
        if value not in names:
            raise ValueError(
                f"unknown environment; valid: {', '.join(names)} (or a plug-in "
                f"of the entry-point group {ENV_GROUP!r})"
            )
        return value

    @field_validator("kwargs")
    @classmethod
    def _checked_kwargs(cls, value: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        if "name" in info.data:  # a valid name (an unknown one is reported by itself)
            check_env_kwargs(info.data["name"], value)
        return value
