"""Shared pytest setup.

CPU JAX with 8 simulated devices (set before JAX is imported), a session-wide real
fake-gcs-server, and a `store_uri` fixture parametrized over file:// and gs:// so the
same test runs on both backends.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import pytest

from tunix_tasks.testing.gcs_server import FakeGcs


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
