"""FakeGcs: both storage backends serve the same objects; only the filesystem one writes
them under its data folder."""

from __future__ import annotations

import pytest

from tunix_tasks.storage.store import open_store
from tunix_tasks.testing.gcs_server import FakeGcs


@pytest.mark.parametrize("backend", ["filesystem", "memory"])
def test_backends_serve_the_same_objects(backend):
    with FakeGcs(backend=backend) as gcs:
        store = open_store(gcs.new_bucket_uri())
        store.write_bytes("shards/a/0.parquet", b"x" * 1000)
        assert store.read_bytes("shards/a/0.parquet") == b"x" * 1000
        assert [o.key for o in store.list("shards/")] == ["shards/a/0.parquet"]
        on_disk = [p for p in gcs.data_dir.rglob("*") if p.is_file()]
        assert bool(on_disk) == (backend == "filesystem")


def test_an_unknown_backend_is_refused():
    with pytest.raises(ValueError, match="backend must be"):
        FakeGcs(backend="disk")  # type: ignore[arg-type]
