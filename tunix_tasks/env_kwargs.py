"""Checks of the `env.kwargs` an environment owns, run when a config is loaded.

A bad constructor argument then fails `tunix-tasks config` (one line naming the kwarg and
its valid values), not an actor minutes later. The config finds an environment's check
through the entry-point group `tunix_tasks.env_kwargs` (the entry point's name is the
environment's), as it finds environment names, without importing any environment: the
learner reads config.json too and must not import them, nor the sandbox. So a check is a
function of the kwargs dict in a light module (standard library only), raising
`ValueError` whose message names the kwarg and its valid values. The built-in ones live
here and are declared in tunix-tasks' own pyproject.toml; a plug-in declares its own:

    [project.entry-points."tunix_tasks.env_kwargs"]
    my_env = "my_pkg.env_checks:check_my_env_kwargs"

`SANDBOX_MODES` is defined here, not in the sandbox, so the config can check
`env.kwargs.sandbox` without importing it (`envs/sandbox/limits.py` reads it from here).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal, get_args

__all__ = [
    "KWARGS_GROUP",
    "PYTHON_EXEC_KWARGS",
    "SANDBOX_MODES",
    "SandboxMode",
    "check_python_exec_kwargs",
]

KWARGS_GROUP = "tunix_tasks.env_kwargs"

SandboxMode = Literal["auto", "bwrap", "unsafe-audit-only"]
SANDBOX_MODES: tuple[str, ...] = get_args(SandboxMode)

#: The `env.kwargs` python_exec takes from a config (its `limits` is a Python object).
PYTHON_EXEC_KWARGS = ("max_operand", "max_turns", "sandbox")


def _listed(values: tuple[str, ...]) -> str:
    return ", ".join(map(repr, values))


def check_python_exec_kwargs(kwargs: Mapping[str, Any]) -> None:
    """python_exec's kwargs: known names, positive int operand and turn counts, and a
    sandbox mode (`auto`, `bwrap` or `unsafe-audit-only`; docs/sandbox.md)."""
    unknown = sorted(set(kwargs) - set(PYTHON_EXEC_KWARGS))
    if unknown:
        raise ValueError(
            f"{_listed(tuple(unknown))}: not a python_exec kwarg; valid: "
            f"{_listed(PYTHON_EXEC_KWARGS)}"
        )
    for name in ("max_operand", "max_turns"):
        value = kwargs.get(name, 1)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}: python_exec needs a positive integer, got {value!r}")
    mode = kwargs.get("sandbox", "auto")
    if mode not in SANDBOX_MODES:
        raise ValueError(
            f"sandbox: {mode!r} is not a sandbox mode of python_exec; valid: "
            f"{_listed(SANDBOX_MODES)} (docs/sandbox.md)"
        )
