"""Store backends are plug-ins: `open_store` opens what is registered for the URI's
scheme (in code or by entry point), an unknown scheme's error lists the valid ones, and
the config and the file:// backend never import google-cloud-storage."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
from pathlib import Path

import pytest

import tunix_tasks.storage.uri as uri_mod
from tunix_tasks.config import ConfigError, config_from_dict
from tunix_tasks.storage.backends.local import LocalStore
from tunix_tasks.storage.store import ObjectStore, open_store
from tunix_tasks.storage.uri import InvalidURI, normalize_uri, register_backend

REPO = Path(__file__).resolve().parents[3]


class MemtestStore(LocalStore):
    """`memtest://<bucket>/<prefix>`: a folder under `MemtestStore.base` per bucket."""

    base = Path("/nonexistent")

    def __init__(self, uri: str) -> None:
        super().__init__(f"file://{self.base}/{uri.removeprefix('memtest://')}")
        self.uri = uri


@pytest.fixture
def backends(monkeypatch, tmp_path):
    """The scheme table, restored after the test; `MemtestStore` rooted in tmp_path."""
    monkeypatch.setattr(uri_mod, "BACKENDS", uri_mod.BACKENDS.copy())
    monkeypatch.setattr(uri_mod, "_ROOTS", dict(uri_mod._ROOTS))
    monkeypatch.setattr(MemtestStore, "base", tmp_path)
    return uri_mod.BACKENDS


def test_a_registered_scheme_is_what_open_store_returns(backends, tmp_path):
    register_backend("memtest", MemtestStore)
    assert normalize_uri(" memtest://bucket/runs/r1/ ") == "memtest://bucket/runs/r1"
    store = open_store("memtest://bucket/runs/r1/")
    assert type(store) is MemtestStore and isinstance(store, ObjectStore)
    assert store.uri == "memtest://bucket/runs/r1"
    store.write_bytes("a/x.bin", b"one")
    assert open_store("memtest://bucket/runs/r1").read_bytes("a/x.bin") == b"one"
    assert (tmp_path / "bucket/runs/r1/a/x.bin").read_bytes() == b"one"
    # The config accepts the scheme too: its URI check is the same table.
    assert config_from_dict({"store": "memtest://bucket/runs/"}).store == "memtest://bucket/runs"
    with pytest.raises(InvalidURI, match="needs a bucket"):
        normalize_uri("memtest:///runs")


def test_a_backend_missing_part_of_the_contract_is_named_on_open(backends):
    """A plug-in written before `read_head` joined the contract: refused as it opens,
    naming what it lacks, not an AttributeError at the first manifest it reads."""

    class Older(MemtestStore):
        read_head = None

    register_backend("memold", Older)
    with pytest.raises(TypeError, match=r"Older for memold://bucket/r lacks read_head of"):
        open_store("memold://bucket/r")


def test_a_backend_registered_by_name_is_imported_on_first_open(backends):
    register_backend("memlazy", "tests.unit.storage.test_backends:MemtestStore")
    assert "memlazy" in backends.names()
    assert type(open_store("memlazy://bucket/r")) is MemtestStore
    register_backend("memlazy", "tests.unit.storage.test_backends:MemtestStore")  # no-op
    with pytest.raises(ValueError, match="already registered"):
        register_backend("memlazy", "tunix_tasks.storage.backends.local:LocalStore")


def test_an_entry_point_backend_is_opened_by_its_scheme(backends, monkeypatch):
    ep = importlib.metadata.EntryPoint(
        name="memplug",
        value="tests.unit.storage.test_backends:MemtestStore",
        group=uri_mod.ENTRY_POINT_GROUP,
    )
    real = importlib.metadata.entry_points

    def entry_points(**kw):
        if kw == {"group": uri_mod.ENTRY_POINT_GROUP}:
            return importlib.metadata.EntryPoints([ep])
        return real(**kw)

    monkeypatch.setattr(importlib.metadata, "entry_points", entry_points)
    assert normalize_uri("memplug://bucket/p/") == "memplug://bucket/p"
    assert type(open_store("memplug://bucket/p")) is MemtestStore


def test_an_unknown_scheme_is_an_error_listing_the_valid_ones(backends):
    for call in (normalize_uri, open_store):
        with pytest.raises(InvalidURI, match=r"unsupported store scheme 's3'.*valid: file, gs$"):
            call("s3://bucket/x")
    register_backend("memtest", MemtestStore)
    with pytest.raises(InvalidURI, match=r"valid: file, gs, memtest$"):
        open_store("s3://bucket/x")
    with pytest.raises(ConfigError, match="valid: file, gs, memtest"):
        config_from_dict({"store": "s3://bucket/x"})


def test_the_backends_say_where_orbax_and_local_readers_find_a_key(tmp_path, monkeypatch):
    local = open_store(str(tmp_path / "run"))
    assert local.local_path() == tmp_path / "run"
    assert local.local_path("shards/a") == tmp_path / "run/shards/a"
    assert local.orbax_path("learner/checkpoints") == str(tmp_path / "run/learner/checkpoints")
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", "http://127.0.0.1:9")  # no request is made
    remote = open_store("gs://bucket/run")
    assert remote.local_path() is None and remote.local_path("shards") is None
    assert remote.orbax_path("learner/checkpoints") == "gs://bucket/run/learner/checkpoints"


def test_config_and_the_file_backend_do_not_import_gcs_or_arrow_too_early():
    script = (
        "import sys\n"
        "from tunix_tasks.config import config_from_dict\n"
        "config_from_dict({'store': 'gs://bucket/runs'})\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('pyarrow', 'google'))\n"
        "assert not heavy, heavy\n"
        "from tunix_tasks.storage.store import open_store\n"
        "open_store('file:///tmp/tunix-backend-test').exists('x')\n"
        "assert 'google.cloud.storage' not in sys.modules\n"
        "assert 'tunix_tasks.storage.backends.gcs' not in sys.modules\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 0, out.stderr[-2000:]
