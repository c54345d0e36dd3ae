"""Retention of weight snapshots (issue #11.11): every snapshot used to be kept forever."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from tests.paths import REPO
from tunix_tasks.learner.publishing import SnapshotPublisher
from tunix_tasks.storage.lease import Lease
from tunix_tasks.storage.retention import SnapshotRetention, plan_pruning, snapshot_files
from tunix_tasks.storage.store import open_store
from tunix_tasks.storage.weights import WeightsClient, WeightsPublisher, read_latest

FLAT = {"w": np.zeros(4, np.float32)}


def test_plan_keeps_the_newest_every_mth_latest_and_protected():
    versions = range(1, 21)
    assert plan_pruning(versions, keep_last=3, keep_every=0, latest=20) == list(range(1, 18))
    assert plan_pruning(versions, keep_last=3, keep_every=5, latest=20) == [
        v for v in range(1, 18) if v % 5
    ]
    # Snapshots newer than LATEST (a publish whose pointer never moved) and LATEST itself
    # stay, even when the newest K are all newer than LATEST.
    assert plan_pruning(versions, keep_last=2, keep_every=0, latest=10) == list(range(1, 10))
    # Versions at or above what an actor is known to hold stay too.
    assert plan_pruning(versions, keep_last=2, keep_every=0, latest=20, protect_from=6) == [
        1,
        2,
        3,
        4,
        5,
    ]
    assert plan_pruning(versions, keep_last=2, keep_every=0, latest=None) == []  # no pointer
    with pytest.raises(ValueError, match="keep_last"):
        plan_pruning(versions, keep_last=1, keep_every=0, latest=20)


def test_publisher_prunes_after_each_publish(store_uri, tmp_path):
    store = open_store(store_uri)
    lease = Lease(store, ttl_s=60)
    lease.acquire()
    pub = SnapshotPublisher(store, lease, model={})
    pub.retention = SnapshotRetention(store, keep_last=3, keep_every=4)
    try:
        for version in range(11):
            pub.publish(FLAT, version=version, step=version)
            pub.wait()
            expected = [v for v in range(version + 1) if v > version - 3 or v % 4 == 0]
            assert sorted(snapshot_files(store)) == expected
    finally:
        pub.close()
        lease.release()
    assert sorted(snapshot_files(store)) == [0, 4, 8, 9, 10]
    assert read_latest(store)[0] == 10
    # Every file of a pruned snapshot is gone, the kept ones are complete and load.
    assert all(len(files) == 2 for files in snapshot_files(store).values())
    assert WeightsClient(store).poll()[1].version == 10


def test_prune_is_idempotent_and_never_raises_on_a_bad_pointer(tmp_path):
    store = open_store(str(tmp_path))
    pub = WeightsPublisher(store)
    for version in range(5):
        pub.publish(FLAT, version=version, step=0, model={})
    retention = SnapshotRetention(store, keep_last=2)
    assert retention.prune() == [0, 1, 2]
    assert retention.prune() == []
    store.delete("weights/LATEST")
    assert retention.prune() == []  # no pointer: nothing is known to be unused
    store.write_if_generation("weights/LATEST", b"not json", 0)
    assert retention.prune() == []  # an unreadable one: the same, and no exception
    assert sorted(snapshot_files(store)) == [3, 4]


def test_a_publish_killed_midway_leaves_a_folder_that_is_collected(tmp_path):
    """Issue #30.4: a learner SIGKILLed while writing a snapshot's manifest leaves
    `weights/v1/` with its params and a torn temp file. Once a newer version is published,
    retention deletes the manifest-less snapshot whatever `keep_last` says, the store's
    collection of killed writers' temp files takes the temp file, and the next prune the
    emptied folder. A manifest-less folder newer than `LATEST` (a publish in progress) stays."""
    root = tmp_path / "run"
    store = open_store(f"file://{root}")
    WeightsPublisher(store).publish(FLAT, version=0, step=0, model={})
    script = textwrap.dedent(
        f"""
        import sys, time
        sys.path.insert(0, {str(REPO)!r})
        import numpy as np
        import tunix_tasks.storage.backends.local_tempfiles as tf
        from tunix_tasks.storage.store import open_store
        from tunix_tasks.storage.weights import WeightsPublisher
        real_fsync, calls = tf.os.fsync, []
        def fsync(fd):  # the second write is the manifest: stall there
            calls.append(fd)
            real_fsync(fd)
            if len(calls) == 2:
                print("writing manifest", flush=True)
                time.sleep(30)
        tf.os.fsync = fsync
        WeightsPublisher(open_store({f"file://{root}"!r})).publish(
            {{"w": np.ones(4, np.float32)}}, version=1, step=1, model={{}}
        )
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE)
    assert proc.stdout.readline().strip() == b"writing manifest"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    torn = root / "weights/v00000001"
    (temp,) = [p for p in torn.iterdir() if p.name.startswith(".tmp-")]
    assert sorted(p.name for p in torn.iterdir()) == [temp.name, "params.safetensors"]

    WeightsPublisher(store).publish(FLAT, version=2, step=2, model={})  # the next learner
    (root / "weights/v00000003").mkdir()  # a publish in progress: newer than LATEST
    retention = SnapshotRetention(store, keep_last=4)
    assert retention.prune() == [1]
    assert [p.name for p in torn.iterdir()] == [temp.name]  # a write in flight, for all we know
    old = time.time() - 2 * 3600
    os.utime(temp, (old, old))
    open_store(f"file://{root}").list("weights/")  # collects killed writers' temp files
    assert torn.is_dir() and not any(torn.iterdir())
    assert retention.prune() == [1]
    assert sorted(p.name for p in (root / "weights").iterdir()) == [
        ".LATEST.gens",
        "LATEST",
        "v00000000",
        "v00000002",
        "v00000003",
    ]
    assert retention.prune() == []
    assert WeightsClient(store).poll()[1].version == 2
