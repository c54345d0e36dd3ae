"""The persistent XLA compilation cache that every actor, learner and eval process uses.

A real model's programs take seconds to compile on CPU (SmolLM2-135M: a decode segment
5-6 s, a train step 16-31 s; docs/models.md), and every restart, resume, evaluation and
`tunix-tasks train` compiled the same programs again. JAX's persistent cache keeps the
compiled executables on disk, keyed by the program, its shapes, the devices and the
jax/XLA versions, so a later process with the same programs loads them instead.

    enable_compile_cache()   # at a process entry point, before its first jit; idempotent

Where, first match wins:
- ``TUNIX_COMPILE_CACHE``: a directory, or ``off`` to compile every time;
- a directory JAX was already given (``JAX_COMPILATION_CACHE_DIR``, ``jax.config``);
- ``$XDG_CACHE_HOME/tunix-tasks/xla`` (``~/.cache/tunix-tasks/xla``).

Bounded: past ``MAX_BYTES`` JAX evicts the least recently used entries. JAX stores only
programs that took a second or more to compile (its default threshold): the rest are
cheaper to compile than to read back. A directory that cannot be created is one logged
warning and no cache.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

__all__ = ["ENV", "MAX_BYTES", "cache_dir", "enable_compile_cache"]

log = logging.getLogger(__name__)

ENV = "TUNIX_COMPILE_CACHE"
MAX_BYTES = 2 << 30


def cache_dir() -> Path | None:
    """The directory `enable_compile_cache` uses (None: off)."""
    chosen = os.environ.get(ENV, "").strip()
    if chosen.lower() == "off":
        return None
    if chosen:
        return Path(chosen).expanduser()
    import jax  # here: entry points import this module before they decide to need JAX

    given = jax.config.jax_compilation_cache_dir
    if given:
        return Path(given)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "tunix-tasks" / "xla"


def enable_compile_cache() -> Path | None:
    """Point JAX's persistent compilation cache at `cache_dir()`; returns it (None: off).
    Settings made before (a test's own cache, a user's jax.config) are kept."""
    path = cache_dir()
    if path is None:
        return None
    import jax

    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        log.warning("compile cache off: cannot create %s (%s)", path, err)
        return None
    if jax.config.jax_compilation_cache_dir != str(path):
        jax.config.update("jax_compilation_cache_dir", str(path))
    if jax.config.jax_compilation_cache_max_size == -1:  # JAX's default: unbounded
        jax.config.update("jax_compilation_cache_max_size", MAX_BYTES)
    return path
