"""Bounds on what a weight snapshot may be (issue #30, round 2): non-finite weights are
never published nor loaded, and a file larger than its manifest says is refused unread."""

from __future__ import annotations

import hashlib
import logging
import os
import re
import struct
import time
import tracemalloc
from dataclasses import replace

import numpy as np
import pytest

from tunix_tasks.learner.publishing import SnapshotPublisher
from tunix_tasks.storage.layout import RunLayout
from tunix_tasks.storage.lease import Lease
from tunix_tasks.storage.snapshot_format import (
    Manifest,
    encode_delta,
    encode_pointer,
    encode_snapshot,
)
from tunix_tasks.storage.store import open_store
from tunix_tasks.storage.weights import (
    DELTA_FILE,
    MANIFEST_FILE,
    PARAMS_FILE,
    WeightsClient,
    WeightsError,
    WeightsPublisher,
    load_snapshot,
    read_latest,
    read_manifest,
)

GIB = 1 << 30


def _params(seed: int, bad: float | None = None) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    flat = {"embed/w": rng.standard_normal((64, 16)).astype(np.float32)}
    flat["out/b"] = np.zeros(16, np.float32)
    if bad is not None:
        flat["out/b"][3] = bad
    return flat


def _write_unchecked(store, flat: dict[str, np.ndarray], version: int, delta: bool) -> None:
    """What a learner without the check published: a snapshot (a delta against v0 when
    `delta`) whose sha256 is valid, and `LATEST` moved to it."""
    blob, manifest = encode_snapshot(flat, version=version, step=version, model={})
    name, data = PARAMS_FILE, blob
    if delta:
        base = read_manifest(store, 0)
        data = encode_delta(blob, store.read_bytes(f"{RunLayout.snapshot(0)}/{PARAMS_FILE}"))
        name, based = DELTA_FILE, {"version": 0, "sha256": base.sha256}
        manifest = replace(manifest, kind="delta", base=based, num_bytes=len(data))
    store.write_bytes(f"{RunLayout.snapshot(version)}/{name}", data)
    store.write_bytes(f"{RunLayout.snapshot(version)}/{MANIFEST_FILE}", manifest.to_json())
    _point_to(store, version)


def _point_to(store, version: int) -> None:
    """`LATEST` moved to `version`, as a learner moves it."""
    generation = read_latest(store)[2]
    store.write_if_generation(RunLayout.LATEST, encode_pointer(version, version), generation)


def test_the_learner_never_publishes_non_finite_weights(tmp_path):
    """Item 1: NaN/Inf in the params stop the learner with an error naming the step;
    nothing of that version is written and `LATEST` stays on the last good one."""
    store = open_store(str(tmp_path))
    lease = Lease(store, ttl_s=60)
    lease.acquire()
    pub = SnapshotPublisher(store, lease, model={})
    try:
        pub.publish(_params(0), version=0, step=0)
        pub.wait()
        pub.publish(_params(1, bad=float("nan")), version=1, step=7)
        with pytest.raises(WeightsError, match=r"after step 7 .*'out/b' has 1 NaN/Inf"):
            pub.wait()
    finally:
        pub.close()
        lease.release()
    assert read_latest(store)[0] == 0
    assert not store.list(RunLayout.snapshot(1) + "/")
    with pytest.raises(WeightsError, match=r"step 3 .*non-finite"):
        WeightsPublisher(store).publish(_params(2, bad=-np.inf), version=2, step=3, model={})


@pytest.mark.parametrize("delta", [False, True], ids=["full", "delta"])
def test_the_client_refuses_non_finite_weights_and_keeps_its_own(tmp_path, caplog, delta):
    """Item 1: a snapshot (full, or a delta rebuilding params) holding NaN with a valid
    sha256 is refused before the swap, logged once; the actor keeps its weights."""
    store = open_store(str(tmp_path))
    WeightsPublisher(store, full_every=4).publish(_params(0), version=0, step=0, model={})
    client = WeightsClient(store)
    assert client.poll()[1].version == 0
    nan = _params(0, bad=float("nan"))
    _write_unchecked(store, nan, version=1, delta=delta)
    applied = []
    with caplog.at_level(logging.ERROR):
        for _ in range(3):
            assert client.poll(lambda flat, m: applied.append(m.version)) is None
    assert applied == [] and client.version == 0
    assert "non-finite weights: tensor 'out/b' has 1 NaN/Inf" in client.refused[1]
    assert [r.getMessage() for r in caplog.records].count(
        f"refusing weights v1, keeping v0: {client.refused[1]}"
    ) == 1


class _ReadSpy:
    """A store that records which keys were read (their bytes, not their metadata)."""

    def __init__(self, store) -> None:
        self._store = store
        self.read: list[str] = []

    def read_bytes(self, key: str) -> bytes:
        self.read.append(key)
        return self._store.read_bytes(key)

    def read_head(self, key: str, max_bytes: int) -> bytes:
        self.read.append(key)
        return self._store.read_head(key, max_bytes)

    def open_input(self, key: str):
        self.read.append(key)
        return self._store.open_input(key)

    def read_to(self, key: str, sink) -> None:
        self.read.append(key)
        self._store.read_to(key, sink)

    def __getattr__(self, name: str):
        return getattr(self._store, name)


@pytest.mark.parametrize("name", [PARAMS_FILE, DELTA_FILE])
def test_a_file_larger_than_its_manifest_says_is_refused_unread(tmp_path, name):
    """Item 2: a 1 GiB (sparse) params or delta file whose manifest says a few KB is
    refused from its size alone: not read, no memory allocated for it, in well under 1 s."""
    store = open_store(str(tmp_path))
    pub = WeightsPublisher(store, full_every=4)
    pub.publish(_params(0), version=0, step=0, model={})
    spy = _ReadSpy(store)
    client = WeightsClient(spy)
    assert client.poll()[1].version == 0
    v1 = {k: v + np.float32(1e-3) for k, v in _params(0).items()}
    pub.full_every = 4 if name == DELTA_FILE else 1
    assert pub.publish(v1, version=1, step=1, model={}).num_bytes < 100_000
    key = f"{RunLayout.snapshot(1)}/{name}"
    os.truncate(store.local_path(key), GIB)
    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        assert client.poll() is None
        elapsed = time.perf_counter() - t0
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert f"{name} has {GIB} bytes, its manifest says" in client.refused[1], client.refused
    assert key not in spy.read
    assert elapsed < 1.0 and peak < 8 << 20, (elapsed, peak)
    assert client.version == 0


DEEP = b"[" * 100_000 + b"]" * 100_000  # json.loads: RecursionError, not a ValueError


@pytest.mark.timeout(30)  # the FIFO manifest blocked the reader forever
@pytest.mark.parametrize(
    ("bad", "why"),
    [
        ("fifo manifest", r"incomplete: .*manifest\.json is a FIFO, not a regular file"),
        ("sparse manifest", r"manifest\.json holds 1073741824 bytes, more than the 1048576"),
        ("deep manifest", "invalid manifest: nested too deeply"),
        ("deep params header", "not valid safetensors: header is not JSON: nested too deeply"),
    ],
)
def test_a_manifest_or_header_no_reader_could_parse_is_refused_once(tmp_path, bad, why):
    """A snapshot whose manifest is a FIFO, a 1 GiB (sparse) file, or JSON nested 100k
    deep, or whose params header is (checksum valid), is refused by the actor's client
    with one logged reason, its weights kept, as the export refuses it (the same reader:
    `load_snapshot`); before, a traceback (RecursionError) or a reader blocked forever."""
    store = open_store(str(tmp_path))
    WeightsPublisher(store).publish(_params(0), version=0, step=0, model={})
    client = WeightsClient(store)
    assert client.poll()[1].version == 0
    folder = store.local_path(RunLayout.snapshot(1))
    folder.mkdir(parents=True)
    manifest = folder / MANIFEST_FILE
    if bad == "fifo manifest":
        os.mkfifo(manifest)
    elif bad == "sparse manifest":
        manifest.touch()
        os.truncate(manifest, GIB)
    elif bad == "deep manifest":
        manifest.write_bytes(DEEP)
    else:
        blob = struct.pack("<Q", len(DEEP)) + DEEP
        (folder / PARAMS_FILE).write_bytes(blob)
        sha = hashlib.sha256(blob).hexdigest()
        manifest.write_bytes(Manifest(1, 1, sha, 0.0, len(blob), {}).to_json())
    _point_to(store, 1)
    assert client.poll() is None and client.poll() is None
    assert re.search(why, client.refused[1]), client.refused
    assert client.version == 0
    with pytest.raises(WeightsError, match=why):
        load_snapshot(store, 1)


def test_a_reload_holds_the_snapshot_once_on_every_backend(store_uri):
    """A reload streams the params file into the one array its tensors view (the store's
    `read_to`): its traced peak is about the snapshot, on gs:// too, where reading the
    object whole as bytes and copying it into the array held it twice."""
    store = open_store(store_uri)
    flat = {"w": np.random.default_rng(0).standard_normal((1024, 4096)).astype(np.float32)}
    WeightsPublisher(store).publish(flat, version=0, step=0, model={})
    size = store.size(f"{RunLayout.snapshot(0)}/{PARAMS_FILE}")
    kept = []
    client = WeightsClient(store)
    tracemalloc.start()
    try:
        client.poll(lambda params, manifest: kept.append(params))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    np.testing.assert_array_equal(kept[0]["w"], flat["w"])
    assert size <= peak < 1.1 * size, peak / size
