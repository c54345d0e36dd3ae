"""Environment registry: owns name -> factory lookup for built-in and plug-in environments.

    env = make_env("guess_number", max_n=32)                  # kwargs go to the factory
    env = make_env("calculator", latency_s=0.5, latency_jitter=0.2, latency_seed=0)
    available_envs()  # ['arithmetic', 'calculator', 'guess_number', 'python_exec', ...]

Register in code with ``@register_env("my_env")`` on a class or factory function, or
from another package with an entry point in the ``tunix_tasks.envs`` group, e.g. in its
pyproject.toml:

    [project.entry-points."tunix_tasks.envs"]
    my_env = "my_pkg.envs:MyEnv"

Entry points are discovered on demand (by ``make_env`` on an unknown name and by
``available_envs``), so the actor can run any installed environment by name. ``make_env``
checks what a factory returns against the protocol (``name``, valid ``tools``, ``reset``,
``step``, ``demonstration``) and raises ``TypeError`` naming the environment otherwise.

Plug-in authors import everything they need from here: ``Action``, ``ToolCall``,
``StepResult``, ``Environment``, ``function_tool`` and ``register_env``.

base.py          the `Environment` protocol, `StepResult`, the schema checks
answers.py       reading a final answer (the `<answer>` tag) and matching it to a reference
answer_turns.py  the turn loop of question-answer envs: calculator turns, then the answer
latency.py       `LatencyWrapper`: a simulated remote environment's delay
arithmetic.py    built-in: multi-digit arithmetic, reliably solved only with the calculator
calculator.py    built-in: arithmetic with a calculator tool
dataset.py       built-in: prompts and reference answers from a dataset file, your own task
dataset_files.py reading a dataset's rows (JSONL, Parquet, store URIs, Hugging Face), cached
guess_number.py  built-in: guess a number from higher/lower hints
python_exec.py   built-in: a program whose output is the target, run in the sandbox
reasoning_gym.py built-in: any reasoning-gym task generator, scored by its own scorer
                 (reasoning-gym itself is imported on the first construction, not here)
sorting.py       built-in: sort digits by swaps (a longer horizon)
sandbox/         running model-written Python under bubblewrap
vectorized/      pure JAX environments for the on-device actor

A new environment: a module here (or in your own package) with a class that satisfies
`Environment`, and an entry point in the ``tunix_tasks.envs`` group of its
pyproject.toml (the built-ins are registered the same way, in tunix-tasks' own).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any, TypeVar

from tunix_tasks.envs.arithmetic import ArithmeticEnv
from tunix_tasks.envs.base import (
    Action,
    Environment,
    StepResult,
    ToolCall,
    check_environment,
    check_tools,
)
from tunix_tasks.envs.calculator import CalculatorEnv
from tunix_tasks.envs.dataset import DatasetEnv
from tunix_tasks.envs.guess_number import GuessNumberEnv
from tunix_tasks.envs.latency import LatencyWrapper
from tunix_tasks.envs.python_exec import PythonExecEnv
from tunix_tasks.envs.reasoning_gym import ReasoningGymEnv
from tunix_tasks.envs.sorting import SortingEnv
from tunix_tasks.messages import function_tool
from tunix_tasks.registry import Registry

__all__ = [
    "ENTRY_POINT_GROUP",
    "Action",
    "ArithmeticEnv",
    "CalculatorEnv",
    "DatasetEnv",
    "Environment",
    "GuessNumberEnv",
    "LatencyWrapper",
    "PythonExecEnv",
    "ReasoningGymEnv",
    "SortingEnv",
    "StepResult",
    "ToolCall",
    "available_envs",
    "check_environment",
    "check_tools",
    "function_tool",
    "make_env",
    "register_env",
]

ENTRY_POINT_GROUP = "tunix_tasks.envs"
EnvFactory = Callable[..., Environment]
F = TypeVar("F", bound=Callable[..., Any])

_REGISTRY = Registry(ENTRY_POINT_GROUP, "environment")


def register_env(name: str) -> Callable[[F], F]:
    """Decorator: register a class or factory under ``name`` (re-registering the same
    object is a no-op; a different object under a taken name is an error)."""
    return _REGISTRY.register(name)


def available_envs() -> list[str]:
    """Names of registered and entry-point environments, sorted."""
    return _REGISTRY.names()


def make_env(
    name: str,
    *,
    latency_s: float = 0.0,
    latency_jitter: float = 0.0,
    latency_seed: int | None = None,
    latency_schedule: tuple[tuple[float, float], ...] = (),
    started_at: float | None = None,
    **kwargs: Any,
) -> Environment:
    """Build environment ``name`` with ``kwargs``; with ``latency_s > 0`` or a
    ``latency_schedule`` wrap it in a ``LatencyWrapper`` (jitter fraction
    ``latency_jitter``, RNG seeded by ``latency_seed``, the schedule from ``started_at``).
    Raises ``KeyError`` listing the valid names when ``name`` is unknown, ``TypeError``
    naming it when the object built does not have the protocol's members."""
    env = _REGISTRY.factory(name)(**kwargs)
    check_environment(env, name)
    if latency_s > 0 or latency_schedule:
        rng = random.Random(latency_seed)
        env = LatencyWrapper(
            env, latency_s, latency_jitter, rng, schedule=latency_schedule, started_at=started_at
        )
    return env
