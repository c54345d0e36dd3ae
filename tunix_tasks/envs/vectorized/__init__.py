"""Vectorized (pure JAX) environments: the registry and the built-ins.

    env = make_vec_env("calculator", difficulty=2)     # kwargs go to the factory
    available_vec_envs()                               # ['calculator', 'sorting', ...]

A vectorized env is the functional twin of an asynchronous env of the same name (same task
and reward; `base.VecEnv` is the contract, docs/vectorized.md shows how to write one).
`actor.kind: vectorized` steps E of them with the policy in one jitted loop
(`actor/vectorized/ondevice.py`). Plug-ins register with ``@register_vec_env("name")`` or an entry
point in the ``tunix_tasks.vec_envs`` group; the run's `env.name` must also name an
asynchronous env (its `demonstration` feeds the learner's warm start).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tunix_tasks.envs.vectorized.base import Chars, VecEnv
from tunix_tasks.envs.vectorized.calculator import VecCalculator
from tunix_tasks.envs.vectorized.sorting import VecSorting
from tunix_tasks.registry import Registry

__all__ = [
    "VEC_ENTRY_POINT_GROUP",
    "Chars",
    "VecCalculator",
    "VecEnv",
    "VecSorting",
    "available_vec_envs",
    "make_vec_env",
    "register_vec_env",
]

VEC_ENTRY_POINT_GROUP = "tunix_tasks.vec_envs"
_REGISTRY = Registry(VEC_ENTRY_POINT_GROUP, "vectorized environment")


def register_vec_env(name: str) -> Callable[[Any], Any]:
    """Decorator: register a `VecEnv` class or factory under ``name``."""
    return _REGISTRY.register(name)


def available_vec_envs() -> list[str]:
    return _REGISTRY.names()


def make_vec_env(name: str, **kwargs: Any) -> VecEnv:
    """Build vectorized env ``name``; `KeyError` lists the valid names, `TypeError` says
    what a factory's result lacks."""
    env = _REGISTRY.factory(name)(**kwargs)
    missing = [m for m in ("name", "obs_len", "reset", "step") if not hasattr(env, m)]
    if missing:
        raise TypeError(f"vectorized environment {name!r} lacks {', '.join(missing)}")
    if not isinstance(env.obs_len, int) or env.obs_len < 1:
        raise TypeError(f"vectorized environment {name!r}: obs_len must be a positive int")
    return env
