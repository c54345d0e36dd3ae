"""The learner never waits on a publish (issue #29, item 5): publishes coalesce in a
one-slot mailbox (the newest version wins, versions reach `LATEST` in increasing order),
a background failure surfaces on the next `check`, `close` flushes what waits, and the
host copy a publish takes leaves the next update its donated buffers."""

from __future__ import annotations

import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tunix_tasks.learner.publishing import SnapshotPublisher
from tunix_tasks.policy.params import flat_params, host_params
from tunix_tasks.storage.layout import RunLayout
from tunix_tasks.storage.lease import Lease
from tunix_tasks.storage.snapshot_format import parse_pointer
from tunix_tasks.storage.store import open_store
from tunix_tasks.storage.weights import (
    NonFiniteWeights,
    PublishConflict,
    WeightsClient,
    WeightsPublisher,
    read_latest,
    snapshot_versions,
)

GATE_S = 20.0  # a test that would hang fails after this instead


def _flat(value: float) -> dict[str, np.ndarray]:
    return {"w": np.full((32, 8), value, np.float32)}


class _GatedStore:
    """A real store whose `LATEST` writes wait for `gate` and are recorded in order:
    an upload that is slow for as long as the test says."""

    def __init__(self, store) -> None:
        self._store = store
        self.gate = threading.Event()
        self.entered = threading.Event()  # a `LATEST` write is waiting at the gate
        self.pointers: list[int] = []

    def write_if_generation(self, key: str, data: bytes, generation: int) -> int:
        if key == RunLayout.LATEST:
            self.entered.set()
            assert self.gate.wait(GATE_S), "the test never opened the gate"
            self.pointers.append(parse_pointer(data))
        return self._store.write_if_generation(key, data, generation)

    def __getattr__(self, name: str):
        return getattr(self._store, name)


@pytest.fixture
def gated(tmp_path):
    store = _GatedStore(open_store(str(tmp_path)))
    lease = Lease(store, ttl_s=60)
    lease.acquire()
    pub = SnapshotPublisher(store, lease, model={})
    yield store, pub
    store.gate.set()
    pub.close()
    lease.release()


def _check_raises(pub: SnapshotPublisher, error: type[BaseException], match: str) -> None:
    """`check` (which never blocks) raises `error` once the thread has failed."""
    deadline = time.monotonic() + GATE_S
    with pytest.raises(error, match=match):
        while time.monotonic() < deadline:
            pub.check()
            time.sleep(0.01)


def test_publishes_coalesce_newest_wins_versions_monotone(gated):
    """While v0 uploads (the store is stuck), v1..v3 are asked for without blocking;
    v1 and v2 are superseded in the slot, v3 is published next. (Before: `publish`
    waited for v0's upload, so the step stalled for as long as the store did.)"""
    store, pub = gated
    pub.publish(_flat(0.0), version=0, step=0)
    assert store.entered.wait(GATE_S)  # v0 is uploading
    t0 = time.perf_counter()
    for v in (1, 2, 3):
        pub.publish(_flat(float(v)), version=v, step=10 * v)
    assert time.perf_counter() - t0 < 1.0  # did not wait on the stuck upload
    assert pub.coalesced == 2
    with pytest.raises(ValueError, match="version 3 is not newer than v3"):
        pub.publish(_flat(9.0), version=3, step=99)
    store.gate.set()
    pub.wait()
    assert store.pointers == [0, 3]
    assert snapshot_versions(store) == [0, 3]
    flat, manifest = WeightsClient(store).poll()
    assert (manifest.version, manifest.step) == (3, 30)
    np.testing.assert_array_equal(flat["w"], _flat(3.0)["w"])


def test_close_flushes_the_publish_waiting_in_the_slot(gated):
    """Shutdown publishes what is waiting: the newest version asked for is out."""
    store, pub = gated
    pub.publish(_flat(0.0), version=0, step=0)
    assert store.entered.wait(GATE_S)  # v0 is uploading
    pub.publish(_flat(1.0), version=1, step=5)
    closer = threading.Thread(target=pub.close)
    closer.start()
    store.gate.set()
    closer.join(GATE_S)
    assert not closer.is_alive()
    assert store.pointers == [0, 1] and read_latest(store)[0] == 1


def test_a_background_failure_surfaces_on_check_and_stops_publishing(tmp_path):
    """Non-finite weights fail in the thread; the learner's next `check` raises the error
    naming the step, and nothing later is published (it stops on it)."""
    store = open_store(str(tmp_path))
    lease = Lease(store, ttl_s=60)
    lease.acquire()
    pub = SnapshotPublisher(store, lease, model={})
    try:
        pub.publish(_flat(0.0), version=0, step=0)
        pub.wait()
        pub.publish(_flat(float("nan")), version=1, step=7)
        match = r"after step 7 .*NaN/Inf"
        _check_raises(pub, NonFiniteWeights, match)
        with pytest.raises(NonFiniteWeights, match=match):
            pub.wait()
        with pytest.raises(NonFiniteWeights, match=match):
            pub.publish(_flat(2.0), version=2, step=8)
    finally:
        pub.close()
        lease.release()
    assert read_latest(store)[0] == 0 and snapshot_versions(store) == [0]


def test_a_conflict_in_the_background_surfaces_on_check(tmp_path):
    """Fencing: another writer moved `LATEST`; the background CAS fails and `check`
    raises `PublishConflict` (the learner exits 3 on it)."""
    store = open_store(str(tmp_path))
    lease = Lease(store, ttl_s=60)
    lease.acquire()
    pub = SnapshotPublisher(store, lease, model={})
    try:
        pub.publish(_flat(0.0), version=0, step=0)
        pub.wait()
        WeightsPublisher(store).publish(_flat(5.0), version=5, step=0, model={})
        pub.publish(_flat(1.0), version=1, step=1)
        _check_raises(pub, PublishConflict, "another learner published v5")
    finally:
        pub.close()
        lease.release()
    assert read_latest(store)[0] == 5


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_a_snapshots_host_copy_is_its_own_and_the_update_still_donates(dtype):
    """`host_params` (what the learner publishes) queues copies to host memory that an
    update donating the params' buffers leaves alone: the snapshot holds the values asked
    for, as float32, and the update did take the buffers (on a CPU, `flat_params`' views
    of them kept every publishing step from donating)."""
    model = nnx.Linear(64, 32, param_dtype=dtype, rngs=nnx.Rngs(0))
    want = {name: v.copy() for name, v in flat_params(model).items()}  # no view left behind
    host = host_params(model)
    kernel = model.kernel[...]
    updated = jax.jit(lambda w: w * 2 + 1, donate_argnums=0)(kernel)
    assert kernel.is_deleted(), "the update could not donate the params' buffer"
    got = {name: np.asarray(v, np.float32) for name, v in host.items()}
    assert got.keys() == want.keys()
    for name in want:
        np.testing.assert_array_equal(got[name], want[name])
    assert not np.array_equal(np.asarray(updated, np.float32), want["kernel"])
