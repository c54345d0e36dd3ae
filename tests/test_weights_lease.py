"""Weight snapshots (publish, verify, refuse) and the single-learner lease, on both backends."""

from __future__ import annotations

import json
import multiprocessing as mp
import time

import numpy as np
import pytest

from tunix_tasks.storage.lease import Lease, LeaseHeldError, LeaseLost
from tunix_tasks.storage.store import open_store
from tunix_tasks.storage.weights import (
    PublishConflict,
    WeightsClient,
    WeightsError,
    WeightsPublisher,
    load_snapshot,
    read_latest,
)


def _params(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "embed/w": rng.standard_normal((4, 3)).astype(np.float32),
        "out/b": np.zeros(3, np.float32),
    }


def test_publish_then_client_reloads_when_latest_moves(store_uri):
    store = open_store(store_uri)
    client = WeightsClient(store)
    assert client.poll() is None
    pub = WeightsPublisher(store)
    pub.publish(_params(0), version=0, step=0, model={"preset": "tiny"})
    flat, manifest = client.poll()
    assert manifest.version == 0 and client.version == 0
    np.testing.assert_array_equal(flat["embed/w"], _params(0)["embed/w"])
    assert client.poll() is None  # LATEST did not move
    pub.publish(_params(1), version=1, step=5, model={"preset": "tiny"})
    flat, manifest = client.poll()
    assert (manifest.version, manifest.step) == (1, 5)
    assert read_latest(store)[:2] == (1, "weights/v00000001")
    keys = {i.key for i in store.list("weights/")}
    assert {"weights/v00000001/params.safetensors", "weights/v00000001/manifest.json"} <= keys


def test_corrupt_snapshot_refused_client_keeps_old(store_uri):
    store = open_store(store_uri)
    pub = WeightsPublisher(store)
    pub.publish(_params(0), version=0, step=0, model={})
    client = WeightsClient(store)
    assert client.poll() is not None
    pub.publish(_params(1), version=1, step=1, model={})
    blob = bytearray(store.read_bytes("weights/v00000001/params.safetensors"))
    blob[-1] ^= 0xFF
    store.write_bytes("weights/v00000001/params.safetensors", bytes(blob))
    assert client.poll() is None
    assert client.version == 0 and "checksum" in client.refused[1]
    with pytest.raises(WeightsError, match="checksum"):
        load_snapshot(store, 1)
    pub.publish(_params(2), version=2, step=2, model={})
    assert client.poll()[1].version == 2


def test_second_publisher_detected(store_uri):
    store = open_store(store_uri)
    a, b = WeightsPublisher(store), WeightsPublisher(store)
    a.publish(_params(0), version=0, step=0, model={})
    with pytest.raises(PublishConflict, match="second learner"):
        b.publish(_params(1), version=1, step=1, model={})


def test_lease_refuses_second_learner(store_uri):
    store = open_store(store_uri)
    first = Lease(store, ttl_s=30)
    first.acquire()
    second = Lease(store, ttl_s=30)
    # Same host, live pid (ours): must be refused.
    with pytest.raises(LeaseHeldError, match="refusing to start a second learner"):
        second.acquire()
    first.release()
    second.acquire()  # a released lease is free
    second.ensure()
    second.release()


def _hold_lease(uri, ready):
    lease = Lease(open_store(uri), ttl_s=300)
    lease.acquire()
    ready.set()
    time.sleep(600)


def test_lease_of_dead_process_taken_over(store_uri):
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    proc = ctx.Process(target=_hold_lease, args=(store_uri, ready))
    proc.start()
    assert ready.wait(60)
    store = open_store(store_uri)
    with pytest.raises(LeaseHeldError):
        Lease(store).acquire()
    proc.kill()
    proc.join()
    Lease(store).acquire()  # owner is dead: taken over at once


def test_lease_lost_when_taken_over(store_uri):
    store = open_store(store_uri)
    lease = Lease(store, ttl_s=0.3)
    lease.acquire()
    time.sleep(0.5)  # expired without renewal
    thief = Lease(store, ttl_s=30)
    holder = json.loads(store.read_bytes("learner/LEASE"))
    holder["host"] = "elsewhere"  # make the expiry, not the pid check, decide
    thief.acquire()
    lease.renew()
    assert lease.lost
    with pytest.raises(LeaseLost):
        lease.ensure()
