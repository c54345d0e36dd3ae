"""ObjectStore contract, run identically on file:// and gs:// (fake-gcs-server)."""

from __future__ import annotations

import functools
import io
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

from tunix_tasks.storage.backends.local import LocalStore
from tunix_tasks.storage.backends.local_tempfiles import MAX_AGE_ENV, write_temp
from tunix_tasks.storage.store import (
    RETRY_DEADLINE_ENV,
    NotAFile,
    NotFound,
    PreconditionFailed,
    StoreError,
    open_store,
    read_small,
)
from tunix_tasks.storage.uri import normalize_uri


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
    for read in (store.read_bytes, functools.partial(_read_to, store)):
        with pytest.raises(NotFound, match=r"b/z\.bin"):
            read("b/z.bin")
    assert store.open_input("a/y.bin").read() == b"two"
    assert _read_to(store, "a/y.bin") == b"two"


class _Chunks:
    """A `ByteSink` keeping each write (a copy: the buffer is valid only in the call)."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []

    def write(self, data: bytes | memoryview, /) -> int:
        self.writes.append(bytes(data))
        return len(data)


def _read_to(store, key: str) -> bytes:
    sink = _Chunks()
    store.read_to(key, sink)
    return b"".join(sink.writes)


def test_a_large_array_is_written_whole_from_its_buffer(store_uri, monkeypatch):
    """An array over the client's 8 MiB multipart limit: on gs:// a resumable upload
    that reads it a chunk at a time from its own buffer (no copy of the whole)."""
    from tunix_tasks.storage.backends import gcs

    monkeypatch.setattr(gcs, "UPLOAD_CHUNK_BYTES", 1 << 20)  # 9 chunks
    data = np.random.default_rng(0).standard_normal((9, 1 << 18)).astype(np.float32)
    store = open_store(store_uri)
    store.write_bytes("w/params.bin", data)
    assert store.size("w/params.bin") == data.nbytes
    assert store.read_bytes("w/params.bin") == data.tobytes()
    sink = _Chunks()  # and read back a chunk at a time (8 MiB locally, 8 KiB from gs://)
    store.read_to("w/params.bin", sink)
    assert b"".join(sink.writes) == data.tobytes()
    assert len(sink.writes) > 1 and max(map(len, sink.writes)) <= 8 << 20


def test_the_upload_reader_reads_and_seeks_like_a_file():
    from tunix_tasks.storage.backends.gcs import _BufferReader

    data = bytes(range(256)) * 5
    ours, ref = _BufferReader(np.frombuffer(data, np.uint8)), io.BytesIO(data)
    assert ours.size == len(data)
    for op, args in [
        ("read", (100,)),
        ("seek", (-30, io.SEEK_CUR)),
        ("read", (50,)),
        ("seek", (-10, io.SEEK_END)),
        ("read", (100,)),
        ("read", (5,)),
        ("seek", (7,)),
        ("read", (-1,)),
        ("seek", (0,)),
        ("read", (None,)),
    ]:
        assert getattr(ours, op)(*args) == getattr(ref, op)(*args), (op, args)
        assert ours.tell() == ref.tell()
    ours.seek(250)
    buffer = bytearray(20)
    assert ours.readinto(buffer) == 20 and bytes(buffer) == data[250:270]


@pytest.mark.gcs
def test_an_outage_mid_upload_is_resumed_and_nothing_is_lost(monkeypatch):
    """The server goes down after the upload's first chunks and comes back within the
    retry deadline, without the upload's session (fake-gcs-server keeps them in memory;
    GCS drops them after a week): the upload starts over from the reader's start, and
    the object is whole. (It was a "bucket does not exist" error.)"""
    import threading

    from tunix_tasks.storage.backends import gcs
    from tunix_tasks.testing.gcs_outage import OutageGcs

    monkeypatch.setattr(gcs, "UPLOAD_CHUNK_BYTES", 1 << 20)
    data = np.random.default_rng(1).integers(0, 255, 12 << 20, dtype=np.uint8)
    read = gcs._BufferReader.read
    with OutageGcs() as server:
        store = gcs.GcsStore(server.new_bucket_uri(), retry_deadline_s=60)
        reads = []

        def read_then_fail(self, size=-1):
            reads.append(size)
            if len(reads) == 3:  # the third chunk's request finds the server down
                server.down()
                threading.Timer(2.0, server.up).start()
            return read(self, size)

        monkeypatch.setattr(gcs._BufferReader, "read", read_then_fail)
        store.write_bytes("w/params.bin", data)
        assert store.read_bytes("w/params.bin") == data.tobytes()
    assert len(reads) > 12  # started over: the first chunks were read again


@pytest.mark.gcs
def test_an_outage_mid_download_resumes_where_it_stopped():
    """`read_to` (a snapshot's reload): the server goes down after the first bytes arrive
    and comes back within the retry deadline; the client asks for the rest (a range of
    the same generation), so the sink gets every byte once, in order."""
    import threading

    from tunix_tasks.storage.backends.gcs import GcsStore
    from tunix_tasks.testing.gcs_outage import OutageGcs

    data = np.random.default_rng(2).integers(0, 255, 64 << 20, dtype=np.uint8).tobytes()
    with OutageGcs() as server:
        store = GcsStore(server.new_bucket_uri(), retry_deadline_s=60)
        store.write_bytes("w/params.bin", data)

        class Interrupted(_Chunks):
            def write(self, chunk: bytes | memoryview, /) -> int:
                if len(self.writes) == 1:  # the server is killed mid-response
                    server.down()
                    threading.Timer(2.0, server.up).start()
                return super().write(chunk)

        sink = Interrupted()
        store.read_to("w/params.bin", sink)
    assert b"".join(sink.writes) == data


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


def test_a_key_written_anew_never_repeats_a_deleted_ones_generation(store_uri):
    """A run deleted and created again at the same place: a leftover writer holding the
    deleted key's generation (a learner renewing its lease) must not win a compare-and-swap
    against the new key's, though a local folder numbers the new key's files from 1."""
    store = open_store(store_uri)
    old = store.write_if_generation("lease", b"old", 0)
    store.delete("lease")
    new = store.write_if_generation("lease", b"new", 0)
    assert new != old
    with pytest.raises(PreconditionFailed):
        store.write_if_generation("lease", b"leftover", old)
    assert store.read_versioned("lease") == (b"new", new)
    assert store.write_if_generation("lease", b"newer", new) not in (0, old, new)


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
        from tunix_tasks.storage.backends.local import LocalStore
        import tunix_tasks.storage.backends.local_tempfiles as st
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


def test_a_full_disk_is_a_store_error_and_leaves_no_temp_file(tmp_path, monkeypatch):
    """The write really fails with ENOSPC (the temp file's writes go to /dev/full): a
    `StoreError` naming the folder and the free space, which the callers' outage handling
    retries, instead of a raw OSError traceback (a learner died of one publishing), and
    no partial temp file left behind (one held 31 MB of a snapshot)."""
    import tunix_tasks.storage.backends.local_tempfiles as temps

    store = LocalStore(f"file://{tmp_path}/run")
    store.write_bytes("weights/v1/params.safetensors", b"old")
    real_create = temps._create

    def onto_a_full_disk(path):
        real_create(path).close()  # the temp file exists, as a partial write leaves it
        return open("/dev/full", "wb")

    monkeypatch.setattr(temps, "_create", onto_a_full_disk)
    with pytest.raises(StoreError, match=r"No space left on device writing 1,048,576 bytes \("):
        store.write_bytes("weights/v1/params.safetensors", b"x" * (1 << 20))
    folder = tmp_path / "run" / "weights" / "v1"
    assert sorted(p.name for p in folder.iterdir()) == ["params.safetensors"]
    assert store.read_bytes("weights/v1/params.safetensors") == b"old"


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
    from tunix_tasks.storage.backends.gcs import GcsStore
    from tunix_tasks.storage.store import StoreError

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


def test_list_start_after_and_folders(store_uri):
    """Issue #11.11: listings that start from a position, and folder discovery."""
    store = open_store(store_uri)
    for key in ["s/a/1.p", "s/a/2.p", "s/a/3.p", "s/b/1.p", "s/b/deep/x.p", "top.txt"]:
        store.write_bytes(key, b"x")
    assert store.list_folders("s/") == ["s/a/", "s/b/"]
    assert store.list_folders("") == ["s/"]
    assert store.list_folders("nothing/") == []
    keys = lambda **kw: [i.key for i in store.list("s/a/", **kw)]  # noqa: E731
    assert keys(start_after="s/a/1.p") == ["s/a/2.p", "s/a/3.p"]  # exclusive
    assert keys(start_after="s/a/0") == ["s/a/1.p", "s/a/2.p", "s/a/3.p"]
    assert keys(start_after="s/a/3.p") == []
    assert keys(start_after=None) == keys()
    assert [i.key for i in store.list("s/", start_after="s/a/3.p")] == ["s/b/1.p", "s/b/deep/x.p"]


def test_list_from_a_position_returns_exactly_the_later_keys(store_uri):
    """Issue #16: the local listing skips folders that hold nothing after the position;
    on both backends it must return exactly what filtering a full listing returns."""
    store = open_store(store_uri)
    keys = [
        "s/a/1700000/1700000001000-aa.p",
        "s/a/1700000/1700000999000-bb.p",
        "s/a/1700001/1700001000000-cc.p",
        "s/a/1700001000500-flat.p",  # a shard key from before time folders
        "s/a/17000010/x.p",
        "s/a/1700002/1700002000000-dd.p",
        "s/a-b/1.p",
        "s/b/1700001/1700001000000-ee.p",
    ]
    for key in keys:
        store.write_bytes(key, b"x")
    full = [i.key for i in store.list("s/")]
    assert full == sorted(keys)
    starts = ["s/a/1700001/1700001000000-cc.p", "s/a/1700001/", "s/a/1700001", "s/a/17", "s/a0"]
    for prefix in ("s/", "s/a/", "s/a/17", "s/a/1700001/"):
        for after in [None, *keys, *starts]:
            got = [i.key for i in store.list(prefix, start_after=after)]
            want = [k for k in full if k.startswith(prefix) and (after is None or k > after)]
            assert got == want, (prefix, after)


def _age(path, seconds: float) -> None:
    t = time.time() - seconds
    os.utime(path, (t, t))


def test_stale_temp_files_of_killed_writers_are_collected(tmp_path, monkeypatch):
    """Issue #11.10: a writer killed between writing its temp file and renaming it leaves a
    hidden `.tmp-*` file; listing collects those older than the max age (1 h by default,
    configurable), in generation folders too, and leaves younger ones (writes in flight)."""
    monkeypatch.delenv(MAX_AGE_ENV, raising=False)
    root = tmp_path / "run"
    store = LocalStore(f"file://{root}")
    store.write_bytes("shards/a/1.parquet", b"x")
    store.write_if_generation("weights/LATEST", b"v1", 0)
    # What killed writers leave: the temp file written, never renamed or linked.
    old_shard = write_temp(root / "shards/a", b"partial shard")
    old_gen = write_temp(root / "weights/.LATEST.gens", b"partial pointer")
    in_flight = write_temp(root / "shards/a", b"being written")
    _age(old_shard, 2 * 3600)
    _age(old_gen, 2 * 3600)
    _age(in_flight, 1800)
    assert [i.key for i in store.list("shards/")] == ["shards/a/1.parquet"]
    assert not old_shard.exists() and not old_gen.exists()
    assert in_flight.exists()
    assert store.read_bytes("weights/LATEST") == b"v1"
    assert store.read_bytes("shards/a/1.parquet") == b"x"

    # Throttled: another listing right away does not walk the folder again.
    late = write_temp(root / "metrics", b"partial chunk")
    _age(late, 2 * 3600)
    store.list("shards/")
    assert late.exists()

    # The age is configurable (TUNIX_STORE_TMP_MAX_AGE_S).
    monkeypatch.setenv(MAX_AGE_ENV, "60")
    open_store(f"file://{root}").list("nothing/")
    assert not late.exists() and not in_flight.exists()
    assert [i.key for i in store.list()] == ["shards/a/1.parquet", "weights/LATEST"]


@pytest.mark.gcs
def test_gcs_retry_deadline_is_configurable(monkeypatch):
    """Issue #11.8: the per-call retry deadline (default 120 s) comes from
    TUNIX_STORE_RETRY_DEADLINE_S, so short outages can be tested and tuned."""
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", "http://127.0.0.1:9")
    monkeypatch.setenv(RETRY_DEADLINE_ENV, "1")
    store = open_store("gs://nobucket/run")
    t0 = time.monotonic()
    with pytest.raises(StoreError, match=r"gs://nobucket/run/x"):
        store.write_bytes("x", b"1")
    assert time.monotonic() - t0 < 15


def test_first_contact_is_bounded_even_when_the_endpoint_hangs(monkeypatch):
    """An endpoint that accepts connections and never answers holds each request for the
    client's own timeout (60 s), past any retry deadline: the first contact gives up
    after TUNIX_STORE_CONNECT_DEADLINE_S whatever the backend does; errors and results
    of a call that finishes in time pass through. The call left behind ends on its own
    retry deadline once the endpoint goes away (here before the test ends, so its retry
    warnings do not outlive the test's log capture)."""
    import socket

    from tunix_tasks.storage.outage import CONNECT_ENV, StoreUnavailable, first_contact
    from tunix_tasks.storage.store import NotFound

    with socket.create_server(("127.0.0.1", 0), backlog=16) as silent:  # never accepts
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", f"http://127.0.0.1:{silent.getsockname()[1]}")
        monkeypatch.setenv(CONNECT_ENV, "1.5")
        monkeypatch.setenv(RETRY_DEADLINE_ENV, "2")
        store = open_store("gs://bucket/run")
        t0 = time.monotonic()
        with pytest.raises(
            StoreUnavailable, match=r"gs://bucket/run: unreachable: no answer within 2 s"
        ):
            first_contact(store.uri, store.read_bytes, "config.json")
        assert 1.4 < time.monotonic() - t0 < 5
        # Still held by the silent endpoint. Looked up here: once it closes, the call may
        # end (its retry deadline passed) before a lookup after the block would run.
        left = [t for t in threading.enumerate() if t.name == "store-first-contact"]
    for thread in left:
        thread.join(30)
    assert left and not any(t.is_alive() for t in left)
    local = open_store("file:///nonexistent-root")
    with pytest.raises(NotFound):
        first_contact(local.uri, local.read_bytes, "config.json")
    assert first_contact("x", sum, [1, 2], deadline_s=5) == 3


def test_a_missing_bucket_is_named_when_writing(gcs_server):
    """An upload into a bucket that does not exist says so (it said the object being
    written did not exist: `train` printed "<run>/config.json does not exist")."""
    from tunix_tasks.storage.store import NotFound

    store = open_store("gs://no-such-bucket-for-tunix/runs/r")
    for write in (
        lambda: store.write_bytes("config.json", b"{}"),
        lambda: store.write_if_generation("learner/LEASE", b"{}", 0),
    ):
        with pytest.raises(NotFound, match=r"bucket gs://no-such-bucket-for-tunix does not exist"):
            write()
    with pytest.raises(NotFound, match=r"r/config\.json does not exist$"):  # reads: the object
        store.read_bytes("config.json")


def test_symlinks_out_of_the_run_are_refused_by_the_local_store(tmp_path):
    """Issue #30.3: `weights/vN` as a symlink to a folder outside the run was followed.
    Every read, write, stat, delete and listing through a link that resolves outside the
    run root is refused (NotFound naming the key) or skipped; a run under a symlinked
    folder (like /tmp on some systems) works as any other."""
    from tunix_tasks.storage.snapshot_format import encode_pointer
    from tunix_tasks.storage.weights import WeightsClient, WeightsPublisher, read_latest

    (tmp_path / "real").mkdir()
    (tmp_path / "alias").symlink_to(tmp_path / "real")
    root = tmp_path / "alias/run"
    store = open_store(f"file://{root}")
    flat = {"w": np.zeros(4, np.float32)}
    WeightsPublisher(store).publish(flat, version=0, step=0, model={})
    client = WeightsClient(store)
    assert client.poll()[1].version == 0  # under a symlinked folder: everything works
    outside = tmp_path / "outside"
    WeightsPublisher(open_store(f"file://{outside}")).publish(flat, version=1, step=1, model={})
    (root / "weights/v00000001").symlink_to(outside / "weights/v00000001")
    (root / "weights/v00000000/stray").symlink_to(outside / "weights/v00000001/manifest.json")
    store.write_if_generation("weights/LATEST", encode_pointer(1, 1), read_latest(store)[2])

    assert client.poll() is None and client.version == 0
    assert "outside the run root" in client.refused[1]
    key = "weights/v00000001/manifest.json"
    read_to = functools.partial(_read_to, store)
    for call in (store.read_bytes, store.open_input, read_to, store.exists, store.delete):
        with pytest.raises(NotFound, match=f"{key} resolves to .*outside the run root"):
            call(key)
    with pytest.raises(NotFound, match="outside the run root"):
        store.write_bytes("weights/v00000001/new", b"x")
    for call in (store.read_bytes, store.open_input, read_to):
        with pytest.raises(NotFound, match="outside the run root"):
            call("weights/v00000000/stray")
    with pytest.raises(NotFound, match="outside the run root"):
        store.list("weights/v00000001/")
    assert [i.key for i in store.list("weights/")] == [
        "weights/LATEST",
        "weights/v00000000/manifest.json",
        "weights/v00000000/params.safetensors",
    ]
    assert store.list_folders("weights/") == ["weights/v00000000/"]
    assert sorted(p.name for p in (outside / "weights/v00000001").iterdir()) == [
        "manifest.json",
        "params.safetensors",
    ]


def test_read_small_refuses_an_object_over_its_bound_unread(store_uri):
    """A reader that knows an object is small (a manifest, a run's config) is refused one
    that is larger, with its size, the same on both backends."""
    store = open_store(store_uri)
    store.write_bytes("m.json", b"x" * 100)
    assert read_small(store, "m.json", 100, error=ValueError) == b"x" * 100
    with pytest.raises(ValueError, match=r"m\.json holds 100 bytes, more than the 99 it may"):
        read_small(store, "m.json", 99, error=ValueError)
    with pytest.raises(NotFound, match=r"nope\.json does not exist"):
        read_small(store, "nope.json", 99, error=ValueError)


def test_read_head_reads_at_most_what_it_is_asked(store_uri):
    """`read_head` hands back the first N bytes, the whole object when smaller (also an
    empty one: on GCS any range of it is a 416), the newest generation of a
    compare-and-swap key, NotFound for none."""
    store = open_store(store_uri)
    store.write_bytes("a.bin", b"0123456789")
    store.write_bytes("empty.bin", b"")
    store.write_if_generation("ptr", b"second", store.write_if_generation("ptr", b"first", 0))
    assert store.read_head("a.bin", 4) == b"0123"
    assert store.read_head("a.bin", 10) == store.read_head("a.bin", 11) == b"0123456789"
    assert store.read_head("empty.bin", 5) == b""
    assert store.read_head("ptr", 3) == b"sec"
    with pytest.raises(NotFound, match=r"nope\.bin does not exist"):
        store.read_head("nope.bin", 5)
    with pytest.raises(ValueError, match="at least 1 byte, not 0"):
        store.read_head("a.bin", 0)


def test_read_small_is_one_request_on_gcs(gcs_server, monkeypatch):
    """A small read is one ranged GET (it was the size, then the bytes): what each look
    of a `RunFence` at the run's id costs, twice a shard on gs://."""
    import requests

    store = open_store(gcs_server.new_bucket_uri())
    store.write_bytes("run_id", b"f" * 32)
    store.write_bytes("big.json", b"x" * 1000)
    calls: list[str] = []
    send = requests.Session.request

    def counted(self, method, url, *args, **kwargs):
        calls.append(f"{method} {url}")
        return send(self, method, url, *args, **kwargs)

    monkeypatch.setattr(requests.Session, "request", counted)
    assert read_small(store, "run_id", 64, error=ValueError) == b"f" * 32
    assert len(calls) == 1, calls
    with pytest.raises(ValueError, match=r"big\.json holds 1000 bytes, more than the 64"):
        read_small(store, "big.json", 64, error=ValueError)  # + its size, for the message


def test_read_small_reads_one_byte_past_its_bound_of_a_huge_file(tmp_path):
    """A 1 GiB (sparse) file where a small object should be is refused having read 65
    bytes of it: no memory for it, however it grew since anything looked at it."""
    import tracemalloc

    store = open_store(f"file://{tmp_path}/run")
    store.write_bytes("m.json", b"{}")
    os.truncate(store.local_path("m.json"), 1 << 30)
    tracemalloc.start()
    try:
        with pytest.raises(ValueError, match=r"holds 1073741824 bytes, more than the 64"):
            read_small(store, "m.json", 64, error=ValueError)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, peak


@pytest.mark.timeout(30)  # the FIFO reads waited for a writer forever
def test_a_key_that_is_no_regular_file_is_refused_unread_by_the_local_store(tmp_path):
    """A FIFO at a key (a plain one, or a compare-and-swap key's generation file) is
    `NotAFile`, a NotFound saying what it is, on every read and `size`, at once; a
    folder at a key does not exist, as a bucket's prefix."""
    from tunix_tasks.storage.weights import WeightsPublisher

    store = open_store(f"file://{tmp_path}/run")
    store.write_bytes("a/ok.json", b"{}")
    os.mkfifo(tmp_path / "run/a/fifo.json")
    (tmp_path / "run/a/dir.json").mkdir()
    read_to = functools.partial(_read_to, store)
    for call in (store.read_bytes, store.size, store.open_input, read_to):
        with pytest.raises(NotAFile, match=r"a/fifo\.json is a FIFO, not a regular file"):
            call("a/fifo.json")
        with pytest.raises(NotFound, match=r"a/dir\.json does not exist$") as err:
            call("a/dir.json")
        assert type(err.value) is NotFound
    assert store.read_bytes("a/ok.json") == b"{}"

    WeightsPublisher(store).publish({"w": np.zeros(4, np.float32)}, version=0, step=0, model={})
    published = store.read_versioned("weights/LATEST")
    gen = tmp_path / "run/weights/.LATEST.gens" / f"{2:020d}"
    os.mkfifo(gen)
    with pytest.raises(NotAFile, match=r"weights/LATEST is a FIFO"):
        store.read_versioned("weights/LATEST")
    gen.unlink()
    assert store.read_versioned("weights/LATEST") == published
