"""Weight snapshots (publish, verify, refuse) and the single-learner lease, on both backends."""

from __future__ import annotations

import json
import logging
import multiprocessing as mp
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from tests.paths import REPO
from tunix_tasks.storage.layout import RunLayout
from tunix_tasks.storage.lease import Lease, LeaseHeldError, LeaseLost
from tunix_tasks.storage.shards import ShardWriter
from tunix_tasks.storage.store import open_store
from tunix_tasks.storage.weights import (
    PointerError,
    PublishConflict,
    WeightsClient,
    WeightsError,
    WeightsPublisher,
    load_snapshot,
    read_latest,
)
from tunix_tasks.testing.shard_factory import make_episode


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


def test_a_client_told_to_stay_behind_loads_only_versions_far_enough_ahead(store_uri):
    """`poll(ahead=3)` (`actor.reload_every_versions`): the first weights whatever their
    version, then only a version at least 3 past those it holds."""
    store = open_store(store_uri)
    client, pub = WeightsClient(store), WeightsPublisher(store)
    for v in (0, 1):
        pub.publish(_params(v), version=v, step=v, model={})
    assert client.poll(ahead=3)[1].version == 1  # the first: whatever LATEST is
    for v in (2, 3):
        pub.publish(_params(v), version=v, step=v, model={})
        assert client.poll(ahead=3) is None and client.version == 1
    pub.publish(_params(4), version=4, step=4, model={})
    assert client.poll(ahead=3)[1].version == 4
    pub.publish(_params(5), version=5, step=5, model={})
    assert client.poll()[1].version == 5  # ahead=1: any newer one


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


def test_a_lease_confirmed_before_a_checkpoint_catches_what_renewals_have_not_seen(store_uri):
    """Between renewals (every ttl/3) the run may be deleted, or its lease taken over: a
    checkpoint would then land in a run that is not this learner's, and the next learner
    would resume from it. `confirm` reads the lease first."""
    store = open_store(store_uri)
    lease = Lease(store, ttl_s=300)
    lease.acquire()
    lease.confirm()
    lease.renew()
    lease.confirm()  # its own renewal is still its lease
    store.delete("learner/LEASE")  # the run deleted
    with pytest.raises(LeaseLost, match="is gone: the run was deleted"):
        lease.confirm()
    assert lease.lost
    taken = Lease(store, ttl_s=300)
    taken.acquire()
    generation = store.read_versioned("learner/LEASE")[1]
    store.write_if_generation("learner/LEASE", b'{"owner": "thief"}', generation)
    with pytest.raises(LeaseLost, match="another learner took over"):
        taken.confirm()


# ------------------------------------------------------------- poisoned pointers (#11)

BAD_POINTERS = {
    "path-like version": {"version": "../../etc", "path": "weights/v00000001"},
    "float version": {"version": 1.5, "path": "weights/v00000001"},
    "negative version": {"version": -1, "path": "weights/v-0000001"},
    "path escaping the run": {"version": 1, "path": "../../etc"},
    "path of another version": {"version": 1, "path": "weights/v00000000"},
    "no path": {"version": 1},
    "not an object": [1, "weights/v00000001"],
    "not json": b"\xff{version",
}


def _poison(store, pointer) -> None:
    """CAS an invalid pointer over LATEST, as a buggy tool or a malicious writer would."""
    data = pointer if isinstance(pointer, bytes) else json.dumps(pointer).encode()
    got = store.read_versioned(RunLayout.LATEST)
    store.write_if_generation(RunLayout.LATEST, data, got[1] if got else 0)


@pytest.mark.parametrize("pointer", list(BAD_POINTERS.values()), ids=list(BAD_POINTERS))
def test_poisoned_latest_refused_once_then_superseded(store_uri, pointer, caplog):
    """A LATEST that is not exactly {"version": int >= 0, "path": snapshot(version)}: the
    client keeps its weights and logs the refusal once (not every poll); a learner's
    publisher starting on it counts from the newest snapshot folder and CASes over it.
    (Before: poll raised WeightsError, or followed the bogus path; the publisher raised.)"""
    store = open_store(store_uri)
    WeightsPublisher(store).publish(_params(0), version=0, step=0, model={})
    client = WeightsClient(store)
    assert client.poll()[1].version == 0
    # a snapshot folder newer than any valid pointer: the learner must count past it
    store.write_bytes("weights/v00000003/params.safetensors", b"half-written")
    _poison(store, pointer)
    with pytest.raises(PointerError, match="is not a valid pointer"):
        read_latest(store)
    with caplog.at_level(logging.ERROR, logger="tunix_tasks.storage.weights"):
        for _ in range(5):
            assert client.poll() is None
    assert client.version == 0 and client.refused == {}
    assert "not a valid pointer" in client.refused_pointer
    refusals = [r for r in caplog.records if "refusing weights pointer" in r.getMessage()]
    assert len(refusals) == 1, [r.getMessage() for r in caplog.records]

    learner = WeightsPublisher(store)  # a restarted learner: starts despite the bad pointer
    assert learner.latest_version == 3 and learner.pointer_found
    learner.publish(_params(4), version=4, step=9, model={})
    assert read_latest(store)[:2] == (4, "weights/v00000004")
    flat, manifest = client.poll()
    assert manifest.version == client.version == 4 and client.refused_pointer is None
    np.testing.assert_array_equal(flat["embed/w"], _params(4)["embed/w"])


def test_pointer_path_must_be_the_snapshot_key(store_uri):
    store = open_store(store_uri)
    WeightsPublisher(store).publish(_params(0), version=0, step=0, model={})
    _poison(store, {"version": 0, "path": "weights/v00000000/../../../etc", "step": 0})
    with pytest.raises(PointerError, match="is not 'weights/v00000000'") as info:
        read_latest(store)
    assert info.value.generation == store.read_versioned(RunLayout.LATEST)[1]


def test_missing_latest_counts_from_snapshot_folders(store_uri):
    """LATEST gone but snapshots left: the next version is still newer than all of them
    (actors holding v2 would otherwise ignore a new v0 forever)."""
    store = open_store(store_uri)
    pub = WeightsPublisher(store)
    assert (pub.latest_version, pub.pointer_found) == (-1, False)
    for v in range(3):
        pub.publish(_params(v), version=v, step=v, model={})
    store.delete(RunLayout.LATEST)
    pub = WeightsPublisher(store)
    assert (pub.latest_version, pub.pointer_found) == (2, False)
    with pytest.raises(ValueError, match="not newer"):
        pub.publish(_params(0), version=2, step=0, model={})
    pub.publish(_params(3), version=3, step=3, model={})
    assert read_latest(store)[0] == 3


def test_client_refuses_a_snapshot_its_apply_rejects(store_uri, caplog):
    """A checksum-valid snapshot that does not fit the model (apply raises ValueError) is
    refused and remembered like a checksum failure; the version only advances after a
    successful apply. (Before: poll set the version, then the actor's load crashed.)"""
    store = open_store(store_uri)
    pub = WeightsPublisher(store)
    pub.publish(_params(0), version=0, step=0, model={})
    client = WeightsClient(store)
    applied: list[int] = []

    def apply(flat, manifest):
        extra = sorted(set(flat) - set(_params(0)))
        if extra:
            raise ValueError(f"load_flat_params: unexpected keys {extra}")
        applied.append(manifest.version)

    assert client.poll(apply)[1].version == 0
    pub.publish({**_params(1), "extra": np.zeros(2, np.float32)}, version=1, step=1, model={})
    with caplog.at_level(logging.ERROR, logger="tunix_tasks.storage.weights"):
        for _ in range(3):
            assert client.poll(apply) is None
    assert client.version == 0 and applied == [0]
    assert "unexpected keys ['extra']" in client.refused[1]
    assert sum("refusing weights v1" in r.getMessage() for r in caplog.records) == 1
    assert "v1: load_flat_params" in client.refusals()
    pub.publish(_params(2), version=2, step=2, model={})
    assert client.poll(apply)[1].version == 2 and applied == [0, 2]

    def broken(flat, manifest):  # not a refusal: a real error propagates, version stays
        raise RuntimeError("device lost")

    pub.publish(_params(3), version=3, step=3, model={})
    with pytest.raises(RuntimeError, match="device lost"):
        client.poll(broken)
    assert client.version == 2 and 3 not in client.refused


# --------------------------------------------------------------- fencing (#11 item 3)


def test_publish_conflict_is_a_one_line_fencing_message(store_uri):
    store = open_store(store_uri)
    a, b = WeightsPublisher(store), WeightsPublisher(store)
    a.publish(_params(0), version=0, step=0, model={})
    a.publish(_params(1), version=7, step=0, model={})
    with pytest.raises(PublishConflict) as info:
        b.publish(_params(1), version=1, step=1, model={})
    msg = str(info.value)
    assert msg.startswith("another learner published v7 over ours: this learner is fenced off")
    assert "\n" not in msg and "v1 was not published" in msg
    assert (info.value.theirs, info.value.ours) == (7, 1)
    assert read_latest(store)[0] == 7


def _prepare_small_run(root: str, **learner) -> str:
    from tunix_tasks.frontdoor.entrypoints import prepare_run

    lc = {
        "buckets": [64, 128],
        "batch_rows": 8,
        "min_episodes_per_step": 16,
        "publish_every": 1,
        "checkpoint_every": 1000,
        "data_timeout_s": 120,
        **learner,
    }
    return prepare_run({"store": root, "model": {"preset": "tiny"}, "learner": lc}, run_name="r")


def _write_shards(store, n_shards: int, per_shard: int = 16) -> None:
    rng = np.random.default_rng(0)
    for _ in range(n_shards):
        writer = ShardWriter(store, actor_id="actor-0", max_episodes=per_shard + 1)
        for i in range(per_shard):
            writer.add(make_episode(rng, length=32, policy_version=0, group_id=f"g{i // 4}"))
        writer.close()
        time.sleep(0.003)


def test_learner_start_supersedes_poisoned_latest(tmp_path):
    """A restarted learner on a run whose LATEST was poisoned starts, publishes a version
    newer than every snapshot folder, over the bad pointer. (Before: WeightsError at start,
    until the pointer's generation files were fixed by hand.)"""
    from tunix_tasks.learner.startup import start_learner
    from tunix_tasks.storage.runs import read_config

    uri = _prepare_small_run(f"file://{tmp_path}")
    cfg, store = read_config(uri)
    pub = WeightsPublisher(store)
    for v in range(3):
        pub.publish(_params(v), version=v, step=0, model={})
    _poison(store, {"version": 10**12, "path": "../../etc"})
    parts = start_learner(cfg, store)
    try:
        assert parts.version == 3
        assert read_latest(store)[:2] == (3, "weights/v00000003")
        flat, manifest = load_snapshot(store, 3)
        assert manifest.model["preset"] == "tiny" and "embed" in flat
    finally:
        parts.close()


def _learner_process(uri: str) -> subprocess.Popen:
    """`tunix-tasks learner --run uri` in its own process."""
    return subprocess.Popen(
        [sys.executable, "-m", "tunix_tasks.frontdoor.cli", "learner", "--run", uri],
        cwd=REPO,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _wait_while_running(proc: subprocess.Popen, cond, what: str, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert proc.poll() is None, (what, proc.communicate())
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def _assert_fenced_in_one_line(proc: subprocess.Popen, err: str, *needles: str) -> None:
    assert proc.returncode == 3, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    lines = [ln for ln in err.splitlines() if "fenced off" in ln]
    assert len(lines) == 1, err[-3000:]
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


def test_learner_taken_over_by_a_second_learner_process_is_fenced(tmp_path):
    """Two real learner processes on one run. The first publishes v0 and is paused
    (SIGSTOP: a long GC pause, a partition) until its lease expires; the second starts,
    takes the lease over and publishes v1. Resumed, the first finds its lease taken: it
    exits with status 3 and one line, publishes and checkpoints nothing, and the second
    runs on. (Before: a LeaseLost traceback and status 1.)"""
    import signal

    uri = _prepare_small_run(f"file://{tmp_path}", lease_ttl_s=2.0)
    store = open_store(uri)
    first, second = _learner_process(uri), None
    try:
        _wait_while_running(first, lambda: read_latest(store) is not None, "the first's v0")
        os.kill(first.pid, signal.SIGSTOP)
        expires_at = json.loads(store.read_bytes(RunLayout.LEASE))["expires_at"]
        time.sleep(max(0.0, expires_at - time.time()) + 0.3)
        second = _learner_process(uri)
        _wait_while_running(second, lambda: read_latest(store)[0] >= 1, "the second's v1")
        assert json.loads(store.read_bytes(RunLayout.LEASE))["pid"] == second.pid
        published = sorted(store.list_folders("weights/"))
        os.kill(first.pid, signal.SIGCONT)
        _, err = first.communicate(timeout=60)
        _assert_fenced_in_one_line(
            first, err, "another learner took over", "learner/LEASE", "is fenced off and stops"
        )
        assert second.poll() is None  # the run's learner now, untouched
        assert json.loads(store.read_bytes(RunLayout.LEASE))["pid"] == second.pid
        assert sorted(store.list_folders("weights/")) == published
        assert not store.list(RunLayout.CHECKPOINTS) and not store.exists(RunLayout.DONE)
        second.send_signal(signal.SIGTERM)  # it stops cleanly and releases the lease
        _, err2 = second.communicate(timeout=60)
        assert second.returncode == 0, err2[-3000:]
        assert json.loads(store.read_bytes(RunLayout.LEASE))["released"]
    finally:
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.communicate()


def test_fenced_learner_exits_with_one_line_and_status_3(tmp_path):
    """`tunix-tasks learner` that loses the LATEST race (another publisher CASes the
    pointer while it still holds its lease): exit status 3 and one line, no traceback.
    (Before: a PublishConflict traceback and status 1.)"""
    uri = _prepare_small_run(f"file://{tmp_path}")
    store = open_store(uri)
    proc = _learner_process(uri)
    try:
        # Its first publish, v0; then it waits for data.
        _wait_while_running(proc, lambda: read_latest(store) is not None, "v0")
        # Another learner (its lease aside) publishes over it; then data arrives, the
        # fenced learner trains a step and its publish loses the compare-and-swap.
        WeightsPublisher(store).publish(_params(9), version=9999, step=0, model={})
        _write_shards(store, 2)
        _, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    _assert_fenced_in_one_line(
        proc, err, "another learner published v9999 over ours: this learner is fenced off"
    )
    assert read_latest(store)[0] == 9999  # never overwritten by the fenced learner
    assert not store.exists(RunLayout.DONE)
