"""Shared pytest setup.

CPU JAX with 8 simulated devices and unoptimized code generation (set before JAX is
imported: compiling is most of what the suite's tiny programs cost), one persistent XLA
compilation cache for the session, a session-wide real fake-gcs-server, and a
`store_uri` fixture parametrized over file:// and gs:// so the same test runs on both
backends.

The compilation cache: the suite builds the same few tiny models again and again, in
this process and in the learner and actor processes of every end-to-end run (they
inherit the environment), and XLA compiles each program from scratch every time. With
one cache directory per session a program is compiled once, then loaded. Compile
*counts* are unchanged: they count traces (`Sampler.compile_count`,
`Trainer.compile_count`), which still happen. The directory is new for each session and
removed after it, so no run depends on an earlier one.

Garbage-collection pauses over `GC_PAUSE_S` are recorded with the test that paid them and
listed at the end of the run: a test with a tight wall-clock margin that failed once on CI
may have met one (a full collection walks this long-lived process's whole heap). They
travel in each test's report (`user_properties`), so with `-n` (pytest-xdist, as `make
test` runs) the controller lists the workers' pauses.
"""

from __future__ import annotations

import atexit
import gc
import os
import shutil
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# LLVM at -O0 (`xla_backend_optimization_level`): the suite's programs are tiny and are
# traced and compiled hundreds of times, so compiling is most of its time. The level
# changes how fast the code runs and the order of float32 additions (rounding), not the
# maths: every comparison of two programs carries a float tolerance. Measured:
# test_sampling.py 48 -> 33 s, the HF and GGUF import tests 95 -> 75 s, test_learning.py
# 228 -> 198 s; the whole suite 40:10 -> 34:29 on CI's 2-core host.
os.environ.setdefault(
    "XLA_FLAGS", "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
)
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _XLA_CACHE = tempfile.mkdtemp(prefix="tunix-tests-xla-cache-")
    atexit.register(shutil.rmtree, _XLA_CACHE, ignore_errors=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _XLA_CACHE
    # Every program, however quick to compile or small: the tiny models' are both.
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"

import pytest

from tunix_tasks.testing.gcs_server import FakeGcs

GC_PAUSE_S = 0.2
_gc_pauses: list[tuple[float, int, str]] = []  # (seconds, generation, the test)
_gc_started = [0.0]


def _time_collections(phase: str, info: dict) -> None:
    if phase == "start":
        _gc_started[0] = time.perf_counter()
        return
    took = time.perf_counter() - _gc_started[0]
    if took > GC_PAUSE_S:
        test = os.environ.get("PYTEST_CURRENT_TEST", "(between tests)")
        _gc_pauses.append((took, info["generation"], test))


gc.callbacks.append(_time_collections)


_reported_pauses: list[tuple[float, int, str]] = []  # every process's, where reports arrive


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item):
    report = (yield).get_result()
    if report.when == "teardown" and _gc_pauses:  # with those since the last test's end
        report.user_properties.append(("gc_pauses", [list(p) for p in _gc_pauses]))
        _gc_pauses.clear()


def pytest_runtest_logreport(report) -> None:
    _reported_pauses.extend(
        tuple(p) for k, v in report.user_properties if k == "gc_pauses" for p in v
    )


def pytest_terminal_summary(terminalreporter) -> None:
    if not _reported_pauses:
        return
    total, count = sum(p for p, _, _ in _reported_pauses), len(_reported_pauses)
    terminalreporter.write_line(
        f"garbage-collection pauses over {GC_PAUSE_S} s: {count}, {total:.1f} s in all; "
        "the longest:"
    )
    for took, generation, test in sorted(_reported_pauses, reverse=True)[:5]:
        terminalreporter.write_line(f"  {took:.2f} s (generation {generation}) in {test}")


@pytest.fixture(scope="session")
def gcs_server():
    with FakeGcs() as server:
        yield server


@pytest.fixture(params=["file", "gs"])
def store_uri(request, tmp_path) -> str:
    """A fresh empty run root on each backend."""
    if request.param == "file":
        return f"file://{tmp_path}/run"
    server = request.getfixturevalue("gcs_server")
    return server.new_bucket_uri()
