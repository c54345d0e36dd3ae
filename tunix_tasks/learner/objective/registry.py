"""The corrections' registry: a name -> `Correction` (the loss function and what it needs).

The built-ins register themselves in `corrections.py`; your own register the same way,
in your own module::

    from tunix_tasks.learner.objective import CorrectionOutput, register_correction

    @register_correction()                  # name: "my_pkg.my_module:my_loss"
    def my_loss(x, params): return CorrectionOutput(x.advantages * x.logp_new, {})

and are chosen with ``learner.correction: my_pkg.my_module:my_loss``: looking up a name
of that form imports ``my_pkg.my_module`` first, which runs its registrations. Unknown
names are an error listing the registered ones.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable
from typing import TypeVar

from tunix_tasks.learner.objective.inputs import CorrectionOutput, CorrectionParams, LossInputs

__all__ = ["Correction", "LossFn", "get_correction", "register_correction", "registered"]

#: A correction's loss: the batch's inputs and hyperparameters -> the per-token objective.
LossFn = Callable[[LossInputs, CorrectionParams], CorrectionOutput]
F = TypeVar("F", bound=LossFn)


@dataclasses.dataclass(frozen=True)
class Correction:
    """One registered off-policy correction."""

    name: str
    loss: LossFn
    # Wants the proximal policy's log-probs (`LossInputs.logp_prox`): the learner keeps
    # the first update's log-probs of each batch for the later ones.
    needs_proximal: bool = False


_REGISTRY: dict[str, Correction] = {}


def register_correction(
    name: str | None = None, *, needs_proximal: bool = False
) -> Callable[[F], F]:
    """Register the decorated loss under `name` (default: its import path
    ``module:function``, which is what ``learner.correction`` takes). Returns it unchanged."""

    def add(fn: F) -> F:
        key = name or f"{fn.__module__}:{fn.__qualname__}"
        old = _REGISTRY.get(key)
        if old is not None and old.loss is not fn:
            raise ValueError(f"correction {key!r} is already registered")
        _REGISTRY[key] = Correction(key, fn, needs_proximal=needs_proximal)
        return fn

    return add


def registered() -> tuple[str, ...]:
    """The names registered so far, sorted."""
    return tuple(sorted(_REGISTRY))


def get_correction(name: str) -> Correction:
    """The correction registered as `name`; a ``module:function`` name imports
    ``module`` first."""
    if name not in _REGISTRY and ":" in name:
        module = name.partition(":")[0]
        try:
            importlib.import_module(module)  # runs its @register_correction calls
        except ImportError as err:
            raise ValueError(f"correction {name!r}: cannot import {module!r}: {err}") from err
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(
            f"unknown correction {name!r}; registered: {list(registered())}, or "
            "'package.module:function' naming a function decorated with "
            "@register_correction()"
        ) from None
