"""`Registry`: names -> factories, from code (`register`, `register_target`) and from an
entry-point group.

One instance per pluggable kind: the asynchronous envs (`tunix_tasks.envs`), the
vectorized JAX envs (`tunix_tasks.envs.vectorized`) and the object-store backends by URI
scheme (`tunix_tasks.storage.uri`). Entry points are discovered on demand, so any
installed plug-in is available by name without an import; a target registered as
``"module:attr"`` is imported on first use, so a backend's heavy client library loads only
when a run uses it.
"""

from __future__ import annotations

import importlib.metadata
import logging
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["Registry", "registered_in_code"]

logger = logging.getLogger(__name__)
F = TypeVar("F", bound=Callable[..., Any])
#: Entry-point group -> the names registered in code in this process (by any Registry of
#: that group), so a reader of names (the config) needs no import of the registry's owner.
_IN_CODE: dict[str, set[str]] = {}


def registered_in_code(group: str) -> set[str]:
    """The names registered in code in this process under entry-point group `group`."""
    return set(_IN_CODE.get(group, ()))


class Registry:
    """`register(name)(factory)`, `register_target(name, "module:attr")`, `names()`,
    `name in registry`, `factory(name)` (which raises `KeyError` listing the valid names)."""

    def __init__(self, group: str, what: str) -> None:
        self.group, self.what = group, what
        self._factories: dict[str, Callable[..., Any]] = {}
        self._targets: dict[str, importlib.metadata.EntryPoint] = {}

    def register(self, name: str) -> Callable[[F], F]:
        """Decorator: register a class or factory under ``name`` (re-registering the same
        object is a no-op; a different object under a taken name is an error)."""

        def deco(factory: F) -> F:
            existing = self._factories.get(name)
            if existing is not None and existing is not factory:
                raise ValueError(f"{self.what} {name!r} is already registered to {existing!r}")
            self._factories[name] = factory
            _IN_CODE.setdefault(self.group, set()).add(name)
            return factory

        return deco

    def register_target(self, name: str, target: str) -> None:
        """Register ``"module:attr"`` under ``name``, imported by the first `factory(name)`
        (the same target again is a no-op; another one under a taken name is an error)."""
        known = self._targets.get(name)
        if known is not None and known.value == target:
            return
        existing = known.value if known is not None else self._factories.get(name)
        if existing is not None:
            raise ValueError(f"{self.what} {name!r} is already registered to {existing!r}")
        self._targets[name] = importlib.metadata.EntryPoint(name, target, self.group)

    def copy(self) -> Registry:
        """An independent registry with the same registrations (tests restore it)."""
        other = Registry(self.group, self.what)
        other._factories, other._targets = dict(self._factories), dict(self._targets)
        return other

    def _entry_points(self) -> dict[str, importlib.metadata.EntryPoint]:
        try:
            eps = importlib.metadata.entry_points(group=self.group)
        except Exception:  # a broken installed distribution must not break the registry
            logger.exception("cannot list entry points of group %s", self.group)
            return {}
        return {ep.name: ep for ep in eps}

    def _lazy(self, name: str) -> importlib.metadata.EntryPoint | None:
        """The not-yet-imported target of `name`: registered in code, else installed."""
        return self._targets.get(name) or self._entry_points().get(name)

    def names(self) -> list[str]:
        """Registered and entry-point names, sorted."""
        return sorted(set(self._factories) | set(self._targets) | set(self._entry_points()))

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and (name in self._factories or self._lazy(name) is not None)

    def factory(self, name: str) -> Callable[..., Any]:
        if name in self._factories:
            return self._factories[name]
        ep = self._lazy(name)
        if ep is None:
            raise KeyError(f"unknown {self.what} {name!r}; available: {', '.join(self.names())}")
        factory = ep.load()
        if not callable(factory):
            raise TypeError(f"entry point {ep.value!r} for {name!r} is not callable")
        return self.register(name)(factory)
