"""The persistent compilation cache of actor, learner and eval processes.

`enable_compile_cache` picks its directory (TUNIX_COMPILE_CACHE, then what JAX was told,
then ~/.cache), bounds it, keeps a directory already chosen, turns off on request or when
the directory cannot be made; and a second process with the same program loads it from
the cache instead of compiling (JAX's own cache-hit event says so).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from tunix_tasks.frontdoor.compile_cache import ENV, cache_dir, enable_compile_cache, prune

_NAMES = ("jax_compilation_cache_dir", "jax_compilation_cache_max_size")


@pytest.fixture
def jax_cache_config():
    """Restore this process's cache settings (the suite's session cache) afterwards."""
    old = {n: getattr(jax.config, n) for n in _NAMES}
    yield
    for n, v in old.items():
        jax.config.update(n, v)


def test_the_directory_is_chosen_in_order(monkeypatch, tmp_path, jax_cache_config):
    monkeypatch.setenv(ENV, str(tmp_path / "mine"))
    assert cache_dir() == tmp_path / "mine"
    monkeypatch.setenv(ENV, "off")
    assert cache_dir() is None and enable_compile_cache() is None
    monkeypatch.delenv(ENV)
    jax.config.update("jax_compilation_cache_dir", str(tmp_path / "given"))
    assert cache_dir() == tmp_path / "given"
    jax.config.update("jax_compilation_cache_dir", None)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "tunix-tasks" / "xla"


def test_enabling_prunes_the_least_recently_used_past_the_bound(
    monkeypatch, tmp_path, jax_cache_config
):
    cache = tmp_path / "xla"
    cache.mkdir()
    for i in range(10):  # 10 programs of 100 bytes, used at t = 1000 + i
        f = cache / f"jit_f{i}-cache"
        f.write_bytes(b"x" * 100)
        os.utime(f, (1000 + i, 1000 + i))
    monkeypatch.setenv(ENV, str(cache))
    assert enable_compile_cache(max_bytes=1000) == cache  # at the bound: nothing goes
    assert len(list(cache.iterdir())) == 10
    assert jax.config.jax_compilation_cache_dir == str(cache)
    assert jax.config.jax_compilation_cache_max_size == -1  # JAX's own bound stays off
    (cache / "jit_new-cache").write_bytes(b"x" * 100)  # over: down to 3/4 of the bound
    assert prune(cache, max_bytes=1000) == 400
    assert sorted(f.name for f in cache.iterdir()) == [
        *(f"jit_f{i}-cache" for i in range(4, 10)),
        "jit_new-cache",
    ]


def test_a_directory_that_cannot_be_made_is_a_warning(monkeypatch, tmp_path, caplog):
    (tmp_path / "file").write_text("not a directory")
    monkeypatch.setenv(ENV, str(tmp_path / "file" / "xla"))
    before = jax.config.jax_compilation_cache_dir
    assert enable_compile_cache() is None
    assert "compile cache off" in caplog.text
    assert jax.config.jax_compilation_cache_dir == before


_PROCESS = """
import json, sys, jax, jax.numpy as jnp
from tunix_tasks.frontdoor.compile_cache import enable_compile_cache
hits = []
jax.monitoring.register_event_listener(
    lambda name, **kw: hits.append(name) if name == "/jax/compilation_cache/cache_hits" else None
)
enable_compile_cache()
f = jax.jit(lambda x: jnp.tanh(x @ x.T).sum())
f(jnp.ones((64, 64))).block_until_ready()
print(json.dumps({"hits": len(hits)}))
"""


def test_a_second_process_loads_the_program_from_the_cache(tmp_path):
    env = {
        **os.environ,
        ENV: str(tmp_path / "xla"),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",  # store even this quick program
    }
    env.pop("JAX_COMPILATION_CACHE_DIR", None)

    def hits() -> int:
        out = subprocess.run(
            [sys.executable, "-c", _PROCESS], env=env, capture_output=True, text=True, timeout=120
        )
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout.strip().splitlines()[-1])["hits"]

    assert hits() == 0
    assert any(Path(tmp_path / "xla").iterdir())
    assert hits() >= 1
