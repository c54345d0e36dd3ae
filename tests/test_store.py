"""ObjectStore contract, run identically on file:// and gs:// (fake-gcs-server)."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from tunix_tasks.storage.store import NotFound, PreconditionFailed, normalize_uri, open_store


def test_bytes_roundtrip_and_list(store_uri):
    store = open_store(store_uri)
    store.write_bytes("a/x.bin", b"one")
    store.write_bytes("a/y.bin", b"two")
    store.write_bytes("b/z.bin", b"three")
    assert store.read_bytes("a/x.bin") == b"one"
    assert [i.key for i in store.list("a/")] == ["a/x.bin", "a/y.bin"]
    assert [i.key for i in store.list()] == ["a/x.bin", "a/y.bin", "b/z.bin"]
    assert store.list("a/")[1].size == 3
    store.write_bytes("a/x.bin", b"replaced")
    assert store.read_bytes("a/x.bin") == b"replaced"
    assert store.exists("b/z.bin") and not store.exists("b/nope")
    store.delete("b/z.bin")
    store.delete("b/z.bin")  # idempotent
    with pytest.raises(NotFound, match=r"b/z\.bin"):
        store.read_bytes("b/z.bin")
    assert store.open_input("a/y.bin").read() == b"two"


def test_compare_and_swap(store_uri):
    store = open_store(store_uri)
    assert store.read_versioned("weights/LATEST") is None
    g1 = store.write_if_generation("weights/LATEST", b"v1", 0)
    with pytest.raises(PreconditionFailed):
        store.write_if_generation("weights/LATEST", b"again", 0)
    g2 = store.write_if_generation("weights/LATEST", b"v2", g1)
    with pytest.raises(PreconditionFailed):
        store.write_if_generation("weights/LATEST", b"stale", g1)
    assert store.read_versioned("weights/LATEST") == (b"v2", g2)
    assert store.read_bytes("weights/LATEST") == b"v2"
    assert [i.key for i in store.list("weights/")] == ["weights/LATEST"]


def _race(uri: str, name: str, barrier, generation: int, results) -> None:
    store = open_store(uri)
    barrier.wait()
    try:
        store.write_if_generation("weights/LATEST", name.encode(), generation)
        results.put((name, "won"))
    except PreconditionFailed as err:
        results.put((name, f"conflict: {err}"))


@pytest.mark.parametrize("writers", [2, 8])
def test_racing_writers_exactly_one_wins(store_uri, writers):
    store = open_store(store_uri)
    gen = store.write_if_generation("weights/LATEST", b"base", 0)
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(writers), ctx.Queue()
    procs = [
        ctx.Process(target=_race, args=(store_uri, f"w{i}", barrier, gen, results))
        for i in range(writers)
    ]
    for p in procs:
        p.start()
    outcomes = dict(results.get(timeout=60) for _ in procs)
    for p in procs:
        p.join(timeout=30)
    winners = [n for n, o in outcomes.items() if o == "won"]
    assert len(winners) == 1, outcomes
    assert all("generation" in o for n, o in outcomes.items() if n not in winners)
    assert store.read_versioned("weights/LATEST")[0] == winners[0].encode()


def test_writer_killed_mid_write_leaves_nothing_visible(tmp_path):
    """SIGKILL a process while it writes a 64 MiB object: no partial object is listed."""
    uri = f"file://{tmp_path}/run"
    script = textwrap.dedent(
        f"""
        import os, sys
        sys.path.insert(0, {os.getcwd()!r})
        from tunix_tasks.storage.store import LocalStore
        import tunix_tasks.storage.store as st
        real_write = st.os.fsync
        def slow_fsync(fd):
            print("writing", flush=True)
            import time; time.sleep(30)
        st.os.fsync = slow_fsync
        LocalStore({uri!r}).write_bytes("shards/a/big.parquet", b"x" * (64 << 20))
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE)
    assert proc.stdout.readline().strip() == b"writing"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    store = open_store(uri)
    assert store.list() == []
    assert not store.exists("shards/a/big.parquet")


def test_normalize_uri(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert normalize_uri("runs") == f"file://{tmp_path}/runs"
    assert normalize_uri("file://./runs") == f"file://{tmp_path}/runs"
    assert normalize_uri("gs://bucket/a/b/") == "gs://bucket/a/b"
    with pytest.raises(ValueError, match="valid: file, gs"):
        normalize_uri("s3://bucket/x")
    with pytest.raises(ValueError, match="bucket"):
        normalize_uri("gs:///x")


def test_invalid_keys_rejected(tmp_path):
    store = open_store(str(tmp_path))
    for key in ("../escape", "a/../../b", "a//b", ""):
        with pytest.raises(ValueError, match="invalid object key"):
            store.write_bytes(key, b"x")


@pytest.mark.gcs
def test_gcs_outage_is_a_clear_error(tmp_path):
    """A dead endpoint gives a StoreError naming the object after bounded retries."""
    from tunix_tasks.storage.store import GcsStore, StoreError

    os.environ["STORAGE_EMULATOR_HOST"], old = (
        "http://127.0.0.1:9",
        os.environ.get("STORAGE_EMULATOR_HOST"),
    )
    try:
        store = GcsStore("gs://nobucket/run", retry_deadline_s=2.0)
        t0 = time.monotonic()
        with pytest.raises(StoreError, match=r"gs://nobucket/run/config\.json"):
            store.read_bytes("config.json")
        assert time.monotonic() - t0 < 30
    finally:
        if old is None:
            os.environ.pop("STORAGE_EMULATOR_HOST")
        else:
            os.environ["STORAGE_EMULATOR_HOST"] = old
