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

Bounded: when a process starts and finds the directory over ``MAX_BYTES``, it deletes
the least recently used files until it is under 3/4 of that. JAX's own bound
(``jax_compilation_cache_max_size``) is not used: it needs an access-time file beside
every entry, and one entry written without (by any process that did not set the bound:
a test suite's cache, a user's ``JAX_COMPILATION_CACHE_DIR``) makes each later write of a
bounded process fail. Deleting an entry another process is about to read costs that
process a compile, never an error. JAX stores only programs that took a second or more to
compile (its default threshold): the rest are cheaper to compile than to read back. A
directory that cannot be created is one logged warning and no cache.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

__all__ = ["ENV", "MAX_BYTES", "cache_dir", "enable_compile_cache", "prune", "user_cache_dir"]

log = logging.getLogger(__name__)

ENV = "TUNIX_COMPILE_CACHE"
MAX_BYTES = 2 << 30


def user_cache_dir() -> Path:
    """This user's tunix-tasks cache folder: ``$XDG_CACHE_HOME/tunix-tasks``
    (``~/.cache/tunix-tasks``). The compile cache's default and a gs:// run's process logs
    (`supervision.process_log_dir`) live under it."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tunix-tasks"


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
    return user_cache_dir() / "xla"


def prune(path: Path, max_bytes: int = MAX_BYTES) -> int:
    """Over `max_bytes`, delete the files of `path` least recently used first (the later of
    access and modification time) until under 3/4 of it; returns the bytes deleted."""
    files = []
    for f in path.iterdir():
        try:
            st = f.stat()
        except FileNotFoundError:  # another process pruned it
            continue
        if f.is_file():
            files.append((max(st.st_atime, st.st_mtime), st.st_size, f))
    total = sum(size for _, size, _ in files)
    if total <= max_bytes:
        return 0
    freed = 0
    for _, size, f in sorted(files, key=lambda x: x[0]):
        if total - freed <= max_bytes * 3 // 4:
            break
        f.unlink(missing_ok=True)
        freed += size
    log.info("compile cache %s: deleted %.0f MB of least recently used programs", path, freed / 1e6)
    return freed


def enable_compile_cache(max_bytes: int = MAX_BYTES) -> Path | None:
    """Point JAX's persistent compilation cache at `cache_dir()`, pruned to `max_bytes`;
    returns it (None: off). A directory JAX was given before (a test's own cache, a
    user's jax.config) is kept."""
    path = cache_dir()
    if path is None:
        return None
    import jax

    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        log.warning("compile cache off: cannot create %s (%s)", path, err)
        return None
    prune(path, max_bytes)
    if jax.config.jax_compilation_cache_dir != str(path):
        jax.config.update("jax_compilation_cache_dir", str(path))
    return path
